"""One resource's manager: its devices, their health, and the answers to kubelet's questions.

Owns: the device list of one resource (e.g. nvidia.com/gpu) with each device's health, a
version number bumped on every change with a condition to wait on (the ListAndWatch streams
follow it), and the plain-data answers to Allocate and GetPreferredAllocation built from
`agent.rm.allocate` and `agent.rm.preferred`. This is the contract the gRPC layer serves
(Intel's device-plugin framework cut: the framework owns sockets and streams, the manager
owns devices). Thread-safe. Must not call NVML nor import grpc: devices come in built, health
changes come in through `set_health`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Callable, NamedTuple

from agent.rm.allocate import (
    ContainerResponse,
    ResponseOptions,
    check_shared_request,
    container_response,
    resolve_request,
)
from agent.rm.devices import Device
from agent.rm.preferred import preferred_allocation
from agent.rm.topology import TopologyModel

log = logging.getLogger(__name__)


class DeviceHealth(NamedTuple):
    """A device and its health at one moment (a line of a ListAndWatch snapshot)."""

    device: Device
    healthy: bool
    reason: str = ""


class Snapshot(NamedTuple):
    """The whole device list at `version`; `closed` once the manager is shut."""

    version: int
    devices: tuple[DeviceHealth, ...]
    closed: bool = False


class Allocation(NamedTuple):
    """One container's answer to Allocate: the devices it asked for and what it gets."""

    devices: list[Device]
    response: ContainerResponse


class Settings(NamedTuple):
    """What Allocate reads of a manager, replaced whole by reconfigure (see `settings`)."""

    options: ResponseOptions
    by_id: dict  # device ID -> Device
    one_replica: bool  # one replica per container (failRequestsGreaterThanOne)
    repeats: bool  # the same request may get the same answer (`_settings`)


class PreferredRequest(NamedTuple):
    """One container's GetPreferredAllocation request, as plain data."""

    available: Sequence[str]
    must_include: Sequence[str]
    size: int


