"""The allocation policies of agent.rm.preferred over a TopologyModel: best-effort against
packed on NVSwitch islands, and shared replicas (several device IDs on one GPU, as
time-slicing advertises them) mapped onto their physical GPUs, distributed or packed. The
links are built as discovery returns them (Link records by GPU index); no NVML here. Every test
runs with the compiled search and with its twin (conftest's `fast_impl`).
"""

from __future__ import annotations

from collections import Counter

import pytest

from agent.nvml.discovery import Gpu, Link
from agent.rm.allocate import ResponseOptions
from agent.rm.devices import RESOURCE_GPU, Device, full_gpu_devices
from agent.rm.manager import PreferredRequest, ResourceManager
from agent.rm.preferred import preferred_allocation
from agent.rm.topology import TopologyModel


def make_gpus(numa: list[int | None]) -> list[Gpu]:
    return [Gpu(index=i, uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000", name="H100",
                minor=i, pci_bus_id=f"00000000:{i + 16:02X}:00.0", numa_node=n,
                memory_total=80 << 30, compute_capability=(9, 0), mig_enabled=False)
            for i, n in enumerate(numa)]


# Two NVSwitch islands of 4 GPUs (island 0 NV12, island 1 NV18), NODE inside a socket, SYS across.
ISLANDS = make_gpus([0, 0, 0, 0, 1, 1, 1, 1])
ISLAND_LINKS = {
    (a, b): (Link(40, 12 if a < 4 else 18, via_switch=True) if a // 4 == b // 4 else Link(50))
    for a in range(8) for b in range(8) if a != b
}
DEVICES = full_gpu_devices(ISLANDS)
IDS = [d.id for d in DEVICES]


@pytest.fixture
def model(fast_impl) -> TopologyModel:
    """The islands' model, searched by the compiled module, then by the twin."""
    return TopologyModel.from_links(ISLANDS, ISLAND_LINKS, topology_module=fast_impl.topology)


def pick(model, available, size, policy, must=()):
    manager = ResourceManager(RESOURCE_GPU, DEVICES, ResponseOptions(), topology=model,
                              allocation_policy=policy)
    got = manager.preferred([PreferredRequest([IDS[i] for i in available],
                                              [IDS[i] for i in must], size)])[0]
    return [IDS.index(i) for i in got]


def test_best_effort_takes_the_best_links_packed_the_broken_island(model, fast_impl):
    assert type(model.search).__module__ == fast_impl.topology.__name__
    free = [0, 1, 4, 5, 6, 7]
    assert sorted(pick(model, free, 2, "best-effort")) == [4, 5]  # NV18 beats NV12
    # island 1 stays whole for a 4-GPU pod
    assert sorted(pick(model, free, 2, "packed")) == [0, 1]
    assert sorted(pick(model, free, 4, "packed")) == [4, 5, 6, 7]  # only island 1 fits
    # no group holds GPU 0 and 2 more: the best set overall (the NV18 pair beats NV12 + SYS)
    assert sorted(pick(model, free, 3, "packed", must=[0])) == [0, 4, 5]


def test_the_model_scores_pairs_as_documented(model):
    assert model.scores[0][1] == 100 * 12 + 20 + 5  # NV12, NODE, one NUMA node
    assert model.scores[4][5] == 100 * 18 + 20 + 5
    assert model.scores[0][4] == 10  # SYS, two NUMA nodes
    assert model.describe([0, 1, 4]) == "GPU0-GPU1 NV12, GPU0-GPU4 SYS, GPU1-GPU4 SYS"


def replicas(gpus: list[Gpu], per_gpu: int) -> list[Device]:
    """`per_gpu` devices on each GPU, sharing its UUID (time-slicing's `<uuid>::<n>` IDs)."""
    return [Device(id=f"{g.uuid}::{r}", index=f"{g.index}::{r}", gpu_uuid=g.uuid,
                   gpu_index=g.index, numa_node=g.numa_node, paths=(f"/dev/nvidia{g.minor}",))
            for g in gpus for r in range(per_gpu)]


SHARED = replicas(ISLANDS, 4)
KNOWN = {d.id: d for d in SHARED}
GPU_OF = {d.id: d.gpu_index for d in SHARED}


def shared_pick(model, available, size, policy, must=()):
    return preferred_allocation(RESOURCE_GPU, available, must, size, KNOWN, model=model,
                                replica_policy=policy)


def test_distributed_replicas_spread_over_the_best_linked_gpus(model):
    ids = [d.id for d in SHARED]
    got = shared_pick(model, ids, 3, "distributed")
    assert len({GPU_OF[i] for i in got}) == 3
    assert {GPU_OF[i] for i in got} <= {4, 5, 6, 7}  # the NV18 island
    many = shared_pick(model, ids, 12, "distributed")  # more than the 8 GPUs: every GPU, evenly
    assert sorted(Counter(GPU_OF[i] for i in many).values()) == [1] * 4 + [2] * 4


def test_distributed_replicas_go_to_the_least_used_gpus_first(model):
    """NVIDIA's greedyAlloc (internal/rm/allocate.go, v0.20.0): the GPU with the fewest
    replicas allocated (total - available) first; the links only decide among GPUs used
    alike."""
    # island 1 (NV18, the better links) has 2 of 4 replicas taken on every GPU
    ids = [d.id for d in SHARED if not (d.gpu_index >= 4 and d.id[-1] in "01")]
    assert {GPU_OF[i] for i in shared_pick(model, ids, 3, "distributed")} <= {0, 1, 2, 3}
    # one-replica pods one after another: each lands on a GPU nobody uses yet
    free, gpus = [d.id for d in SHARED], []
    for _ in range(8):
        got = shared_pick(model, free, 1, "distributed")[0]
        free.remove(got)
        gpus.append(GPU_OF[got])
    assert sorted(gpus) == list(range(8))


def test_packed_replicas_fill_a_gpu_in_use_first(model):
    # GPU 2 has only one replica left (three taken), GPU 5 two: packed fills GPU 2 first
    ids = [d.id for d in SHARED if not (d.gpu_index == 2 and d.id[-1] in "012")
           and not (d.gpu_index == 5 and d.id[-1] in "01")]
    assert [GPU_OF[i] for i in shared_pick(model, ids, 1, "packed")] == [2]
    # then the GPU best linked to GPU 2 (its island), before the fuller GPU 5 across sockets
    assert [GPU_OF[i] for i in shared_pick(model, ids, 3, "packed")] == [2, 0, 0]
    assert [GPU_OF[i] for i in shared_pick(model, ids, 2, "packed", must=[ids[-1]])][1] == 7
    # a request that starts on GPU 6 stays there while it has replicas
    must = [d.id for d in SHARED if d.gpu_index == 6][:1]
    got = shared_pick(model, ids, 4, "packed", must=must)
    assert got[0] == must[0] and [GPU_OF[i] for i in got] == [6, 6, 6, 6]


@pytest.mark.parametrize("policy", ["distributed", "packed"])
def test_replica_answers_do_not_depend_on_the_request_order(model, policy):
    ids = [d.id for d in SHARED][::3]
    assert shared_pick(model, ids, 5, policy) == shared_pick(model, list(reversed(ids)), 5,
                                                             policy)
