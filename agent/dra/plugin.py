"""The DRA driver's kubelet plugin: its two sockets and the services kubelet calls on them.

Owns: the DRA socket (`<kubelet dir>/plugins/gpu.nvidia.com/dra.sock`) serving kubelet's
DRAPlugin service in v1 and v1beta1 from one pair of handlers, and the registration socket
(`<kubelet dir>/plugins_registry/gpu.nvidia.com-reg.sock`, where kubelet's plugin watcher
looks) serving pluginregistration.Registration: GetInfo names the plugin (type DRAPlugin,
name gpu.nvidia.com, the DRA socket as endpoint, versions v1.DRAPlugin and v1beta1.DRAPlugin,
as NVIDIA's driver registers: kubeletplugin/draplugin.go, registrationserver.go), and
NotifyRegistrationStatus is kept (`registered`, `registration_error`) and logged; the DRA
socket also serves the devices' health (agent.dra.health, listed in the registration too). The
DRA socket serves before the registration socket appears, and the registration socket goes
first at stop. NodePrepareResources and NodeUnprepareResources hand each claim to the `claims`
object (`prepare(ClaimRef) -> [Prepared]`, `unprepare(ClaimRef)`); a claim that fails gets its
error in its own answer (kubelet retries it) and the others are answered. Must not call NVML
or the API server (the claims object does), nor decide what a claim gets.
"""

from __future__ import annotations

import logging
import os
from concurrent import futures
from typing import Any, Callable, NamedTuple

import grpc

from agent import latency
from agent._proto.dra.v1 import api_pb2 as v1
from agent._proto.dra.v1 import api_pb2_grpc as v1_grpc
from agent._proto.dra.v1.constants import DRA_PLUGIN_SERVICE as V1_SERVICE
from agent._proto.dra.v1beta1 import api_pb2 as v1beta1
from agent._proto.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from agent._proto.dra.v1beta1.constants import DRA_PLUGIN_SERVICE as V1BETA1_SERVICE
from agent._proto.pluginregistration.v1 import api_pb2 as reg
from agent._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from agent._proto.pluginregistration.v1.constants import DRA_PLUGIN
from agent.dra import health as health_api
from agent.dra.slices import DRIVER
from agent.errors import AgentError

log = logging.getLogger(__name__)

DEFAULT_KUBELET_DIR = "/var/lib/kubelet"
WORKERS = 8  # kubelet calls a DRA plugin one claim batch at a time per pod; a health stream
# holds one worker while it is open (one per kubelet)


class ClaimRef(NamedTuple):
    """A ResourceClaim as kubelet names it in a call."""

    namespace: str
    uid: str
    name: str


class Prepared(NamedTuple):
    """One device prepared for a claim, as kubelet is told of it."""

    requests: tuple[str, ...]  # the claim's requests this device serves
    pool: str
    device: str
    cdi_ids: tuple[str, ...]  # fully qualified CDI device IDs
    share_id: str = ""  # a share of a device allowing several allocations (v1 only)


def socket_paths(kubelet_dir: str, driver: str = DRIVER) -> tuple[str, str]:
    """(the DRA socket, the registration socket) under kubelet's directory."""
    return (os.path.join(kubelet_dir, "plugins", driver, "dra.sock"),
            os.path.join(kubelet_dir, "plugins_registry", f"{driver}-reg.sock"))


class DraPlugin:
    """The kubelet plugin of the DRA driver, answering from `claims`."""

    def __init__(self, claims: Any, kubelet_dir: str = DEFAULT_KUBELET_DIR,
                 driver: str = DRIVER, on_change: Callable[[], None] = lambda: None):
        self.claims = claims
        self.on_change = on_change  # after a registration status and each call's claims
        self.driver = driver
        self.socket, self.registration_socket = socket_paths(kubelet_dir, driver)
        self.registered: bool | None = None  # as kubelet last said; None: not yet
        self.registrations = 0  # times kubelet said registered (each kubelet start once)
        self.registration_error = ""
        self.health = health_api.HealthFeed()
        self._servers: list[tuple[grpc.Server, str]] = []

    def start(self) -> None:
        """Serve the DRA socket, then the registration socket (kubelet then registers)."""
        dra = _server()
        handlers = _Handlers(self.claims, self.on_change)
        v1_grpc.add_DRAPluginServicer_to_server(_Servicer(handlers, v1), dra)
        v1beta1_grpc.add_DRAPluginServicer_to_server(_Servicer(handlers, v1beta1), dra)
        health_api.add_to_server(self.health, dra)
        self._serve(dra, self.socket)
        registration = _server()
        reg_grpc.add_RegistrationServicer_to_server(_Registration(self), registration)
        self._serve(registration, self.registration_socket)
        log.info("DRA driver %s: serving %s, registration at %s", self.driver, self.socket,
                 self.registration_socket)

    def _serve(self, server: grpc.Server, path: str) -> None:
        os.makedirs(os.path.dirname(path), mode=0o750, exist_ok=True)
        if os.path.lexists(path):  # left by an agent that was killed
            os.unlink(path)
        server.add_insecure_port(f"unix:{path}")
        server.start()
        os.chmod(path, 0o600)
        self._servers.append((server, path))

    def stop(self) -> None:
        """The registration socket first (kubelet unregisters), then the DRA socket."""
        self.health.close()  # its streams end (they would hold server.stop)
        for server, path in reversed(self._servers):
            server.stop(None)
            if os.path.lexists(path):
                os.unlink(path)
        self._servers = []

    def notified(self, registered: bool, error: str) -> None:
        self.registrations += registered  # first: agent.dramode holds its slice until then
        self.registered, self.registration_error = registered, error
        self.on_change()
        if registered:
            log.info("DRA driver %s registered with kubelet", self.driver)
        else:
            log.error("kubelet refused the DRA driver %s: %s", self.driver, error)


