"""The preferred-allocation policy kubelet asks for (GetPreferredAllocation), a simple one.

Owns: choosing `size` devices out of kubelet's available ones, must-include devices first,
then keeping the pick on as few NUMA nodes as it can: a node that holds all the rest alone is
preferred (the one with the fewest free devices that still fits, so that large free nodes stay
whole for large pods), otherwise nodes with the most free devices first. Ties fall to the lower
NUMA node and the lower GPU index, so the answer is deterministic. NVLink-aware choice comes
with the topology work. Must not call NVML nor import grpc.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from agent.errors import RequestError
from agent.rm.devices import Device

_NO_NODE = 1 << 30  # devices without NUMA affinity sort after every real node


def _node(device: Device) -> int:
    return _NO_NODE if device.numa_node is None else device.numa_node


def preferred_allocation(resource: str, available: Sequence[str], must_include: Sequence[str],
                         size: int, known: Mapping[str, Device]) -> list[str]:
    """The device IDs to prefer for one container: `size` of `available`, `must_include` first.

    RequestError when the request cannot be met as asked: a size below one or above the
    available count, IDs this resource does not advertise, must-include devices that are not
    available, or more must-include devices than `size`.
    """
    where = f"invalid preferred allocation request for '{resource}'"
    if size < 1:
        raise RequestError(f"{where}: allocation size {size} is less than 1")
    avail = list(dict.fromkeys(available))
    unknown = [i for i in avail if i not in known]
    if unknown:
        raise RequestError(f"{where}: unknown device: {unknown[0]}")
    must = list(dict.fromkeys(must_include))
    missing = [i for i in must if i not in avail]
    if missing:
        raise RequestError(f"{where}: must-include device {missing[0]} is not available")
    if len(must) > size:
        raise RequestError(f"{where}: {len(must)} must-include devices exceed the allocation "
                           f"size {size}")
    if size > len(avail):
        raise RequestError(f"{where}: allocation size {size} exceeds the {len(avail)} "
                           f"available devices")

    chosen = list(must)
    need = size - len(chosen)
    free: dict[int, list[Device]] = {}
    for device_id in avail:
        if device_id not in chosen:
            device = known[device_id]
            free.setdefault(_node(device), []).append(device)
    for devices in free.values():
        devices.sort(key=lambda d: d.gpu_index)
    home = {_node(known[i]) for i in must}

    while need:
        fits = [n for n in free if len(free[n]) >= need]
        if home & set(free):  # fill the must-include devices' nodes first
            node = min(home & set(free), key=lambda n: (-len(free[n]), n))
        elif fits:  # one node holds the rest: the tightest fit
            node = min(fits, key=lambda n: (n == _NO_NODE, len(free[n]), n))
        else:  # spread as little as possible: biggest nodes first
            node = min(free, key=lambda n: (-len(free[n]), n))
        take = free.pop(node)[:need]
        home.discard(node)
        chosen += [d.id for d in take]
        need -= len(take)
    return chosen
