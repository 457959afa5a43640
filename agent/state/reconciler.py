"""The reconciler: a thread that keeps the allocation journal matched to kubelet's pods.

Owns: when to ask kubelet's podresources which container holds which devices (at start,
shortly after each Allocate (debounced), every `period`, sooner while an allocation waits for
its pod or kubelet does not answer), applying agent.state.reconcile's outcome to the journal,
and reporting a podresources that is missing, too old (UNIMPLEMENTED) or not answering (log
once per change, status; never fatal). Kubelet is asked with no lock held that Allocate, the
main loop or a reload needs, and a record appended while kubelet is being asked is never judged
by that (older) listing. Must not import grpc (the client comes in through `connect`, the
daemon's agent.kubelet.podresources.PodResourcesClient), call NVML (the advertised devices come
in through a callable), nor decide which records stand (agent.state.reconcile) or how they are
stored (agent.state.journal).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable

from agent.constants import DEFAULT_ENDED_POD_GRACE_S
from agent.errors import PodResourcesError, StateError
from agent.state.journal import Journal
from agent.state.reconcile import Outcome, PodDevices, reconcile

log = logging.getLogger(__name__)

# After an Allocate, reconcile once this much later (more Allocates in between share it).
DEBOUNCE_S = 0.5
# While an allocation waits for its pod to show up in podresources, look again this often.
PENDING_RETRY_S = 1.0
# While kubelet's podresources does not answer, try again this often (or the period if less).
UNAVAILABLE_RETRY_S = 5.0
# Under a stream of Allocates, passes (each walks every record) are spaced at least this many
# times as long as the last one took: they take at most a tenth of the time.
PASS_SPACING = 10
STOP_WAIT_S = 11.0  # a pass in flight ends within its two RPC timeouts


class Reconciler:
    """The thread that keeps the journal's records matched to kubelet's pods."""

    def __init__(self, journal: Journal, socket_path: str, *,
                 connect: Callable[[str], Any],
                 devices: Callable[[], Mapping[str, Sequence[Any]] | None], period: float,
                 ended_grace: float = DEFAULT_ENDED_POD_GRACE_S,
                 clock: Callable[[], float] = time.time):
        self.journal = journal
        self.connect = connect  # socket path -> a podresources client (list, allocatable)
        self.devices = devices
        self.period = period
        self.clock = clock
        self.client = connect(socket_path) if socket_path else None
        self._socket_path = socket_path
        self._reconnect: str | None = None  # a new socket path, taken up by the next pass
        self._settings = threading.Lock()  # client, socket path and period; never held long
        self._cond = threading.Condition()
        self._due: float | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self._pass = threading.Lock()  # one reconciliation at a time (nothing else takes it)
        self.version = 0
        self.runs = 0
        self.last_run: float | None = None
        self.error = ""
        self.error_kind = ""
        self.allocatable: dict[str, int] | None = None
        self.allocatable_error = ""
        self._allocatable_unimplemented = False
        self.last_outcome: dict | None = None
        self.last_duration = 0.0  # of the last full pass, in seconds
        self._judged: tuple | None = None  # (devices, keyed_by) the records were last judged by
        # attributed records the last listing lacked: ID -> since when (agent.state.reconcile
        # rule 3: dropped once unlisted for ended_grace)
        self.ended_grace = ended_grace
        self._missing: Mapping[str, float] = {}
        journal.on_allocate = self.after_allocate
        # told after every pass, from its thread (the daemon publishes the status then)
        self.on_change: Callable[[], None] = lambda: None

    @property
    def socket_path(self) -> str:
        return self._socket_path

    def start(self) -> None:
        """Start the thread; the first reconciliation runs at once."""
        self._due = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="reconcile", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(STOP_WAIT_S)
        with self._settings:
            if self.client is not None:
                self.client.close()

    def poke(self, delay: float = 0.0) -> None:
        """Reconcile within `delay` s (an earlier one already due stays)."""
        at = time.monotonic() + delay
        due = self._due
        if due is not None and at >= due:
            # the usual case after an Allocate, read without the lock: a pass is due no later.
            # Should the loop clear it just after this read, that pass starts after the
            # caller's record was written, so it sees the record all the same.
            return
        with self._cond:
            if self._due is None or at < self._due:
                self._due = at
                self._cond.notify_all()

    def configure(self, socket_path: str, period: float,
                  ended_grace: float = DEFAULT_ENDED_POD_GRACE_S) -> None:
        """New settings (SIGHUP): used from the next reconciliation, which runs at once.
        Returns at once, even while a reconciliation waits on kubelet."""
        with self._settings:
            if socket_path != self._socket_path:
                self._socket_path = self._reconnect = socket_path
            self.period = period
            self.ended_grace = ended_grace
        self.poke()

    def _client(self) -> Any:
        """The client this pass asks (a new socket path takes effect here)."""
        with self._settings:
            if self._reconnect is not None:
                old, self.client = self.client, (self.connect(self._reconnect)
                                                 if self._reconnect else None)
                self._reconnect = None
                self._allocatable_unimplemented = False
                if old is not None:
                    old.close()
            return self.client

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (self._due is None or time.monotonic() < self._due):
                    timeout = None if self._due is None else self._due - time.monotonic()
                    self._cond.wait(timeout)
                if self._stop:
                    return
                # an Allocate from here on asks for the pass after this one (`after_allocate`):
                # one in between finds this pass due (its poke does nothing), and this pass,
                # which marks after, sees its record
                self._due = None
            try:
                outcome = self.run_once()
            except Exception:  # the loop boundary: a bug; show it and keep reconciling
                log.exception("reconciliation failed unexpectedly")
                outcome = None
            self.on_change()  # (every pass: the journal's Allocates since the last one too)
            if outcome is None or not outcome.listed:
                delay = min(self.period, UNAVAILABLE_RETRY_S) if self.period else \
                    UNAVAILABLE_RETRY_S
            elif outcome.pending:
                delay = PENDING_RETRY_S
            else:
                delay = self.period
            if outcome is not None and outcome.missing:  # look again when the first is due
                due = min(outcome.missing.values()) + self.ended_grace - self.clock()
                delay = max(PENDING_RETRY_S, min(delay, due) if delay else due)
            if delay:
                self.poke(delay)

    # -- one reconciliation -------------------------------------------------------------------

    def _list(self, client: Any) -> list[PodDevices] | None:
        if client is None:
            self._report("disabled", "no podresources socket configured: allocations are not "
                                     "attributed to pods")
            return None
        try:
            listing = client.list()
        except PodResourcesError as exc:
            self._report(exc.kind, str(exc))
            return None
        if self.error:
            log.info("podresources answers again on %s", client.socket_path)
        self.error = self.error_kind = ""
        if not self._allocatable_unimplemented:
            try:
                self.allocatable = {k: len(v) for k, v in client.allocatable().items()}
                self.allocatable_error = ""
            except PodResourcesError as exc:
                if exc.kind == "unimplemented":
                    self._allocatable_unimplemented = True
                    log.warning("%s; allocatable devices are not reported", exc)
                self.allocatable, self.allocatable_error = None, str(exc)
        return listing

    def _report(self, kind: str, message: str) -> None:
        if message != self.error:
            (log.info if kind == "disabled" else log.warning)(
                "%s; allocations stay as recorded until it answers", message)
        self.error, self.error_kind = message, kind

    def run_once(self) -> Outcome | None:
        """Ask kubelet, reconcile, apply; the outcome (None if the journal write failed)."""
        with self._pass:
            # Records appended from here on are not judged by this listing (fresh): it may
            # predate their containers. The listing comes before the records are read: a
            # container kubelet lists had its Allocate answered, hence recorded, by then (no
            # false adoption).
            started = time.monotonic()
            self.journal.mark()
            listing = self._list(self._client())
            devices, keyed_by = self.devices(), self.journal.keyed_by
            if listing is None and (devices, keyed_by) == self._judged:
                # Without a listing a pass only re-resolves GPUs, and nothing they depend on
                # changed since the last one: no need to walk every record again.
                self.journal.fresh()  # nor to note what is appended meanwhile
                self.runs += 1
                self.last_run = self.clock()
                return Outcome((), (), (), (), (), self.last_outcome["pending"], False)
            records = self.journal.records()
            outcome = reconcile(records, listing, devices=devices, keyed_by=keyed_by,
                                boot=self.journal.boot, now=self.clock(),
                                protected=self.journal.fresh(), ended_grace=self.ended_grace,
                                missing=self._missing)
            try:
                self.journal.apply(outcome)
            except StateError as exc:
                log.error("reconciliation not saved: %s", exc)
                return None
            finally:
                self.runs += 1
                self.last_run = self.clock()
                self.version += 1
            for r in outcome.attributed:
                log.info("allocation of %s attributed to pod %s", _devices(r), r.pod)
            for r in outcome.adopted:
                log.info("allocation of %s to pod %s adopted from podresources (no record of "
                         "its Allocate)", _devices(r), r.pod)
            for r, note in outcome.rekeyed:
                log.warning("allocation of %s kept: %s (checkpointDeviceIDStrategy %s)",
                            _devices(r), note, self.journal.keyed_by)
            for r, why in outcome.dropped:
                log.info("allocation of %s%s dropped: %s", _devices(r),
                         f" (pod {r.pod})" if r.pod else "", why)
            if outcome.missing.keys() - self._missing.keys():
                by_id = {r.id: r for r in records}
                for rid in outcome.missing.keys() - self._missing.keys():
                    r = by_id[rid]
                    log.info("allocation of %s (pod %s) not listed by podresources; dropped "
                             "if still not listed in %g s", _devices(r), r.pod,
                             self.ended_grace)
            self._missing = outcome.missing
            self.last_outcome = {"listed": outcome.listed, "kept": len(outcome.kept),
                                 "attributed": len(outcome.attributed),
                                 "adopted": len(outcome.adopted),
                                 "dropped": len(outcome.dropped), "pending": outcome.pending,
                                 "unlisted": len(outcome.missing)}
            self._judged = (devices, keyed_by) if devices is not None else None
            self.last_duration = time.monotonic() - started
            return outcome

    def after_allocate(self) -> None:
        """An Allocate was recorded: reconcile soon (DEBOUNCE_S, shared by the Allocates
        meanwhile), but no sooner than PASS_SPACING times the last pass after it
        (a pass walks every record: with thousands unclaimed it takes a while). The journal
        calls it after each Allocate (`Journal.on_allocate`); while a pass is due, `poke`
        returns at once."""
        self.poke(max(DEBOUNCE_S, PASS_SPACING * self.last_duration))

    def status(self) -> dict:
        return {
            "socket": self.socket_path,
            "answering": not self.error,
            "error": self.error,
            "errorKind": self.error_kind,
            "allocatable": self.allocatable,
            "allocatableError": self.allocatable_error,
            "reconciles": self.runs,
            "lastReconcile": self.last_run,
            "lastOutcome": self.last_outcome,
            "period": self.period,
        }


def _devices(r: Any) -> str:
    gpus = ", ".join(f"{d} (GPU {g.index} {g.uuid})" if d != g.uuid else f"GPU {g.index} {g.uuid}"
                     for d, g in zip(r.devices, r.gpus))
    return f"{r.resource} [{gpus}]"