class ResourceManager:
    """Devices of one resource, their health, and allocation answers. `options` shapes the
    Allocate responses (device-list and device-ID strategies, passDeviceSpecs...)."""

    def __init__(self, resource: str, devices: Sequence[Device], options: ResponseOptions, *,
                 journal: Callable[[str, list[Allocation]], object] | None = None,
                 topology: TopologyModel | None = None,
                 allocation_policy: str = "best-effort",
                 replica_policy: str = "distributed", one_replica: bool = False,
                 one_gpu: bool = False):
        self.resource = resource
        self.one_gpu = one_gpu  # MPS: a container's replicas on one GPU
        self.options = options
        self.allocation_policy = allocation_policy
        self.replica_policy = replica_policy
        # Called with (resource, [(devices, response) per container]) before Allocate answers;
        # it returns once the allocation is written or raises (agent.state.journal).
        self.journal = journal
        self.devices: tuple[Device, ...] = tuple(devices)
        self.by_id = {d.id: d for d in self.devices}
        # The node's link model, built once per device set (agent.rm.topology); without one,
        # or when it lacks one of these GPUs, a NUMA-only model of these devices.
        self.topology = _fitting(topology, self.devices)
        self._health = {d.id: (True, "") for d in self.devices}
        # replaced whole by reconfigure, read once per Allocate, so that an Allocate during a
        # reload gets the old settings or the new ones, never a mix; a caller that keeps
        # answers keeps them while it is the same object
        self.settings = _settings(options, self.by_id, one_replica)
        self._cond = threading.Condition()
        self._version = 1
        self._closed = False

    def __repr__(self) -> str:
        return f"ResourceManager({self.resource!r}, {len(self.devices)} devices)"

    # -- state -----------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        with self._cond:
            return Snapshot(self._version, tuple(
                DeviceHealth(d, *self._health[d.id]) for d in self.devices), self._closed)

    @property
    def healthy_count(self) -> int:
        with self._cond:
            return sum(1 for ok, _ in self._health.values() if ok)

    def wait_for_change(self, version: int, timeout: float,
                        interrupted: Callable[[], bool] = lambda: False) -> Snapshot:
        """The snapshot once its version differs from `version` or the manager closes, or the
        current one after `timeout` s or once `interrupted()` holds after a `wake()`."""
        with self._cond:
            self._cond.wait_for(lambda: self._version != version or self._closed
                                or interrupted(), timeout)
        return self.snapshot()

    def wake(self) -> None:
        """Make every waiter re-check its `interrupted` (a server stopping its streams)."""
        with self._cond:
            self._cond.notify_all()

    def set_health(self, device_id: str, healthy: bool, reason: str = "") -> bool:
        """Record a device's health; True (and a new version) when it changed."""
        with self._cond:
            if device_id not in self._health or self._health[device_id][0] == healthy:
                return False
            self._health[device_id] = (healthy, reason)
            self._version += 1
            self._cond.notify_all()
        d = self.by_id[device_id]
        log.info("%s device %s (GPU %d) is now %s%s", self.resource, d.gpu_uuid, d.gpu_index,
                 "healthy" if healthy else "unhealthy", f": {reason}" if reason else "")
        return True

    def set_health_many(self, changes: Mapping[str, tuple[bool, str]]) -> bool:
        """Record several devices' (healthy, reason) at once: one transition touching many
        devices is one new version, so ListAndWatch sends one snapshot. A reason that changes
        without the health is kept without a new version; unknown IDs are skipped (they are
        another resource's). True when any device's health changed. The health monitor logs
        the transition (once per GPU), so this logs at DEBUG only."""
        flipped = []
        with self._cond:
            for device_id, (healthy, reason) in changes.items():
                old = self._health.get(device_id)
                if old is None or old == (healthy, reason):
                    continue
                self._health[device_id] = (healthy, reason)
                if old[0] != healthy:
                    flipped.append(device_id)
            if flipped:
                self._version += 1
                self._cond.notify_all()
        if flipped:
            log.debug("%s: health of %s changed (version %d)", self.resource,
                      ", ".join(flipped), self._version)
        return bool(flipped)

    def reconfigure(self, devices: Sequence[Device], options: ResponseOptions, *,
                    topology: TopologyModel | None = None, allocation_policy: str = "best-effort",
                    replica_policy: str = "distributed", one_replica: bool = False,
                    one_gpu: bool = False) -> bool:
        """Apply a reload behind the running server: new response options and policies take
        effect for the next call; a changed device list (GPUs found or gone, another order) is
        a new version, so open ListAndWatch streams send it. Devices that stay keep their
        health. True when the advertised list changed."""
        devices = tuple(devices)
        topology = _fitting(topology, devices)
        with self._cond:
            self.options, self.topology = options, topology
            self.allocation_policy, self.replica_policy = allocation_policy, replica_policy
            self.one_gpu = one_gpu
            if devices == self.devices:
                self.settings = _settings(options, self.by_id, one_replica)
                return False
            self.devices, self.by_id = devices, {d.id: d for d in devices}
            self.settings = _settings(options, self.by_id, one_replica)
            self._health = {d.id: self._health.get(d.id, (True, "")) for d in devices}
            self._version += 1
            self._cond.notify_all()
        log.info("%s: now %d devices", self.resource, len(devices))
        return True

    def close(self) -> None:
        """Wake every waiter for good (the streams following this manager end)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- kubelet's questions -----------------------------------------------------------------

    def allocate(self, container_requests: Sequence[Sequence[str]]) -> list[Allocation]:
        """The devices and the ContainerResponse for each container request, in order;
        RequestError (nothing allocated) if any request is empty, repeats an ID or names an
        unknown one. With a `journal`, the allocation is recorded before this returns
        (StateError if it could not be)."""
        options, by_id, one_replica, _ = self.settings
        out = []
        for ids in container_requests:
            devices = resolve_request(self.resource, ids, by_id)
            if one_replica:
                check_shared_request(self.resource, devices)
            out.append(Allocation(devices, container_response(devices, options,
                                                              resource=self.resource)))
        self.record(out)
        return out

    def record(self, allocations: list[Allocation]) -> None:
        """Record an Allocate answered with `allocations` (the journal hook, StateError if it
        could not be recorded): `allocate` calls it, and a caller that answers a request
        again with an answer it kept (while `settings` is the same)."""
        if self.journal is not None:
            self.journal(self.resource, allocations)

    def preferred(self, requests: Sequence[PreferredRequest]) -> list[list[str]]:
        """The preferred device IDs for each container request, in order; RequestError if one
        cannot be met."""
        return [preferred_allocation(self.resource, r.available, r.must_include, r.size,
                                     self.by_id, model=self.topology,
                                     policy=self.allocation_policy,
                                     replica_policy=self.replica_policy,
                                     one_gpu=self.one_gpu) for r in requests]


def _settings(options: ResponseOptions, by_id: dict, one_replica: bool) -> Settings:
    """A manager's `settings`. An answer may be given again to the same request unless each
    must be new: a CDI annotation key is unique per Allocate, and passDeviceSpecs passes the
    control nodes that exist now (nvidia-uvm appears on first use)."""
    repeats = not options.pass_device_specs and "cdi-annotations" not in options.list_strategies
    return Settings(options, by_id, one_replica, repeats)


def _fitting(topology: TopologyModel | None, devices: Sequence[Device]) -> TopologyModel:
    """`topology` when it knows every GPU behind `devices`, else a NUMA-only model of them."""
    if topology is None or not topology.covers(d.gpu_uuid for d in devices):
        return TopologyModel.numa_only(devices)
    return topology
