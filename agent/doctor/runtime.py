"""The doctor's container-runtime checks: containerd's and CRI-O's configuration give GPU
containers what the agent's device-list strategy needs.

Owns: reading containerd's config.toml (versions 1, 2 and 3, with the files its `imports` name,
merged key by key in order) and CRI-O's crio.conf plus crio.conf.d/*.conf (in lexical order),
with tomllib (Python 3.11+) or tomli; and the checks `runtime.containerd`, `runtime.crio`.

What each strategy needs (NVIDIA's container toolkit, pkg/config/engine/containerd and crio):
- envvar / volume-mounts: the `nvidia` runtime (BinaryName nvidia-container-runtime), as the
  default runtime or through a RuntimeClass; containerd keeps it at
  plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia (config version 2) or
  plugins."io.containerd.cri.v1.runtime".containerd.runtimes.nvidia (version 3), CRI-O at
  crio.runtime.runtimes.nvidia (runtime_path).
- cdi-annotations / cdi-cri: CDI enabled: containerd's `enable_cdi` in the same plugin table
  (default false in containerd 1.x, true in 2.x, whose config is version 3); CRI-O always has
  CDI (1.23 and later).
Must not write either configuration or restart anything.
"""

from __future__ import annotations

import glob
import os
import re
import sys
from typing import Any

from agent.doctor.context import Context
from agent.doctor.model import Finding, Spec, fail, ok, skip, warn, worst

CONTAINERD_CONFIG = "/etc/containerd/config.toml"
CRIO_CONFIG = "/etc/crio/crio.conf"
CRIO_DROP_INS = "/etc/crio/crio.conf.d"
NVIDIA_RUNTIME_NAME = "nvidia"
NVIDIA_RUNTIME_BINARY = "nvidia-container-runtime"
# The CRI runtime plugin's table, by containerd config version (the toolkit's
# criRuntimePluginName).
CRI_PLUGIN = {1: "cri", 2: "io.containerd.grpc.v1.cri", 3: "io.containerd.cri.v1.runtime"}
CONTAINERD_RUNTIME_FIX = "nvidia-ctk runtime configure --runtime=containerd{default} && " \
                         "systemctl restart containerd"
CONTAINERD_CDI_FIX = "nvidia-ctk runtime configure --runtime=containerd --cdi.enabled && " \
                     "systemctl restart containerd"
CRIO_RUNTIME_FIX = "nvidia-ctk runtime configure --runtime=crio{default} && " \
                   "systemctl restart crio"
_SEMVER = re.compile(r"\bv?(\d+)\.(\d+)\.(\d+)")


class TomlProblem(Exception):
    """A TOML file that cannot be read or parsed (the message says which and why)."""


