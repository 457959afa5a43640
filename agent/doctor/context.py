"""The node the doctor looks at: its root, the agent's configuration, and bounded ways to read it.

Owns: `Context` (the root every host path the doctor knows is read under, the effective agent
configuration or why it could not be loaded, the timeout every subprocess and RPC gets, and a
memo so that facts several checks share — NVML's view, status.json, kubelet's answer — are
gathered once), the host paths and PATH directories the doctor itself knows, and `run_command`
(a subprocess with a timeout, its output or why it did not run).

What `--root` covers: the paths the doctor knows itself (/dev, /etc/containerd, /etc/crio, the
PATH directories, the unit's config file) are read under it. The paths the agent's config names
(sockets, state directory, NVML library, CDI spec directories) are used as the configuration
gives them, exactly as `gpu-agent run` uses them. Must not change anything on the node.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from agent.config import Config, load_config
from agent.errors import ConfigError

# Every subprocess and RPC gets this long (seconds) unless --timeout says otherwise.
DEFAULT_TIMEOUT_S = 2.0
# NVML is bounded separately: without persistence mode the driver initialises every GPU at
# nvmlInit, which takes seconds on a large node.
NVML_TIMEOUT_S = 10.0
# Where a systemd service finds programs (systemd's default PATH, plus /sbin:/bin for hosts
# without a merged /usr): nvidia-ctk, nvidia-container-runtime, containerd, crio, systemctl.
SYSTEM_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
# The config file the RPM's unit runs the agent with (systemd/gpu-agent.service ExecStart):
# read when neither --config nor CONFIG_FILE names one, so that a bare `gpu-agent doctor`
# checks what the service runs.
UNIT_CONFIG_FILE = "/etc/gpu-agent/config.yaml"
UNIT_NAME = "gpu-agent"


@dataclass(frozen=True)
class Ran:
    """A finished (or failed) subprocess: `error` says why it did not run to an exit code."""

    rc: int | None
    out: str = ""
    err: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.error


def run_command(argv: list[str], timeout: float) -> Ran:
    """Run `argv` (no shell) with `timeout` seconds; its exit code and output."""
    env = {**os.environ, "LC_ALL": "C"}
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                              stdin=subprocess.DEVNULL, errors="replace")
    except subprocess.TimeoutExpired:
        return Ran(None, error=f"`{' '.join(argv)}` did not finish within {timeout:g} s")
    except OSError as exc:
        return Ran(None, error=f"cannot run {argv[0]}: {exc.strerror or exc}")
    return Ran(proc.returncode, proc.stdout, proc.stderr)


@dataclass
class Context:
    """What every check gets. `cfg` is the effective configuration, or the defaults when it
    could not be loaded (`config_error` then says why, and the agent.config check fails)."""

    root: str
    cfg: Config
    config_error: ConfigError | None = None
    config_note: str = ""  # how the config file was chosen, when the doctor chose it
    config_fallback: str = ""  # with config_error: what the other checks used instead
    timeout: float = DEFAULT_TIMEOUT_S
    nvml_timeout: float = NVML_TIMEOUT_S
    _memo: dict = field(default_factory=dict, repr=False)

    def host(self, path: str) -> str:
        """`path` (absolute, as on the host) under the root."""
        if self.root in ("", "/"):
            return path
        return os.path.join(self.root, path.lstrip("/"))

    def which(self, name: str) -> str | None:
        """`name` in the system PATH directories under the root (executable files only)."""
        for directory in SYSTEM_PATH:
            path = self.host(os.path.join(directory, name))
            if os.path.isfile(path) and os.access(path, os.X_OK):
                return path
        return None

    def run(self, argv: list[str]) -> Ran:
        return run_command(argv, self.timeout)

    def memo(self, key: str, fn: Callable[[], Any]) -> Any:
        """fn()'s value, computed once per run under `key` (facts several checks share)."""
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    @property
    def uses_cdi(self) -> bool:
        from agent.rm.cdi import CDI_STRATEGIES

        return any(s in CDI_STRATEGIES for s in self.cfg.device_list_strategy)

    @property
    def uses_runtime_hook(self) -> bool:
        """Whether a device-list strategy needs nvidia-container-runtime to read it (envvar,
        volume-mounts)."""
        return any(s in ("envvar", "volume-mounts") for s in self.cfg.device_list_strategy)


def make_context(args: argparse.Namespace | Mapping[str, Any] | None,
                 environ: Mapping[str, str], root: str = "/",
                 timeout: float = DEFAULT_TIMEOUT_S) -> Context:
    """The context for `args` (run's options) and `environ`, the root and the timeout."""
    given = dict(vars(args)) if isinstance(args, argparse.Namespace) else dict(args or {})
    root = os.path.abspath(root or "/")
    note = ""
    if given.get("config_file") is None and "CONFIG_FILE" not in environ:
        unit_config = UNIT_CONFIG_FILE if root == "/" else \
            os.path.join(root, UNIT_CONFIG_FILE.lstrip("/"))
        if os.path.isfile(unit_config):
            given["config_file"] = unit_config
            note = f"the unit's config file {unit_config} (no --config given)"
    try:
        return Context(root=root, cfg=load_config(given, environ), config_note=note,
                       timeout=timeout)
    except ConfigError as exc:
        error = exc
    # The other checks still run: with the flags and environment but not the file (the usual
    # culprit), else with the defaults; agent.config reports the error.
    try:
        cfg = load_config({**given, "config_file": None},
                          {k: v for k, v in environ.items() if k != "CONFIG_FILE"})
        fallback = "the flags and environment without the file"
    except ConfigError:
        cfg, fallback = load_config({}, {}), "the defaults"
    return Context(root=root, cfg=cfg, config_error=error, config_note=note,
                   config_fallback=fallback, timeout=timeout)
