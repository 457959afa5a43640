"""kubelet's podresources v1 API, and the reconciliation of the allocation journal with it.

Owns: `PodResourcesClient` (List and GetAllocatableResources over kubelet's pod-resources
socket, default agent.constants.DEFAULT_POD_RESOURCES_SOCKET), `Reconciler` (a thread that
asks kubelet which container holds which devices and applies agent.state.reconcile's outcome
to the journal: at start, shortly after each Allocate (debounced), periodically, and sooner
while some allocation waits for its pod or kubelet does not answer; a container kubelet lists
that no record matches is adopted), and `AllocationState`,
the one object the daemon holds (journal + reconciler + status).

A missing socket, a kubelet too old to serve v1 (UNIMPLEMENTED) or one not answering is
reported (log once per change, status), never fatal: the agent keeps serving and recording.
Must not call NVML (the advertised devices come in through a callable) nor decide which records stand
(agent.state.reconcile) or how they are stored (agent.state.journal).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import grpc

from agent.errors import AgentError, PodResourcesError, StateError
from agent.host import boot_id
from agent.state.journal import CHECKPOINT_FILE, Journal
from agent.state.reconcile import Outcome, PodDevices, reconcile

log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 5.0
# After an Allocate, reconcile once this much later (more Allocates in between share it).
DEBOUNCE_S = 0.5
# While an allocation waits for its pod to show up in podresources, look again this often.
PENDING_RETRY_S = 1.0
# While kubelet's podresources does not answer, try again this often (or the period if less).
UNAVAILABLE_RETRY_S = 5.0
MAX_MESSAGE = 16 << 20  # kubelet's own podresources clients allow 16 MiB
_OPTIONS = [("grpc.enable_http_proxy", 0), ("grpc.max_receive_message_length", MAX_MESSAGE)]


_SINCE = {"List": "Kubernetes 1.20", "GetAllocatableResources": "Kubernetes 1.23"}


class PodResourcesClient:
    """A podresources v1 client on `socket_path` (the channel is opened on first use and
    follows kubelet restarts by itself)."""

    def __init__(self, socket_path: str, timeout: float = RPC_TIMEOUT_S):
        self.socket_path = socket_path
        self.timeout = timeout
        self._channel: grpc.Channel | None = None
        self._stub: Any = None  # a PodResourcesListerStub once used

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = self._stub = None

    def _call(self, method: str, request_type: str) -> Any:
        # The generated modules load when kubelet is first asked, after registration: they
        # are not on the start path.
        from agent._proto.podresources.v1 import api_pb2 as pr
        from agent._proto.podresources.v1 import api_pb2_grpc as pr_grpc

        if not os.path.exists(self.socket_path):
            raise PodResourcesError("missing", f"kubelet's podresources socket "
                                               f"{self.socket_path} does not exist")
        if self._stub is None:
            self._channel = grpc.insecure_channel(f"unix:{self.socket_path}", options=_OPTIONS)
            self._stub = pr_grpc.PodResourcesListerStub(self._channel)
        try:
            return getattr(self._stub, method)(getattr(pr, request_type)(), timeout=self.timeout)
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise PodResourcesError(
                    "unimplemented", f"kubelet at {self.socket_path} does not serve "
                                     f"podresources v1 {method} (it needs {_SINCE[method]} or "
                                     f"later): {exc.details()}") from None
            kind = "unavailable" if code in (grpc.StatusCode.UNAVAILABLE,
                                             grpc.StatusCode.DEADLINE_EXCEEDED) else "error"
            raise PodResourcesError(kind, f"podresources {method} on {self.socket_path} "
                                          f"failed: {code.name}: {exc.details()}") from None

    def list(self) -> list[PodDevices]:
        """Every container's devices per resource (kubelet's NUMA split merged later)."""
        response = self._call("List", "ListPodResourcesRequest")
        return [PodDevices(pod.namespace, pod.name, c.name, d.resource_name, tuple(d.device_ids))
                for pod in response.pod_resources for c in pod.containers for d in c.devices]

    def allocatable(self) -> dict[str, tuple[str, ...]]:
        """The device IDs kubelet can allocate, per resource (sorted)."""
        response = self._call("GetAllocatableResources", "AllocatableResourcesRequest")
        out: dict[str, set[str]] = {}
        for d in response.devices:
            out.setdefault(d.resource_name, set()).update(d.device_ids)
        return {name: tuple(sorted(ids)) for name, ids in sorted(out.items())}


class Reconciler:
    """The thread that keeps the journal's records matched to kubelet's pods."""

    def __init__(self, journal: Journal, socket_path: str, *,
                 devices: Callable[[], Mapping[str, Sequence[Any]] | None], period: float,
                 clock: Callable[[], float] = time.time):
        self.journal = journal
        self.devices = devices
        self.period = period
        self.clock = clock
        self.client = PodResourcesClient(socket_path) if socket_path else None
        self._cond = threading.Condition()
        self._due: float | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one reconciliation at a time
        self.version = 0
        self.runs = 0
        self.last_run: float | None = None
        self.error = ""
        self.error_kind = ""
        self.allocatable: dict[str, int] | None = None
        self.allocatable_error = ""
        self._allocatable_unimplemented = False
        self.last_outcome: dict | None = None

    @property
    def socket_path(self) -> str:
        return self.client.socket_path if self.client else ""

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
            self._thread.join(RPC_TIMEOUT_S * 2 + 1)
        if self.client is not None:
            self.client.close()

    def poke(self, delay: float = 0.0) -> None:
        """Reconcile within `delay` s (an earlier one already due stays)."""
        at = time.monotonic() + delay
        with self._cond:
            if self._due is None or at < self._due:
                self._due = at
                self._cond.notify_all()

    def configure(self, socket_path: str, period: float) -> None:
        """New settings (SIGHUP): used from the next reconciliation, which runs at once."""
        with self._lock:
            if socket_path != self.socket_path:
                if self.client is not None:
                    self.client.close()
                self.client = PodResourcesClient(socket_path) if socket_path else None
                self._allocatable_unimplemented = False
            self.period = period
        self.poke()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (self._due is None or time.monotonic() < self._due):
                    timeout = None if self._due is None else self._due - time.monotonic()
                    self._cond.wait(timeout)
                if self._stop:
                    return
                self._due = None
            try:
                outcome = self.run_once()
            except Exception:  # the loop boundary: a bug; show it and keep reconciling
                log.exception("reconciliation failed unexpectedly")
                outcome = None
            if outcome is None or not outcome.listed:
                delay = min(self.period, UNAVAILABLE_RETRY_S) if self.period else \
                    UNAVAILABLE_RETRY_S
            elif outcome.pending:
                delay = PENDING_RETRY_S
            else:
                delay = self.period
            if delay:
                self.poke(delay)

    # -- one reconciliation -------------------------------------------------------------------

    def _list(self) -> list[PodDevices] | None:
        if self.client is None:
            self._report("disabled", "no podresources socket configured: allocations are not "
                                     "attributed to pods")
            return None
        try:
            listing = self.client.list()
        except PodResourcesError as exc:
            self._report(exc.kind, str(exc))
            return None
        if self.error:
            log.info("podresources answers again on %s", self.client.socket_path)
        self.error = self.error_kind = ""
        if not self._allocatable_unimplemented:
            try:
                self.allocatable = {k: len(v) for k, v in self.client.allocatable().items()}
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
        with self._lock:
            # the listing before the records: a container kubelet lists had its Allocate
            # answered, hence recorded, before we read the records (no false adoption)
            listing = self._list()
            records = self.journal.records()
            outcome = reconcile(records, listing, devices=self.devices(),
                                keyed_by=self.journal.keyed_by, boot=self.journal.boot,
                                now=self.clock())
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
            self.last_outcome = {"listed": outcome.listed, "kept": len(outcome.kept),
                                 "attributed": len(outcome.attributed),
                                 "adopted": len(outcome.adopted),
                                 "dropped": len(outcome.dropped), "pending": outcome.pending}
            return outcome

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


class AllocationState:
    """The journal and its reconciler, as the daemon holds them."""

    def __init__(self, state_dir: str, *, keyed_by: str, socket_path: str, period: float,
                 devices: Callable[[], Mapping[str, Sequence[Any]] | None],
                 environ: Mapping[str, str] | None = None):
        try:
            boot = boot_id(environ)
        except AgentError as exc:
            log.warning("%s: records from another boot cannot be told apart", exc)
            boot = ""
        self.journal = Journal(os.path.join(state_dir, CHECKPOINT_FILE), boot=boot,
                               keyed_by=keyed_by)
        self.reconciler = Reconciler(self.journal, socket_path, devices=devices, period=period)
        self.journal.add_listener(lambda: self.reconciler.poke(DEBOUNCE_S))

    @property
    def record_allocation(self) -> Callable:
        """The ResourceManager `journal` hook."""
        return self.journal.record_allocation

    @property
    def version(self) -> int:
        return self.journal.version + self.reconciler.version

    def start(self) -> None:
        """Load the checkpoint (a bad one is set aside) and start reconciling."""
        self.journal.load()
        self.reconciler.start()

    def poke(self) -> None:
        self.reconciler.poke()

    def reconfigure(self, *, keyed_by: str, socket_path: str, period: float) -> None:
        if keyed_by != self.journal.keyed_by:
            log.info("checkpointDeviceIDStrategy is now %s (was %s)", keyed_by,
                     self.journal.keyed_by)
            self.journal.keyed_by = keyed_by
        self.reconciler.configure(socket_path, period)

    def close(self) -> None:
        self.reconciler.stop()

    def status(self) -> dict:
        return {**self.journal.status(), "podResources": self.reconciler.status()}

    @property
    def problem(self) -> str:
        """A one-line note for the daemon's summary when the state needs attention."""
        st = self.journal
        if st.blocked:
            return "checkpoint: " + st.blocked
        if st.set_aside:
            return f"bad checkpoint set aside: {st.set_aside[-1].path or st.path}"
        if st.last_error:
            return f"checkpoint not writable: {st.last_error}"
        return ""


def format_state(doc: Mapping[str, Any]) -> list[str]:
    """`gpu-agent status` lines for status.json's "state"."""
    lines = [f"allocations: {doc.get('allocations', 0)} recorded ({doc.get('attributed', 0)} "
             f"attributed to pods, {doc.get('pending', 0)} waiting) in {doc.get('checkpoint')}"
             f" (GPUs keyed by {doc.get('keyedBy')})"]
    if doc.get("lastError"):
        lines.append(f"  checkpoint error: {doc['lastError']}")
    for a in doc.get("setAside", []):
        lines.append(f"  bad checkpoint set aside ({a['kind']}): {a['path'] or 'not moved'}: "
                     f"{a['reason']}")
    for path in doc.get("setAsideEarlier", []):
        lines.append(f"  set aside earlier: {path}")
    p = doc.get("podResources") or {}
    if p.get("error"):
        lines.append(f"  podresources: {p['error']}")
    elif p.get("socket"):
        alloc = p.get("allocatable")
        extra = (", allocatable " + ", ".join(f"{k}: {v}" for k, v in alloc.items())
                 if alloc else "")
        lines.append(f"  podresources: answering on {p['socket']} ({p.get('reconciles', 0)} "
                     f"reconciliations{extra})")
    return lines
