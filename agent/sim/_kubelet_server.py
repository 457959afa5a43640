"""SimKubelet: the simulated kubelet's gRPC servers and its socket directory.

Owns: the sockets (DIR/kubelet.sock for Registration, the podresources socket, and
DIR/sim-control/kubelet-control.sock for the control API), start/stop/restart, and the mapping
of the device manager's errors onto gRPC status codes. On start and restart it deletes every
socket directly in DIR, as kubelet's device manager does (plugins' sockets included; regular
files and subdirectories are kept). Must not hold device-manager logic: `_kubelet_manager` does.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from concurrent import futures

import grpc

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from agent._proto.podresources.v1 import api_pb2_grpc as pr_grpc
from agent._proto.simkubelet.v1 import control_pb2 as ctl
from agent._proto.simkubelet.v1 import control_pb2_grpc as ctl_grpc
from agent.errors import SimError
from agent.sim._kubelet_manager import DeviceManager, FailedDial, watch_events
from agent.sim.kubelet import (
    DEFAULT_DIAL_TIMEOUT,
    DEFAULT_KUBELET_VERSION,
    DEFAULT_RELIST_AFTER_RESTART_S,
    SimKubeletError,
    control_socket_path,
    default_podresources_socket,
    kubelet_socket_path,
)

log = logging.getLogger(__name__)

# AF_UNIX socket paths hold at most 107 bytes on Linux (sun_path is 108 with the NUL).
MAX_SOCKET_PATH = 107


def _abort(context: grpc.ServicerContext, err: SimKubeletError):
    context.abort(getattr(grpc.StatusCode, err.grpc_code), str(err))


def _sockets_in(directory: str) -> list[str]:
    """Unix sockets directly in `directory` (not in its subdirectories)."""
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        path = os.path.join(directory, name)
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                out.append(path)
        except FileNotFoundError:
            continue
    return out


def remove_sockets(directory: str) -> list[str]:
    """Delete every unix socket directly in `directory` (kubelet's CleanupPluginDirectory)."""
    removed = []
    for path in _sockets_in(directory):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            continue
    return removed


class _Registration(dp_grpc.RegistrationServicer):
    """One kubelet instance's Registration service (a restart builds a new one)."""

    def __init__(self, manager: DeviceManager):
        self.manager = manager
        self.generation = manager.generation  # the instance this server belongs to

    def Register(self, request, context):
        try:
            self.manager.register(request, self.generation)
        except SimKubeletError as err:
            _abort(context, err)
        return dp.Empty()


class _PodResources(pr_grpc.PodResourcesListerServicer):
    def __init__(self, manager: DeviceManager):
        self.manager = manager

    def List(self, request, context):
        return self.manager.list_pod_resources()

    def GetAllocatableResources(self, request, context):
        return self.manager.allocatable_resources()

    def Get(self, request, context):
        try:
            return self.manager.get_pod_resources(request.pod_name, request.pod_namespace)
        except SimKubeletError as err:  # kubelet answers an unknown pod with status UNKNOWN
            context.abort(grpc.StatusCode.UNKNOWN, str(err))


class _Control(ctl_grpc.SimKubeletControlServicer):
    def __init__(self, sim: SimKubelet):
        self.sim = sim
        self.manager = sim.manager

    def GetState(self, request, context):
        return self.sim.state()

    def Watch(self, request, context):
        yield from watch_events(self.manager.events, request.after_seq, context.is_active)

    def GetSnapshots(self, request, context):
        return ctl.GetSnapshotsResponse(
            snapshots=self.manager.snapshots(request.resource_name, request.after_seq))

    def AdmitPod(self, request, context):
        try:
            return ctl.AdmitPodResponse(pod=self.manager.admit_pod(request))
        except SimKubeletError as err:
            _abort(context, err)

    def DeletePod(self, request, context):
        try:
            return ctl.DeletePodResponse(pod=self.manager.delete_pod(request.name,
                                                                     request.namespace))
        except SimKubeletError as err:
            _abort(context, err)

    def Restart(self, request, context):
        restarts, removed = self.sim.restart()
        return ctl.RestartResponse(restarts=restarts, removed_sockets=removed)

    def GetAllocatableHistory(self, request, context):
        return ctl.GetAllocatableHistoryResponse(changes=self.manager.allocatable_history(
            request.resource_name, request.after_seq))


class SimKubelet:
    """A simulated kubelet serving in this process (threads); `gpu-agent sim kubelet` runs one.

    `SimKubelet(dir, podresources_socket=None, dial_timeout=10.0, kubelet_version="1.36",
    relist_after_restart=0.5)`; `start()`, `stop()`,
    `restart()` (returns (restart count, removed socket paths)), `state()` (the control API's
    State message), `failed_dials(instance)` (the dials to registering plugins whose first
    attempt failed; in this process only); usable as a context manager. Talk to it with
    SimKubeletClient(dir).
    """

    def __init__(self, directory: str | os.PathLike, podresources_socket: str | None = None,
                 dial_timeout: float = DEFAULT_DIAL_TIMEOUT,
                 kubelet_version: str = DEFAULT_KUBELET_VERSION,
                 relist_after_restart: float = DEFAULT_RELIST_AFTER_RESTART_S):
        self.dir = os.path.abspath(os.fspath(directory))
        self.kubelet_socket = kubelet_socket_path(self.dir)
        self.podresources_socket = os.path.abspath(
            podresources_socket or default_podresources_socket(self.dir))
        self.control_socket = control_socket_path(self.dir)
        for path in (self.kubelet_socket, self.podresources_socket, self.control_socket):
            if len(path.encode()) > MAX_SOCKET_PATH:
                raise SimError(f"socket path {path} is {len(path.encode())} bytes; unix sockets "
                               f"allow {MAX_SOCKET_PATH}: use a shorter --dir")
        self.manager = DeviceManager(self.dir, dial_timeout, kubelet_version,
                                     relist_after_restart)
        self._lock = threading.Lock()  # start/stop/restart one at a time
        self._registration: grpc.Server | None = None
        self._podresources: grpc.Server | None = None
        self._control: grpc.Server | None = None

    def __enter__(self) -> SimKubelet:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @staticmethod
    def _server(servicer_adder, servicer, workers: int, what: str) -> grpc.Server:
        """A gRPC server with its servicer, not listening yet."""
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers,
                                                        thread_name_prefix=what))
        servicer_adder(servicer, server)
        return server

    @staticmethod
    def _listen(server: grpc.Server, path: str, what: str) -> grpc.Server:
        os.makedirs(os.path.dirname(path), mode=0o750, exist_ok=True)
        if os.path.exists(path):
            os.unlink(path)
        try:
            bound = server.add_insecure_port(f"unix:{path}")
        except RuntimeError as err:
            raise SimError(f"cannot listen on {path} ({what}): {err}") from err
        if not bound:
            raise SimError(f"cannot listen on {path} ({what})")
        server.start()
        return server

    def _kubelet_servers(self) -> tuple[grpc.Server, grpc.Server]:
        """Registration and podresources servers, built but not listening yet."""
        return (self._server(dp_grpc.add_RegistrationServicer_to_server,
                             _Registration(self.manager), 8, "registration"),
                self._server(pr_grpc.add_PodResourcesListerServicer_to_server,
                             _PodResources(self.manager), 4, "podresources"))

    def _wipe_and_listen(self, servers: tuple[grpc.Server, grpc.Server]) -> list[str]:
        """Delete the sockets in DIR and listen on kubelet.sock at once, as kubelet's device
        manager does (plugin/v1beta1/server.go Start: CleanupPluginDirectory, then listen):
        a plugin registering meanwhile meets the new kubelet with its socket gone only if it
        looked at its socket before the wipe. Returns the sockets deleted."""
        removed = remove_sockets(self.dir)
        self._registration = self._listen(servers[0], self.kubelet_socket, "registration")
        self._podresources = self._listen(servers[1], self.podresources_socket, "podresources")
        return removed

    def _stop_kubelet_servers(self) -> None:
        for server in (self._registration, self._podresources):
            if server is not None:
                server.stop(grace=None).wait()
        self._registration = self._podresources = None
        for path in (self.kubelet_socket, self.podresources_socket):
            if os.path.exists(path):
                os.unlink(path)

    def start(self) -> None:
        with self._lock:
            os.makedirs(self.dir, mode=0o750, exist_ok=True)
            self._control = self._listen(
                self._server(ctl_grpc.add_SimKubeletControlServicer_to_server, _Control(self),
                             32, "control"), self.control_socket, "control")
            removed = self._wipe_and_listen(self._kubelet_servers())
        if removed:
            log.info("removed stale sockets from %s: %s", self.dir, removed)
        log.info("simulated kubelet serving: registration %s, podresources %s, control %s",
                 self.kubelet_socket, self.podresources_socket, self.control_socket)

    def restart(self) -> tuple[int, list[str]]:
        """Like a kubelet restart: streams dropped, sockets in DIR deleted, listening again.

        The new instance's state is set before kubelet.sock exists again, so a plugin that
        registers the moment it appears is counted in the new instance and not forgotten.
        From the old instance's end to the new one listening takes milliseconds, as from a
        kubelet process's end to the next one's socket: the old streams are cut, and their
        threads (closing a channel can take 0.2 s) are waited for only after that.
        """
        with self._lock:
            log.info("simulated kubelet restarting")
            before = set(_sockets_in(self.dir))
            self._stop_kubelet_servers()
            dropped = self.manager.drop_endpoints("kubelet restarted", wait=0.0)
            servers = self._kubelet_servers()
            restarts = self.manager.restarted(sorted(before.union(_sockets_in(self.dir))))
            removed = sorted(before.union(self._wipe_and_listen(servers)))
            self.manager.join_streams(dropped)
        return restarts, removed

    def stop(self) -> None:
        with self._lock:
            self._stop_kubelet_servers()
            self.manager.close()
            if self._control is not None:
                self._control.stop(grace=1.0).wait()
                self._control = None
            if os.path.exists(self.control_socket):
                os.unlink(self.control_socket)
        log.info("simulated kubelet stopped")

    def failed_dials(self, instance: int | None = None) -> list[FailedDial]:
        """The dials to registering plugins whose first attempt failed (each made its Register
        wait on gRPC's reconnect backoff), of kubelet instance `instance` (restart count) or
        all, oldest first."""
        return self.manager.failed_dials(instance)

    def state(self) -> ctl.State:
        state = self.manager.state()
        state.dir = self.dir
        state.kubelet_socket = self.kubelet_socket
        state.podresources_socket = self.podresources_socket
        state.control_socket = self.control_socket
        return state
