"""Being registered with the kubelet that runs now: the plugin servers and their registration.

Owns: one `PluginServer` per resource in kubelet's device-plugin directory, the inotify watch
on that directory, and the two rules that say when to act. Both read the directory as it is
now, never the order of past events, so a burst of events (a kubelet restart, two restarts
100 ms apart) is coalesced into one action per resource:
- a server is (re)started only when its own socket file is gone (kubelet wiped the directory,
  or someone removed it);
- a resource registers when the kubelet instance (the identity of kubelet.sock: device, inode
  and ctime) differs from the instance it last registered with, or when that instance ended
  the resource's last ListAndWatch stream, one opened since our last Register call (an earlier
  kubelet's stream ending late is not a drop), while our server kept serving (kubelet dropped us
  without restarting: up to 1.36 it does so to a plugin that replaced another one of the same
  resource when the other one's stream ends, docs/install.md). Registration is immediate (no
  settle delay); a failed attempt is retried after 10 ms doubling to 5 s while kubelet.sock
  exists, and at once when another kubelet instance appears.
One thread does all of it (`registrar`): it sleeps in select() on the inotify descriptor and
a wake pipe, so an idle agent is idle. `serve(managers)` changes the set of resources at run
time: new servers start and register before the servers of removed resources stop; servers of
resources that stay are untouched (hitless reload). Must not build devices (agent.rm) nor call
NVML; the daemon decides which managers to serve.
"""

from __future__ import annotations

import logging
import os
import selectors
import threading
import time
from collections.abc import Mapping
from typing import Callable, NamedTuple

import grpc

from agent.dirwatch import DIR_GONE, DirWatch
from agent.errors import AgentError, RegistrationError
from agent.kubelet.plugin import REGISTER_TIMEOUT_S, PluginServer, registration_failed
from agent.rm.manager import ResourceManager
from agent.signals import drain

log = logging.getLogger(__name__)

RETRY_FIRST_S = 0.01  # kubelet.sock exists but refused us: it may be binding right now
RETRY_MAX_S = 5.0
# The directory cannot be watched: it is looked at this often instead (with the watch, inotify
# says when to act, and the thread sleeps until it or a retry is due).
IDLE_RECHECK_S = 5.0
WATCH_RETRY_S = 1.0

Identity = tuple  # (st_dev, st_ino, st_ctime_ns) of kubelet.sock


def kubelet_identity(path: str) -> Identity | None:
    """Which kubelet instance serves `path` now: the socket file's identity, or None if there
    is none. A restarted kubelet re-creates its socket, so a new instance has a new identity
    (the ctime tells an inode number the filesystem reused)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


# A method kubelet does not serve: its answer, UNIMPLEMENTED (the gRPC spec's status for an
# unknown method), says the channel is connected to a kubelet listening on kubelet.sock.
_PROBE = "/v1beta1.Registration/Connected"


def _connect(channel: grpc.Channel, resource: str, kubelet_socket: str) -> str:
    """Connect `channel` (to kubelet.sock) by a call kubelet answers UNIMPLEMENTED; "" once
    connected, else why not (nobody listens: UNAVAILABLE at once)."""
    try:
        channel.unary_unary(_PROBE)(b"", timeout=REGISTER_TIMEOUT_S)
    except grpc.RpcError as exc:
        if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
            return ""
        return str(registration_failed(resource, kubelet_socket, exc))
    return ""


class ResourceStatus(NamedTuple):
    """What `gpu-agent status` shows of one resource's registration."""

    socket: str
    registered: bool
    registrations: int
    last_error: str


class _Plugin:
    """What the registrar knows of one resource's server and registration."""

    __slots__ = ("manager", "server", "registered_with", "registrations", "failed_for",
                 "retry_at", "backoff", "last_error", "servers_started", "dropped")

    def __init__(self, manager: ResourceManager, registrations: int = 0):
        self.manager = manager
        self.server: PluginServer | None = None
        self.registered_with: Identity | None = None
        self.registrations = registrations
        self.failed_for: Identity | None = None  # the kubelet instance the last failure was against
        self.retry_at = 0.0
        self.backoff = RETRY_FIRST_S
        self.last_error = ""
        self.servers_started = 0
        self.dropped = False  # kubelet ended our last stream; set from a gRPC thread


