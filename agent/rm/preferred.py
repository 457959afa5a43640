"""The preferred-allocation policy kubelet asks for (GetPreferredAllocation).

Owns: checking one container's request, mapping device IDs onto the physical GPUs of the
`TopologyModel` (several device IDs may share one GPU: shared replicas), asking the exact set
search of `agent._fast` for the GPUs, and turning its answer back into device IDs in a stable
order. Policies (docs/allocation.md): `best-effort` (the highest-scoring set), `packed` (the
tightest group of the score tree that fits, then the highest-scoring set in it), and for
replicas `distributed` (as many GPUs as the request allows, the best-scoring set of them, the
least loaded first) or `packed` (fill GPUs already partly used, then the best-linked next
one). Answers depend only on the request and the model, never on the order of `available`.
Must not call NVML nor import grpc.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from agent.constants import BEST_EFFORT, DISTRIBUTED, PACKED
from agent.errors import RequestError
from agent.rm.devices import Device
from agent.rm.topology import TopologyModel


def _mask(positions) -> int:
    mask = 0
    for p in positions:
        mask |= 1 << p
    return mask


def _positions(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def check_request(resource: str, available: Sequence[str], must_include: Sequence[str],
                  size: int, known: Mapping[str, Device]) -> tuple[list[str], list[str]]:
    """(available, must-include) without repeats; RequestError when the request cannot be met
    as asked: a size below one or above the available count, IDs this resource does not
    advertise, must-include devices that are not available, or more must-include devices
    than `size`."""
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
    return avail, must


def preferred_allocation(resource: str, available: Sequence[str], must_include: Sequence[str],
                         size: int, known: Mapping[str, Device], *,
                         model: TopologyModel | None = None, policy: str = BEST_EFFORT,
                         replica_policy: str = DISTRIBUTED, one_gpu: bool = False,
                         topology_module: Any = None) -> list[str]:
    """The device IDs to prefer for one container: `size` of `available`, `must_include` first
    (in request order), then the others: those on the NUMA node holding most of the pick first,
    by GPU index (GPUs of unknown NUMA node last).

    `model` is the node's TopologyModel; without one (or when it lacks a device's GPU) a
    NUMA-only model of `known` is used, searched by `topology_module` (None: the live
    agent._fast implementation). RequestError when the request cannot be met (see
    `check_request`).
    """
    avail, must = check_request(resource, available, must_include, size, known)
    if model is None or not model.covers(known[i].gpu_uuid for i in avail):
        model = TopologyModel.numa_only(known.values(), topology_module=topology_module)
    rank = {device_id: r for r, device_id in enumerate(known)}
    pos_of = {i: model.by_uuid[known[i].gpu_uuid].pos for i in avail}
    per_gpu = Counter(pos_of.values())
    if one_gpu and any(known[i].replica_of for i in avail):
        # MPS: a container's replicas must reach one GPU's daemon (agent.rm.allocate)
        in_use = _in_use(model, known, per_gpu)
        return _one_parent(avail, must, size, pos_of, rank, in_use, replica_policy) or \
            _replicas(model, avail, must, size, pos_of, rank, PACKED)
    if all(c == 1 for c in per_gpu.values()):
        return _whole_gpus(model, avail, must, size, pos_of, policy)
    if any(known[i].gi is not None for i in avail):
        # MIG devices (NVIDIA's plugin states no preference for them): all on one parent
        # GPU when one can hold the request, else packed (fill the request's GPUs, then the
        # best-linked next one)
        return _one_parent(avail, must, size, pos_of, rank) or \
            _replicas(model, avail, must, size, pos_of, rank, PACKED)
    return _replicas(model, avail, must, size, pos_of, rank, replica_policy,
                     _in_use(model, known, per_gpu))


def _in_use(model: TopologyModel, known: Mapping[str, Device], per_gpu: Counter) -> Counter:
    """Per GPU position: its devices of this resource that are not available (allocated, or
    withdrawn), as NVIDIA's greedyAlloc counts them (total - available)."""
    total = Counter(model.by_uuid[d.gpu_uuid].pos for d in known.values()
                    if d.gpu_uuid in model.by_uuid)
    return Counter({p: total[p] - per_gpu[p] for p in per_gpu})


