"""A client of the Kubernetes API server for the few calls the agent makes: create and patch
Events, read a Pod or the Node, patch the Node's status; in DRA mode list, create and replace
the node's ResourceSlice and read ResourceClaims.

Owns: reading a kubeconfig (its current context's server, CA, and the user's bearer token,
token file or client certificate and key, as paths or inline `-data`), HTTPS with a fresh TLS
context on each new connection (the kubelet's client certificate is rotated in place, so a
reconnection picks up the new one), JSON in and out, and turning a failed request into
agent.errors.KubeApiError. Exec plugins and auth providers are refused with a clear error:
a node agent's kubeconfig (the kubelet's) never needs them.

Why no client library: the agent makes a handful of kinds of request; the official client and
lightkube each bring a dozen packages and 0.2–1 s of import for them (README, the dependency
list). Must not: retry (the caller decides), or be called from a thread that must not block
(each call waits on the network, at most `timeout`).
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any

from agent.errors import KubeApiError

REQUEST_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Kubeconfig:
    """What the client needs of a kubeconfig's current context."""

    path: str
    server: str
    ca_file: str = ""
    ca_data: bytes = b""
    insecure: bool = False
    token: str = ""
    token_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    cert_data: bytes = b""
    key_data: bytes = b""


def load_kubeconfig(path: str) -> Kubeconfig:
    """Read `path`; KubeApiError naming the file and the entry when it cannot be used."""
    import yaml

    try:
        with open(path, "rb") as f:
            doc = yaml.safe_load(f.read(1 << 20))
    except OSError as exc:
        raise KubeApiError(f"kubeconfig {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise KubeApiError(f"kubeconfig {path}: not YAML: {exc}") from None
    if not isinstance(doc, dict):
        raise KubeApiError(f"kubeconfig {path}: not a kubeconfig (a mapping is expected)")

    def named(section: str, name: str) -> dict:
        for item in doc.get(section) or []:
            if isinstance(item, dict) and item.get("name") == name:
                return item.get(section[:-1]) or {}
        raise KubeApiError(f"kubeconfig {path}: no {section[:-1]} named {name!r}")

    contexts = [c for c in doc.get("contexts") or [] if isinstance(c, dict)]
    current = doc.get("current-context") or (contexts[0].get("name") if len(contexts) == 1
                                             else None)
    if not current:
        raise KubeApiError(f"kubeconfig {path}: no current-context")
    context = named("contexts", current)
    cluster = named("clusters", context.get("cluster", ""))
    user = named("users", context.get("user", "")) if context.get("user") else {}
    for unsupported in ("exec", "auth-provider"):
        if user.get(unsupported):
            raise KubeApiError(f"kubeconfig {path}: user {context.get('user')!r} authenticates "
                               f"with {unsupported}, which gpu-agent does not run; use a "
                               f"client certificate or a token (the kubelet's kubeconfig)")
    server = cluster.get("server") or ""
    if not server.startswith(("https://", "http://")):
        raise KubeApiError(f"kubeconfig {path}: cluster {context.get('cluster')!r} has no "
                           f"https:// server")
    base = os.path.dirname(os.path.abspath(path))

    def rel(value: Any) -> str:  # paths in a kubeconfig are relative to its directory
        return os.path.join(base, value) if value else ""

    def data(value: Any, key: str) -> bytes:
        if not value:
            return b""
        try:
            return base64.b64decode(value, validate=True)
        except (ValueError, TypeError):
            raise KubeApiError(f"kubeconfig {path}: {key} is not base64") from None

    return Kubeconfig(
        path=path, server=server.rstrip("/"),
        ca_file=rel(cluster.get("certificate-authority")),
        ca_data=data(cluster.get("certificate-authority-data"), "certificate-authority-data"),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        token=user.get("token") or "", token_file=rel(user.get("tokenFile")),
        cert_file=rel(user.get("client-certificate")), key_file=rel(user.get("client-key")),
        cert_data=data(user.get("client-certificate-data"), "client-certificate-data"),
        key_data=data(user.get("client-key-data"), "client-key-data"))


class ApiClient:
    """Requests to the API server of `config`, one connection kept open between them.
    Thread-safe: requests are serialised."""

    def __init__(self, config: Kubeconfig, timeout: float = REQUEST_TIMEOUT_S):
        self.config = config
        self.timeout = timeout
        url = urllib.parse.urlsplit(config.server)
        self.https = url.scheme == "https"
        self.host = url.hostname or ""
        self.port = url.port or (443 if self.https else 80)
        self.prefix = url.path.rstrip("/")
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/json") -> Any:
        """The decoded JSON answer; KubeApiError when unreachable or refused."""
        data = None if body is None else json.dumps(body).encode()
        headers = self._headers()
        if data is not None:
            headers["Content-Type"] = content_type
        with self._lock:
            try:
                conn = self._conn or self._connect()
                self._conn = conn
                conn.request(method, self.prefix + path, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException) as exc:
                self.close_locked()
                raise KubeApiError(f"{method} {path}: {self.config.server} not answering: "
                                   f"{exc or type(exc).__name__}") from None
            if resp.getheader("Connection", "").lower() == "close":
                self.close_locked()
        if resp.status >= 400:
            message = raw.decode(errors="replace")
            try:
                message = json.loads(message).get("message", message)
            except (ValueError, AttributeError):
                pass
            raise KubeApiError(f"{method} {path}: HTTP {resp.status}: {message[:500]}",
                               code=resp.status)
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            raise KubeApiError(f"{method} {path}: the answer is not JSON") from None

    def watch(self, path: str, timeout: float) -> Watch:
        """A watch request (`path` with `watch=1`) on a connection of its own, its answer read
        line by line as the API server sends the events (`timeout`: the longest silence
        waited for). KubeApiError when unreachable or refused."""
        headers = self._headers()
        conn = self._connect()
        conn.timeout = timeout
        try:
            conn.request("GET", self.prefix + path, headers=headers)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise KubeApiError(f"watch {path}: {self.config.server} not answering: "
                               f"{exc or type(exc).__name__}") from None
        if resp.status >= 400:
            message = resp.read().decode(errors="replace")
            conn.close()
            raise KubeApiError(f"watch {path}: HTTP {resp.status}: {message[:500]}",
                               code=resp.status)
        return Watch(path, conn, resp)

    def close(self) -> None:
        with self._lock:
            self.close_locked()

    def close_locked(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _headers(self) -> dict[str, str]:
        """The headers of every request: JSON, and the bearer token when there is one."""
        headers = {"Accept": "application/json", "User-Agent": "gpu-agent"}
        token = self._token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _token(self) -> str:
        if self.config.token_file:
            try:
                with open(self.config.token_file) as f:
                    return f.read().strip()
            except OSError as exc:
                raise KubeApiError(f"kubeconfig {self.config.path}: token file "
                                   f"{self.config.token_file}: {exc.strerror or exc}") from None
        return self.config.token

    def _connect(self) -> http.client.HTTPConnection:
        if not self.https:
            return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        return http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout,
                                           context=self._tls())

    def _tls(self) -> Any:
        import ssl

        c = self.config
        try:
            ctx = ssl.create_default_context(
                cafile=c.ca_file or None,
                cadata=c.ca_data.decode() if c.ca_data else None)
            if c.insecure:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            if c.cert_data or c.cert_file:
                _load_client_cert(ctx, c)
        except (OSError, ssl.SSLError, ValueError) as exc:
            raise KubeApiError(f"kubeconfig {c.path}: TLS setup failed: {exc}") from None
        return ctx


class Watch:
    """The events of one watch request, each a decoded JSON object ({"type", "object"}); ends
    when the API server ends the request. `close()` from another thread ends it too."""

    def __init__(self, path: str, conn: http.client.HTTPConnection, resp: Any):
        self.path = path
        self._conn = conn
        self._resp = resp

    def __iter__(self):
        try:
            while True:
                line = self._resp.readline()
                if not line:
                    return
                if line.strip():
                    yield json.loads(line)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise KubeApiError(f"watch {self.path}: ended: {exc or type(exc).__name__}") from None
        finally:
            self._conn.close()

    def close(self) -> None:
        sock = self._conn.sock
        if sock is not None:
            try:
                sock.shutdown(2)  # wakes the thread reading it
            except OSError:
                pass


def _load_client_cert(ctx: Any, c: Kubeconfig) -> None:
    """The client certificate and key, from files or from the kubeconfig's -data (through a
    memfd: ssl reads a certificate chain only from a path)."""
    fds = []
    try:
        def path_of(inline: bytes, path: str, name: str) -> str:
            if not inline:
                return path
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
            fds.append(fd)
            os.write(fd, inline)
            return f"/proc/self/fd/{fd}"

        cert = path_of(c.cert_data, c.cert_file, "client-cert")
        key = path_of(c.key_data, c.key_file, "client-key") if (c.key_data or c.key_file) \
            else None
        ctx.load_cert_chain(cert, key)
    finally:
        for fd in fds:
            os.close(fd)


def connect(path: str) -> ApiClient:
    """A client for the kubeconfig at `path` (read now)."""
    return ApiClient(load_kubeconfig(path))
