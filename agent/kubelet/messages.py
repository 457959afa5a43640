"""The device-plugin API's messages made from the manager's plain data.

Owns: the ListAndWatch device list of a snapshot (each device's ID, health and NUMA node) and
the AllocateResponse of an Allocate's answers (envs, mounts, device specs, annotations, CDI
devices), as kubelet reads them. Must not serve anything, call NVML or decide what a container
gets (agent.rm.allocate does).
"""

from __future__ import annotations

from collections.abc import Iterable

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1.constants import HEALTHY, UNHEALTHY
from agent.rm.allocate import ContainerResponse
from agent.rm.manager import Snapshot


def _device(health) -> dp.Device:
    d = health.device
    device = dp.Device(ID=d.id, health=HEALTHY if health.healthy else UNHEALTHY)
    if d.numa_node is not None:
        device.topology.nodes.add(ID=d.numa_node)
    return device


def list_response(snapshot: Snapshot) -> dp.ListAndWatchResponse:
    return dp.ListAndWatchResponse(devices=[_device(h) for h in snapshot.devices])


def _container_response(r: ContainerResponse) -> dp.ContainerAllocateResponse:
    return dp.ContainerAllocateResponse(
        envs=r.envs,
        mounts=[dp.Mount(container_path=m.container_path, host_path=m.host_path,
                         read_only=m.read_only) for m in r.mounts],
        devices=[dp.DeviceSpec(container_path=s.container_path, host_path=s.host_path,
                               permissions=s.permissions) for s in r.devices],
        annotations=r.annotations,
        cdi_devices=[dp.CDIDevice(name=n) for n in r.cdi_devices],
    )


def allocate_response(responses: Iterable[ContainerResponse]) -> dp.AllocateResponse:
    return dp.AllocateResponse(container_responses=[_container_response(r) for r in responses])