def load_toml(path: str) -> dict:
    """The TOML document at `path`; TomlProblem with the reason if unreadable or invalid."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # the backport, the same parser (requirements.txt installs it below 3.11)
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise TomlProblem(f"cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise TomlProblem(f"{path} is not valid TOML: {exc}") from None


def merge(base: dict, over: dict) -> dict:
    """`over` merged into a copy of `base`, tables key by key (later files win)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def _dig(doc: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(key)
    return doc


# ---------------------------------------------------------------------------------------------
# containerd


class ContainerdConfig:
    """containerd's effective CRI runtime settings: the CRI runtime plugin's table of the main
    file and its imports, merged; `files` read, in order; `version` the main file's."""

    def __init__(self, version: int, table: dict, files: list[str]):
        self.version = version
        self.table = table
        self.files = files

    @property
    def plugin(self) -> str:
        return CRI_PLUGIN.get(self.version, CRI_PLUGIN[3])

    @property
    def runtimes(self) -> dict:
        return _dig(self.table, "containerd", "runtimes") or {}

    @property
    def default_runtime(self) -> str:
        return _dig(self.table, "containerd", "default_runtime_name") or "runc"

    @property
    def enable_cdi(self) -> bool | None:
        value = self.table.get("enable_cdi")
        return value if isinstance(value, bool) else None

    @property
    def cdi_spec_dirs(self) -> list[str] | None:
        value = self.table.get("cdi_spec_dirs")
        return list(value) if isinstance(value, list) else None


def _version_of(doc: dict, default: int) -> int:
    value = doc.get("version", default)
    return value if isinstance(value, int) else default


def _imports(ctx: Context, doc: dict) -> list[str]:
    """The files `imports` names, under the root; relative paths against the config's
    directory, globs expanded (sorted), as containerd resolves them."""
    out = []
    for pattern in doc.get("imports") or []:
        if not isinstance(pattern, str):
            continue
        if not os.path.isabs(pattern):
            pattern = os.path.join(os.path.dirname(CONTAINERD_CONFIG), pattern)
        path = ctx.host(pattern)
        out += sorted(glob.glob(path)) if glob.has_magic(path) else [path]
    return out


def read_containerd(ctx: Context) -> ContainerdConfig | None:
    """containerd's settings, or None when there is no config file (TomlProblem if a file is
    bad). Version 1 is a file without `version`; an imported file without one takes the main
    file's."""
    path = ctx.host(CONTAINERD_CONFIG)
    if not os.path.exists(path):
        return None
    main = load_toml(path)
    version = _version_of(main, 1)
    table: dict = {}
    files = [path]
    for doc_path, doc in [(path, main)] + [(p, None) for p in _imports(ctx, main)]:
        if doc is None:
            if not os.path.exists(doc_path):
                continue  # containerd skips an import that does not exist
            doc = load_toml(doc_path)
            files.append(doc_path)
        plugin = CRI_PLUGIN.get(_version_of(doc, version), CRI_PLUGIN[3])
        table = merge(table, _dig(doc, "plugins", plugin) or {})
    return ContainerdConfig(version, table, files)


def _containerd_major(ctx: Context) -> tuple[int | None, str]:
    """containerd's major version from `containerd --version` (None with why, if unknown)."""
    path = ctx.which("containerd")
    if path is None:
        return None, "containerd not found in the PATH directories"
    ran = ctx.run([path, "--version"])
    m = _SEMVER.search(ran.out) if ran.ok else None
    if m is None:
        return None, ran.error or f"`{path} --version` said {ran.out.strip()[:80]!r}"
    return int(m.group(1)), m.group(0)


def _runtime_findings(ctx: Context, runtimes: dict, default: str, table_name: str,
                      path_key: tuple[str, ...], fix: str) -> list[Finding]:
    """The `nvidia` runtime, for the envvar / volume-mounts strategies."""
    strategies = ",".join(s for s in ctx.cfg.device_list_strategy
                          if s in ("envvar", "volume-mounts"))
    nvidia = runtimes.get(NVIDIA_RUNTIME_NAME)
    if not isinstance(nvidia, dict):
        return [fail(f"no `{NVIDIA_RUNTIME_NAME}` runtime in [{table_name}]: the "
                     f"{strategies} strategy names GPUs in NVIDIA_VISIBLE_DEVICES, which only "
                     f"nvidia-container-runtime reads, so containers get no GPU",
                     fix.format(default=" --set-as-default"))]
    binary = _dig(nvidia, *path_key)
    key = ".".join((table_name, NVIDIA_RUNTIME_NAME) + path_key)
    if not isinstance(binary, str) or not binary:
        return [fail(f"{key} is not set: the `nvidia` runtime runs plain runc",
                     fix.format(default=" --set-as-default"))]
    if os.path.basename(binary) != NVIDIA_RUNTIME_BINARY:
        found = [warn(f"{key} is {binary}, not {NVIDIA_RUNTIME_BINARY}",
                      fix.format(default=""))]
    elif os.path.isabs(binary) and not os.path.exists(ctx.host(binary)):
        return [fail(f"{key} is {binary}, which does not exist",
                     "reinstall nvidia-container-toolkit, or " + fix.format(default=""))]
    else:
        found = [ok(f"runtime `nvidia` runs {binary}")]
    if default != NVIDIA_RUNTIME_NAME:
        found.append(warn(f"the default runtime is `{default}`: only pods with "
                          f"runtimeClassName set to a RuntimeClass whose handler is `nvidia` "
                          f"get GPUs",
                          fix.format(default=" --set-as-default")))
    else:
        found.append(ok("it is the default runtime"))
    return found


def _cdi_dirs_finding(ctx: Context, dirs: list[str] | None) -> list[Finding]:
    if dirs is None:
        return []
    agent_dirs = set(ctx.cfg.cdi_spec_dirs)
    if agent_dirs & set(dirs):
        return []
    return [warn(f"cdi_spec_dirs {dirs} holds none of the agent's CDI spec "
                 f"directories ({', '.join(ctx.cfg.cdi_spec_dirs)})",
                 f"add {ctx.cfg.cdi_spec_dirs[-1]} to cdi_spec_dirs")]


def check_containerd(ctx: Context) -> Finding:
    path = ctx.host(CONTAINERD_CONFIG)
    try:
        conf = read_containerd(ctx)
    except TomlProblem as exc:
        return fail(str(exc), f"repair {path} (`containerd config dump` shows what containerd "
                              f"reads), then `systemctl restart containerd`")
    if conf is None:
        if ctx.which("containerd") is None:
            if _crio_files(ctx) or ctx.which("crio"):
                return skip(f"containerd not installed ({path} absent); CRI-O is checked")
            return warn(f"no container runtime configuration found ({path}, "
                        f"{ctx.host(CRIO_CONFIG)}, {ctx.host(CRIO_DROP_INS)} absent)",
                        "install and configure containerd or CRI-O, then "
                        "`nvidia-ctk runtime configure --runtime=containerd`")
        conf = ContainerdConfig(2, {}, [])  # containerd's built-in defaults
    where = f"containerd ({', '.join(conf.files) or 'built-in defaults'}, version " \
            f"{conf.version})"
    table = f'plugins."{conf.plugin}".containerd.runtimes'
    findings: list[Finding] = []
    if ctx.uses_runtime_hook:
        findings += _runtime_findings(ctx, conf.runtimes, conf.default_runtime, table,
                                      ("options", "BinaryName"), CONTAINERD_RUNTIME_FIX)
    if ctx.uses_cdi:
        key = f'plugins."{conf.plugin}".enable_cdi'
        enabled = conf.enable_cdi
        if enabled is None and conf.version >= 3:
            findings.append(ok(f"CDI on ({key} unset: on by default in containerd 2.x)"))
        elif enabled is None:
            major, said = _containerd_major(ctx)
            if major is not None and major >= 2:
                findings.append(ok(f"CDI on ({key} unset: on by default in containerd {said})"))
            elif major is not None:
                findings.append(fail(f"CDI is off ({key} unset: off by default in "
                                     f"containerd {said}): the cdi-* device-list strategy's "
                                     f"devices never reach the container", CONTAINERD_CDI_FIX))
            else:
                findings.append(warn(f"{key} is unset: CDI is on only with containerd "
                                     f"2.x, off in 1.x ({said})", CONTAINERD_CDI_FIX))
        elif enabled:
            findings.append(ok(f"CDI on ({key} = true)"))
        else:
            findings.append(fail(f"{key} = false: the cdi-* device-list strategy's "
                                 f"devices never reach the container", CONTAINERD_CDI_FIX))
        findings += _cdi_dirs_finding(ctx, conf.cdi_spec_dirs)
    return worst([ok(where)] + findings)


# ---------------------------------------------------------------------------------------------
# CRI-O


def _crio_files(ctx: Context) -> list[str]:
    files = [ctx.host(CRIO_CONFIG)] if os.path.isfile(ctx.host(CRIO_CONFIG)) else []
    drop_ins = ctx.host(CRIO_DROP_INS)
    if os.path.isdir(drop_ins):
        files += sorted(os.path.join(drop_ins, n) for n in os.listdir(drop_ins)
                        if n.endswith(".conf"))
    return files


def check_crio(ctx: Context) -> Finding:
    files = _crio_files(ctx)
    if not files:
        return skip(f"CRI-O not configured here ({ctx.host(CRIO_CONFIG)} and "
                    f"{ctx.host(CRIO_DROP_INS)} absent)")
    doc: dict = {}
    try:
        for path in files:
            doc = merge(doc, load_toml(path))
    except TomlProblem as exc:
        return fail(str(exc), "repair it (`crio status config` shows what CRI-O reads), then "
                              "`systemctl restart crio`")
    where = f"CRI-O ({', '.join(files)})"
    runtime = _dig(doc, "crio", "runtime") or {}
    findings: list[Finding] = [ok(where)]
    if ctx.uses_runtime_hook:
        findings += _runtime_findings(ctx, runtime.get("runtimes") or {},
                                      runtime.get("default_runtime") or "crun",
                                      "crio.runtime.runtimes", ("runtime_path",),
                                      CRIO_RUNTIME_FIX)
    if ctx.uses_cdi:
        findings.append(ok("CDI on (always, in CRI-O 1.23 and later)"))
        dirs = runtime.get("cdi_spec_dirs")
        findings += _cdi_dirs_finding(ctx, list(dirs) if isinstance(dirs, list) else None)
    return worst(findings)


CHECKS = (
    Spec("runtime.containerd", "containerd gives containers their GPUs", check_containerd),
    Spec("runtime.crio", "CRI-O gives containers their GPUs", check_crio),
)
