"""SimKubeletClient: the control API of a simulated kubelet, as plain Python objects.

Owns: the client used by tests, the demo and the benchmarks (`SimKubeletClient(dir)`), the
read-only views of what the kubelet knows (`KubeletState` and its parts, the allocatable history
and what it says: zero windows, registrations per kubelet instance), bounded waiting
(`wait_for`, `wait_for_event`, `wait_ready`), and turning gRPC errors back into the errors of
agent.sim.kubelet. Must not change what the kubelet does: every action is one control RPC.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Callable

import grpc

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1.constants import HEALTHY
from agent._proto.simkubelet.v1 import control_pb2 as ctl
from agent._proto.simkubelet.v1 import control_pb2_grpc as ctl_grpc
from agent.sim.kubelet import (
    BadRequest,
    PodExists,
    PodNotFound,
    PodRejected,
    SimKubeletError,
    control_socket_path,
)

EventKind = ctl.Event.Kind
_ERRORS = {cls.grpc_code: cls for cls in (PodRejected, PodNotFound, PodExists, BadRequest)}


@dataclass(frozen=True)
class DeviceState:
    id: str
    health: str
    numa_nodes: tuple[int, ...]
    allocated: bool

    @property
    def healthy(self) -> bool:
        return self.health == HEALTHY


@dataclass(frozen=True)
class ResourceState:
    """One resource as kubelet sees it: registration, stream, devices, capacity/allocatable."""

    name: str
    endpoint: str
    pre_start_required: bool
    get_preferred_allocation_available: bool
    registrations: int
    connected: bool
    capacity: int
    allocatable: int
    allocated: int
    snapshot_seq: int
    devices: tuple[DeviceState, ...]
    stream_end_reason: str
    registered_ns: int
    last_snapshot_ns: int
    # The newest ListAndWatchResponse as sent (health as the plugin said it); None before one.
    latest_snapshot: ctl.Snapshot | None = None

    def device(self, device_id: str) -> DeviceState | None:
        return next((d for d in self.devices if d.id == device_id), None)

    @property
    def healthy_ids(self) -> tuple[str, ...]:
        return tuple(d.id for d in self.devices if d.healthy)

    def describe(self) -> str:
        stream = "stream open" if self.connected else \
            f"no stream ({self.stream_end_reason or 'never registered'})"
        devices = ", ".join(f"{d.id}:{d.health}@numa{list(d.numa_nodes)}"
                            f"{'*' if d.allocated else ''}" for d in self.devices)
        return (f"{self.name}: endpoint {self.endpoint or '-'}, registrations "
                f"{self.registrations}, {stream}, capacity {self.capacity}, allocatable "
                f"{self.allocatable}, allocated {self.allocated}, snapshot #{self.snapshot_seq}"
                f"\n    devices: {devices or '(none)'}")


@dataclass(frozen=True)
class Allocation:
    """What one container got of one resource, and how kubelet got it."""

    resource: str
    device_ids: tuple[str, ...]
    allocate_response: dp.AllocateResponse
    preferred_called: bool
    preferred_device_ids: tuple[str, ...]
    pre_start_called: bool

    @property
    def container_response(self) -> dp.ContainerAllocateResponse:
        """The first container response: the only one kubelet uses."""
        return self.allocate_response.container_responses[0]


@dataclass(frozen=True)
class ContainerState:
    name: str
    allocations: tuple[Allocation, ...]

    def allocation(self, resource: str) -> Allocation | None:
        return next((a for a in self.allocations if a.resource == resource), None)

    def devices(self, resource: str) -> tuple[str, ...]:
        a = self.allocation(resource)
        return a.device_ids if a else ()


@dataclass(frozen=True)
class PodState:
    name: str
    namespace: str
    uid: str
    containers: tuple[ContainerState, ...]
    admitted_ns: int

    def container(self, name: str) -> ContainerState | None:
        return next((c for c in self.containers if c.name == name), None)

    def devices(self, resource: str) -> tuple[str, ...]:
        """Every device of `resource` held by the pod, containers in order."""
        return tuple(d for c in self.containers for d in c.devices(resource))

    def describe(self) -> str:
        lines = [f"pod {self.namespace}/{self.name} (uid {self.uid})"]
        for c in self.containers:
            held = "; ".join(f"{a.resource}: {', '.join(a.device_ids)}" for a in c.allocations)
            lines.append(f"  container {c.name}: {held or 'no devices'}")
        return "\n".join(lines)


@dataclass(frozen=True)
class KubeletState:
    """Everything the simulated kubelet knows at one moment (GetState)."""

    dir: str
    kubelet_socket: str
    podresources_socket: str
    control_socket: str
    restarts: int
    resources: Mapping[str, ResourceState]
    pods: tuple[PodState, ...]
    last_event_seq: int
    registration_failures: int

    def resource(self, name: str) -> ResourceState | None:
        return self.resources.get(name)

    @property
    def registrations(self) -> tuple[ResourceState, ...]:
        """Resources whose plugin is registered now (its ListAndWatch stream is open)."""
        return tuple(r for r in self.resources.values() if r.connected)

    def pod(self, name: str, namespace: str = "default") -> PodState | None:
        return next((p for p in self.pods if p.name == name and p.namespace == namespace), None)

    def describe(self) -> str:
        lines = [f"simulated kubelet in {self.dir}: {self.restarts} restarts, "
                 f"{self.registration_failures} refused registrations, last event "
                 f"#{self.last_event_seq}"]
        lines += [f"  {r.describe()}" for r in self.resources.values()] or ["  no resources"]
        lines += [f"  {p.describe()}".replace("\n", "\n  ") for p in self.pods] or ["  no pods"]
        return "\n".join(lines)


def _allocation(msg: ctl.ResourceAllocation) -> Allocation:
    return Allocation(msg.resource_name, tuple(msg.device_ids), msg.allocate_response,
                      msg.preferred_called, tuple(msg.preferred_device_ids), msg.pre_start_called)


def pod_state(msg: ctl.Pod) -> PodState:
    return PodState(msg.name, msg.namespace, msg.uid, tuple(
        ContainerState(c.name, tuple(_allocation(a) for a in c.resources))
        for c in msg.containers), msg.admitted.wall_ns)


def kubelet_state(msg: ctl.State) -> KubeletState:
    resources = {
        r.resource_name: ResourceState(
            r.resource_name, r.endpoint, r.options.pre_start_required,
            r.options.get_preferred_allocation_available, r.registrations, r.connected,
            r.capacity, r.allocatable, r.allocated, r.latest_snapshot.seq,
            tuple(DeviceState(d.id, d.health, tuple(d.numa_nodes), d.allocated)
                  for d in r.devices),
            r.stream_end_reason, r.registered.wall_ns, r.latest_snapshot.received.wall_ns,
            r.latest_snapshot if r.HasField("latest_snapshot") else None)
        for r in msg.resources
    }
    return KubeletState(msg.dir, msg.kubelet_socket, msg.podresources_socket,
                        msg.control_socket, msg.restarts, resources,
                        tuple(pod_state(p) for p in msg.pods), msg.last_event_seq,
                        msg.registration_failures)


@dataclass(frozen=True)
class AllocatableChange:
    """One entry of kubelet's allocatable history (GetAllocatableHistory); times are ns."""

    seq: int
    resource: str
    # What changed the counts: cause_name() of the Event kind SNAPSHOT, STREAM_ENDED,
    # RESTARTED or REGISTERED ("snapshot", "stream-ended", "restarted", "registered").
    cause: str
    wall_ns: int
    monotonic_ns: int
    capacity: int
    allocatable: int
    # The kubelet instance (0 from the start, n after the n-th restart) and the registration.
    instance: int
    registration: int


