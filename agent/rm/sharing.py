"""Sharing: the replicas a `sharing.timeSlicing` or `sharing.mps` config makes of a resource's
devices, and what MPS needs per GPU.

Owns: `replicate`, which turns the device map of agent.rm.devices into the advertised one
(each shared device becomes N devices `<id>::<n>` under the resource's shared name), the
names and rules that go with it, MPS's refusals (MIG devices, too many clients), the host
paths of each GPU's MPS control daemon and `mps_plan` (which GPUs need one, with which default
limits). Plain data in and out: must not call NVML, start processes nor import grpc (the
daemons are agent.mps's). docs/sharing.md is the operator's view of the same rules.

NVIDIA's rules, read in k8s-device-plugin v0.20.0 (internal/rm/device_map.go
updateDeviceMapWithReplicas and getIDsOfDevicesToReplicate, internal/rm/devices.go
NewAnnotatedID, api/config/v1/resources.go DefaultSharedRename):
- a replica's ID is `<device ID>::<n>`, n from 0 to replicas - 1; it keeps the device's
  index (`3`, or `3:1` for a MIG device), device nodes and NUMA node;
- the replicas are advertised under `rename`, else `<name>.shared` with renameByDefault, else
  under the name itself; devices of a listed resource that are not selected stay whole under
  the resource's own name; resources no entry names are left as they are; an entry naming a
  resource this node does not have is skipped;
- `devices` selects: all, the first N, or the listed indexes and UUIDs.
Where gpu-agent differs on purpose (docs/sharing.md says why): NVIDIA's binaries ignore
`rename` and `devices` (config.go DisableResourceNamingInConfig) and gpu-agent honours them;
a count takes the first N devices by index, not N picked at random; a listed device this
node does not have is logged and left out rather than failing the plugin; an entry of
`devices` may carry its own replica count ({device: 2, replicas: 8}).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from agent.constants import VCUDA_CORE
from agent.errors import ConfigError, MigLayoutError
from agent.rm.devices import Device

log = logging.getLogger(__name__)

REPLICA_SEPARATOR = "::"
SHARED_SUFFIX = ".shared"  # consts.go DefaultSharedResourceNameSuffix
MIB = 1 << 20


class MpsGpu(NamedTuple):
    """A GPU shared with MPS: its control daemon's default limits and the replicas it serves."""

    uuid: str
    index: int
    replicas: int
    device_ids: tuple[str, ...]
    thread_percentage: int  # set_default_active_thread_percentage
    memory_limit_mib: int  # set_default_device_pinned_mem_limit 0 <n>M


def mps_pipe_dir(root: str, gpu_uuid: str) -> str:
    """The host pipe directory of a GPU's MPS control daemon (CUDA_MPS_PIPE_DIRECTORY)."""
    return os.path.join(root, gpu_uuid, "pipe")


def mps_log_dir(root: str, gpu_uuid: str) -> str:
    return os.path.join(root, gpu_uuid, "log")


def mps_shm_dir(root: str) -> str:
    """The /dev/shm every MPS daemon and client shares (NVIDIA's root.go ShmDir: <root>/shm)."""
    return os.path.join(root, "shm")


def mps_max_clients(compute_capability: tuple[int, int]) -> int:
    """cmd/mps-control-daemon/mps/device.go maxClients: 48 from compute capability 7.5 (the
    isAtLeastVolta check compares with v7.5), 16 below."""
    return 48 if tuple(compute_capability) >= (7, 5) else 16


def replica_id(device_id: str, n: int) -> str:
    """NVIDIA's annotated ID of replica `n` of a device (devices.go NewAnnotatedID)."""
    return f"{device_id}{REPLICA_SEPARATOR}{n}"


def shared_name(entry: Any, rename_by_default: bool) -> str:
    """The resource an entry's replicas are advertised under."""
    if entry.rename:
        return entry.rename
    return entry.name + SHARED_SUFFIX if rename_by_default else entry.name


def _selected(entry: Any, devices: Sequence[Device], key: str) -> dict[str, int]:
    """The IDs of the entry's devices to share, each with its replica count."""
    spec = entry.devices
    if spec == "all":
        return {d.id: entry.replicas for d in devices}
    if isinstance(spec, int):
        if spec > len(devices):
            log.warning("%s.devices: %d devices to share, but %s has %d on this node: sharing "
                        "all of them", key, spec, entry.name, len(devices))
        return {d.id: entry.replicas for d in devices[:spec]}
    out: dict[str, int] = {}
    for ref in spec:
        name, count = (ref, entry.replicas) if isinstance(ref, str) else \
            (ref.device, ref.replicas)
        found = next((d for d in devices if name in (d.id, d.index)), None)
        if found is None:
            log.warning("%s.devices: %s has no device %s on this node: left out", key,
                        entry.name, name)
            continue
        out[found.id] = count
    return out


