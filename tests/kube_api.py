"""The Kubernetes API server for the fast tests of agent.kubeapi: plain HTTP on loopback, with
a bearer token, serving only what the agent asks of the real one (tests/e2e checks it there):
create and patch Events, read a Pod and the Node, patch the Node's status with a strategic
merge patch of its conditions (merged by `type`, as the real server merges them), read, create
and replace ResourceSlices (a replacement naming an older resourceVersion gets the real
server's 409 Conflict; `slices` holds them by name), read ResourceClaims (`claims`), and watch
the Node (one JSON event per line from the resourceVersion asked, as the real server streams
them; `label()` changes a label as `kubectl label` does, `end_watches()` ends every watch as
the server does after timeoutSeconds).

A test stops and starts it on the same port (the API server down for a while), refuses paths
(RBAC's 403), and waits for what it received: `wait(predicate)` follows each request, never a
fixed sleep. Every request is kept in `requests` (method, path, body).
"""

from __future__ import annotations

import json
import queue
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

TOKEN = "fast-test-token"
WAIT = 30.0


class KubeApi:
    """Serves node `node` with pods `pods` ({(namespace, name): uid})."""

    def __init__(self, node: str, pods: dict[tuple[str, str], str] | None = None):
        self.node = node
        self.pods = dict(pods or {})
        self.events: dict[tuple[str, str], dict] = {}  # (namespace, name) -> event
        self.conditions: dict[str, dict] = {}  # the Node's, by type
        self.requests: list[tuple[str, str, Any]] = []
        self.refuse: set[str] = set()  # path prefixes answered 403
        self.labels: dict[str, str] = {}  # the Node's
        self.version = 1  # the Node's resourceVersion
        self.uid = "7d3c1b52-node-uid"  # the Node's
        self.slices: dict[str, dict] = {}  # ResourceSlices by name
        self.kubernetes = (1, 37)  # the Kubernetes version /version answers
        self.claims: dict[tuple[str, str], dict] = {}  # ResourceClaims by (namespace, name)
        self._object_version = 100  # resourceVersions of the other objects
        self._history: list[tuple[int, dict]] = []  # (version, watch event) of each change
        self._watchers: list[queue.Queue] = []
        self._cv = threading.Condition()
        self._server: ThreadingHTTPServer | None = None
        self.port = 0
        self.start()

    # -- life ----------------------------------------------------------------------------------

    def start(self) -> None:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _serve(self) -> None:
                if self.command == "GET" and "watch=1" in self.path:
                    self._watch()
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    code, answer = 401, {"message": "Unauthorized"}
                else:
                    code, answer = api._answer(self.command, self.path, body,
                                               self.headers.get("Content-Type", ""))
                data = json.dumps(answer).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _watch(self) -> None:
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self.send_error(401)
                    return
                events = api._watch(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()  # no length: the answer ends when the connection closes
                try:
                    while True:
                        event = events.get()
                        if event is None:
                            return
                        self.wfile.write(json.dumps(event).encode() + b"\n")
                        self.wfile.flush()
                except OSError:
                    return  # the agent closed it
                finally:
                    api._unwatch(events)

            do_GET = do_POST = do_PATCH = do_PUT = _serve

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        """Down: connections refused until `start()` (the same port)."""
        self.end_watches()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def server(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kubeconfig(self, path: str) -> str:
        with open(path, "w") as f:
            f.write("apiVersion: v1\nkind: Config\ncurrent-context: fast\n"
                    f"clusters:\n- name: fast\n  cluster:\n    server: {self.server}\n"
                    f"users:\n- name: agent\n  user:\n    token: {TOKEN}\n"
                    "contexts:\n- name: fast\n  context:\n    cluster: fast\n    user: agent\n")
        return path

    # -- the Node's labels and its watches -------------------------------------------------------

    def label(self, key: str, value: str | None) -> None:
        """Set (None: remove) label `key` of the Node; every watch gets the MODIFIED Node."""
        with self._cv:
            if value is None:
                self.labels.pop(key, None)
            else:
                self.labels[key] = value
            self.version += 1
            event = {"type": "MODIFIED", "object": self._node()}
            self._history.append((self.version, event))
            for w in self._watchers:
                w.put(event)

    def end_watches(self) -> None:
        with self._cv:
            for w in self._watchers:
                w.put(None)

    def watches(self) -> int:
        with self._cv:
            return len(self._watchers)

    def _node(self) -> dict:
        return {"metadata": {"name": self.node, "uid": self.uid, "labels": dict(self.labels),
                             "resourceVersion": str(self.version)},
                "status": {"conditions": list(self.conditions.values())}}

    def _watch(self, path: str) -> queue.Queue:
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
        events: queue.Queue = queue.Queue()
        with self._cv:
            self.requests.append(("WATCH", path, None))
            assert query["fieldSelector"] == [f"metadata.name={self.node}"], query
            since = int(query.get("resourceVersion", ["0"])[0] or 0)
            for version, event in self._history:
                if version > since:
                    events.put(event)
            self._watchers.append(events)
            self._cv.notify_all()
        return events

    def _unwatch(self, events: queue.Queue) -> None:
        with self._cv:
            self._watchers.remove(events)
            self._cv.notify_all()

    # -- what it received -------------------------------------------------------------------

    def wait(self, predicate: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                got = predicate()
                if got:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out waiting for {what}; requests: "
                                         f"{self.requests[-10:]}")
                self._cv.wait(left)

    def poke(self) -> None:
        """Something outside the requests changed (a reporter's counts): `wait` looks again."""
        with self._cv:
            self._cv.notify_all()

    def events_about(self, kind: str, name: str, reason: str | None = None) -> list[dict]:
        with self._cv:
            return [e for e in self.events.values()
                    if e["involvedObject"]["kind"] == kind and e["involvedObject"]["name"] == name
                    and (reason is None or e["reason"] == reason)]

    def condition(self, type_: str) -> dict | None:
        with self._cv:
            return self.conditions.get(type_)

    # -- answers --------------------------------------------------------------------------------

    def _answer(self, method: str, path: str, body: Any, content_type: str) -> tuple[int, Any]:
        with self._cv:
            self.requests.append((method, path, body))
            try:
                if any(path.startswith(p) for p in self.refuse):
                    return 403, {"message": f"forbidden: {path}"}
                return self._route(method, path.split("/")[1:], body, content_type)
            finally:
                self._cv.notify_all()

    def _route(self, method: str, parts: list[str], body: Any, ctype: str) -> tuple[int, Any]:
        if parts == ["version"] and method == "GET":
            major, minor = self.kubernetes
            return 200, {"major": str(major), "minor": f"{minor}+",
                         "gitVersion": f"v{major}.{minor}.0"}
        if parts[:3] == ["api", "v1", "namespaces"] and len(parts) >= 5:
            namespace, kind, rest = parts[3], parts[4], parts[5:]
            if kind == "events" and method == "POST" and not rest:
                name = body["metadata"]["name"]
                self.events[(namespace, name)] = body
                return 201, body
            if kind == "events" and method == "PATCH" and len(rest) == 1:
                event = self.events.get((namespace, rest[0]))
                if event is None:
                    return 404, {"message": f"events {rest[0]} not found"}
                event.update(body)
                return 200, event
            if kind == "pods" and method == "GET" and len(rest) == 1:
                uid = self.pods.get((namespace, rest[0]))
                if uid is None:
                    return 404, {"message": f"pods {rest[0]} not found"}
                return 200, {"metadata": {"name": rest[0], "namespace": namespace, "uid": uid}}
        if parts[:3] == ["api", "v1", "nodes"] and len(parts) >= 4 and parts[3] == self.node:
            if method == "GET" and len(parts) == 4:
                return 200, self._node()
            if method == "PATCH" and parts[4:] == ["status"]:
                if ctype != "application/strategic-merge-patch+json":
                    return 415, {"message": f"unsupported patch type {ctype}"}
                for c in body["status"]["conditions"]:
                    self.conditions[c["type"]] = {**self.conditions.get(c["type"], {}), **c}
                return 200, {"metadata": {"name": self.node}}
        if parts[:4] == ["apis", "resource.k8s.io", "v1", "namespaces"] and \
                parts[5:6] == ["resourceclaims"] and len(parts) == 7 and method == "GET":
            claim = self.claims.get((parts[4], parts[6]))
            if claim is None:
                return 404, {"message": f'resourceclaims.resource.k8s.io "{parts[6]}" not '
                                        f"found", "reason": "NotFound"}
            return 200, claim
        if parts[:3] == ["apis", "resource.k8s.io", "v1"] and len(parts) > 3 and \
                parts[3].partition("?")[0] == "resourceslices":
            query = parts[3].partition("?")[2]
            return self._slices(method, [f"?{urllib.parse.unquote(query)}"] if query else
                                parts[4:], body)
        return 404, {"message": f"{method} /{'/'.join(parts)}: not served here"}

    def _slices(self, method: str, rest: list[str], body: Any) -> tuple[int, Any]:
        if rest and rest[0].startswith("?"):  # a list, by the node's name only (as the Node
            # authorizer lets a node's identity list them)
            query = urllib.parse.parse_qs(rest[0][1:])
            node = query.get("fieldSelector", [""])[0].removeprefix("spec.nodeName=")
            return 200, {"items": [s for s in self.slices.values()
                                   if s["spec"]["nodeName"] == node]}
        name = rest[0] if rest else (body or {}).get("metadata", {}).get("name", "")
        held = self.slices.get(name)
        if method == "GET" and rest:
            if held is None:
                return 404, {"message": f'resourceslices.resource.k8s.io "{name}" not found',
                             "reason": "NotFound"}
            return 200, held
        if method == "POST" and not rest:
            if held is not None:
                return 409, {"message": f'resourceslices.resource.k8s.io "{name}" already '
                                        f"exists", "reason": "AlreadyExists"}
            return 201, self._store(name, body)
        if method == "PUT" and rest:
            if held is None:
                return 404, {"message": f'resourceslices.resource.k8s.io "{name}" not found'}
            if body["metadata"].get("resourceVersion") != held["metadata"]["resourceVersion"]:
                return 409, {"message": "Operation cannot be fulfilled on "
                                        f'resourceslices.resource.k8s.io "{name}": the object '
                                        "has been modified; please apply your changes to the "
                                        "latest version and try again", "reason": "Conflict"}
            return 200, self._store(name, body)
        if method == "DELETE" and rest:
            if self.slices.pop(name, None) is None:
                return 404, {"message": f'resourceslices.resource.k8s.io "{name}" not found'}
            return 200, {"kind": "Status", "status": "Success"}
        return 405, {"message": f"{method} resourceslices: not served here"}

    def _store(self, name: str, body: dict) -> dict:
        self._object_version += 1
        stored = json.loads(json.dumps(body))
        stored["metadata"]["resourceVersion"] = str(self._object_version)
        self.slices[name] = stored
        return stored

    def change_slice(self, name: str) -> None:
        """Someone else replaces slice `name` (its resourceVersion moves on)."""
        with self._cv:
            self._store(name, self.slices[name])
