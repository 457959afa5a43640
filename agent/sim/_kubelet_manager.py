"""The simulated kubelet's device manager: registrations, ListAndWatch streams, allocation, events.

Owns: what the simulated kubelet knows (per resource: endpoint, options, devices and health,
snapshots, the history of its capacity/allocatable; admitted pods and their devices) and the
rules kubelet's device manager applies (pkg/kubelet/cm/devicemanager, 1.25+): synchronous
dial-back on Register with kubelet's blocking dial and gRPC's reconnect backoff (each dial whose
first attempt failed is kept: failed_dials), one stream per resource that is never restarted,
devices unhealthy when it ends, the allocation order of devicesToAllocate, one
ContainerAllocateRequest per Allocate. Every change is an event. Must not listen on sockets or
change the filesystem (it only dials plugins, and looks whether a socket it failed to dial is
there): `_kubelet_server` does.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import grpc
from google.protobuf import text_format

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from agent._proto.deviceplugin.v1beta1.constants import HEALTHY, SUPPORTED_VERSIONS, UNHEALTHY
from agent._proto.podresources.v1 import api_pb2 as pr
from agent._proto.simkubelet.v1 import control_pb2 as ctl
from agent.errors import SimError
from agent.sim.kubelet import (
    DEFAULT_KUBELET_VERSION,
    DEFAULT_RELIST_AFTER_RESTART_S,
    KUBELET_VERSIONS,
    BadRequest,
    PodExists,
    PodNotFound,
    PodRejected,
    RegistrationRejected,
)

log = logging.getLogger(__name__)

Kind = ctl.Event.Kind
# kubelet bounds PreStartContainer with 30 s; Allocate and GetPreferredAllocation have no bound
# there, but a simulated kubelet that hangs forever helps nobody.
PLUGIN_RPC_TIMEOUT = 30.0
SNAPSHOTS_KEPT = 256
EVENTS_KEPT = 10000
ALLOCATABLE_CHANGES_KEPT = 100_000  # over all resources
# kubelet files devices without NUMA affinity under this pseudo node.
NODE_WITHOUT_TOPOLOGY = -1
FAILED_DIALS_KEPT = 1000
# How kubelet dials a plugin that registers: dial() in pkg/kubelet/cm/devicemanager/plugin/
# v1beta1/client.go is grpc.DialContext with grpc.WithBlock() and a 10 s timeout, so Register
# answers only once the connection is up; an attempt that fails (the socket missing, or nobody
# listening on it) is tried again after grpc-go's reconnect backoff (backoff.DefaultConfig:
# 1 s, then x1.6 each time with 20 % jitter, at most 120 s), about 1 s, then 1.6 s. gRPC C-core
# backs off with the same numbers (src/core/client_channel/subchannel.cc); they are named here
# so that another grpcio keeps the simulation as it is. A local subchannel pool gives each dial
# its own connection and backoff, as each grpc-go ClientConn has: from the global pool, a dial
# would share (and wait out) the backoff of an earlier failed dial to the same path.
DIAL_OPTIONS = [("grpc.enable_http_proxy", 0), ("grpc.use_local_subchannel_pool", 1),
                ("grpc.initial_reconnect_backoff_ms", 1000),
                ("grpc.max_reconnect_backoff_ms", 120_000)]

_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"^{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_REQUESTS_PREFIX = "requests."


def extended_resource_problem(name: str) -> str | None:
    """Why `name` is not an extended resource name (kubelet's IsExtendedResourceName), or None."""
    if "/" not in name:
        return "it has no domain prefix (vendor.example/name); names without one are native resources"
    if "kubernetes.io/" in name:
        return "names in the kubernetes.io/ domain are native resources"
    if name.startswith(_REQUESTS_PREFIX):
        return "names starting with 'requests.' are reserved for resource quota"
    prefix, _, short = (_REQUESTS_PREFIX + name).partition("/")
    if "/" in short:
        return "a qualified name has at most one '/'"
    if len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix):
        return ("the domain prefix must be a DNS-1123 subdomain: lower-case alphanumerics, '-' "
                "and '.', starting and ending with an alphanumeric")
    if not short:
        return "the name after '/' is empty"
    if len(short) > 63:
        return "the name after '/' is longer than 63 characters"
    if not _QUALIFIED_NAME.match(short):
        return ("the name after '/' must be alphanumerics, '-', '_' or '.', starting and ending "
                "with an alphanumeric")
    return None


def now() -> ctl.Time:
    return ctl.Time(wall_ns=time.time_ns(), monotonic_ns=time.monotonic_ns())