@dataclass(frozen=True)
class ZeroWindow:
    """A stretch in which a resource's allocatable was 0 after having been above 0."""

    start: AllocatableChange  # the entry that took allocatable to 0
    end: AllocatableChange | None  # the entry that took it above 0 again; None: still 0

    @property
    def duration_ns(self) -> int | None:
        """Monotonic ns from start to end; None while it lasts."""
        return None if self.end is None else self.end.monotonic_ns - self.start.monotonic_ns


def cause_name(kind: int) -> str:
    """AllocatableChange.cause for an Event kind: EventKind.STREAM_ENDED -> "stream-ended"."""
    return EventKind.Name(kind).lower().replace("_", "-")


def allocatable_change(msg: ctl.AllocatableChange) -> AllocatableChange:
    return AllocatableChange(msg.seq, msg.resource_name, cause_name(msg.cause), msg.time.wall_ns,
                             msg.time.monotonic_ns, msg.capacity, msg.allocatable, msg.instance,
                             msg.registration)


def zero_windows(changes: list[AllocatableChange], since_ns: int = 0) -> list[ZeroWindow]:
    """The zero windows in one resource's history (oldest first) that begin at or after
    `since_ns` (CLOCK_MONOTONIC, e.g. time.monotonic_ns()). A resource that has not been above
    0 yet (new, or only 0 since the oldest kept entry) has none."""
    windows: list[ZeroWindow] = []
    start: AllocatableChange | None = None
    was_up = False
    for change in changes:
        if change.allocatable == 0 and was_up and start is None:
            start = change
        elif change.allocatable > 0:
            if start is not None and start.monotonic_ns >= since_ns:
                windows.append(ZeroWindow(start, change))
            start, was_up = None, True
    if start is not None and start.monotonic_ns >= since_ns:
        windows.append(ZeroWindow(start, None))
    return windows


