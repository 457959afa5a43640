"""The device-plugin gRPC server of one resource, and its registration with kubelet.

Owns: the socket of one resource in kubelet's device-plugin directory (created mode 0600,
removed on stop), the DevicePlugin service (GetDevicePluginOptions, ListAndWatch,
GetPreferredAllocation, Allocate, PreStartContainer) answering from an
`agent.rm.manager.ResourceManager`, and the Register call towards kubelet.sock. Protobuf in,
plain data to the manager, protobuf out: a RequestError from the manager (or bytes that are
no AllocateRequest) becomes INVALID_ARGUMENT with its reason, a StateError (the allocation
could not be recorded in the journal) UNAVAILABLE, and the server keeps serving. A
ListAndWatch stream sleeps until the manager's devices or health change. Must not call NVML
(it never imports agent.nvml) nor decide lifecycle: `agent.kubelet.registrar` starts, stops
and re-registers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from concurrent import futures
from typing import Callable

import grpc
from google.protobuf.message import DecodeError

from agent import latency
from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from agent._proto.deviceplugin.v1beta1.constants import VERSION
from agent.errors import AgentError, RegistrationError, RequestError, StateError
from agent.kubelet.messages import allocate_response, list_response
from agent.rm.manager import PreferredRequest, ResourceManager

log = logging.getLogger(__name__)

SOCKET_PREFIX = "gpu-agent-"
# A ListAndWatch stream sleeps until its devices or their health change, kubelet goes away or
# the server stops; this timeout is only a safety net, long so that an idle agent sleeps.
STREAM_RECHECK_S = 60.0
REGISTER_TIMEOUT_S = 5.0
REGISTER_CHECK_S = 0.01  # while kubelet dials us back: how often our socket is looked at
# Threads per resource's server: its ListAndWatch stream (two while kubelet re-registers) and
# the calls kubelet makes one at a time. More callers than threads queue in gRPC's core; 16
# threads let 64 concurrent callers through a fifth slower than 4 (bench/bench_floor.py).
WORKERS = 4
SERVICE = "v1beta1.DevicePlugin"
# Allocate's answers kept by request bytes (speed-only, kept by docs/benchmarks.md's rule) for
# requests up to this long (a whole 8-GPU node's is some 400 bytes), this many (then cleared).
REQUEST_KEPT_BYTES = 4096
ANSWERS_KEPT = 1024


def socket_name(resource: str) -> str:
    """gpu-agent-<name after the slash>.sock (gpu-agent-gpu.sock for nvidia.com/gpu: not
    NVIDIA's nvidia-gpu.sock, so the two never remove each other's socket in a migration)."""
    return f"{SOCKET_PREFIX}{resource.rsplit('/', 1)[-1]}.sock"


def registration_failed(resource: str, kubelet_socket: str,
                        exc: grpc.RpcError) -> RegistrationError:
    """The error of a call to kubelet.sock that failed while registering `resource`."""
    return RegistrationError(f"registering {resource} with kubelet at {kubelet_socket} failed: "
                             f"{exc.code().name}: {exc.details()}")


class _DevicePlugin(dp_grpc.DevicePluginServicer):
    def __init__(self, plugin: PluginServer):
        self.plugin = plugin
        self.manager = plugin.manager
        # request bytes -> (the manager's settings, its allocations, the answer's bytes, the
        # log lines' text): kubelet asks for the same few device sets again and again
        self._kept: dict[bytes, tuple] = {}
        self._allocate_latency = latency.histogram("Allocate", self.manager.resource)
        self._preferred_latency = latency.histogram("GetPreferredAllocation",
                                                    self.manager.resource)

    def GetDevicePluginOptions(self, request, context):
        return self.plugin.options

    def ListAndWatch(self, request, context):
        plugin, manager = self.plugin, self.manager
        snapshot = manager.snapshot()
        log.info("%s: ListAndWatch stream opened; sending %d devices (%d healthy)",
                 manager.resource, len(snapshot.devices),
                 sum(1 for h in snapshot.devices if h.healthy))
        plugin.streams_opened()
        try:
            if not context.add_callback(manager.wake):  # kubelet gone: end the wait at once
                return  # gone already
            yield list_response(snapshot)
            while context.is_active() and not plugin.stopping:
                current = manager.wait_for_change(
                    snapshot.version, STREAM_RECHECK_S,
                    lambda: plugin.stopping or not context.is_active())
                if current.closed:
                    return
                if current.version != snapshot.version:
                    snapshot = current
                    log.debug("%s: ListAndWatch snapshot %d: %s", manager.resource,
                              snapshot.version, [(h.device.id, h.healthy) for h in snapshot.devices])
                    yield list_response(snapshot)
        finally:
            plugin.streams_closed()

    def GetPreferredAllocation(self, request, context):
        return latency.timed(self._preferred_latency, self._preferred, request, context)

    def Allocate(self, raw: bytes, context) -> bytes:
        return latency.timed(self._allocate_latency, self._allocate, raw, context)

    def _allocate(self, raw: bytes, context) -> bytes:
        """The answer to `raw`'s AllocateRequest (bytes in and out: `_add_servicer`), kept for
        those bytes while the manager's settings hold; recorded in the journal by the manager
        (`allocate`, or `record` for a kept answer) before it is sent."""
        manager = self.manager
        settings, kept = manager.settings, self._kept.get(raw)
        try:
            if kept is not None and kept[0] is settings:
                _, allocations, data, lines = kept
                manager.record(allocations)
            else:
                allocations = manager.allocate([c.devices_ids for c in
                                                self._decoded(raw, context).container_requests])
                data = allocate_response(a.response for a in allocations).SerializeToString()
                lines = [", ".join(d.describe() for d in a.devices) for a in allocations]
                if settings.repeats and len(raw) <= REQUEST_KEPT_BYTES:
                    if len(self._kept) >= ANSWERS_KEPT:
                        self._kept.clear()
                    self._kept[raw] = (settings, allocations, data, lines)
        except RequestError as exc:
            log.warning("%s: refused Allocate: %s", manager.resource, exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except StateError as exc:  # not recorded: kubelet must not start the container
            log.error("%s: Allocate failed: %s", manager.resource, exc)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"allocation not recorded: {exc}")
        for text in lines:  # the line operators grep for
            log.info("%s: allocated to a container: %s", manager.resource, text)
        return data

    def _decoded(self, raw: bytes, context) -> dp.AllocateRequest:
        try:
            return dp.AllocateRequest.FromString(raw)
        except DecodeError as exc:
            log.warning("%s: refused Allocate: the request is not an AllocateRequest (%s)",
                        self.manager.resource, exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"the request is not a valid AllocateRequest: {exc}")

    def _preferred(self, request, context):
        requests = [PreferredRequest(list(c.available_deviceIDs), list(c.must_include_deviceIDs),
                                     c.allocation_size) for c in request.container_requests]
        try:
            picks = self.manager.preferred(requests)
        except RequestError as exc:
            log.warning("%s: refused GetPreferredAllocation: %s", self.manager.resource, exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        log.debug("%s: preferred %s for %s", self.manager.resource, picks,
                  [(r.size, list(r.must_include)) for r in requests])
        return dp.PreferredAllocationResponse(container_responses=[
            dp.ContainerPreferredAllocationResponse(deviceIDs=ids) for ids in picks])

    def PreStartContainer(self, request, context):
        return dp.PreStartContainerResponse()


def _add_servicer(servicer: _DevicePlugin, server: grpc.Server) -> None:
    """dp_grpc.add_DevicePluginServicer_to_server, but Allocate takes and returns the bytes on
    the wire (bad bytes: INVALID_ARGUMENT with the reason, not gRPC's INTERNAL)."""
    handlers = {name: grpc.unary_unary_rpc_method_handler(
        getattr(servicer, name), request and request.FromString,
        response and response.SerializeToString)
        for name, request, response in (
            ("GetDevicePluginOptions", dp.Empty, dp.DevicePluginOptions),
            ("GetPreferredAllocation", dp.PreferredAllocationRequest,
             dp.PreferredAllocationResponse),
            ("Allocate", None, None),
            ("PreStartContainer", dp.PreStartContainerRequest, dp.PreStartContainerResponse))}
    handlers["ListAndWatch"] = grpc.unary_stream_rpc_method_handler(
        servicer.ListAndWatch, dp.Empty.FromString, dp.ListAndWatchResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


class PluginServer:
    """The gRPC server of one resource on DIR/gpu-agent-<name>.sock: start() listens (mode
    0600), register() registers it with kubelet, stop() ends the streams and removes the
    socket. A stopped server is not restarted: the registrar makes a new one."""

    def __init__(self, manager: ResourceManager, socket_dir: str):
        self.manager = manager
        self.resource = manager.resource
        self.endpoint = socket_name(self.resource)
        self.path = os.path.join(socket_dir, self.endpoint)
        self.options = dp.DevicePluginOptions(pre_start_required=False,
                                              get_preferred_allocation_available=True)
        self.inode: int | None = None
        self.stopping = False
        # on a gRPC thread when kubelet ended the last stream: the registrar decides what next
        self.on_dropped: Callable[[], None] | None = None
        self._server: grpc.Server | None = None
        self._lock = threading.Lock()
        self._streams = 0
        # streams opened since the last Register: an earlier kubelet's stream ending after it
        # (two kubelet starts 150 ms apart) is not the new kubelet dropping us
        self._opened_since_register = 0

    def __repr__(self) -> str:
        return f"PluginServer({self.resource!r} on {self.path})"

    def streams_opened(self) -> None:
        with self._lock:
            self._streams += 1
            self._opened_since_register += 1

    def streams_closed(self) -> None:
        with self._lock:
            self._streams -= 1
            dropped = self._streams == 0 and not self.stopping and \
                self._opened_since_register > 0
        if dropped and self.on_dropped is not None:
            self.on_dropped()

    def start(self) -> None:
        """Listen on our path. A socket kubelet wiped as it was made leaves `owns_socket()`
        False (the registrar then starts another server), never an exception."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a socket left by a crash: nobody is serving it
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS,
                                                        thread_name_prefix="plugin"),
                             options=[("grpc.so_reuseport", 0)])
        _add_servicer(_DevicePlugin(self), server)
        old_umask = os.umask(0o177)  # the socket is born 0600: no window where others connect
        try:
            bound = server.add_insecure_port(f"unix:{self.path}")
        except RuntimeError as exc:
            raise AgentError(f"cannot listen on {self.path} for {self.resource}: {exc}") from exc
        finally:
            os.umask(old_umask)
        if not bound:
            raise AgentError(f"cannot listen on {self.path} for {self.resource}")
        server.start()
        self._server = server
        try:
            self.inode = os.stat(self.path).st_ino
        except FileNotFoundError:
            log.info("%s: %s was removed as it was created", self.resource, self.path)
            return
        log.info("%s: serving the device-plugin API on %s", self.resource, self.path)

    def owns_socket(self) -> bool:
        """True while the socket file at our path is the one this server listens on."""
        try:
            return self.inode is not None and os.stat(self.path).st_ino == self.inode
        except FileNotFoundError:
            return False

    def register(self, channel: grpc.Channel, kubelet_socket: str,
                 timeout: float = REGISTER_TIMEOUT_S) -> None:
        """Register this endpoint over `channel`, connected to the kubelet at `kubelet_socket`,
        which dials us back before it answers; RegistrationError on failure, and at once when
        our socket is removed meanwhile (a kubelet starting wipes it: its dial would back off
        for seconds)."""
        request = dp.RegisterRequest(version=VERSION, endpoint=self.endpoint,
                                     resource_name=self.resource, options=self.options)
        with self._lock:  # before the call: kubelet may open its stream before it answers
            self._opened_since_register = 0
        answered = threading.Event()
        call = dp_grpc.RegistrationStub(channel).Register.future(request, timeout=timeout)
        call.add_done_callback(lambda _: answered.set())
        try:
            while not answered.wait(REGISTER_CHECK_S):
                if not self.owns_socket():
                    call.cancel()
                    raise RegistrationError(f"{self.path} was removed while registering "
                                            f"{self.resource}")
            call.result()
        except grpc.RpcError as exc:
            raise registration_failed(self.resource, kubelet_socket, exc) from None

    def stop(self, grace: float = 0.5) -> None:
        """Stop serving (open streams end) and remove our socket if it is still ours."""
        self.stopping = True
        self.manager.wake()
        server, self._server = self._server, None
        if server is None:
            return
        server.stop(grace).wait(grace + 1.0)
        if self.owns_socket():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        log.info("%s: stopped serving on %s", self.resource, self.path)