def _rpc_error_text(err: grpc.RpcError) -> str:
    """Go's rendering of a gRPC error, as kubelet would put it into its messages."""
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    name = code.name if code is not None else "Unknown"
    return f"rpc error: code = {name} desc = {details}"


class EventLog:
    """Numbered, timestamped events; readers wait for those after a sequence number."""

    def __init__(self, keep: int = EVENTS_KEPT):
        self._cond = threading.Condition()
        self._events: collections.deque[ctl.Event] = collections.deque(maxlen=keep)
        self._seq = 0
        self._closed = False

    @property
    def last_seq(self) -> int:
        with self._cond:
            return self._seq

    def emit(self, kind: int, **fields) -> ctl.Event:
        with self._cond:
            self._seq += 1
            event = ctl.Event(seq=self._seq, time=now(), kind=kind, **fields)
            self._events.append(event)
            self._cond.notify_all()
        log.debug("event %s", text_format.MessageToString(event, as_one_line=True))
        return event

    def after(self, seq: int, timeout: float) -> list[ctl.Event]:
        """Events with seq > `seq` still kept; waits up to `timeout` s for one if there are none."""
        with self._cond:
            self._cond.wait_for(lambda: self._seq > seq or self._closed, timeout)
            out = []
            for event in reversed(self._events):
                if event.seq <= seq:
                    break
                out.append(event)
            return out[::-1]

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


@dataclass(frozen=True)
class FailedDial:
    """A dial to a registering plugin whose first attempt failed: its Register then waited on
    gRPC's reconnect backoff (about 1 s) for the next one."""

    instance: int  # the kubelet instance the Register came to (0, then n after the n-th restart)
    resource: str
    path: str
    socket_there: bool  # the plugin's socket file existed when gRPC reported the failure
    monotonic_ns: int

    @property
    def why(self) -> str:
        return ("nobody accepted a connection on the socket" if self.socket_there
                else "the socket was missing")


@dataclass
class _Endpoint:
    """One accepted registration: the channel to the plugin and its ListAndWatch stream."""

    resource: str
    name: str
    path: str
    registration: int
    channel: grpc.Channel
    stub: dp_grpc.DevicePluginStub
    options: dp.DevicePluginOptions
    call: object = None
    thread: threading.Thread | None = None
    closing_reason: str = ""
    ended: threading.Event = field(default_factory=threading.Event)  # the end was reported

    def close(self, reason: str) -> None:
        """Cancel the stream (its thread then reports the end); the channel closes with it."""
        self.closing_reason = self.closing_reason or reason
        if self.call is not None:
            self.call.cancel()
        else:
            self.channel.close()


@dataclass
class _Resource:
    """kubelet's knowledge of one resource; outlives endpoints and restarts."""

    name: str
    endpoint: _Endpoint | None = None  # the registration Allocate goes to
    # earlier registrations whose streams still run (a second plugin registered the resource)
    others: list[_Endpoint] = field(default_factory=list)
    endpoint_name: str = ""
    options: dp.DevicePluginOptions | None = None
    registrations: int = 0
    # device id -> (health as kubelet sees it, NUMA nodes)
    devices: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    snapshot_seq: int = 0
    snapshots: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=SNAPSHOTS_KEPT))
    registered: ctl.Time | None = None
    stream_end_reason: str = ""
    # (capacity, allocatable) of the resource's latest AllocatableChange; None before one.
    recorded: tuple[int, int] | None = None

    def healthy(self) -> set[str]:
        return {d for d, (health, _) in self.devices.items() if health == HEALTHY}

    def counts(self) -> tuple[int, int]:
        """(capacity, allocatable) as kubelet's GetCapacity reports them: all devices, healthy ones."""
        return len(self.devices), len(self.healthy())


@dataclass
class _PodRecord:
    pod: ctl.Pod
    # (container, resource) -> NUMA node -> device ids, as kubelet checkpoints them at allocation
    by_numa: dict[tuple[str, str], dict[int, list[str]]] = field(default_factory=dict)

    def device_ids(self, resource: str) -> list[str]:
        return [d for c in self.pod.containers for r in c.resources if r.resource_name == resource
                for d in r.device_ids]


