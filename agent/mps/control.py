"""Talking to one GPU's MPS control daemon through NVIDIA's nvidia-cuda-mps-control program.

Owns: how the daemon of a GPU is started (`nvidia-cuda-mps-control -d` with its pipe and log
directories and CUDA_VISIBLE_DEVICES set to the GPU, and its /dev/shm bound to the root's
shared one), how commands reach it (the program in client mode, commands on stdin, as
`echo quit | nvidia-cuda-mps-control`), and how its process is found again (the PID file the
daemon writes in its pipe directory, checked against /proc). Must not decide when a daemon
starts or stops (agent.mps.daemons does), nor call NVML.

From NVIDIA's MPS documentation (docs.nvidia.com/deploy/mps): the control daemon writes
`nvidia-cuda-mps-control.pid` in CUDA_MPS_PIPE_DIRECTORY, logs to control.log in
CUDA_MPS_LOG_DIRECTORY, and its clients share /dev/shm with the servers it starts. The daemon
is started one of two ways:
- `systemd-run` (the agent runs as a systemd service): a transient unit of its own, outside
  the agent's sandbox (no capabilities, MemoryDenyWriteExecute, ...), which the MPS server
  could not run in, with BindPaths= giving it the shared /dev/shm. The unit outlives the
  agent's restarts, as NVIDIA's separate DaemonSet does.
- directly, in a mount namespace of its own where /dev/shm is the shared one (`unshare`, as
  root); without root, directly, sharing the host's /dev/shm (a warning says so).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Mapping

from agent.errors import MpsError
from agent.rm.sharing import mps_log_dir, mps_pipe_dir, mps_shm_dir

log = logging.getLogger(__name__)

PID_FILE = "nvidia-cuda-mps-control.pid"
COMMAND_TIMEOUT_S = 5.0
UNIT_PREFIX = "gpu-agent-mps-"  # systemd-run's unit: gpu-agent-mps-<GPU UUID>.service


def launcher(environ: Mapping[str, str]) -> str:
    """"systemd-run" when the agent runs as a systemd service (systemd booted the host, sd_booted:
    /run/systemd/system) and systemd-run is there, else "unshare" as root where unshare is
    there, else "direct"."""
    if environ.get("INVOCATION_ID") and os.path.isdir("/run/systemd/system") and \
            shutil.which("systemd-run"):
        return "systemd-run"
    if os.geteuid() == 0 and shutil.which("unshare"):
        return "unshare"
    return "direct"


class Control:
    """The daemons under `root` (flags.mpsRoot), run through `program`."""

    def __init__(self, program: str, root: str, how: str = "direct"):
        self.program, self.root, self.how = program, root, how

    def env(self, gpu_uuid: str) -> dict[str, str]:
        return {"CUDA_MPS_PIPE_DIRECTORY": mps_pipe_dir(self.root, gpu_uuid),
                "CUDA_MPS_LOG_DIRECTORY": mps_log_dir(self.root, gpu_uuid),
                "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")}

    def daemon_env(self, gpu_uuid: str) -> dict[str, str]:
        """The control daemon's environment: the client's, and only its GPU visible."""
        return {**self.env(gpu_uuid), "CUDA_VISIBLE_DEVICES": gpu_uuid}

    def start_command(self, gpu_uuid: str) -> list[str]:
        """The command that starts the GPU's control daemon in the background."""
        env = self.daemon_env(gpu_uuid)
        shm = mps_shm_dir(self.root)
        if self.how == "systemd-run":
            return ["systemd-run", f"--unit={UNIT_PREFIX}{gpu_uuid}", "--collect", "--quiet",
                    "--service-type=forking",
                    f"--property=PIDFile={os.path.join(env['CUDA_MPS_PIPE_DIRECTORY'], PID_FILE)}",
                    f"--property=BindPaths={shm}:/dev/shm",
                    *(f"--setenv={k}={v}" for k, v in env.items()), "--",
                    self.program, "-d"]
        if self.how == "unshare":
            return ["unshare", "--mount", "--propagation", "slave", "--", "sh", "-c",
                    'mount --bind "$0" /dev/shm && exec "$@"', shm, self.program, "-d"]
        return [self.program, "-d"]

    def start(self, gpu_uuid: str) -> int:
        """Start the GPU's daemon and return its PID; MpsError with the program's words."""
        for path in (mps_pipe_dir(self.root, gpu_uuid), mps_log_dir(self.root, gpu_uuid),
                     mps_shm_dir(self.root)):
            os.makedirs(path, mode=0o755, exist_ok=True)
        env = self.daemon_env(gpu_uuid)
        what = f"start the MPS control daemon of {gpu_uuid}"
        try:
            self._run(self.start_command(gpu_uuid), env, "", what)
        except MpsError as exc:
            if self.how != "unshare" or self.pid(gpu_uuid) is not None:
                raise
            # a root without CAP_SYS_ADMIN (a container): no mount namespace of its own
            log.warning("%s; starting MPS control daemons directly from now on: their "
                        "/dev/shm is the host's, not %s", exc, mps_shm_dir(self.root))
            self.how = "direct"
            self._run(self.start_command(gpu_uuid), env, "", what)
        pid = self.pid(gpu_uuid)
        if pid is None:
            raise MpsError(f"the MPS control daemon of {gpu_uuid} started but wrote no PID to "
                           f"{os.path.join(mps_pipe_dir(self.root, gpu_uuid), PID_FILE)}")
        return pid

    def send(self, gpu_uuid: str, *commands: str) -> str:
        """Send `commands` to the GPU's daemon; its printed answers. MpsError when it does not
        answer or refuses one."""
        return self._run([self.program], self.env(gpu_uuid), "".join(f"{c}\n" for c in commands),
                         f"send {'; '.join(commands)} to the MPS control daemon of "
                         f"{gpu_uuid}")

    def pid(self, gpu_uuid: str) -> int | None:
        """The PID of the GPU's running control daemon, from its PID file; None when there is
        none or the process is gone (or is another program: the PID was reused)."""
        path = os.path.join(mps_pipe_dir(self.root, gpu_uuid), PID_FILE)
        try:
            with open(path) as f:
                pid = int(f.read().split()[0])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            return None
        name = os.path.basename(self.program).encode()
        return pid if any(os.path.basename(a) == name for a in argv[:2]) else None

    def running(self) -> list[str]:
        """The GPU UUIDs under the root whose daemon runs (found from an earlier agent)."""
        try:
            names = sorted(os.listdir(self.root))
        except OSError:
            return []
        return [n for n in names if n != "shm" and self.pid(n) is not None]

    def _run(self, argv: list[str], env: dict[str, str], stdin: str, what: str) -> str:
        try:
            done = subprocess.run(argv, input=stdin, env=env, capture_output=True, text=True,
                                  timeout=COMMAND_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MpsError(f"could not {what}: {exc}") from None
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip() or f"exit {done.returncode}"
            raise MpsError(f"could not {what}: {said}")
        return done.stdout