def replicate(device_map: Mapping[str, Sequence[Device]], shared: Any,
              key: str = "sharing.timeSlicing") -> dict[str, list[Device]]:
    """The devices of each resource once `shared` (a ReplicatedResources, or None: nothing
    shared) is applied to `device_map` (agent.rm.devices.devices_by_resource), sorted by
    resource name; each device's replicas follow one another in the device's place."""
    out: dict[str, list[Device]] = {name: list(ds) for name, ds in device_map.items()}
    if shared is None:
        return out
    listed = {entry.name for entry in shared.resources}
    for name in listed:
        out.pop(name, None)
    for i, entry in enumerate(shared.resources):
        devices = list(device_map.get(entry.name, ()))
        if not devices:
            log.info("%s.resources[%d]: no %s devices on this node: nothing to share", key, i,
                     entry.name)
            continue
        counts = _selected(entry, devices, f"{key}.resources[{i}]")
        to = shared_name(entry, shared.rename_by_default)
        for d in devices:
            n = counts.get(d.id)
            if n is None:
                out.setdefault(entry.name, []).append(d)
            else:
                out.setdefault(to, []).extend(
                    d._replace(id=replica_id(d.id, k), replica_of=d.id, replicas=n)
                    for k in range(n))
    return {name: ds for name, ds in sorted(out.items()) if ds}


def check_mps(device_map: Mapping[str, Sequence[Device]], gpus: Sequence[Any], mps: Any,
              config_file: str = "") -> None:
    """MPS's refusals, in NVIDIA's words where it has them: a MIG device among the shared
    ones (internal/plugin/mps.go getMPSOptions; MigLayoutError, so a reload keeps the running
    layout), more replicas of a GPU than its MPS server takes clients (device.go
    assertReplicas; ConfigError naming the entry), but for gpu-manager's vcuda-core units."""
    shared = [d for ds in device_map.values() for d in ds if d.replica_of]
    mig = next((d for d in shared if d.gi is not None), None)
    if mig is not None:
        raise MigLayoutError(f"sharing.mps: sharing using MPS is not supported for MIG devices "
                             f"(MIG device {mig.replica_of} on GPU {mig.gpu_index}; see "
                             f"docs/sharing.md)")
    by_uuid = {g.uuid: g for g in gpus}
    entries = {shared_name(r, mps.rename_by_default): i for i, r in enumerate(mps.resources)}
    for name, devices in device_map.items():
        for d in devices:
            gpu = by_uuid.get(d.gpu_uuid)
            most = mps_max_clients(gpu.compute_capability) if gpu is not None else 0
            # vcuda-core's 100 units are not clients: a container holds several of them (its
            # containers are the clients; docs/sharing.md says how many a GPU takes)
            if d.replica_of and gpu is not None and d.replicas > most and name != VCUDA_CORE:
                entry = entries.get(name, 0)
                raise ConfigError(f"sharing.mps.resources[{entry}].replicas",
                                  f"invalid MPS configuration: invalid device maximum allowed "
                                  f"replicas exceeded: {d.replicas} > {most} (GPU "
                                  f"{gpu.index}, compute capability "
                                  f"{gpu.compute_capability[0]}.{gpu.compute_capability[1]})",
                                  config_file)


def mps_plan(device_map: Mapping[str, Sequence[Device]],
             fail_requests_greater_than_one: bool) -> dict[str, MpsGpu]:
    """The GPUs that need an MPS control daemon, by UUID, with its default limits: a GPU's
    share (100 / N % of the SMs, 1/N of the memory) when a container gets one replica at most
    (failRequestsGreaterThanOne, NVIDIA's default for MPS: the daemon enforces it for every
    client), else the whole GPU, and each container's own k/N comes in its environment
    (agent.rm.allocate), which the client can only lower, not raise."""
    out: dict[str, MpsGpu] = {}
    ids: dict[str, list[str]] = {}
    for devices in device_map.values():
        for d in devices:
            if not d.replica_of:
                continue
            ids.setdefault(d.gpu_uuid, []).append(d.id)
            if d.gpu_uuid not in out:
                share = 1 if fail_requests_greater_than_one else d.replicas
                out[d.gpu_uuid] = MpsGpu(d.gpu_uuid, d.gpu_index, d.replicas, (),
                                         100 * share // d.replicas,
                                         d.memory * share // d.replicas // MIB)
    return {u: g._replace(device_ids=tuple(ids[u])) for u, g in sorted(
        out.items(), key=lambda kv: kv[1].index)}