class _Wanted(NamedTuple):
    """What serve() asked for last; replaced whole, never changed."""

    managers: dict[str, ResourceManager]
    generation: int


class Registrar:
    """Serves `serve()`'s managers beside kubelet.sock and keeps them registered with the
    kubelet running now. `on_change()` is called (from the registrar's thread) after every
    registration, failure or server (re)start, for the daemon to publish its status."""

    def __init__(self, kubelet_socket: str, on_change: Callable[[], None] = lambda: None):
        self.kubelet_socket = kubelet_socket
        self.directory = os.path.dirname(kubelet_socket) or "."
        self.on_change = on_change
        self.restarts = 0  # servers started again because their socket went away
        self._lock = threading.Lock()
        self._wanted = _Wanted({}, 0)
        self._plugins: dict[str, _Plugin] = {}
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._watch: DirWatch | None = None
        self._watch_retry_at: float | None = None  # also: None with no watch = not tried yet
        self._thread: threading.Thread | None = None
        self._synced = threading.Condition()
        self._synced_generation = -1

    def __repr__(self) -> str:
        return f"Registrar({self.kubelet_socket!r})"

    # -- the daemon's side --------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        try:
            os.makedirs(self.directory, mode=0o750, exist_ok=True)
        except OSError as exc:  # the first pass reports what it means for the servers
            log.error("cannot create the kubelet socket directory %s: %s", self.directory, exc)
        self._thread = threading.Thread(target=self._run, name="registrar", daemon=True)
        self._thread.start()

    def serve(self, managers: Mapping[str, ResourceManager]) -> int:
        """Serve exactly these resources from now on; returns a generation `wait_synced`
        can wait for. Managers already served (same object) are left as they are."""
        with self._lock:
            self._wanted = _Wanted(dict(managers), self._wanted.generation + 1)
            generation = self._wanted.generation
        self._wake()
        return generation

    def wait_synced(self, generation: int, timeout: float) -> bool:
        """Wait until the registrar has acted on `serve()`'s `generation` once."""
        with self._synced:
            return self._synced.wait_for(lambda: self._synced_generation >= generation, timeout)

    def status(self) -> dict[str, ResourceStatus]:
        with self._lock:
            return {name: ResourceStatus(
                socket=p.server.path if p.server is not None else "",
                registered=p.registered_with is not None, registrations=p.registrations,
                last_error=p.last_error) for name, p in self._plugins.items()}

    def stop(self) -> None:
        """Stop the thread, then every server (their sockets removed)."""
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(RETRY_MAX_S + 5.0)
            self._thread = None
        for p in list(self._plugins.values()):
            self._stop_server(p, "stopping")  # its streams end; the manager is not ours
        self._plugins = {}
        self._close_watch()
        self._selector.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self._wake_w = -1

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except BlockingIOError:
            pass  # the pipe is full: the thread is awake anyway
        except OSError:
            pass  # stopped

    # -- the registrar's thread ---------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync()
            except Exception:  # a bug must not end registration for good: log, retry later
                log.exception("registrar: unexpected error; retrying in %g s", WATCH_RETRY_S)
                time.sleep(WATCH_RETRY_S)
                continue
            if self._watch is None and self._watch_retry_at is None:
                # Registered first, watching second (start-up time); what changed in between
                # is seen by the pass that follows, which reads the directory as it is.
                self._ensure_watch()
                continue
            timeout = self._next_due()
            for key, _ in self._selector.select(timeout):
                if key.data == "wake":
                    drain(self._wake_r)
                elif self._watch is not None:
                    self._on_dir_events()

    def _next_due(self) -> float | None:
        """Seconds until something is due, None for nothing (asleep until woken)."""
        now = time.monotonic()
        due = [now + IDLE_RECHECK_S] if self._watch is None else []
        if self._watch_retry_at is not None:
            due.append(self._watch_retry_at)
        kubelet_there = os.path.exists(self.kubelet_socket)
        for p in self._plugins.values():
            if p.server is None or (kubelet_there and p.registered_with is None):
                due.append(max(p.retry_at, now))
        return max(0.0, min(due) - now) if due else None

    def _on_dir_events(self) -> None:
        for event in self._watch.read():
            log.debug("kubelet directory: %s %s", event.kind, event.name)
            if event.kind == DIR_GONE:
                log.warning("the kubelet socket directory %s went away; watching for it "
                            "again", self.directory)
                self._close_watch()
                self._watch_retry_at = time.monotonic()

    def _sync(self) -> None:
        """Bring the servers and registrations in line with the directory and the wanted
        set, as they are now."""
        if self._watch is None and self._watch_retry_at is not None \
                and time.monotonic() >= self._watch_retry_at:
            self._ensure_watch()
        with self._lock:
            wanted = self._wanted
        changed = False
        for name, manager in wanted.managers.items():
            changed |= self._sync_one(name, manager)
        for name in [n for n in self._plugins if n not in wanted.managers]:
            p = self._plugins[name]
            self._stop_server(p, "resource no longer advertised")
            with self._lock:
                del self._plugins[name]
            log.info("%s: no longer advertised; its server stopped", name)
            changed = True
        with self._synced:
            self._synced_generation = wanted.generation
            self._synced.notify_all()
        if changed:
            self.on_change()

    def _sync_one(self, name: str, manager: ResourceManager) -> bool:
        p = self._plugins.get(name)
        if p is None or p.manager is not manager:
            if p is not None:  # another manager object: a new server (the daemon avoids this)
                self._stop_server(p, "manager replaced")
            p = _Plugin(manager, registrations=p.registrations if p else 0)
            with self._lock:
                self._plugins[name] = p
        now = time.monotonic()
        changed = False
        if p.server is None or not p.server.owns_socket():
            if now < p.retry_at and p.server is None:
                return False
            if p.server is not None:
                log.info("%s: our socket %s was removed; serving it again", name,
                         p.server.endpoint)
                self.restarts += 1
                # Stopped before the new one binds: gRPC unlinks the path when a server stops,
                # which would take the new server's socket with it.
                self._stop_server(p, "socket removed")
            if not self._start_server(p):
                return True
            changed = True
        kubelet = kubelet_identity(self.kubelet_socket)
        if p.dropped:
            with self._lock:
                p.dropped = False
                again = kubelet is not None and kubelet == p.registered_with
                if again:
                    p.registered_with = None
            if again:
                log.info("%s: kubelet ended our ListAndWatch stream without restarting; "
                         "registering again", name)
        if kubelet is None:
            waiting = f"kubelet is not serving {self.kubelet_socket} yet; waiting for it"
            if p.last_error != waiting:
                with self._lock:
                    p.last_error, p.registered_with = waiting, None
                log.info("%s: %s", name, waiting)
                return True
            return changed
        if kubelet == p.registered_with:
            return changed
        if kubelet == p.failed_for and now < p.retry_at:
            return changed
        self._register(name, p, kubelet)
        return True

    def _start_server(self, p: _Plugin) -> bool:
        server = PluginServer(p.manager, self.directory)
        try:
            server.start()
        except (AgentError, OSError) as exc:
            delay = self._failed(p, None, f"cannot serve {p.manager.resource}: {exc}")
            log.error("%s; retrying in %g s", p.last_error, delay)
            return False
        server.on_dropped = lambda: self._dropped(p, server)
        with self._lock:
            p.server, p.registered_with = server, None
        p.servers_started += 1
        return True

    def _dropped(self, p: _Plugin, server: PluginServer) -> None:
        """A gRPC thread: kubelet ended `server`'s last stream; the next pass looks."""
        with self._lock:
            if p.server is not server:
                return
            p.dropped = True
        self._wake()

    def _stop_server(self, p: _Plugin, why: str) -> None:
        server = p.server
        with self._lock:
            p.server, p.registered_with = None, None
        if server is not None:
            server.stop()
            log.debug("%s: server stopped (%s)", p.manager.resource, why)

    def _register(self, name: str, p: _Plugin, kubelet: Identity) -> None:
        # kubelet dials our socket when it gets Register, and a kubelet starting wipes the
        # directory before it listens. So the connection comes first, then our socket and
        # kubelet.sock are looked at again: the instance seen before connecting is still
        # there, so it wiped before it listened, and our socket outlived that. Looked at before
        # connecting (as up to 0575db6), a kubelet starting in between got our Register and
        # dialled a socket it had removed, then waited on its reconnect backoff (about 1 s).
        # The channel dials the socket file seen now through /proc/self/fd, never the path:
        # if that kubelet goes before the call, gRPC's reconnect finds nobody there (refused,
        # retried) rather than a kubelet started since, which would dial our socket as wiped.
        try:
            pinned = os.open(self.kubelet_socket, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            self._wake()  # gone meanwhile: the next pass looks again
            return
        st = os.fstat(pinned)
        if (st.st_dev, st.st_ino, st.st_ctime_ns) != kubelet:
            os.close(pinned)
            self._wake()
            return
        channel = grpc.insecure_channel(f"unix:/proc/self/fd/{pinned}",
                                        options=[("grpc.enable_http_proxy", 0)])
        try:
            error = _connect(channel, name, self.kubelet_socket)
            if not error and kubelet_identity(self.kubelet_socket) != kubelet:
                log.debug("%s: kubelet restarted while we connected; registering with the "
                          "new one", name)
                self._wake()
                return
            if not error and p.server.owns_socket():
                p.server.register(channel, self.kubelet_socket)
        except RegistrationError as exc:
            error = str(exc)
        finally:
            channel.close()
            os.close(pinned)
        if not p.server.owns_socket():  # a kubelet started meanwhile: serve, then register
            log.info("%s: our socket %s went away while registering; serving it again", name,
                     p.server.path)
            self._wake()
            return
        if error:
            delay = self._failed(p, kubelet, error)
            level = log.warning if p.backoff <= RETRY_FIRST_S * 2 else log.debug
            level("%s; retrying in %g s", error, delay)
            return
        with self._lock:
            # The instance seen before the call: if kubelet restarted during it, the identity
            # differs now and the next pass registers with the new one.
            p.registered_with, p.failed_for = kubelet, None
            p.registrations += 1
            p.backoff, p.retry_at, p.last_error = RETRY_FIRST_S, 0.0, ""
        log.info("registered %s with kubelet at %s (endpoint %s, %d devices; registration %d)",
                 name, self.kubelet_socket, p.server.endpoint, len(p.manager.devices),
                 p.registrations)

    def _failed(self, p: _Plugin, kubelet: Identity | None, error: str) -> float:
        delay = p.backoff
        with self._lock:
            p.backoff = min(p.backoff * 2, RETRY_MAX_S)
            p.retry_at = time.monotonic() + delay
            p.failed_for, p.last_error = kubelet, error
        return delay

    # -- the directory watch ------------------------------------------------------------------

    def _ensure_watch(self) -> None:
        try:
            os.makedirs(self.directory, mode=0o750, exist_ok=True)
            self._watch = DirWatch(self.directory)
        except OSError as exc:
            log.error("cannot watch the kubelet socket directory %s: %s; retrying in %g s",
                      self.directory, exc, WATCH_RETRY_S)
            self._watch_retry_at = time.monotonic() + WATCH_RETRY_S
            return
        self._watch_retry_at = None
        self._selector.register(self._watch.fileno(), selectors.EVENT_READ, "watch")

    def _close_watch(self) -> None:
        if self._watch is not None:
            self._selector.unregister(self._watch.fileno())
            self._watch.close()
            self._watch = None

