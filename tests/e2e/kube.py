"""A small client of the Kubernetes API for the end-to-end tests: what kubectl would do for them
(create, read, delete, patch objects; watch them until a condition holds).

Owns: HTTPS to the API server with a bearer token and the cluster's CA (urllib, no client
library), the pod manifests the cases use (`gpu_pod`), and waits that follow the API's watch
streams, never a fixed sleep. Must not know how the cluster was started.
"""

from __future__ import annotations

import json
import socket
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

WAIT = 60.0  # the bound of a wait; a healthy cluster needs far less


class ApiError(Exception):
    """The API server answered with an error status; `code` and the server's message."""

    def __init__(self, code: int, message: str):
        super().__init__(f"HTTP {code}: {message}")
        self.code = code


class Kube:
    """The API server at `server` (https://host:port), as the user of `token`."""

    def __init__(self, server: str, token: str, ca_file: str):
        self.server = server.rstrip("/")
        self.token = token
        self.ssl = ssl.create_default_context(cafile=ca_file)

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/json", timeout: float = 30) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Accept": "application/json",
            "Content-Type": content_type})
        try:
            with urllib.request.urlopen(req, context=self.ssl, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            try:
                text = json.loads(text).get("message", text)
            except ValueError:
                pass
            raise ApiError(exc.code, text) from None
        return json.loads(raw) if raw else None

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def create(self, path: str, body: dict) -> dict:
        return self.request("POST", path, body)

    def delete(self, path: str, grace_seconds: int | None = None, missing_ok: bool = True) -> None:
        body = None if grace_seconds is None else {"gracePeriodSeconds": grace_seconds}
        try:
            self.request("DELETE", path, body)
        except ApiError as exc:
            if not (missing_ok and exc.code == 404):
                raise

    def patch_status(self, path: str, patch: dict) -> dict:
        return self.request("PATCH", path + "/status", patch,
                            content_type="application/strategic-merge-patch+json")

    def readyz(self) -> bool:
        try:
            req = urllib.request.Request(self.server + "/readyz",
                                         headers={"Authorization": f"Bearer {self.token}"})
            with urllib.request.urlopen(req, context=self.ssl, timeout=5) as resp:
                return resp.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def watch(self, path: str, resource_version: str, timeout: float) -> Iterator[dict]:
        """The watch events of the collection at `path` after `resource_version`, until
        `timeout` seconds pass (then the iterator ends)."""
        query = urllib.parse.urlencode({"watch": "1", "resourceVersion": resource_version,
                                        "allowWatchBookmarks": "false",
                                        "timeoutSeconds": str(max(1, int(timeout + 1)))})
        sep = "&" if "?" in path else "?"
        req = urllib.request.Request(f"{self.server}{path}{sep}{query}", headers={
            "Authorization": f"Bearer {self.token}", "Accept": "application/json"})
        # the server ends the stream after timeoutSeconds; the socket's timeout (each read)
        # covers a server that does not
        try:
            with urllib.request.urlopen(req, context=self.ssl, timeout=timeout + 5) as resp:
                while True:
                    try:
                        line = resp.readline()
                    except (socket.timeout, TimeoutError):
                        return
                    if not line:
                        return
                    yield json.loads(line)
        except urllib.error.HTTPError as exc:
            raise ApiError(exc.code, exc.read().decode(errors="replace")) from None

    def wait_for(self, path: str, predicate: Callable[[dict], Any], what: str,
                 timeout: float = WAIT) -> Any:
        """Follow the object at `path` (a namespaced or cluster object: .../pods/NAME) until
        predicate(object) is true; returns what the predicate returned. A list-and-watch of
        its collection, filtered by name; restarted when the server ends the watch."""
        collection, name = path.rsplit("/", 1)
        deadline = time.monotonic() + timeout
        last: dict | None = None
        while True:
            listing = self.get(f"{collection}?fieldSelector=metadata.name%3D{name}")
            items = listing.get("items", [])
            last = items[0] if items else None
            if last is not None:
                result = predicate(last)
                if result:
                    return result
            version = listing["metadata"]["resourceVersion"]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{what}: not within {timeout:g} s; last seen: "
                                   f"{json.dumps(last)[:4000] if last else 'nothing'}")
            for event in self.watch(f"{collection}?fieldSelector=metadata.name%3D{name}",
                                    version, remaining):
                if event.get("type") == "ERROR":
                    break  # a watch too old: list again
                if event.get("type") == "DELETED":
                    last = None
                    continue
                last = event["object"]
                result = predicate(last)
                if result:
                    return result

    def wait_gone(self, path: str, timeout: float = WAIT) -> None:
        """Until the object at `path` no longer exists."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.get(path)
            except ApiError as exc:
                if exc.code == 404:
                    return
                raise
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} still exists after {timeout:g} s")
            collection, name = path.rsplit("/", 1)
            listing = self.get(f"{collection}?fieldSelector=metadata.name%3D{name}")
            if not listing.get("items"):
                return
            for event in self.watch(f"{collection}?fieldSelector=metadata.name%3D{name}",
                                    listing["metadata"]["resourceVersion"],
                                    min(5.0, max(0.1, deadline - time.monotonic()))):
                if event.get("type") == "DELETED":
                    return


def gpu_pod(name: str, node: str, resources: dict[str, int] | None, image: str,
            command: str = "sleep 3600", annotations: dict[str, str] | None = None) -> dict:
    """A one-container pod on `node` asking for `resources` (limits), running `command` with
    busybox's sh. Host network (the cluster has no CNI network for pods), no service-account
    token, a grace period of 1 s, and the image only from the node (no registry exists)."""
    limits = {k: str(v) for k, v in (resources or {}).items()}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "hostNetwork": True, "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1, "restartPolicy": "Never",
            "enableServiceLinks": False,
            "containers": [{
                "name": "main", "image": image, "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", command],
                "resources": {"limits": limits} if limits else {},
            }],
        },
    }


def pod_phase(pod: dict) -> str:
    return pod.get("status", {}).get("phase", "")


def pod_reason(pod: dict) -> str:
    """Why a pod failed or waits: its status reason and message, or the container's."""
    status = pod.get("status", {})
    parts = [status.get("reason", ""), status.get("message", "")]
    for cs in status.get("containerStatuses", []):
        for state in cs.get("state", {}).values():
            parts += [state.get("reason", ""), state.get("message", "")]
    for cond in status.get("conditions", []):
        if cond.get("status") == "False":
            parts += [cond.get("reason", ""), cond.get("message", "")]
    return "; ".join(p for p in parts if p)