def _server() -> grpc.Server:
    return grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS,
                                                  thread_name_prefix="dra"))


class _Registration(reg_grpc.RegistrationServicer):
    def __init__(self, plugin: DraPlugin):
        self.plugin = plugin

    def GetInfo(self, request, context):
        return reg.PluginInfo(type=DRA_PLUGIN, name=self.plugin.driver,
                              endpoint=self.plugin.socket,
                              supported_versions=[V1_SERVICE, V1BETA1_SERVICE,
                                                  *health_api.SERVICES])

    def NotifyRegistrationStatus(self, request, context):
        self.plugin.notified(request.plugin_registered, request.error)
        return reg.RegistrationStatusResponse()


class _Handlers:
    """Each claim of a call to `claims`, its answer or its error."""

    def __init__(self, claims: Any, on_change: Callable[[], None]):
        self.claims = claims
        self.on_change = on_change
        # the metrics' gpu_agent_rpc_duration_seconds, method and driver as labels
        self.prepare_latency = latency.histogram("NodePrepareResources", DRIVER)
        self.unprepare_latency = latency.histogram("NodeUnprepareResources", DRIVER)

    def prepare(self, claims: Any, api: Any) -> Any:
        try:
            return latency.timed(self.prepare_latency, self._prepare, claims, api)
        finally:
            self.on_change()

    def unprepare(self, claims: Any, api: Any) -> Any:
        try:
            return latency.timed(self.unprepare_latency, self._unprepare, claims, api)
        finally:
            self.on_change()

    def _prepare(self, claims: Any, api: Any) -> Any:
        out = api.NodePrepareResourcesResponse()
        for c in claims:
            ref = ClaimRef(c.namespace, c.uid, c.name)
            answer = out.claims[c.uid]
            try:
                for d in self.claims.prepare(ref):
                    device = answer.devices.add(request_names=d.requests, pool_name=d.pool,
                                                device_name=d.device, cdi_device_ids=d.cdi_ids)
                    if d.share_id and api is v1:  # v1beta1 has no share_id
                        device.share_id = d.share_id
            except AgentError as exc:
                del answer.devices[:]
                answer.error = str(exc)
                log.warning("claim %s/%s (%s) not prepared: %s", c.namespace, c.name, c.uid, exc)
            except Exception as exc:  # the call's boundary: a bug fails this claim alone
                del answer.devices[:]
                answer.error = f"internal error: {exc}"
                log.exception("preparing claim %s/%s (%s) failed unexpectedly", c.namespace,
                              c.name, c.uid)
        return out

    def _unprepare(self, claims: Any, api: Any) -> Any:
        out = api.NodeUnprepareResourcesResponse()
        for c in claims:
            answer = out.claims[c.uid]
            try:
                self.claims.unprepare(ClaimRef(c.namespace, c.uid, c.name))
            except AgentError as exc:
                answer.error = str(exc)
                log.warning("claim %s/%s (%s) not unprepared: %s", c.namespace, c.name, c.uid,
                            exc)
            except Exception as exc:  # the call's boundary: a bug fails this claim alone
                answer.error = f"internal error: {exc}"
                log.exception("unpreparing claim %s/%s (%s) failed unexpectedly", c.namespace,
                              c.name, c.uid)
        return out


class _Servicer:
    """DRAPlugin of one API version (`api`: its messages) over the shared handlers."""

    def __init__(self, handlers: _Handlers, api: Any):
        self.handlers, self.api = handlers, api

    def NodePrepareResources(self, request, context):
        return self.handlers.prepare(request.claims, self.api)

    def NodeUnprepareResources(self, request, context):
        return self.handlers.unprepare(request.claims, self.api)
