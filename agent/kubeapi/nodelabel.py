"""The Node label that chooses this node's named config (agent.config.named): read at start,
then watched, so that relabelling a node switches its config at once, as SIGHUP does.

Owns: reading the label (one GET of the Node, bounded: the start waits for it at most
READ_TIMEOUT_S), then a watch of the Node from the version read (the API server ends a watch
every few minutes; the next one follows from the last version seen; a version too old is
read again), reconnecting 1, 2, 4 ... 30 s apart while the API is down, and calling
`on_change(value)` from its thread when the value differs from the one last known. Idle, the
thread is blocked on the watch's socket: no timer wakes it. As NVIDIA's config-manager
(cmd/config-manager/main.go) it lists and watches the one Node by
`fieldSelector=metadata.name=<node>`, which the Node authorizer lets a node do for itself.

Must not: choose or load a config (agent.config does, on the daemon's thread), nor block its
caller but in `prime()`.
"""

from __future__ import annotations

import logging
import threading
import urllib.parse
from typing import Any, Callable

from agent.errors import KubeApiError

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 2.0  # the start waits this long for the label, then goes on without it
WATCH_TIMEOUT_S = 300  # the server ends each watch after this (timeoutSeconds) ...
SILENCE_S = WATCH_TIMEOUT_S + 30.0  # ... so a watch silent for longer is a dead connection
RETRY_MIN_S = 1.0
RETRY_MAX_S = 30.0


class NodeLabelWatch:
    """Label `label` of Node `node` through the kubeconfig at `kubeconfig`. `value` is the
    value last known ("" no such label; None not read yet), `error` why the API is not
    answering now ("" when it is)."""

    def __init__(self, *, kubeconfig: str, node: str, label: str,
                 on_change: Callable[[str], None], connect: Callable[[str], Any] | None = None):
        self.kubeconfig = kubeconfig
        self.node = node
        self.label = label
        self.on_change = on_change
        self._connect = connect
        self._client: Any = None
        self._version = ""  # the resourceVersion the next watch starts from; "": read first
        self._watch: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.value: str | None = None
        self.error = ""
        self.changes = 0

    def prime(self) -> str:
        """Read the label now, before the thread starts, as the value the config is chosen by
        (on_change is not called for it); KubeApiError when the API cannot say within
        READ_TIMEOUT_S, `error` then saying why."""
        try:
            self.value = self._read()
        except KubeApiError as exc:
            self.error = str(exc)
            raise
        return self.value

    def _read(self) -> str:
        """The label's value now ("" when the Node has no such label)."""
        node = self._api().request("GET", f"/api/v1/nodes/{urllib.parse.quote(self.node)}")
        self._version = node["metadata"].get("resourceVersion", "")
        self.error = ""
        return _label_of(node, self.label)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="node-label", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        watch = self._watch
        if watch is not None:
            watch.close()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._client is not None:
            self._client.close()

    def status(self) -> dict:
        return {"label": self.label, "value": self.value, "api": self.error or "answering",
                "changes": self.changes}

    # -- the thread --------------------------------------------------------------------------

    def _api(self) -> Any:
        if self._client is None:
            if self._connect is None:
                from agent.kubeapi.client import connect

                self._connect = connect
            self._client = self._connect(self.kubeconfig)
            self._client.timeout = READ_TIMEOUT_S  # each request's; a watch sets its own
        return self._client

    def _run(self) -> None:
        wait = RETRY_MIN_S
        while not self._stop.is_set():
            try:
                if not self._version:
                    self._seen(self._read())
                self._follow()
                wait = RETRY_MIN_S  # the server ended a watch that worked: the next at once
            except KubeApiError as exc:
                if self._stop.is_set():
                    return
                if exc.code == 410:  # too old a version: read the Node again, now
                    self._version = ""
                    continue
                if str(exc) != self.error:
                    log.warning("node label %s: %s; watched again when the API answers",
                                self.label, exc)
                self.error = str(exc)
                self._version = ""  # (what changed while it was down is read first)
                if self._stop.wait(wait):
                    return
                wait = min(wait * 2, RETRY_MAX_S)

    def _follow(self) -> None:
        """One watch, from `_version`, until the server ends it."""
        query = urllib.parse.urlencode({
            "fieldSelector": f"metadata.name={self.node}", "watch": "1",
            "resourceVersion": self._version, "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_TIMEOUT_S)})
        self._watch = self._api().watch(f"/api/v1/nodes?{query}", timeout=SILENCE_S)
        try:
            if self._stop.is_set():
                return
            self.error = ""
            for event in self._watch:
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise KubeApiError(f"watch of node {self.node}: "
                                       f"{obj.get('message', obj)}", code=obj.get("code", 0))
                self._version = (obj.get("metadata") or {}).get("resourceVersion") or \
                    self._version
                if kind in ("ADDED", "MODIFIED"):
                    self._seen(_label_of(obj, self.label))
                elif kind == "DELETED":
                    self._seen("")
        finally:
            self._watch = None

    def _seen(self, value: str) -> None:
        if value != self.value:
            log.info("node label %s: %r, was %r", self.label, value, self.value)
            self.value = value
            self.changes += 1
            self.on_change(value)


def _label_of(node: dict, label: str) -> str:
    return ((node.get("metadata") or {}).get("labels") or {}).get(label, "")
