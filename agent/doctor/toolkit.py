"""The doctor's nvidia-container-toolkit checks: `nvidia-ctk` and `nvidia-container-runtime`
installed (and their versions), and the CDI spec defines every device name the agent hands out.

Owns: the checks `toolkit.*` and reading a program's version (`<program> --version`, bounded).
The CDI comparison is agent.rm.cdi's `check`, on the devices discovery and the config give
(the same code the agent runs at start). Must not generate specs or change the toolkit's
configuration; must not import grpc or pynvml.
"""

from __future__ import annotations

import re

from agent.doctor.context import SYSTEM_PATH, Context
from agent.doctor.driver import nvml_facts
from agent.doctor.model import Finding, Spec, fail, ok, skip, warn
from agent.errors import MigLayoutError

NVIDIA_CTK = "nvidia-ctk"
NVIDIA_RUNTIME = "nvidia-container-runtime"
INSTALL_FIX = ("install nvidia-container-toolkit: `dnf install nvidia-container-toolkit` "
               "(RHEL and derivatives) or `apt-get install nvidia-container-toolkit` (Debian, "
               "Ubuntu), from NVIDIA's repository")
_VERSION = re.compile(r"\bversion\s+v?(\d+(?:\.\d+)+\S*)", re.IGNORECASE)


def program_version(ctx: Context, path: str) -> tuple[str | None, str]:
    """(version, problem) of the program at `path` from `path --version`; the version is None
    with the reason when it does not say."""
    ran = ctx.run([path, "--version"])
    if ran.error:
        return None, ran.error
    text = ran.out + ran.err
    m = _VERSION.search(text)
    if ran.rc != 0 or m is None:
        first = (text.strip().splitlines() or ["no output"])[0]
        return None, f"`{path} --version` exited {ran.rc}: {first}"
    return m.group(1), ""


def _program(ctx: Context, name: str, missing_status: str, why: str) -> Finding:
    path = ctx.which(name)
    if path is None:
        text = f"{name} not found in {', '.join(ctx.host(d) for d in SYSTEM_PATH)}: {why}"
        return fail(text, INSTALL_FIX) if missing_status == "fail" else warn(text, INSTALL_FIX)
    version, problem = program_version(ctx, path)
    if version is None:
        return warn(f"{path} is there but its version is unknown: {problem}",
                    f"reinstall nvidia-container-toolkit; `{path} --version` must answer")
    return ok(f"{name} {version} ({path})")


def check_ctk(ctx: Context) -> Finding:
    return _program(ctx, NVIDIA_CTK, "warn",
                    "it writes the CDI spec and the container runtime's configuration")


def check_runtime(ctx: Context) -> Finding:
    if ctx.uses_runtime_hook:
        return _program(ctx, NVIDIA_RUNTIME, "fail",
                        f"the device-list strategy {','.join(ctx.cfg.device_list_strategy)} "
                        f"names devices in NVIDIA_VISIBLE_DEVICES, which only this runtime reads")
    return _program(ctx, NVIDIA_RUNTIME, "warn",
                    "containers that ask for GPUs through NVIDIA_VISIBLE_DEVICES get none")


def check_cdi_spec(ctx: Context) -> Finding:
    from agent.rm import cdi
    from agent.rm.resources import response_options

    cfg = ctx.cfg
    if not ctx.uses_cdi:
        return skip(f"device-list strategy {','.join(cfg.device_list_strategy)}: the agent "
                    f"hands out no CDI names")
    facts = nvml_facts(ctx)
    if not facts.up:
        return skip("needs the GPUs from NVML (see driver.nvml)")
    try:
        devices = [d for ds in facts.device_map(cfg).values() for d in ds]
    except MigLayoutError as exc:
        return skip(f"the MIG layout is refused by migStrategy {cfg.mig_strategy} ({exc})")
    found = cdi.check(devices, response_options(cfg), cfg.cdi_spec_dirs)
    fix = (f"`{cdi.GENERATE_COMMAND}`, and keep it current: `systemctl enable --now "
           f"{cdi.REFRESH_UNITS}`; then `systemctl reload gpu-agent`")
    if not found.ok:
        return fail(found.message(), fix)
    if found.index.problems:
        return warn(found.message(), "remove or repair the files named; " + fix)
    return ok(found.message())


CHECKS = (
    Spec("toolkit.nvidia-ctk", "nvidia-ctk installed", check_ctk),
    Spec("toolkit.runtime", "nvidia-container-runtime installed", check_runtime),
    Spec("toolkit.cdi-spec", "the CDI spec covers every device handed out", check_cdi_spec),
)
