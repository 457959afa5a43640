"""The MPS control daemons of the GPUs `sharing.mps` shares: one per GPU, kept running.

Owns: which daemons run (those of agent.rm.sharing.mps_plan; any other under flags.mpsRoot is
told to quit, as when sharing is turned off), adopting the daemons an earlier agent started
(they outlive the agent: their clients are not disturbed by a restart or a SIGHUP), their
default limits (sent at every start and adoption), noticing a daemon that exits (a pidfd per
daemon, no polling) and starting it again (at once, then backing off to 30 s), and which
advertised replicas are down meanwhile (`outages`, which the health monitor withdraws). Must
not decide what a container gets (agent.rm.allocate) nor call NVML.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from agent.errors import MpsError
from agent.mps.control import Control, launcher

log = logging.getLogger(__name__)

RETRY_FIRST_S = 1.0  # after a failed start; the first restart after an exit is at once
RETRY_MAX_S = 30.0
POLL_S = 1.0  # where pidfd_open is missing (Linux < 5.3): how often a daemon's PID is checked


class MpsDaemons:
    """`on_change()` is called (from any thread) when a daemon goes down or comes back."""

    def __init__(self, on_change: Callable[[], None] = lambda: None):
        self.on_change = on_change
        self._lock = threading.Lock()
        self._control: Control | None = None
        self._plan: dict[str, Any] = {}  # GPU UUID -> agent.rm.sharing.MpsGpu
        self._pids: dict[str, int] = {}
        self._down: dict[str, str] = {}  # GPU UUID -> why its replicas are withdrawn
        self._retry: dict[str, tuple[float, float]] = {}  # UUID -> (when, next backoff)
        self._restarts: dict[str, int] = {}
        self._starting = threading.Lock()  # one start or adoption at a time (loop, watch)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- the main loop's side ------------------------------------------------------------

    def apply(self, plan: Mapping[str, Any], program: str, root: str,
              environ: Mapping[str, str]) -> None:
        """Make the running daemons those of `plan` (UUID -> MpsGpu): quit the others, adopt
        or start each planned one and send its limits. A daemon that cannot be started is
        down (its replicas withdrawn) and tried again later."""
        with self._lock:
            old, self._plan, old_control = self._plan, dict(plan), self._control
            same = old_control is not None and (old_control.program, old_control.root) == (
                program, root)  # kept: it knows when unshare had to give way (control.py)
            control = self._control = old_control if same else Control(program, root,
                                                                        launcher(environ))
            moved = old_control is not None and old_control.root != control.root
            for uuid in list(self._pids):
                if uuid not in plan or moved:
                    del self._pids[uuid]
            for uuid in list(self._down):
                if uuid not in plan:
                    del self._down[uuid]
                    self._retry.pop(uuid, None)
        if moved:  # another flags.mpsRoot: the daemons under the old one go
            for uuid in sorted(old):
                self._quit(old_control, uuid)
        for uuid in sorted(set(control.running()) | (set() if moved else set(old))):
            if uuid not in plan:
                self._quit(control, uuid)
        for uuid in plan:
            self._ensure(uuid, adopt=True)
        if plan and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="mps-daemons",
                                            daemon=True)
            self._thread.start()
        self._poke()

    def outages(self) -> dict[str, tuple[str, str]]:
        """Advertised device ID -> ("mps", why it is withdrawn), for the replicas of GPUs
        whose daemon is down."""
        with self._lock:
            return {i: ("mps", reason) for uuid, reason in self._down.items()
                    for i in self._plan[uuid].device_ids}

    def stop(self) -> None:
        """Stop watching (the agent stops); the daemons keep running for their clients."""
        self._stopping = True
        self._poke()
        if self._thread is not None:
            self._thread.join(5)

    def status(self) -> dict:
        with self._lock:
            control = self._control
            return {
                "root": control.root if control else "",
                "program": control.program if control else "",
                "launcher": control.how if control else "",
                "daemons": [{"gpuUuid": uuid, "gpuIndex": g.index, "pid": self._pids.get(uuid),
                             "running": uuid in self._pids and uuid not in self._down,
                             "reason": self._down.get(uuid, ""),
                             "restarts": self._restarts.get(uuid, 0),
                             "replicas": g.replicas, "threadPercentage": g.thread_percentage,
                             "memoryLimitMiB": g.memory_limit_mib}
                            for uuid, g in self._plan.items()],
            }

    # -- starting, adopting, quitting ------------------------------------------------------

    def _ensure(self, uuid: str, adopt: bool) -> bool:
        """Adopt the GPU's running daemon or start one, then send its limits; True when it
        runs with them. On failure the GPU is down and a retry is due."""
        with self._starting:
            return self._ensure_one(uuid, adopt)

    def _ensure_one(self, uuid: str, adopt: bool) -> bool:
        with self._lock:
            control, gpu = self._control, self._plan.get(uuid)
        if control is None or gpu is None:
            return False
        pid = control.pid(uuid) if adopt else None
        try:
            if pid is None:
                pid = control.start(uuid)
                how = "started"
            else:
                how = "adopted (started by an earlier agent)"
            control.send(uuid, f"set_default_active_thread_percentage {gpu.thread_percentage}",
                         f"set_default_device_pinned_mem_limit 0 {gpu.memory_limit_mib}M")
        except MpsError as exc:
            self._went_down(uuid, str(exc), failed_start=True)
            return False
        with self._lock:
            if self._plan.get(uuid) is not gpu:
                return False  # a reload replaced the plan meanwhile; apply() handles it
            self._pids[uuid] = pid
            was_down = self._down.pop(uuid, None)
            self._retry.pop(uuid, None)
        log.info("GPU %d %s: MPS control daemon %s (pid %d; %s); default limits %d%% of the "
                 "SMs, %d MiB a client, for %d replicas", gpu.index, uuid, how, pid,
                 control.how, gpu.thread_percentage, gpu.memory_limit_mib, gpu.replicas)
        if was_down is not None:
            self.on_change()
        return True

    def _quit(self, control: Control, uuid: str) -> None:
        if control.pid(uuid) is None:
            return
        try:
            control.send(uuid, "quit")
            log.info("%s: MPS control daemon told to quit (its GPU is no longer shared with "
                     "MPS)", uuid)
        except MpsError as exc:
            log.error("%s", exc)

    def _went_down(self, uuid: str, reason: str, failed_start: bool) -> None:
        now = time.monotonic()
        with self._lock:
            gpu = self._plan.get(uuid)
            if gpu is None:
                return
            self._pids.pop(uuid, None)
            first = uuid not in self._down
            self._down[uuid] = f"MPS control daemon not running: {reason}"
            _, backoff = self._retry.get(uuid, (now, RETRY_FIRST_S))
            when = now + backoff if failed_start else now
            self._retry[uuid] = (when, min(backoff * 2, RETRY_MAX_S))
        log.error("GPU %d %s: MPS control daemon not running (%s); its %d replicas are "
                  "withdrawn until it runs again", gpu.index, uuid, reason, gpu.replicas)
        if first:
            self.on_change()
        self._poke()

    # -- the watch thread ------------------------------------------------------------------

    def _poke(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the watch has wake-ups pending already

    def _watch(self) -> None:
        fds: dict[tuple[str, int], int] = {}  # (uuid, pid) -> pidfd
        while not self._stopping:
            with self._lock:
                pids = dict(self._pids)
                retry = dict(self._retry)
            for key in [k for k in fds if pids.get(k[0]) != k[1]]:
                os.close(fds.pop(key))
            for uuid, pid in pids.items():
                if (uuid, pid) not in fds and hasattr(os, "pidfd_open"):
                    try:
                        fds[(uuid, pid)] = os.pidfd_open(pid)
                    except ProcessLookupError:
                        self._exited(uuid, pid)
                    except OSError:
                        pass  # no pidfds here: checked every POLL_S below
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            by_fd = {fd: key for key, fd in fds.items()}
            for fd in by_fd:
                poller.register(fd, select.POLLIN)
            now = time.monotonic()
            waits = [max(0.0, when - now) for when, _ in retry.values()]
            if len(fds) < len(pids):
                waits.append(POLL_S)
            timeout = min(waits) * 1000 if waits else None
            for fd, _ in poller.poll(timeout):
                if fd == self._wake_r:
                    os.read(self._wake_r, 4096)
                elif fd in by_fd:
                    self._exited(*by_fd[fd])
            for uuid, pid in pids.items():
                if (uuid, pid) not in fds and not os.path.exists(f"/proc/{pid}"):
                    self._exited(uuid, pid)
            now = time.monotonic()
            for uuid, (when, _) in retry.items():
                if when <= now and not self._stopping:
                    self._ensure(uuid, adopt=True)
        for fd in fds.values():
            os.close(fd)

    def _exited(self, uuid: str, pid: int) -> None:
        with self._lock:
            if self._pids.get(uuid) != pid:
                return  # quit on purpose, or replaced
            self._restarts[uuid] = self._restarts.get(uuid, 0) + 1
        self._went_down(uuid, f"pid {pid} exited", failed_start=False)