def _one_parent(avail: list[str], must: list[str], size: int, pos_of: dict[str, int],
                rank: dict[str, int], in_use: Counter | None = None,
                replica_policy: str = PACKED) -> list[str] | None:
    """`size` devices on one GPU: the GPU of the must-include devices, or the one with the
    fewest available devices that still holds the request (bigger ones stay free; under
    `distributed`, the one with the fewest devices in use, per `in_use`); None when no GPU
    can."""
    on: dict[int, list[str]] = {}
    for i in sorted(avail, key=lambda d: rank[d]):
        on.setdefault(pos_of[i], []).append(i)
    homes = {pos_of[i] for i in must}
    fits = [p for p, ids in on.items() if len(ids) >= size and (not homes or homes == {p})]
    if not fits:
        return None
    if replica_policy == DISTRIBUTED and in_use is not None:
        p = min(fits, key=lambda q: (in_use[q], -len(on[q]), q))
    else:
        p = min(fits, key=lambda q: (len(on[q]), q))
    return list(must) + [i for i in on[p] if i not in must][:size - len(must)]


def _whole_gpus(model: TopologyModel, avail: list[str], must: list[str], size: int,
                pos_of: dict[str, int], policy: str) -> list[str]:
    """One device per GPU: the search picks the GPUs themselves."""
    chosen = model.search.best_set(_mask(pos_of.values()), _mask(pos_of[i] for i in must),
                                   size, policy)
    device_at = {pos_of[i]: i for i in avail}
    rest = [p for p in _positions(chosen) if device_at[p] not in must]
    numa = Counter(model.gpus[p].numa_node for p in _positions(chosen))

    def home_first(p: int) -> tuple:
        node = model.gpus[p].numa_node
        return (node is None, -numa[node], node or 0, p)

    rest.sort(key=home_first)
    return list(must) + [device_at[p] for p in rest]


def _replicas(model: TopologyModel, avail: list[str], must: list[str], size: int,
              pos_of: dict[str, int], rank: dict[str, int], replica_policy: str,
              in_use: Counter | None = None) -> list[str]:
    """Several devices on some GPU: choose GPUs by the replica policy, then devices on them
    (on each GPU, in the order the resource lists its devices). `in_use`: per GPU position,
    its devices already taken (distributed goes to the least used GPUs first)."""
    in_use = in_use or Counter()
    free: dict[int, list[str]] = {}
    for i in sorted(avail, key=lambda d: rank[d]):
        if i not in must:
            free.setdefault(pos_of[i], []).append(i)
    used = Counter(pos_of[i] for i in must)
    chosen = list(must)
    need = size - len(chosen)
    scores = model.scores
    if replica_policy == PACKED:
        while need:
            open_gpus = [p for p in used if free.get(p)]
            if open_gpus:  # the GPU of this request with the fewest free devices first
                p = min(open_gpus, key=lambda q: (len(free[q]), q))
            else:  # a new GPU: the best linked to the request's GPUs, then the fullest
                p = min((q for q in free if free[q]),
                        key=lambda q: (-sum(scores[q][u] for u in used), len(free[q]), q))
            take = free[p][:need]
            del free[p][:len(take)]
            chosen += take
            used[p] += len(take)
            need -= len(take)
        return chosen
    # distributed: as many distinct GPUs as the request allows, the least used ones (NVIDIA's
    # greedyAlloc), and among GPUs used alike the best-scoring set
    gpus = set(used) | {p for p, ids in free.items() if ids}
    target = min(len(gpus), len(used) + need)
    others = sorted((in_use[p], p) for p in gpus - set(used))
    level = others[target - len(used) - 1][0] if target > len(used) else -1
    keep = set(used) | {p for n, p in others if n < level}
    ties = keep | {p for n, p in others if n == level}
    spread = _positions(model.search.best_set(_mask(ties), _mask(keep), target, BEST_EFFORT))
    while need:
        p = min((q for q in spread if free.get(q)),
                key=lambda q: (in_use[q] + used[q], used[q], -len(free[q]), q))
        chosen.append(free[p].pop(0))
        used[p] += 1
        need -= 1
    return chosen
