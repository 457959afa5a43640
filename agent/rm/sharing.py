"""Time-slicing: the replicas a `sharing.timeSlicing` config makes of a resource's devices.

Owns: `replicate`, which turns the device map of agent.rm.devices into the advertised one
(each shared device becomes N devices `<id>::<n>` under the resource's shared name), and the
names and rules that go with it. Plain data in and out: must not call NVML nor import grpc.
docs/sharing.md is the operator's view of the same rules.

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
from collections.abc import Mapping, Sequence
from typing import Any

from agent.rm.devices import Device

log = logging.getLogger(__name__)

REPLICA_SEPARATOR = "::"
SHARED_SUFFIX = ".shared"  # consts.go DefaultSharedResourceNameSuffix


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
                    d._replace(id=replica_id(d.id, k), replica_of=d.id) for k in range(n))
    return {name: ds for name, ds in sorted(out.items()) if ds}
