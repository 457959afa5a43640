"""GPU faults where operators look in Kubernetes: Events on the Node and on the pods holding a
withdrawn GPU, and the Node condition GPUHealthy.

Owns: turning the health monitor's transitions (a GPU withdrawn, a GPU back) into Events, at
the moment they happen (the pods that hold the GPU are asked of podresources then), sending
them as kubelet's event recorder does (an event seen again within 10 minutes raises the count
of the one already posted; at most 25 new events per object, then one per 5 minutes), the
condition (False naming each GPU out and why, True when all are in; asserted at start, on
every change, and again as soon as the API answers after a failure), and the counts status and
metrics show. Everything runs on its own thread: `notify()` and `refresh()`, called from the
health monitor and the daemon, only queue and wake it, so the API being slow or down never
delays health handling or Allocate. Events wait in a bounded queue while the API is down; the
ones that do not fit are dropped and counted. The thread sleeps on a wake pipe and, while the
kubeconfig is not there, an inotify watch of its directory (agent.dirwatch): between changes
nothing runs on a timer but the retries after the API failed.

Must not: decide health (agent.health does), call NVML, or block its callers.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable

from agent.constants import CONDITION_TYPE, EVENT_COMPONENT
from agent.dirwatch import CREATED, MOVED_IN, WRITTEN, DirWatch, MissingDir
from agent.errors import AgentError, KubeApiError

log = logging.getLogger(__name__)

QUEUE_MAX = 256  # events waiting for the API; more are dropped (counted)
RETRY_S = 1.0  # after a failed request, the next try
REFUSED_RETRY_S = 60.0  # the longest wait after refusals (RBAC): 1, 2, 4 ... 60 s
# A kubeconfig that does not load is read again this often; one not there yet (a node still
# joining) is waited for with inotify, and looked for this often only if that cannot be done.
KUBECONFIG_RETRY_S = 10.0
# What in the kubeconfig's directory may be the kubeconfig arriving.
KUBECONFIG_ARRIVES = frozenset((CREATED, MOVED_IN, WRITTEN))
# kubelet's event recorder (client-go tools/record/events_cache.go): the same event within
# this window is counted on the one posted, and each object gets a burst of 25 new events,
# then one per 5 minutes (EventSourceObjectSpamFilter: burst 25, qps 1/300).
CORRELATION_WINDOW_S = 600.0
CORRELATION_KEPT = 4096
SPAM_BURST = 25
SPAM_REFILL_S = 300.0
MESSAGE_MAX = 1024  # a Node condition's message is shown whole by kubectl describe: kept short
NODE_EVENT_NAMESPACE = "default"  # where kubelet posts its Node's events

# the reasons the events and the condition carry
WITHDRAWN = "GPUWithdrawn"
RECOVERED = "GPURecovered"
ALL_HEALTHY = "AllGPUsHealthy"
GPUS_OUT = "GPUsWithdrawn"

Holder = tuple[str, str, str]  # namespace, pod, container


def node_name(configured: str) -> str:
    """The node's name: `configured`, else the host name lowercased (kubelet's default)."""
    return configured or socket.gethostname().lower()


@dataclass
class Event:
    """One event to post: about `kind` `name` (in `namespace`; "" for the Node)."""

    kind: str
    namespace: str
    name: str
    type: str  # Normal or Warning
    reason: str
    message: str
    time: float


def _transient(exc: KubeApiError) -> bool:
    """Not answering, overloaded or failing inside: worth trying again in a moment."""
    return exc.code == 0 or exc.code == 429 or exc.code >= 500


def _rfc3339(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _duration(seconds: float) -> str:
    seconds = int(max(0, round(seconds)))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


class FaultReporter:
    """Events and the condition for node `node` through the kubeconfig at `kubeconfig`.
    `gpus_out()` -> {GPU UUID: (index, why)} of the GPUs withdrawn now (the condition's
    source); `holders(device IDs)` -> the containers holding any of them now (podresources);
    `on_change` is called when the status this shows changes."""

    def __init__(self, *, kubeconfig: str, node: str, events: bool, condition: bool,
                 gpus_out: Callable[[], dict[str, tuple[int, str]]],
                 holders: Callable[[list[str]], list[Holder]],
                 on_change: Callable[[], None] = lambda: None,
                 connect: Callable[[str], Any] | None = None):
        self.kubeconfig = kubeconfig
        self.node = node
        self.events_on = events
        self.condition_on = condition
        self.gpus_out = gpus_out
        self.holders = holders
        self.on_change = on_change
        self._connect = connect
        self._client: Any = None
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._awaiting: Any = None  # while the kubeconfig is not there: DirWatch or MissingDir
        self._transitions: collections.deque = collections.deque()
        self._dirty = condition  # the condition is asserted once at start
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pending: collections.deque[Event] = collections.deque()
        self._out_since: dict[str, float] = {}  # GPU UUID -> when it was withdrawn
        self._posted: collections.OrderedDict = collections.OrderedDict()  # correlation
        self._tokens: dict[tuple[str, str, str], tuple[float, float]] = {}  # spam filter
        self._uids: dict[tuple[str, str], str] = {}
        self._asserted: tuple[str, str, str] | None = None
        self._transition_time = ""
        self._retry_at = 0.0
        self._refused = 0.0  # the last wait after a refusal (doubled while refusals go on)
        self.api_error = ""  # why the API is not answering now ("" when it is)
        self.counts = dict.fromkeys(("posted", "counted", "dropped", "limited", "failed"), 0)
        self.condition_patches = 0
        self.condition_failures = 0

    # -- from other threads ----------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kube-faults", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread (after at most one request in flight: `timeout` bounds the wait)."""
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._client is not None:
            self._client.close()
        if self._thread is not None and self._thread.is_alive():
            return  # a request still in flight: the thread keeps its pipe and watch
        self._stop_awaiting()
        with self._lock:
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            self._wake_r = self._wake_w = -1

    def notify(self, transition: dict) -> None:
        """A GPU's health flipped (agent.health.monitor's transition record). Never blocks."""
        with self._lock:
            self._transitions.append(transition)
            self._dirty = self.condition_on
        self._wake()

    def refresh(self) -> None:
        """The GPUs out may have changed (a reload, a new monitor): assert the condition."""
        with self._lock:
            self._dirty = self.condition_on
        self._wake()

    def _wake(self) -> None:
        with self._lock:
            if self._wake_w < 0:
                return  # stopped
            try:
                os.write(self._wake_w, b"w")
            except BlockingIOError:
                pass  # the pipe is full: the thread wakes anyway

    def status(self) -> dict:
        with self._lock:
            asserted = self._asserted
            return {
                "node": self.node, "kubeconfig": self.kubeconfig,
                "api": "answering" if self._client is not None and not self.api_error
                else self.api_error or "not asked yet",
                "events": self.events_on, "eventCounts": dict(self.counts),
                "queued": len(self._pending),
                "condition": None if not self.condition_on else {
                    "type": CONDITION_TYPE, "asserted": asserted is not None,
                    "status": asserted[0] if asserted else None,
                    "reason": asserted[1] if asserted else None,
                    "message": asserted[2] if asserted else None,
                    "pending": self._dirty},
            }

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                idle = not self._transitions and not self._due()
                wait = None
                if idle and (self._pending or self._dirty) and self._retry_at and \
                        self._awaiting is None:
                    wait = max(0.01, self._retry_at - time.monotonic())
            if idle:
                self._sleep(wait)
                continue
            with self._lock:
                taken = list(self._transitions)
                self._transitions.clear()
            try:
                if self.events_on:  # (the condition is read from gpus_out(), not these)
                    for transition in taken:
                        self._queue(self._events_of(transition))
                if time.monotonic() >= self._retry_at:
                    self._send()
            except Exception:  # noqa: BLE001 - the loop boundary: log once, go on
                log.exception("Kubernetes events: unexpected error; going on")
                self._retry_at = time.monotonic() + RETRY_S
            self.on_change()

    def _due(self) -> bool:
        return bool(self._pending or self._dirty) and self._awaiting is None and \
            time.monotonic() >= self._retry_at

    def _sleep(self, timeout: float | None) -> None:
        """Until notify(), refresh(), stop(), the kubeconfig's arrival or `timeout` s."""
        fds = [self._wake_r] + ([self._awaiting.fileno()] if self._awaiting is not None else [])
        ready, _, _ = select.select(fds, [], [], timeout)
        if self._wake_r in ready:
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass  # another read took it
        if self._awaiting is not None and self._awaiting.fileno() in ready:
            self._await_kubeconfig()

    def _await_kubeconfig(self) -> None:
        """The kubeconfig is not there: watch its directory (or, while that is missing, the
        directory's appearance) for it; once it is there, stop watching and try at once."""
        directory = os.path.dirname(os.path.abspath(self.kubeconfig))
        try:
            if isinstance(self._awaiting, MissingDir) and self._awaiting.appeared():
                self._stop_awaiting()
            if self._awaiting is None:
                self._awaiting = DirWatch(directory, KUBECONFIG_ARRIVES) \
                    if os.path.isdir(directory) else MissingDir(directory)
            elif isinstance(self._awaiting, DirWatch):
                self._awaiting.read()  # which name came does not matter: the path is looked at
        except OSError as exc:
            log.debug("cannot watch for %s (%s): looked for every %g s", self.kubeconfig, exc,
                      KUBECONFIG_RETRY_S)
            self._stop_awaiting()
            self._retry_at = time.monotonic() + KUBECONFIG_RETRY_S
            return
        if os.path.exists(self.kubeconfig) or (isinstance(self._awaiting, MissingDir)
                                               and self._awaiting.appeared()):
            self._stop_awaiting()  # there now (or its directory: watched next)
            self._retry_at = 0.0

    def _stop_awaiting(self) -> None:
        if self._awaiting is not None:
            self._awaiting.close()
            self._awaiting = None

    def _queue(self, events: list[Event]) -> None:
        for event in events:
            if len(self._pending) >= QUEUE_MAX:
                self.counts["dropped"] += 1
                if self.counts["dropped"] == 1 or self.counts["dropped"] % 100 == 0:
                    log.warning("Kubernetes events: %d waiting for the API, %d dropped so far "
                                "(%s)", len(self._pending), self.counts["dropped"],
                                self.api_error or "the API is slow")
                continue
            self._pending.append(event)

    def _events_of(self, t: dict) -> list[Event]:
        """The Node's event and each holding pod's for transition `t`."""
        index, uuid, now = t["gpuIndex"], t["gpuUuid"], t["time"]
        gpu = f"GPU {index} ({uuid})"
        if t["healthy"]:
            since = self._out_since.pop(uuid, None)
            out = f" after {_duration(now - since)} out" if since is not None else ""
            return [Event("Node", "", self.node, "Normal", RECOVERED,
                          f"{gpu} back in service{out}: {t['reason']}", now)]
        self._out_since.setdefault(uuid, now)
        action = t.get("action") or "isolate"
        events = [Event("Node", "", self.node, "Warning", WITHDRAWN,
                        f"{gpu} withdrawn from scheduling ({action} class): {t['reason']}", now)]
        try:
            held = self.holders(list(t["devices"]))
        except AgentError as exc:
            log.warning("%s: which pods hold it is unknown (podresources: %s); only the Node "
                        "gets an event", gpu, exc)
            held = []
        by_pod: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
        for namespace, pod, container in held:
            by_pod[(namespace, pod)].append(container)
        what = f"reported {t['reason']}" if t.get("xid") is not None else \
            f"was withdrawn: {t['reason']}"
        for (namespace, pod), containers in sorted(by_pod.items()):
            names = ", ".join(sorted(set(containers)))
            events.append(Event(
                "Pod", namespace, pod, "Warning", WITHDRAWN,
                f"{gpu} that this pod uses (container {names}) {what}; the GPU is withdrawn "
                f"from scheduling; the container may need a restart", now))
        return events

    # -- talking to the API ------------------------------------------------------------------

    def _send(self) -> None:
        if self._client is None and not self._open():
            return
        try:
            if self._dirty:  # first: the one statement of the node's GPUs as they are now
                self._assert_condition()
            while self._pending and not self._stop.is_set():
                self._post(self._pending[0])
                self._pending.popleft()
                if self._dirty:  # a change while the queue drains
                    self._assert_condition()
        except KubeApiError as exc:
            # not answering: again in a second; refused (RBAC, a node not registered yet):
            # in a minute, the error logged once
            if _transient(exc):
                self._failed(str(exc), RETRY_S)
            else:  # 1, 2, 4 ... 60 s: a server just started may refuse until RBAC is loaded
                self._refused = min(REFUSED_RETRY_S, max(RETRY_S, self._refused * 2))
                self._failed(str(exc), self._refused)
            return
        self._refused = 0.0
        if self.api_error:
            log.info("Kubernetes API answering again (%s)", self.kubeconfig)
            self.api_error = ""
        self._retry_at = 0.0

    def _failed(self, why: str, retry_s: float) -> None:
        if why != self.api_error:
            log.warning("Kubernetes API: %s; events wait (up to %d), the %s condition is "
                        "asserted once it answers (next try in %g s)", why, QUEUE_MAX,
                        CONDITION_TYPE, retry_s)
        self.api_error = why
        self._retry_at = time.monotonic() + retry_s

    def _open(self) -> bool:
        if not os.path.exists(self.kubeconfig):
            if self.api_error != f"no kubeconfig at {self.kubeconfig}":
                log.info("no kubeconfig at %s yet: Kubernetes events and the %s condition wait "
                         "for it (its directory watched)", self.kubeconfig, CONDITION_TYPE)
            self.api_error = f"no kubeconfig at {self.kubeconfig}"
            self._await_kubeconfig()
            return False
        try:
            if self._connect is None:
                from agent.kubeapi.client import connect

                self._connect = connect
            self._client = self._connect(self.kubeconfig)
        except KubeApiError as exc:
            if str(exc) != self.api_error:
                log.error("%s: no Kubernetes events or %s condition until it is fixed (read "
                          "again every %g s)", exc, CONDITION_TYPE, KUBECONFIG_RETRY_S)
            self.api_error = str(exc)
            self._retry_at = time.monotonic() + KUBECONFIG_RETRY_S
            return False
        log.info("Kubernetes API %s (kubeconfig %s): node %s, events %s, %s condition %s",
                 self._client.config.server, self.kubeconfig, self.node,
                 "on" if self.events_on else "off", CONDITION_TYPE,
                 "on" if self.condition_on else "off")
        return True

    def _post(self, event: Event) -> None:
        """Post `event`, or count it on the same one posted within the window."""
        obj = (event.kind, event.namespace, event.name)
        key = (*obj, event.type, event.reason, event.message)
        seen = self._posted.get(key)
        now = time.monotonic()
        if seen is not None and now - seen[2] < CORRELATION_WINDOW_S:
            namespace, name, _, count = seen
            try:
                self._client.request(
                    "PATCH", f"/api/v1/namespaces/{namespace}/events/{name}",
                    {"count": count + 1, "lastTimestamp": _rfc3339(event.time)},
                    content_type="application/strategic-merge-patch+json")
            except KubeApiError as exc:
                if _transient(exc):
                    raise
                if exc.code != 404:  # 404: expired (kept an hour by the API server): post anew
                    self.counts["failed"] += 1
                    log.warning("Kubernetes event on %s %s refused: %s", event.kind,
                                event.name, exc)
                    return
            else:
                self._posted[key] = (namespace, name, now, count + 1)
                self._posted.move_to_end(key)
                self.counts["counted"] += 1
                return
        if self._tokens_left(obj, now) < 1.0:
            self.counts["limited"] += 1
            return
        namespace = event.namespace or NODE_EVENT_NAMESPACE
        uid = self._uid(event)
        name = f"{event.name}.{time.time_ns():x}"
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": name, "namespace": namespace},
            "involvedObject": {"apiVersion": "v1", "kind": event.kind, "name": event.name,
                               "namespace": event.namespace, "uid": uid},
            "type": event.type, "reason": event.reason, "message": event.message,
            "source": {"component": EVENT_COMPONENT, "host": self.node},
            "reportingComponent": EVENT_COMPONENT, "reportingInstance": self.node,
            "firstTimestamp": _rfc3339(event.time), "lastTimestamp": _rfc3339(event.time),
            "count": 1,
        }
        try:
            self._client.request("POST", f"/api/v1/namespaces/{namespace}/events", body)
        except KubeApiError as exc:
            if _transient(exc):
                raise
            self.counts["failed"] += 1  # refused (RBAC, a namespace gone): not retried
            log.warning("Kubernetes event on %s %s refused: %s", event.kind, event.name, exc)
            return
        self.counts["posted"] += 1
        self._tokens[obj] = (self._tokens_left(obj, now) - 1.0, now)  # spent once posted
        if len(self._tokens) > CORRELATION_KEPT:  # forget objects whose burst is whole again
            self._tokens = {o: t for o, t in self._tokens.items()
                            if self._tokens_left(o, now) < SPAM_BURST}
        self._posted[key] = (namespace, name, now, 1)
        self._posted.move_to_end(key)
        while len(self._posted) > CORRELATION_KEPT:
            self._posted.popitem(last=False)

    def _tokens_left(self, obj: tuple[str, str, str], now: float) -> float:
        tokens, at = self._tokens.get(obj, (float(SPAM_BURST), now))
        return min(float(SPAM_BURST), tokens + (now - at) / SPAM_REFILL_S)

    def _uid(self, event: Event) -> str:
        """The involved object's UID, which `kubectl describe` matches events by (kubelet
        gives its Node's events the node name as UID, and kubectl looks for that)."""
        if event.kind == "Node":
            return event.name
        key = (event.namespace, event.name)
        if key not in self._uids:
            path = (f"/api/v1/namespaces/{urllib.parse.quote(event.namespace)}/pods/"
                    f"{urllib.parse.quote(event.name)}")
            try:
                pod = self._client.request("GET", path)
            except KubeApiError as exc:
                if _transient(exc):
                    raise
                return ""  # gone already: the event is still listed under its name
            if len(self._uids) > CORRELATION_KEPT:
                self._uids.clear()
            self._uids[key] = (pod.get("metadata") or {}).get("uid", "")
        return self._uids[key]

    def _desired(self) -> tuple[str, str, str]:
        out = self.gpus_out()
        if not out:
            return ("True", ALL_HEALTHY, "every GPU is in service")
        parts = [f"GPU {index} ({uuid}): {why}"
                 for uuid, (index, why) in sorted(out.items(), key=lambda kv: kv[1][0])]
        message = f"{len(out)} GPU{'s' if len(out) > 1 else ''} withdrawn: " + "; ".join(parts)
        if len(message) > MESSAGE_MAX:
            message = message[:MESSAGE_MAX - 1] + "…"
        return ("False", GPUS_OUT, message)

    def _assert_condition(self) -> None:
        with self._lock:
            self._dirty = False
        desired = self._desired()
        if desired == self._asserted:
            return
        path = f"/api/v1/nodes/{urllib.parse.quote(self.node)}"
        try:
            if not self._transition_time:  # the first time: keep a transition time that holds
                node = self._client.request("GET", path)
                for c in (node.get("status") or {}).get("conditions") or []:
                    if c.get("type") == CONDITION_TYPE and c.get("status") == desired[0]:
                        self._transition_time = c.get("lastTransitionTime") or ""
            if self._asserted is not None and self._asserted[0] != desired[0] or \
                    not self._transition_time:
                self._transition_time = _rfc3339(time.time())
            status, reason, message = desired
            self._client.request(
                "PATCH", path + "/status", {"status": {"conditions": [{
                    "type": CONDITION_TYPE, "status": status, "reason": reason,
                    "message": message, "lastHeartbeatTime": _rfc3339(time.time()),
                    "lastTransitionTime": self._transition_time}]}},
                content_type="application/strategic-merge-patch+json")
        except KubeApiError:
            with self._lock:
                self._dirty = True
            self.condition_failures += 1
            raise
        self.condition_patches += 1
        if self._asserted is None or self._asserted[0] != status:
            log.info("node %s: condition %s=%s (%s)", self.node, CONDITION_TYPE, status, reason)
        self._asserted = desired
