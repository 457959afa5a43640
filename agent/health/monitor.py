"""The health monitor: the NVML event loop thread, fan-out to devices, lost GPUs, recovery,
and manual isolation, ending in one health state per advertised device.

Owns: one `agent._fast` EventSet (the compiled one or its twin: as the selector chose, or the
module a test hands in as `events_module`) with every physical GPU registered for
XidCriticalError, DoubleBitEccError and SingleBitEccError (masked by what each supports;
NOT_SUPPORTED leaves the GPU Healthy with one warning), the ignored XIDs handed to its C
filter, and a thread that waits on it (GIL released) and:
- fans an event out to every advertised device its GPU backs (all replicas; for a MIG
  instance, the one named by GI/CI, or all instances of the GPU when the event names none),
  and an event that names no GPU to every device;
- on a wait error (GPU_IS_LOST, which NVML does not pin on a GPU) probes the GPUs to find
  the lost ones (all GPUs when none can be named), withdraws them and re-establishes the
  event set;
- registers again the GPUs whose recovery probe passed but that the set lost.
A second thread returns devices when their fault's recovery rule holds (agent.health.recovery),
probing through agent.nvml.probe. NVML calls on a sick GPU may hang, so every NVML call here
but the event wait runs under agent.nvml.guard's budget (a GPU that does not answer in time is
withdrawn as "NVML not answering": the running monitor is the guard's `on_hung` listener,
`not_answering`; it returns once a probe answers), and no probe runs under the monitor's lock:
what to probe (with each GPU's fault generation, bumped by every fault or event on it) is read
under the lock, the probes run without it, and their results are applied under it again only
where the generation is unchanged and the monitor is not stopping; status(), the isolation file
and event handling never wait for a probe.
Isolation comes from agent.health.isolation's thread. A device is Unhealthy while it has a
fault or is isolated; every change of that goes to `sink` as one batch (one ListAndWatch
snapshot), is logged once per GPU with UUID, index, XID, action and reason, and is kept in a
short list of recent transitions for `gpu-agent status`. Faults are persisted through
recovery.FaultFile. Must not import grpc or talk to kubelet (the sink does), nor call pynvml
itself (agent.nvml does).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

from agent import _fast
from agent._fast._types import (
    COUNTERS,
    EVENT_DOUBLE_BIT_ECC,
    EVENT_SINGLE_BIT_ECC,
    EVENT_XID_CRITICAL,
    NO_INSTANCE,
)
from agent.errors import AgentError, NvmlError, NvmlLibraryError, NvmlNotAnswering
from agent.health.isolation import Isolation, IsolationWatch
from agent.health.policy import (
    ACTION_TEXT,
    REBOOT,
    RESET,
    WITHDRAWING,
    XID_RECOVERY_ACTION_CHANGED,
    XidPolicy,
)
from agent.health.recovery import STRENGTH, Fault, FaultFile, reset_may_recover
from agent.host import boot_id
from agent.nvml import probe
from agent.nvml.guard import GUARD

log = logging.getLogger(__name__)

# One wait never blocks longer than this: stop() returns within it. An idle agent wakes once
# per wait, so this is also what the loop costs at rest (docs/benchmarks.md).
WAIT_MS = 1000
# Recovery checks (probes) run this often, on their own thread, while a reset-class fault waits
# to end (or health.json waits to be written); without one the thread sleeps until one comes.
TICK_S = 0.25
# stop() waits this long for a recovery probe in flight; one that hangs in NVML is left behind
# (it changes nothing once the monitor is stopping).
RECOVERY_JOIN_S = 5.0
# After the event set could not be opened, try again this often.
REOPEN_RETRY_S = 1.0
# Waits that fail again right after the set was re-established (a wedged driver) are retried
# after REOPEN_RETRY_S, doubling up to this, instead of in a tight loop.
WAIT_ERROR_BACKOFF_MAX_S = 30.0
EVENT_TYPES = EVENT_XID_CRITICAL | EVENT_DOUBLE_BIT_ECC | EVENT_SINGLE_BIT_ECC
TRANSITIONS_KEPT = 50

# device id -> (healthy, reason), for every device whose health changed.
Sink = Callable[[Mapping[str, tuple[bool, str]]], None]
# (GPU UUID, PCI bus id or None) -> None when the GPU answers NVML as itself, else what failed.
Probe = Callable[[str, Optional[str]], Optional[str]]


def matches_instance(device: Any, gi: int, ci: int) -> bool:
    """Does an event with GPU instance `gi` / compute instance `ci` concern `device`? A full
    GPU (no gi) always; a MIG instance when each id the event gives equals its own (NVIDIA's
    matchesMigEvent), so an event naming no instance concerns every instance."""
    dev_gi = getattr(device, "gi", None)
    if dev_gi is None:
        return True
    dev_ci = getattr(device, "ci", None)
    return (gi == NO_INSTANCE or gi == dev_gi) and (ci == NO_INSTANCE or ci == dev_ci)


class HealthMonitor:
    """Health of the advertised `devices` (agent.rm.devices.Device) on the physical `gpus`
    (agent.nvml.discovery.Gpu). `start()` applies the recorded faults and the isolation file
    before it returns (so the first ListAndWatch snapshot already has them), then runs.
    `recovery_probe` replaces agent.nvml.probe.recovery_probe (tests hold a probe in flight
    with it). `outages()` names devices withdrawn for a reason outside NVML (device ID ->
    (class, reason): agent.mps's daemons that are down, class "mps"); `outages_changed()`
    applies a change of it."""

    def __init__(self, *, library_path: str, gpus: Sequence[Any], devices: Sequence[Any],
                 policy: XidPolicy, sink: Sink, state_dir: str | None = None,
                 quiet_period_s: float = 60.0, isolation_file: str = "",
                 events_module: Any = None, on_change: Callable[[], None] | None = None,
                 current: Mapping[str, tuple[bool, str]] | None = None,
                 recovery_probe: Probe | None = None,
                 outages: Callable[[], Mapping[str, tuple[str, str]]] = dict,
                 on_transition: Callable[[dict], None] = lambda record: None,
                 holders: Callable[[list[str]], list[str]] = lambda ids: []):
        self.library_path = library_path
        self.on_transition = on_transition
        self.holders = holders
        self.outages = outages
        self.policy = policy
        self.sink = sink
        self.quiet_s = quiet_period_s
        self.isolation_file = isolation_file
        self.events = events_module or _fast.events_impl
        self.on_change = on_change or (lambda: None)
        self.recovery_probe = recovery_probe or probe.recovery_probe
        self.gpus = {g.uuid: g for g in sorted(gpus, key=lambda g: g.index)}
        self.by_index = {g.index: g.uuid for g in gpus}
        self.devices = {d.id: d for d in devices}
        self.by_gpu: dict[str, list] = collections.defaultdict(list)
        for d in devices:
            self.by_gpu[d.gpu_uuid].append(d)
        self._lock = threading.RLock()
        self._faults: dict[str, Fault] = {}
        # GPU UUID -> how many times a fault was raised or renewed on it: a probe result is
        # applied only while this is what it was when the probe began.
        self._fault_gen: dict[str, int] = {}
        # GPU UUID -> fault generation, for GPUs whose probe passed but that the event set
        # lost: the event loop (which owns the set) registers them, then clears their faults.
        self._reregister: dict[str, int] = {}
        self._isolation = Isolation()
        self._outages: dict[str, tuple[str, str]] = dict(outages())
        self._isolation_error = ""
        self._isolation_unknown: list[str] = []
        # What the devices' holders show now (a monitor replacing another on a reload): only
        # real differences are sent, so nothing flaps.
        self._applied = {d.id: (current or {}).get(d.id, (True, "")) for d in devices}
        self._transitions: collections.deque = collections.deque(maxlen=TRANSITIONS_KEPT)
        self._file = FaultFile(state_dir)
        self._boot = ""
        self._es: Any = None
        self._es_error = ""
        self._unregistered: set[str] = set()
        self._unsupported: dict[str, str] = {}
        self._probe_failures: dict[str, str] = {}
        self._closed_counts = dict.fromkeys(COUNTERS, 0)
        self._xids: dict[tuple[int | None, str | None, int], int] = {}  # (index, uuid, xid)
        self.reestablished = 0
        self.wait_errors = 0
        self.loop_errors = 0  # unexpected exceptions caught at the loop boundary
        self._error_streak = 0  # wait errors since the last good wait
        self._stop = threading.Event()
        self._recovery_due = threading.Event()  # a fault to check came, or stop()
        self._thread: threading.Thread | None = None
        self._recovery: threading.Thread | None = None
        self._watch: IsolationWatch | None = None

    # -- life ------------------------------------------------------------------------------

    def start(self, watch_isolation: bool = True) -> None:
        """Apply the recorded faults and the isolation file, then watch NVML's events;
        without `watch_isolation` the file is read now and followed from `watch_isolation()`
        on (the agent's start: after its first registration)."""
        try:
            self._boot = boot_id()
        except AgentError as exc:
            log.warning("%s: reboot-class faults cannot be cleared by a reboot this run", exc)
        GUARD.on_hung = self.not_answering  # the monitor that runs is the one told
        with self._lock:
            self._load_faults()
            for gpu, (what, _) in GUARD.not_answering().items():
                self._hung(gpu, what)
            if self.isolation_file:
                self._watch = IsolationWatch(self.isolation_file, self._on_isolation)
                self._watch.start()
                if watch_isolation:
                    self._watch.watch()
            self._apply("")
            log.info("health: %s; implementation %s; recovery quiet period %g s; isolation "
                     "file %s", self.policy.summary(), self.implementation, self.quiet_s,
                     self.isolation_file or "none")
            if not self.policy.enabled:
                return
        self._open_set()  # registers every GPU: NVML, so not under the lock
        self._thread = threading.Thread(target=self._run, name="health-events", daemon=True)
        self._thread.start()
        self._recovery = threading.Thread(target=self._run_recovery, name="health-recovery",
                                          daemon=True)
        self._recovery.start()

    def watch_isolation(self) -> None:
        """Follow the isolation file from now on (see start)."""
        if self._watch is not None:
            self._watch.watch()

    def stop(self, wait: bool = True) -> None:
        """Stop the loop (within one wait, WAIT_MS) and the isolation watch; close the set.
        From the moment this is called the monitor changes nothing (no sink call, no
        health.json write). With wait=False the rest happens in the background: a reload hands
        over to a new monitor at once instead of waiting out the NVML event wait."""
        self._stop.set()
        self._recovery_due.set()
        if not wait:
            threading.Thread(target=self.stop, name="health-stop", daemon=True).start()
            return
        stuck = False
        if self._thread is not None:
            self._thread.join(WAIT_MS / 1000 + 30)
            stuck = self._thread.is_alive()
            self._thread = None
        if self._recovery is not None:  # it never touches the event set: no need to wait it out
            self._recovery.join(RECOVERY_JOIN_S)
            if self._recovery.is_alive():
                log.warning("health recovery probe did not return within %g s (an NVML call "
                            "hangs); left behind, it changes nothing", RECOVERY_JOIN_S)
            self._recovery = None
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        if stuck:  # an NVML call that never returned: freeing its set under it would crash
            log.error("health loop did not stop within %g s (an NVML call hangs); its event "
                      "set is left open", WAIT_MS / 1000 + 30)
            return
        with self._lock:
            self._close_set()

    @property
    def implementation(self) -> str:
        return "python" if self.events.__name__.endswith("_events_py") else "cython"

    # -- recorded faults ---------------------------------------------------------------------

    def _load_faults(self) -> None:
        kept, cleared = self._file.load(self._boot)
        now = time.monotonic()
        for fault in cleared:
            log.info("GPU %d %s: healthy again: %s fault recorded before the last reboot is "
                     "cleared (boot ID changed) [xid=%s action=%s]: %s", fault.gpu_index,
                     fault.gpu_uuid, fault.action, fault.xid, fault.action, fault.reason)
            self._record(fault.gpu_uuid, fault.gpu_index, [fault.device_id], True,
                         f"boot ID changed since {fault.action}-class fault: {fault.reason}",
                         fault.xid, fault.action)
        for fault in kept:
            if fault.device_id not in self.devices:
                log.warning("GPU %d %s: recorded fault for device %s, which is not advertised "
                            "now; dropped: %s", fault.gpu_index, fault.gpu_uuid,
                            fault.device_id, fault.reason)
                continue
            if not self.policy.enabled:
                log.warning("GPU %d %s: recorded %s-class fault not applied, health checks "
                            "are disabled: %s", fault.gpu_index, fault.gpu_uuid, fault.action,
                            fault.reason)
                continue
            fault.last_event = now
            self._faults[fault.device_id] = fault
            if fault.kind in ("lost", "register"):
                self._unregistered.add(fault.gpu_uuid)

    # -- the event set -----------------------------------------------------------------------

    def _open_set(self) -> None:
        """Open an event set and register every GPU on it (NVML: called without the lock, so
        status() and the other threads never wait on a GPU that does not answer), then make it
        the monitor's set under the lock. Only the event thread (or start()) calls this."""
        try:
            es = self.events.EventSet(self.library_path)
            es.set_ignored_xids(self.policy.filtered_xids())
        except (NvmlError, NvmlLibraryError) as exc:
            message = f"cannot open an NVML event set on {self.library_path}: {exc}"
            with self._lock:
                if message != self._es_error:
                    log.error("%s; retrying every %g s (no XID health checks until then)",
                              message, REOPEN_RETRY_S)
                self._es_error = message
            return
        attempts = [(gpu, self._try_register(es, gpu)) for gpu in self.gpus.values()]
        with self._lock:
            self._es, self._es_error = es, ""
            registered = sum(self._registered(gpu, *attempt) for gpu, attempt in attempts)
            self._apply("")  # the GPUs that could not be registered
        log.info("NVML event set open: %d of %d GPUs registered for XID and ECC events",
                 registered, len(self.gpus))

    def _close_set(self) -> None:
        es, self._es = self._es, None
        if es is None:
            return
        for key, value in es.counters.items():
            self._closed_counts[key] += value
        try:
            es.close()
        except NvmlError as exc:
            log.warning("closing the NVML event set: %s", exc)

    @staticmethod
    def _try_register(es: Any, gpu: Any) -> tuple[int, NvmlError | None]:
        """Register `gpu` on `es` (NVML, without the lock): (mask, None) or (0, the error)."""
        try:
            return GUARD.call(gpu.index, "NVML event registration", es.register, gpu.index,
                              EVENT_TYPES), None
        except NvmlError as exc:
            return 0, exc

    def _registered(self, gpu: Any, mask: int, exc: NvmlError | None) -> bool:
        """Apply the outcome of registering `gpu` (under the lock); True when it is watched
        (or has nothing to watch)."""
        if exc is not None:
            if exc.is_not_supported:
                self._not_supported(gpu, str(exc))
                return False
            kind, what = (("lost", f"GPU is lost ({exc})") if exc.is_gpu_lost else
                          ("hung", _not_answering(exc.function))
                          if isinstance(exc, NvmlNotAnswering) else
                          ("register", f"cannot register for NVML events ({exc})"))
            self._fault_gpu(gpu, kind, RESET, what, None, time.monotonic())
            self._unregistered.add(gpu.uuid)
            return False
        self._unregistered.discard(gpu.uuid)
        if not mask & (EVENT_XID_CRITICAL | EVENT_DOUBLE_BIT_ECC):
            self._not_supported(gpu, f"supported event mask {mask:#x} has neither "
                                     f"XidCriticalError nor DoubleBitEccError")
            return False
        return True

    def _not_supported(self, gpu: Any, why: str) -> None:
        if gpu.uuid not in self._unsupported:
            log.warning("GPU %d %s: NVML events not supported (%s): its devices stay Healthy, "
                        "without XID health checks", gpu.index, gpu.uuid, why)
        self._unsupported[gpu.uuid] = why

    # -- the loop ----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._guarded(self._step, "health loop")

    def _guarded(self, turn: Callable[[], None], what: str) -> None:
        """One turn of a thread's loop, at its boundary: a dead thread would withdraw (or
        return) nothing again, so an unexpected error is counted, logged, and waited out."""
        try:
            turn()
        except Exception:
            with self._lock:
                self.loop_errors += 1
            log.exception("%s: unexpected error; going on in %g s", what, REOPEN_RETRY_S)
            self._stop.wait(REOPEN_RETRY_S)

    def _step(self) -> None:
        """One turn of the loop: a wait, what it returned, the GPUs to register again."""
        es = self._es
        if es is None:
            if not self._stop.wait(REOPEN_RETRY_S):
                self._open_set()
            return
        try:
            event = es.wait(WAIT_MS)
        except NvmlError as exc:
            self._error_streak += 1
            if self._error_streak > 1:  # it failed again at once: do not spin on NVML
                delay = min(REOPEN_RETRY_S * 2 ** (self._error_streak - 2),
                            WAIT_ERROR_BACKOFF_MAX_S)
                if self._stop.wait(delay):
                    return
            self._on_wait_error(exc)
            return
        self._error_streak = 0
        if event is not None:
            self._on_event(event)
        self._register_recovered()

    def _targets(self, event: Any) -> list | None:
        """The GPU UUIDs an event concerns (every GPU when it names none); None for a GPU the
        agent does not know."""
        if event.uuid is not None:
            return [event.uuid] if event.uuid in self.gpus else None
        if event.index is not None:
            uuid = self.by_index.get(event.index)
            return [uuid] if uuid is not None else None
        return list(self.gpus)

    def _on_event(self, event: Any) -> None:
        if event.event_type == EVENT_XID_CRITICAL:
            key = (event.index, event.uuid, event.xid)
            self._xids[key] = self._xids.get(key, 0) + 1  # this thread is the only writer
        action, reason = self.policy.event_action(event.event_type, event.xid)
        if action not in WITHDRAWING:
            log.debug("event %s: %s", event, reason)
            return
        targets = self._targets(event)
        if targets is None:
            log.warning("%s on GPU %s %s, which the agent did not discover: ignored", reason,
                        event.index, event.uuid)
            return
        if event.event_type == EVENT_XID_CRITICAL and len(targets) == 1 and \
                event.xid == XID_RECOVERY_ACTION_CHANGED:  # what the driver asks for now
            try:  # NVML: not under the lock, and not longer than the guard's budget
                asked = GUARD.call(self.gpus[targets[0]].index, "recovery action",
                                   probe.recovery_action, targets[0])
            except NvmlNotAnswering:
                asked = None  # the table's class; the guard's listener withdraws the GPU
            action, reason = self.policy.event_action(event.event_type, event.xid, asked)
        if event.uuid is None and event.index is None:
            reason += " (the event names no GPU: every GPU is withdrawn)"
        kind = "xid" if event.event_type == EVENT_XID_CRITICAL else "ecc"
        xid = event.xid if kind == "xid" else None
        now = time.monotonic()
        with self._lock:
            touched = 0
            for uuid in targets:
                gpu = self.gpus[uuid]
                devices = [d for d in self.by_gpu.get(uuid, ())
                           if matches_instance(d, event.gpu_instance_id,
                                               event.compute_instance_id)]
                if not devices:
                    log.info("GPU %d %s: %s [xid=%s action=%s]; it backs no advertised device",
                             gpu.index, uuid, reason, xid, action)
                for d in devices:
                    self._add_fault(d, kind, action, reason, xid, now)
                    touched += 1
            if touched:
                self._apply("")

    def _on_wait_error(self, exc: NvmlError) -> None:
        lost = self._lost() if exc.is_gpu_lost else []  # NVML: not under the lock
        with self._lock:
            self.wait_errors += 1
            now = time.monotonic()
            if lost:
                for uuid in lost:
                    self._fault_gpu(self.gpus[uuid], "lost", RESET,
                                    f"GPU is lost ({exc}): fallen off the bus or not answering "
                                    f"NVML", None, now)
                    self._unregistered.add(uuid)
            else:
                for gpu in self.gpus.values():
                    self._fault_gpu(gpu, "wait", RESET,
                                    f"NVML event wait failed ({exc}) naming no GPU: withdrawn "
                                    f"until it passes a probe", None, now)
            self._apply("")
            self._close_set()
            self.reestablished += 1
            log.info("re-establishing the NVML event set after: %s", exc)
        self._open_set()

    def _lost(self) -> list[str]:
        """The GPUs NVML says are lost, each asked under the guard's budget (one that does not
        answer is not counted lost: the guard's listener withdraws it as not answering)."""
        lost = []
        for uuid, gpu in self.gpus.items():
            try:
                lost += GUARD.call(gpu.index, "lost GPU probe", probe.lost, [uuid])
            except NvmlNotAnswering:
                pass
        return lost

    def not_answering(self, gpu: Any, what: str) -> None:
        """From agent.nvml.guard's listener (any thread): NVML call `what` on GPU `gpu` (its
        index, or UUID) did not return within the budget. Its devices are withdrawn (a
        reset-class fault of kind `hung`) until a recovery probe answers."""
        with self._lock:
            if self._hung(gpu, what):
                self._apply("")

    def _hung(self, gpu: Any, what: str) -> bool:
        uuid = self.by_index.get(gpu, gpu)
        if uuid not in self.gpus or self._stop.is_set():
            return False
        if not self.policy.enabled:
            log.warning("GPU %s %s: NVML not answering (%s); health checks are disabled: it "
                        "stays advertised", self.gpus[uuid].index, uuid, what)
            return False
        self._fault_gpu(self.gpus[uuid], "hung", RESET, _not_answering(what), None,
                        time.monotonic())
        return True

    # -- recovery ------------------------------------------------------------------------------

    def _run_recovery(self) -> None:
        # every TICK_S while a reset-class fault waits to end; asleep until one comes otherwise
        while not self._stop.is_set():
            self._recovery_due.wait(TICK_S if self._recovery_pending() else None)
            self._recovery_due.clear()  # what set it is read afresh below
            if self._stop.is_set():
                return
            self._guarded(self._recover, "health recovery")
            if self._file.error:  # health.json could not be written: try again until it is
                with self._lock:
                    if not self._stop.is_set():
                        self._file.save(list(self._faults.values()))

    def _recovery_pending(self) -> bool:
        """Is there something for the recovery thread to check: a reset-class fault (others
        end only with a reboot), or health.json still to be written? Read without the lock: a
        fault added meanwhile sets `_recovery_due`."""
        return bool(self._file.error) or any(f.action == RESET for f in list(self._faults.values()))

    def _recover(self) -> None:
        """One recovery check: which GPUs are due a probe is read under the lock, the probes
        run with it released, and a result is applied under it only when the GPU's fault
        generation is still what it was before the probe (no fault or event came meanwhile)."""
        now = time.monotonic()
        with self._lock:
            due = self._due(now)
        results = []
        for uuid, gpu, gen in due:
            if self._stop.is_set():
                return
            try:
                problem = GUARD.call(gpu.index if gpu is not None else uuid, "recovery probe",
                                     self.recovery_probe, uuid,
                                     gpu.pci_bus_id if gpu is not None else None)
            except NvmlNotAnswering as exc:
                problem = str(exc)
            results.append((uuid, gpu, gen, problem))
        if not results:
            return
        with self._lock:
            if self._stop.is_set():  # a reload handed the devices over: change nothing
                return
            cleared: list[Fault] = []
            for uuid, gpu, gen, problem in results:
                if self._stale(uuid, gpu, gen):
                    continue
                if problem is not None:
                    self._not_recovered(uuid, gpu, problem)
                elif uuid in self._unregistered and gpu is not None:
                    self._reregister[uuid] = gen
                else:
                    cleared += self._clear_resets(uuid)
            self._cleared(cleared)

    def _due(self, now: float) -> list[tuple[str, Any, int]]:
        """(UUID, Gpu or None, fault generation) of each GPU whose reset-class faults may all
        end now: it waits for a passing probe. Nothing while there is no event set."""
        if self._es is None:
            return []
        by_gpu: dict[str, list[Fault]] = collections.defaultdict(list)
        for fault in self._faults.values():
            by_gpu[fault.gpu_uuid].append(fault)
        due = []
        for uuid, faults in by_gpu.items():
            if uuid in self._reregister:
                continue
            resets = [f for f in faults if f.action == RESET]
            if resets and all(reset_may_recover(f, now, self.quiet_s) for f in resets):
                due.append((uuid, self.gpus.get(uuid), self._fault_gen.get(uuid, 0)))
        return due

    def _register_recovered(self) -> None:
        """On the event loop thread, which owns the set: register again the GPUs whose probe
        passed but that the set lost (NVML, without the lock), then clear their faults where
        that held and nothing changed since the probe began."""
        if not self._reregister:  # the common case, read without the lock: one dict test
            return
        with self._lock:
            if not self._reregister:
                return
            pending, self._reregister = self._reregister, {}
            todo = [(uuid, gen, uuid in self._unregistered) for uuid, gen in pending.items()]
        es = self._es  # only this thread replaces it
        attempts = [(uuid, gen, self._try_register(es, self.gpus[uuid])
                     if needed and es is not None else None)
                    for uuid, gen, needed in todo]
        with self._lock:
            if self._stop.is_set():
                return
            cleared: list[Fault] = []
            for uuid, gen, attempt in attempts:
                gpu = self.gpus[uuid]
                ok = (self._registered(gpu, *attempt) if attempt is not None
                      else uuid not in self._unregistered)
                if not ok:
                    self._not_recovered(uuid, gpu, "not yet registered for NVML events again")
                    continue
                if self._stale(uuid, gpu, gen):
                    continue
                cleared += self._clear_resets(uuid)
            self._cleared(cleared)

    def _stale(self, uuid: str, gpu: Any, gen: int) -> bool:
        """Was a fault raised or renewed on GPU `uuid` since its probe began (generation
        `gen`)? Then the probe's result is dropped: the next check decides afresh."""
        if self._fault_gen.get(uuid, 0) == gen:
            return False
        log.debug("GPU %s %s: recovery probe result dropped: a fault or event came during it",
                  getattr(gpu, "index", "?"), uuid)
        return True

    def _not_recovered(self, uuid: str, gpu: Any, problem: str) -> None:
        if self._probe_failures.get(uuid) != problem:
            log.info("GPU %s %s: not recovered yet: %s", getattr(gpu, "index", "?"), uuid,
                     problem)
        self._probe_failures[uuid] = problem

    def _clear_resets(self, uuid: str) -> list[Fault]:
        """Drop the reset-class faults of GPU `uuid` (its probe passed); return them."""
        self._probe_failures.pop(uuid, None)
        resets = [f for f in self._faults.values() if f.gpu_uuid == uuid and f.action == RESET]
        for f in resets:
            del self._faults[f.device_id]
        return resets

    def _cleared(self, cleared: list[Fault]) -> None:
        if cleared:
            self._apply(f"reset-class fault cleared: no critical event for {self.quiet_s:g} s "
                        f"and the GPU answers NVML as itself (was: {cleared[0].reason})")

    # -- faults and isolation ------------------------------------------------------------------

    def _add_fault(self, device: Any, kind: str, action: str, reason: str, xid: int | None,
                   now: float) -> None:
        self._fault_gen[device.gpu_uuid] = self._fault_gen.get(device.gpu_uuid, 0) + 1
        self._recovery_due.set()
        fault = self._faults.get(device.id)
        if fault is None:
            self._faults[device.id] = Fault(device.id, device.gpu_uuid, device.gpu_index, kind,
                                            action, reason, xid, time.time(), self._boot, now)
            return
        fault.last_event = now  # a new critical event restarts the quiet period
        if STRENGTH[action] > STRENGTH[fault.action]:
            log.info("GPU %d %s: device %s now needs more: %s [xid=%s action=%s] (was: %s)",
                     device.gpu_index, device.gpu_uuid, device.id, reason, xid, action,
                     fault.reason)
            fault.kind, fault.action, fault.reason, fault.xid = kind, action, reason, xid
            fault.since = time.time()
            fault.boot_id = self._boot

    def _fault_gpu(self, gpu: Any, kind: str, action: str, reason: str, xid: int | None,
                   now: float) -> None:
        for d in self.by_gpu.get(gpu.uuid, ()):
            self._add_fault(d, kind, action, reason, xid, now)

    def _on_isolation(self, isolation: Isolation | None, error: str | None) -> None:
        with self._lock:
            if error is not None:
                if error != self._isolation_error:
                    log.error("isolation file: %s; keeping the previous isolation set",
                              error)
                self._isolation_error = error
                self.on_change()
                return
            if self._isolation_error:
                log.info("isolation file %s is valid again", self.isolation_file)
            self._isolation_error = ""
            unknown = isolation.unknown(self.devices.values())
            if unknown and unknown != self._isolation_unknown:
                log.warning("isolation file %s names %s, which no advertised device is",
                            self.isolation_file, ", ".join(unknown))
            self._isolation_unknown = unknown
            self._isolation = isolation
            self._apply(f"no longer listed in {self.isolation_file}")
            self.on_change()

    # -- applying ----------------------------------------------------------------------------

    def _desired(self, device: Any) -> tuple[bool, str]:
        reasons = []
        fault = self._faults.get(device.id)
        if fault is not None:
            reasons.append(fault.reason)
        if self._isolation.names(device):
            reasons.append(f"isolated by {self.isolation_file}")
        outage = self._outages.get(device.id)
        if outage:
            reasons.append(outage[1])
        return (not reasons, "; ".join(reasons))

    def outages_changed(self) -> None:
        """From any thread: `outages()` changed; withdraw or return those devices."""
        with self._lock:
            old, self._outages = self._outages, dict(self.outages())
            ended = sorted({r for i, (_, r) in old.items() if i not in self._outages})
            self._apply(f"no longer {'; '.join(ended)}" if ended else "")

    def _apply(self, why_healthy: str) -> None:
        """Send every change of health (or reason) to the sink as one batch, log each GPU's
        transition once, record it, persist the faults. Nothing once stopping: the monitor
        that replaces this one (it registered its own event set first) owns the devices."""
        if self._stop.is_set():
            return
        changes = {}
        for device_id, device in self.devices.items():
            state = self._desired(device)
            if state != self._applied[device_id]:
                changes[device_id] = state
        if changes:
            flipped = {i: s for i, s in changes.items() if s[0] != self._applied[i][0]}
            self._applied.update(changes)
            self.sink(changes)
            by_gpu: dict[tuple, list[str]] = collections.defaultdict(list)
            for device_id, (healthy, reason) in flipped.items():
                d = self.devices[device_id]
                by_gpu[(d.gpu_uuid, d.gpu_index, healthy, reason)].append(device_id)
            for (uuid, index, healthy, reason), ids in sorted(by_gpu.items(),
                                                              key=lambda kv: kv[0][1]):
                fault = self._faults.get(ids[0])
                xid, action = (fault.xid, fault.action) if fault else (None, None)
                if healthy:
                    log.info("GPU %d %s: healthy again (%s); returned: %s", index, uuid,
                             why_healthy, ", ".join(ids))
                    self._record(uuid, index, ids, True, why_healthy, None, None)
                else:
                    held = self._holders(ids)
                    # WARNING: `journalctl -u gpu-agent -p warning` lists every withdrawal
                    log.warning("GPU %d %s: unhealthy [xid=%s action=%s]: %s; withdrawn: %s; "
                                "held by %s", index, uuid, xid, action or "isolate", reason,
                                ", ".join(ids), ", ".join(held) or "no pod")
                    self._record(uuid, index, ids, False, reason, xid, action or "isolate")
        self._file.save([f for f in self._faults.values()])
        if self._file.error:
            self._recovery_due.set()  # its thread writes it again until it works
        if changes:
            self.on_change()

    def _record(self, uuid: str, index: int, ids: list[str], healthy: bool, reason: str,
                xid: int | None, action: str | None) -> None:
        record = {"time": time.time(), "gpuIndex": index, "gpuUuid": uuid,
                  "devices": list(ids), "healthy": healthy, "reason": reason,
                  "xid": xid, "action": action}
        self._transitions.append(record)
        self.on_transition(record)  # queues only (agent.kubeapi.faults): nothing blocks here

    def _holders(self, ids: list[str]) -> list[str]:
        """namespace/pod/container of each container holding one of `ids`, as the
        allocation journal knows them (in memory: nothing is asked of kubelet here)."""
        try:
            return self.holders(ids)
        except Exception as exc:  # noqa: BLE001 - a log line's detail must not stop health
            log.debug("holders of %s unknown: %s", ids, exc)
            return []

    def transitions(self) -> list[dict]:
        """The transitions recorded so far (the last TRANSITIONS_KEPT), oldest first."""
        with self._lock:
            return list(self._transitions)

    def gpus_out(self) -> dict[str, tuple[int, str]]:
        """GPU UUID -> (index, why) for each GPU with a device withdrawn now."""
        with self._lock:
            out: dict[str, tuple[int, str]] = {}
            for device_id, (healthy, reason) in self._applied.items():
                if not healthy:
                    d = self.devices[device_id]
                    out.setdefault(d.gpu_uuid, (d.gpu_index, reason))
            return out

    # -- status ------------------------------------------------------------------------------

    @property
    def counters(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._closed_counts)
            if self._es is not None:
                for key, value in self._es.counters.items():
                    out[key] += value
            return out

    def xid_counts(self) -> dict[tuple[int | None, str | None, int], int]:
        """(GPU index, GPU UUID, XID) -> XID events delivered to the policy (the ignored ones
        are filtered before Python and only counted, as `ignored`)."""
        return dict(self._xids)

    def withdrawn(self) -> dict[str, str]:
        """device id -> why it is Unhealthy, as a class: its fault's kind (xid, ecc, lost,
        hung, register, wait), `isolated` (the isolation file) or its outage's class (`mps`)."""
        with self._lock:
            return {i: self._withdrawn_class(i)
                    for i, (healthy, _) in self._applied.items() if not healthy}

    def _withdrawn_class(self, device_id: str) -> str:
        if device_id in self._faults:
            return self._faults[device_id].kind
        if device_id in self._outages and not self._isolation.names(self.devices[device_id]):
            return self._outages[device_id][0]
        return "isolated"

    def reboot_needed(self) -> set[str]:
        """IDs of the withdrawn devices whose fault only a reboot ends (the reboot class)."""
        with self._lock:
            return {i for i, f in self._faults.items()
                    if f.action == REBOOT and not self._applied.get(i, (True, ""))[0]}

    def unhealthy(self) -> dict[str, str]:
        """device id -> reason, for every Unhealthy device."""
        with self._lock:
            return {i: s[1] for i, s in self._applied.items() if not s[0]}

    def status(self) -> dict:
        """The health part of status.json."""
        with self._lock:
            unhealthy = []
            for device_id, (healthy, reason) in sorted(self._applied.items()):
                if healthy:
                    continue
                d = self.devices[device_id]
                f = self._faults.get(device_id)
                unhealthy.append({
                    "id": device_id, "gpuIndex": d.gpu_index, "gpuUuid": d.gpu_uuid,
                    "reason": reason, "xid": f.xid if f else None,
                    "action": f.action if f else "isolate",
                    "since": f.since if f else None,
                    "isolated": self._isolation.names(d),
                })
            return {
                "enabled": self.policy.enabled,
                "policy": self.policy.summary(),
                "implementation": self.implementation,
                "quietPeriodS": self.quiet_s,
                "eventSet": "open" if self._es is not None else (self._es_error or "closed"),
                "counters": {**self.counters, "waitErrors": self.wait_errors,
                             "reestablished": self.reestablished,
                             "loopErrors": self.loop_errors},
                "unsupported": {self.gpus[u].index: why for u, why in self._unsupported.items()
                                if u in self.gpus},
                "isolation": {"file": self.isolation_file, "error": self._isolation_error,
                              "indexes": sorted(self._isolation.indexes),
                              "uuids": sorted(self._isolation.uuids),
                              "unknown": list(self._isolation_unknown)},
                "stateError": self._file.error,
                "unhealthy": unhealthy,
                "transitions": list(self._transitions)[-20:],
            }


def _not_answering(what: str) -> str:
    """The withdrawal reason of a GPU whose NVML call `what` did not return in time."""
    return f"NVML not answering: {what} did not return within {GUARD.budget_s:g} s"


def monitor_from_config(cfg: Any, *, library_path: str, gpus: Sequence[Any],
                        devices: Sequence[Any], sink: Sink,
                        on_change: Callable[[], None] | None = None,
                        current: Mapping[str, tuple[bool, str]] | None = None,
                        outages: Callable[[], Mapping[str, tuple[str, str]]] = dict,
                        on_transition: Callable[[dict], None] = lambda record: None,
                        holders: Callable[[list[str]], list[str]] = lambda ids: []
                        ) -> HealthMonitor:
    """A monitor set up from the agent's Config (agent.health options)."""
    policy = XidPolicy.build(cfg.disable_healthchecks, cfg.enable_healthchecks, cfg.xid_actions,
                             table=cfg.xid_policy)
    return HealthMonitor(library_path=library_path, gpus=gpus, devices=devices, policy=policy,
                         sink=sink, state_dir=cfg.state_dir,
                         quiet_period_s=cfg.recovery_quiet_period,
                         isolation_file=cfg.unhealthy_devices_file, on_change=on_change,
                         current=current, outages=outages, on_transition=on_transition,
                         holders=holders)


__all__ = ["ACTION_TEXT", "HealthMonitor", "matches_instance",
           "monitor_from_config"]