_REGISTERED = cause_name(EventKind.REGISTERED)


def registrations_per_instance(changes: list[AllocatableChange]) -> dict[int, int]:
    """kubelet instance -> accepted registrations in it, from one resource's history; every
    instance the history shows (each restart marks one) is present, 0 where none."""
    counts: dict[int, int] = {}
    for change in changes:
        counts.setdefault(change.instance, 0)
        if change.cause == _REGISTERED:
            counts[change.instance] += 1
    return counts


class SimKubeletClient:
    """Client of the control API of the simulated kubelet serving DIR.

    state() -> KubeletState; admit_pod(name, {container: {resource: count}}) -> PodState;
    delete_pod(name) -> PodState; restart() -> removed socket paths; snapshots(resource);
    allocatable_history(resource) -> [AllocatableChange], zero_windows(resource, since_ns),
    registrations_per_instance(resource); events(after_seq) -> control Event messages;
    wait_for(predicate) / wait_for_event(predicate) / wait_ready() wait a bounded time and raise
    TimeoutError showing the last state.
    """

    def __init__(self, directory: str | os.PathLike, rpc_timeout: float = 60.0):
        self.dir = os.fspath(directory)
        self.socket = control_socket_path(self.dir)
        self.rpc_timeout = rpc_timeout
        # Short reconnect backoff: wait_ready() polls a socket that appears after a moment.
        # A full allocatable history (100,000 entries, about 6 MB) is over gRPC's 4 MB default.
        self._channel = grpc.insecure_channel(f"unix:{self.socket}", options=[
            ("grpc.enable_http_proxy", 0), ("grpc.initial_reconnect_backoff_ms", 50),
            ("grpc.min_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 500),
            ("grpc.max_receive_message_length", 64 << 20)])
        self._stub = ctl_grpc.SimKubeletControlStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> SimKubeletClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, request, timeout: float | None = None):
        try:
            return getattr(self._stub, method)(request, timeout=timeout or self.rpc_timeout)
        except grpc.RpcError as err:
            cls = _ERRORS.get(err.code().name)
            if cls is not None:
                raise cls(err.details()) from None
            raise SimKubeletError(f"simulated kubelet control API at {self.socket}: {method} "
                                  f"failed: {err.code().name}: {err.details()}") from None

    def state(self) -> KubeletState:
        return kubelet_state(self._call("GetState", ctl.GetStateRequest()))

    def admit_pod(self, name: str, containers: Mapping[str, Mapping[str, int]],
                  namespace: str = "default", uid: str = "") -> PodState:
        """Admit a pod; `containers` maps container name -> {resource: count}. PodRejected
        carries kubelet's reason when the pod cannot be admitted."""
        request = ctl.AdmitPodRequest(name=name, namespace=namespace, uid=uid, containers=[
            ctl.ContainerRequest(name=cname, requests=dict(requests))
            for cname, requests in containers.items()])
        return pod_state(self._call("AdmitPod", request).pod)

    def delete_pod(self, name: str, namespace: str = "default") -> PodState:
        return pod_state(self._call("DeletePod", ctl.DeletePodRequest(name=name,
                                                                      namespace=namespace)).pod)

    def restart(self) -> list[str]:
        """Restart the kubelet; returns the socket paths it deleted."""
        return list(self._call("Restart", ctl.RestartRequest()).removed_sockets)

    def snapshots(self, resource: str, after_seq: int = 0) -> list[ctl.Snapshot]:
        request = ctl.GetSnapshotsRequest(resource_name=resource, after_seq=after_seq)
        return list(self._call("GetSnapshots", request).snapshots)

    def allocatable_history(self, resource: str = "", after_seq: int = 0
                            ) -> list[AllocatableChange]:
        """kubelet's capacity/allocatable changes of `resource` (every resource when empty)
        with seq > after_seq, oldest first (the newest 100,000 are kept)."""
        request = ctl.GetAllocatableHistoryRequest(resource_name=resource, after_seq=after_seq)
        return [allocatable_change(c) for c in self._call("GetAllocatableHistory", request).changes]

    def zero_windows(self, resource: str, since_ns: int = 0) -> list[ZeroWindow]:
        """Where `resource`'s allocatable dropped to 0 at or after `since_ns` (monotonic ns)
        having been above 0; see zero_windows()."""
        return zero_windows(self.allocatable_history(resource), since_ns)

    def registrations_per_instance(self, resource: str) -> dict[int, int]:
        """kubelet instance -> registrations of `resource` accepted in it (0 where none)."""
        return registrations_per_instance(self.allocatable_history(resource))

    def events(self, after_seq: int = 0, timeout: float = 10.0) -> Iterator[ctl.Event]:
        """Events after `after_seq` (those kept, then live ones) for at most `timeout` s."""
        call = self._stub.Watch(ctl.WatchRequest(after_seq=after_seq), timeout=timeout)
        try:
            yield from call
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise SimKubeletError(f"Watch on {self.socket} failed: {err.code().name}: "
                                      f"{err.details()}") from None
        finally:
            call.cancel()

    def wait_for_event(self, predicate: Callable[[ctl.Event], bool], after_seq: int = 0,
                       timeout: float = 10.0, what: str = "") -> ctl.Event:
        """The first event after `after_seq` for which predicate(event) holds."""
        seen = []
        for event in self.events(after_seq, timeout):
            if predicate(event):
                return event
            seen.append(event)
        kinds = ", ".join(f"#{e.seq} {EventKind.Name(e.kind)} {e.resource_name or e.pod_name}"
                          for e in seen[-20:])
        raise TimeoutError(f"no event {what or getattr(predicate, '__name__', predicate)} after "
                           f"#{after_seq} within {timeout:g} s; last events: {kinds or '(none)'}"
                           f"\n{self.state().describe()}")

    def wait_for(self, predicate: Callable[[KubeletState], bool], timeout: float = 10.0,
                 what: str = "", interval: float = 0.02) -> KubeletState:
        """Poll state() until predicate(state) holds; return that state."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.state()
            if predicate(state):
                return state
            if time.monotonic() >= deadline:
                raise TimeoutError(f"timed out after {timeout:g} s waiting for "
                                   f"{what or getattr(predicate, '__name__', predicate)}; "
                                   f"last state:\n{state.describe()}")
            time.sleep(interval)

    def wait_ready(self, timeout: float = 30.0) -> KubeletState:
        """Wait until the control API answers (the kubelet is serving)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return kubelet_state(self._stub.GetState(ctl.GetStateRequest(), timeout=2.0))
            except grpc.RpcError as err:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"simulated kubelet control API at {self.socket} not "
                                       f"answering after {timeout:g} s: {err.code().name}: "
                                       f"{err.details()}") from None
                time.sleep(0.05)