class DeviceManager:
    """The device manager of one simulated kubelet. Thread-safe; plugin RPCs run unlocked."""

    def __init__(self, directory: str, dial_timeout: float,
                 kubelet_version: str = DEFAULT_KUBELET_VERSION,
                 relist_after_restart: float = DEFAULT_RELIST_AFTER_RESTART_S):
        if kubelet_version not in KUBELET_VERSIONS:
            raise SimError(f"kubelet version {kubelet_version!r}: the simulated kubelet "
                           f"behaves as {' or '.join(KUBELET_VERSIONS)}")
        self.dir = directory
        self.dial_timeout = dial_timeout
        # how a second registration of one resource is handled: "1.36" (and older) replace
        # the first and let its stream run on; "1.37" keeps one endpoint per socket
        self.kubelet_version = kubelet_version
        # a restarted kubelet lists its pods in podresources only once it has read them from
        # the API server again: none until this monotonic time
        self.relist_after_restart = relist_after_restart
        self._pods_listed_from = 0.0
        self.events = EventLog()
        self.started = now()
        self.restarts = 0
        self.registration_failures = 0
        self._lock = threading.RLock()
        self._admit_lock = threading.Lock()  # kubelet admits one pod at a time
        self._resources: dict[str, _Resource] = {}
        self._pods: dict[tuple[str, str], _PodRecord] = {}
        # Bumped when kubelet "goes away": a Register still dialling from before is refused.
        self._generation = 0
        self._changes: collections.deque[ctl.AllocatableChange] = collections.deque(
            maxlen=ALLOCATABLE_CHANGES_KEPT)
        self._change_seq = 0
        self._failed_dials: collections.deque[FailedDial] = collections.deque(
            maxlen=FAILED_DIALS_KEPT)

    # -- registration and streams --------------------------------------------------------------

    @property
    def generation(self) -> int:
        """Which kubelet instance's life this is (a restart or stop ends one)."""
        with self._lock:
            return self._generation

    def register(self, req: dp.RegisterRequest, generation: int) -> None:
        """kubelet's Register, received by the instance of `generation` (its server's): raise RegistrationRejected with its reason, or return once the
        plugin is dialled, its options read and its ListAndWatch stream opened. A Register the
        old instance took just before a restart is refused, not dialled and counted as the new
        instance's: a real kubelet's process ends with its calls."""
        resource, endpoint = req.resource_name, req.endpoint
        with self._lock:
            if generation != self._generation:
                self._reject(req, "kubelet restarted or stopped after this registration came; "
                                  "register again")
            instance = self.restarts
        log.info("registration request: resource %s, endpoint %s, version %s",
                 resource, endpoint, req.version)
        if req.version not in SUPPORTED_VERSIONS:
            self._reject(req, f"requested API version {req.version!r} is not supported by kubelet. "
                              f"Supported versions are {list(SUPPORTED_VERSIONS)}")
        problem = extended_resource_problem(resource)
        if problem:
            self._reject(req, f"the ResourceName {resource!r} is invalid: {problem}")

        path = f"{self.dir.rstrip('/')}/{endpoint}"
        channel, failed = self._dial(resource, path, instance)
        if channel is None:
            self._reject(req, f"failed to dial device plugin: context deadline exceeded: nothing "
                              f"accepted a connection on {path} within {self.dial_timeout:g} s "
                              "(a plugin must serve before it registers)")
        stub = dp_grpc.DevicePluginStub(channel)
        try:
            options = stub.GetDevicePluginOptions(dp.Empty(), timeout=self.dial_timeout)
        except grpc.RpcError as err:
            channel.close()
            self._reject(req, f"failed to get device plugin options: {_rpc_error_text(err)}")

        with self._lock:
            if generation != self._generation:
                channel.close()
                self._reject(req, "kubelet restarted or stopped while this registration was "
                                  "dialling the plugin; register again")
            res = self._resources.setdefault(resource, _Resource(resource))
            old = res.endpoint
            if self.kubelet_version == "1.37" and any(
                    e.path == path for e in [old, *res.others] if e is not None):
                channel.close()  # 1.37's PluginConnected: one endpoint per socket path
                self._reject(req, f"device plugin already connected: {path}")
            if old is not None:  # its stream runs on (kubelet does not close it)
                res.others.append(old)
            res.registrations += 1
            ep = _Endpoint(resource, endpoint, path, res.registrations, channel, stub, options)
            res.endpoint, res.endpoint_name, res.options = ep, endpoint, options
            res.registered, res.stream_end_reason = now(), ""
            ep.call = stub.ListAndWatch(dp.Empty())
            ep.thread = threading.Thread(target=self._watch, args=(ep,), daemon=True,
                                         name=f"listandwatch-{resource}-{ep.registration}")
            self._record_change(res, Kind.REGISTERED, ep.registration, res.registered)
            waited = f"; the dial waited on gRPC's reconnect backoff ({failed.why})" \
                if failed else ""
            self.events.emit(Kind.REGISTERED, resource_name=resource, endpoint=endpoint,
                             message=f"registration {ep.registration}; options: "
                                     f"pre_start_required={options.pre_start_required} "
                                     f"get_preferred_allocation_available="
                                     f"{options.get_preferred_allocation_available}{waited}")
            ep.thread.start()
        log.info("registered resource %s at %s (registration %d)", resource, path, ep.registration)
        if old is not None:
            log.info("resource %s registered again: registration %d answers Allocate; the "
                     "stream of registration %d runs on", resource, ep.registration,
                     old.registration)

    def _dial(self, resource: str, path: str, instance: int
              ) -> tuple[grpc.Channel | None, FailedDial | None]:
        """kubelet's blocking dial of a registering plugin (DIAL_OPTIONS): the channel once
        connected, or None after dial_timeout; and the failed first attempt, if there was one
        (logged and kept in failed_dials() as it happens)."""
        channel = grpc.insecure_channel(f"unix:{path}", options=DIAL_OPTIONS)
        ready = threading.Event()
        failed: list[FailedDial] = []

        def on_state(state: grpc.ChannelConnectivity) -> None:  # gRPC's thread, one at a time
            if state is grpc.ChannelConnectivity.READY:
                ready.set()
            elif state is grpc.ChannelConnectivity.TRANSIENT_FAILURE and not failed:
                # later attempts fail silently: gRPC stays in TRANSIENT_FAILURE until READY
                dial = FailedDial(instance, resource, path, os.path.exists(path),
                                  time.monotonic_ns())
                failed.append(dial)
                with self._lock:
                    self._failed_dials.append(dial)
                log.info("dialling %s for resource %s failed: %s; gRPC tries again after its "
                         "reconnect backoff (about 1 s)", path, resource, dial.why)

        channel.subscribe(on_state, try_to_connect=True)
        try:
            up = ready.wait(self.dial_timeout)
        finally:
            channel.unsubscribe(on_state)
        if not up:
            channel.close()
        return (channel if up else None), (failed[0] if failed else None)

    def failed_dials(self, instance: int | None = None) -> list[FailedDial]:
        """Dials to registering plugins whose first attempt failed, oldest first (the newest
        1,000 are kept); of one kubelet instance if given."""
        with self._lock:
            return [d for d in self._failed_dials if instance is None or d.instance == instance]

    def _reject(self, req: dp.RegisterRequest, reason: str) -> None:
        with self._lock:
            self.registration_failures += 1
        self.events.emit(Kind.REGISTRATION_FAILED, resource_name=req.resource_name,
                         endpoint=req.endpoint, message=reason)
        log.info("registration of %r refused: %s", req.resource_name, reason)
        raise RegistrationRejected(reason)

    def _watch(self, ep: _Endpoint) -> None:
        reason = "the device plugin closed the ListAndWatch stream"
        try:
            for response in ep.call:
                self._on_snapshot(ep, response)
        except grpc.RpcError as err:
            reason = f"ListAndWatch ended: {_rpc_error_text(err)}"
        finally:
            try:
                self._on_stream_end(ep, ep.closing_reason or reason)
            finally:
                ep.ended.set()
                # after the report: within 0.2 s of the dial's connectivity watch, closing
                # the channel waits that long for gRPC's watcher thread
                ep.channel.close()

    def _on_snapshot(self, ep: _Endpoint, response: dp.ListAndWatchResponse) -> None:
        with self._lock:
            res = self._resources.get(ep.resource)
            if res is None or (res.endpoint is not ep and ep not in res.others):
                return  # a stream being closed; kubelet no longer listens to it
            # any open stream of the resource replaces its device list, the replaced
            # registration's too (kubelet's callback goes by resource name)
            res.devices = {
                d.ID: (HEALTHY if d.health == HEALTHY else UNHEALTHY,
                       tuple(n.ID for n in d.topology.nodes))
                for d in response.devices
            }
            res.snapshot_seq += 1
            capacity, allocatable = res.counts()
            snapshot = ctl.Snapshot(
                resource_name=ep.resource, seq=res.snapshot_seq, received=now(),
                registration=ep.registration,
                devices=[ctl.DeviceState(id=d.ID, health=d.health,
                                         numa_nodes=[n.ID for n in d.topology.nodes])
                         for d in response.devices],
                capacity=capacity, allocatable=allocatable,
            )
            res.snapshots.append(snapshot)
            self._record_change(res, Kind.SNAPSHOT, ep.registration, snapshot.received)
            self.events.emit(Kind.SNAPSHOT, resource_name=ep.resource, endpoint=ep.name,
                             snapshot=snapshot)
        log.info("resource %s: snapshot %d, capacity %d, allocatable %d", ep.resource,
                 snapshot.seq, snapshot.capacity, snapshot.allocatable)
        log.debug("resource %s snapshot %d devices: %s", ep.resource, snapshot.seq,
                  [(d.id, d.health, list(d.numa_nodes)) for d in snapshot.devices])

    def _on_stream_end(self, ep: _Endpoint, reason: str) -> None:
        """kubelet's runClient after a stream ended (plugin/v1beta1/handler.go). Up to 1.36 it
        disconnects the resource's client by name: the registration that answers now, also
        when the stream that ended belongs to one it replaced. 1.37 disconnects that stream's
        own endpoint, and the resource turns unhealthy only when it was the last one."""
        dropped = None
        with self._lock:
            res = self._resources.get(ep.resource)
            replaced = res is not None and ep in res.others
            if replaced:
                res.others.remove(ep)
            if res is not None and res.endpoint is ep and self.kubelet_version == "1.37" \
                    and res.others:
                res.endpoint = res.others.pop()
                reason += (f"; registration {res.endpoint.registration} of the same resource "
                           f"answers from now on")
            elif res is not None and (res.endpoint is ep or (
                    replaced and self.kubelet_version == "1.36" and res.endpoint is not None)):
                dropped = res.endpoint if res.endpoint is not ep else None
                registration = res.endpoint.registration
                res.endpoint = None
                res.stream_end_reason = reason
                res.devices = {d: (UNHEALTHY, numa) for d, (_, numa) in res.devices.items()}
                self._record_change(res, Kind.STREAM_ENDED, registration)
                if dropped is not None:
                    reason += (f"; kubelet 1.36 and older then disconnect the registration "
                               f"that replaced it ({registration})")
                reason += "; all its devices are now unhealthy until the plugin registers again"
            self.events.emit(Kind.STREAM_ENDED, resource_name=ep.resource, endpoint=ep.name,
                             message=reason)
        log.info("resource %s: ListAndWatch stream of registration %d ended: %s",
                 ep.resource, ep.registration, reason)
        if dropped is not None:
            dropped.close("kubelet disconnected it: the stream of a registration it replaced "
                          "ended")

    # The allocatable history is what kubelet 1.32's device manager reports through GetCapacity
    # (pkg/kubelet/cm/devicemanager/manager.go): capacity = healthy + unhealthy devices,
    # allocatable = healthy devices, and these change only where it changes those sets:
    # - genericDeviceUpdateCallback (each ListAndWatchResponse) replaces both sets with the
    #   response's devices: SNAPSHOT, recorded when the counts differ from the last entry.
    # - PluginDisconnected -> markResourceUnhealthy, when the stream ends (plugin/v1beta1/
    #   handler.go runClient -> disconnectClient -> client.go Disconnect), moves every healthy
    #   device to unhealthy: capacity stays, allocatable 0 (STREAM_ENDED). kubelet then drops
    #   the resource from node status after endpointStopGracePeriod (5 min): not simulated.
    # - A new kubelet's readCheckpoint gives every checkpointed resource empty sets and a
    #   stopped endpoint: capacity and allocatable 0 until a snapshot after re-registration
    #   (RESTARTED, recorded always, so that every instance shows up per resource).
    # - PluginConnected (an accepted Register) only stores the endpoint; the sets change with the
    #   new stream's first response. REGISTERED entries, recorded always, carry the counts as
    #   they stand (0/0 for a resource kubelet has no devices of yet; kubelet leaves such a
    #   resource out of node status).

    def _record_change(self, res: _Resource, cause: int, registration: int,
                       when: ctl.Time | None = None) -> None:
        """Append res's counts to the allocatable history (caller holds the lock); `cause` is
        the Event kind that changed them."""
        counts = res.counts()
        if cause in (Kind.SNAPSHOT, Kind.STREAM_ENDED) and counts == res.recorded:
            return
        res.recorded = counts
        self._change_seq += 1
        self._changes.append(ctl.AllocatableChange(
            seq=self._change_seq, resource_name=res.name, cause=cause, time=when or now(),
            capacity=counts[0], allocatable=counts[1], instance=self.restarts,
            registration=registration))

    def allocatable_history(self, resource: str = "", after_seq: int = 0
                            ) -> list[ctl.AllocatableChange]:
        """Kept AllocatableChanges with seq > after_seq, of `resource` (all when empty)."""
        with self._lock:
            return [c for c in self._changes if c.seq > after_seq
                    and (not resource or c.resource_name == resource)]

    def drop_endpoints(self, reason: str, wait: float = 5.0) -> list[_Endpoint]:
        """Close every stream (kubelet going away) and wait up to `wait` s for their threads to
        report; returns the endpoints closed, for join_streams to wait on later."""
        with self._lock:
            self._generation += 1
            endpoints = [e for r in self._resources.values()
                         for e in [r.endpoint, *r.others] if e is not None]
            for res in self._resources.values():
                res.others = []
                if res.endpoint is not None:
                    res.endpoint = None
                    res.stream_end_reason = reason
        for ep in endpoints:
            ep.close(reason)
        self.join_streams(endpoints, wait)
        return endpoints

    @staticmethod
    def join_streams(endpoints: list[_Endpoint], wait: float = 5.0) -> None:
        """Wait up to `wait` s for the threads of closed streams to report their end."""
        deadline = time.monotonic() + wait
        for ep in endpoints:
            if ep.thread is not None:
                ep.ended.wait(max(0.0, deadline - time.monotonic()))

    def restarted(self, removed_sockets: list[str]) -> int:
        """State after a kubelet restart: devices forgotten until plugins register again (kubelet
        reads only its checkpoint: pods and their devices survive), streams gone."""
        with self._lock:
            self.restarts += 1
            restarts = self.restarts
            self._pods_listed_from = time.monotonic() + self.relist_after_restart
            for res in self._resources.values():
                res.endpoint, res.endpoint_name, res.options = None, "", None
                res.others = []
                res.devices = {}
                res.stream_end_reason = res.stream_end_reason or "kubelet restarted"
                self._record_change(res, Kind.RESTARTED, res.registrations)
        self.events.emit(Kind.RESTARTED, message=f"restart {restarts}; removed sockets: "
                                                 f"{', '.join(removed_sockets) or '(none)'}")
        log.info("simulated kubelet restarted (%d); removed sockets %s", restarts, removed_sockets)
        return restarts

    def close(self) -> None:
        self.drop_endpoints("kubelet stopped")
        self.events.close()

    # -- pods ----------------------------------------------------------------------------------

    def admit_pod(self, req: ctl.AdmitPodRequest) -> ctl.Pod:
        """Admit a pod as kubelet does, or raise PodRejected with kubelet's reason."""
        namespace = req.namespace or "default"
        self._validate(req)
        with self._admit_lock:
            with self._lock:
                if (namespace, req.name) in self._pods:
                    raise PodExists(f"pod {namespace}/{req.name} is already admitted")
            pod = ctl.Pod(name=req.name, namespace=namespace, uid=req.uid or str(uuid.uuid4()))
            record = _PodRecord(pod)
            try:
                self._check_node_fits(req)
                for creq in req.containers:
                    container = pod.containers.add(name=creq.name)
                    for resource in sorted(creq.requests):
                        needed = creq.requests[resource]
                        if needed == 0 or not self._is_device_plugin_resource(resource):
                            continue
                        alloc = self._allocate(record, creq.name, resource, needed)
                        container.resources.append(alloc)
            except PodRejected as err:
                self.events.emit(Kind.POD_REJECTED, pod_namespace=namespace, pod_name=req.name,
                                 message=str(err))
                log.info("pod %s/%s rejected: %s", namespace, req.name, err)
                raise
            pod.admitted.CopyFrom(now())
            with self._lock:
                self._pods[(namespace, req.name)] = record
            for container in pod.containers:
                for alloc in container.resources:
                    self.events.emit(Kind.ALLOCATED, pod_namespace=namespace, pod_name=req.name,
                                     container_name=container.name,
                                     resource_name=alloc.resource_name, device_ids=alloc.device_ids)
                    log.info("pod %s/%s container %s: allocated %s %s", namespace, req.name,
                             container.name, alloc.resource_name, list(alloc.device_ids))
            return pod

    @staticmethod
    def _validate(req: ctl.AdmitPodRequest) -> None:
        if not req.name:
            raise BadRequest("a pod needs a name")
        if not req.containers:
            raise BadRequest(f"pod {req.name} has no containers")
        names = [c.name for c in req.containers]
        if "" in names or len(set(names)) != len(names):
            raise BadRequest(f"pod {req.name}: container names must be non-empty and unique: {names}")
        for c in req.containers:
            for resource, count in c.requests.items():
                if count < 0:
                    raise BadRequest(f"pod {req.name} container {c.name}: {resource}={count} "
                                     "is negative")

    def _is_device_plugin_resource(self, resource: str) -> bool:
        with self._lock:
            return resource in self._resources or any(
                r.device_ids(resource) for r in self._pods.values())

    def _check_node_fits(self, req: ctl.AdmitPodRequest) -> None:
        """kubelet's predicate admission for extended resources no plugin ever registered."""
        totals: dict[str, int] = collections.Counter()
        for c in req.containers:
            for resource, count in c.requests.items():
                if count and extended_resource_problem(resource) is None:
                    totals[resource] += count
        for resource, requested in sorted(totals.items()):
            if not self._is_device_plugin_resource(resource):
                raise PodRejected(
                    f"pod {req.namespace or 'default'}/{req.name} rejected (OutOf{resource}): "
                    f"Node didn't have enough resource: {resource}, requested: {requested}, "
                    "used: 0, capacity: 0")

    def _allocate(self, record: _PodRecord, container: str, resource: str,
                  needed: int) -> ctl.ResourceAllocation:
        """devicesToAllocate + Allocate (+ PreStartContainer) for one container and resource."""
        pod = record.pod

        def reject(reason: str) -> PodRejected:
            return PodRejected(f"pod {pod.namespace}/{pod.name} rejected (UnexpectedAdmissionError)"
                               f": Allocate failed due to {reason}, which is unexpected")

        with self._lock:
            res = self._resources[resource]
            healthy = res.healthy()
            if res.registrations == 0:
                raise reject(f"cannot allocate unregistered device {resource}")
            if not healthy:
                raise reject(f"no healthy devices present; cannot allocate unhealthy devices "
                             f"{resource}")
            in_use = {d for r in self._pods.values() for d in r.device_ids(resource)}
            in_use.update(record.device_ids(resource))  # earlier containers of this pod
            available = sorted(healthy - in_use)
            if len(available) < needed:
                raise reject(f"requested number of devices unavailable for {resource}. "
                             f"Requested: {needed}, Available: {len(available)}")
            ep = res.endpoint
            if ep is None:
                raise reject(f"endpoint not found in cache for a registered resource: {resource}")
            numa = {d: res.devices[d][1] for d in available}

        alloc = ctl.ResourceAllocation(resource_name=resource)
        chosen: list[str] = []

        def take(candidates) -> None:
            for d in candidates:
                if len(chosen) == needed:
                    return
                if d in numa and d not in chosen:
                    chosen.append(d)

        # No topology-manager hint in the simulation, so every available device is "no affinity"
        # and kubelet asks the plugin whenever the plugin offers GetPreferredAllocation.
        if ep.options.get_preferred_allocation_available:
            request = dp.PreferredAllocationRequest(container_requests=[
                dp.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available, must_include_deviceIDs=[],
                    allocation_size=needed)])
            try:
                response = ep.stub.GetPreferredAllocation(request, timeout=PLUGIN_RPC_TIMEOUT)
            except grpc.RpcError as err:
                raise reject(f"device plugin GetPreferredAllocation rpc failed with err: "
                             f"{_rpc_error_text(err)}") from None
            alloc.preferred_called = True
            if response.container_responses:
                alloc.preferred_device_ids.extend(response.container_responses[0].deviceIDs)
            take(alloc.preferred_device_ids)
        take(available)
        alloc.device_ids.extend(chosen)

        request = dp.AllocateRequest(container_requests=[
            dp.ContainerAllocateRequest(devices_ids=chosen)])
        try:
            response = ep.stub.Allocate(request, timeout=PLUGIN_RPC_TIMEOUT)
        except grpc.RpcError as err:
            raise reject(f"device plugin Allocate rpc failed with err: {_rpc_error_text(err)}") \
                from None
        if not response.container_responses:
            raise reject(f"no containers return in allocation response {response}")
        alloc.allocate_response.CopyFrom(response)

        if ep.options.pre_start_required:
            try:
                ep.stub.PreStartContainer(dp.PreStartContainerRequest(devices_ids=chosen),
                                          timeout=PLUGIN_RPC_TIMEOUT)
            except grpc.RpcError as err:
                raise reject(f"device plugin PreStartContainer rpc failed with err: "
                             f"{_rpc_error_text(err)}") from None
            alloc.pre_start_called = True

        by_numa: dict[int, list[str]] = {}
        for d in chosen:
            for node in numa[d] or (NODE_WITHOUT_TOPOLOGY,):
                by_numa.setdefault(node, []).append(d)
        record.by_numa[(container, resource)] = by_numa
        return alloc

    def delete_pod(self, name: str, namespace: str = "") -> ctl.Pod:
        namespace = namespace or "default"
        with self._lock:
            record = self._pods.pop((namespace, name), None)
        if record is None:
            raise PodNotFound(f"pod {name} in namespace {namespace} not found")
        freed = [d for c in record.pod.containers for r in c.resources for d in r.device_ids]
        self.events.emit(Kind.POD_DELETED, pod_namespace=namespace, pod_name=name,
                         device_ids=freed, message=f"freed {len(freed)} devices")
        log.info("pod %s/%s deleted; freed %s", namespace, name, freed)
        return record.pod

    # -- views ---------------------------------------------------------------------------------

    def state(self) -> ctl.State:
        with self._lock:
            state = ctl.State(restarts=self.restarts, started=self.started,
                              last_event_seq=self.events.last_seq,
                              registration_failures=self.registration_failures)
            for name in sorted(self._resources):
                res = self._resources[name]
                allocated = {d for r in self._pods.values() for d in r.device_ids(name)}
                rs = state.resources.add(
                    resource_name=name, endpoint=res.endpoint_name,
                    registrations=res.registrations, connected=res.endpoint is not None,
                    capacity=len(res.devices), allocatable=len(res.healthy()),
                    stream_end_reason=res.stream_end_reason, allocated=len(allocated),
                )
                if res.options is not None:
                    rs.options.CopyFrom(res.options)
                if res.registered is not None:
                    rs.registered.CopyFrom(res.registered)
                if res.snapshots:
                    rs.latest_snapshot.CopyFrom(res.snapshots[-1])
                for dev_id in sorted(res.devices):
                    health, numa = res.devices[dev_id]
                    rs.devices.add(id=dev_id, health=health, numa_nodes=numa,
                                   allocated=dev_id in allocated)
            for key in sorted(self._pods):
                state.pods.append(self._pods[key].pod)
        return state

    def snapshots(self, resource: str, after_seq: int = 0) -> list[ctl.Snapshot]:
        with self._lock:
            res = self._resources.get(resource)
            return [s for s in (res.snapshots if res else []) if s.seq > after_seq]

    def _container_devices(self, record: _PodRecord, container: str) -> list[pr.ContainerDevices]:
        out = []
        for (cname, resource), by_numa in sorted(record.by_numa.items()):
            if cname != container:
                continue
            for node in sorted(by_numa):
                cd = pr.ContainerDevices(resource_name=resource, device_ids=by_numa[node])
                if node != NODE_WITHOUT_TOPOLOGY:
                    cd.topology.nodes.add(ID=node)
                out.append(cd)
        return out

    def _pod_resources(self, record: _PodRecord) -> pr.PodResources:
        pod = record.pod
        return pr.PodResources(name=pod.name, namespace=pod.namespace, containers=[
            pr.ContainerResources(name=c.name, devices=self._container_devices(record, c.name))
            for c in pod.containers
        ])

    def _pods_known(self) -> bool:
        """False while a restarted kubelet has not read its pods again (podresources lists
        none meanwhile, as kubelet's pod manager is empty until then)."""
        return time.monotonic() >= self._pods_listed_from

    def list_pod_resources(self) -> pr.ListPodResourcesResponse:
        with self._lock:
            if not self._pods_known():
                return pr.ListPodResourcesResponse()
            return pr.ListPodResourcesResponse(
                pod_resources=[self._pod_resources(self._pods[k]) for k in sorted(self._pods)])

    def get_pod_resources(self, name: str, namespace: str) -> pr.GetPodResourcesResponse:
        with self._lock:
            record = self._pods.get((namespace, name)) if self._pods_known() else None
            if record is None:
                raise PodNotFound(f"pod {name} in namespace {namespace} not found")
            return pr.GetPodResourcesResponse(pod_resources=self._pod_resources(record))

    def allocatable_resources(self) -> pr.AllocatableResourcesResponse:
        """Healthy devices, one entry per device and NUMA node (kubelet's GetAllocatableResources)."""
        out = pr.AllocatableResourcesResponse()
        with self._lock:
            for name in sorted(self._resources):
                res = self._resources[name]
                for dev_id in sorted(res.healthy()):
                    numa = res.devices[dev_id][1]
                    if not numa:
                        out.devices.add(resource_name=name, device_ids=[dev_id])
                    for node in numa:
                        cd = out.devices.add(resource_name=name, device_ids=[dev_id])
                        cd.topology.nodes.add(ID=node)
        return out


def watch_events(events: EventLog, after_seq: int, active: Callable[[], bool],
                 poll: float = 0.25):
    """Yield events after `after_seq` as they come, while `active()` and the log is open."""
    seq = after_seq
    while active() and not events.closed:
        for event in events.after(seq, poll):
            seq = event.seq
            yield event
