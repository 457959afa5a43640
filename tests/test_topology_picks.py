"""Preferred allocation on the real `nvidia-smi topo -m` matrices of tests/data/topologies/.

Owns: for each file, the profile `agent.sim.profile.profile_from_topo` makes of it, loaded in
the simulated libnvidia-ml.so.1, read back by the agent's own discovery (`discover`,
`read_links`) into the TopologyModel, and the picks of `ResourceManager.preferred` judged
against the file's own cells (this file reads them with test_sim_topologies' small parser, not
through the agent): the 2-GPU pick is a pair with the best cell of the node, the DGX-1V 4-GPU
pick is a fully NVLinked quad, a PCIe box's pair shares a switch, the pick stays on one NUMA
node when one holds it, and every pick scores the brute-force optimum. One daemon test checks
that GetPreferredAllocation keeps answering after a GPU falls off the bus. Every test runs with
the compiled search and with its twin (conftest's `fast_impl`; the daemon's through
GPU_AGENT_PURE_PYTHON=1).
"""

from __future__ import annotations

import itertools
import re

import grpc
import pytest

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent.nvml import discovery, library
from agent.rm.allocate import ResponseOptions
from agent.rm.devices import RESOURCE_GPU, full_gpu_devices
from agent.rm.manager import PreferredRequest, ResourceManager
from agent.rm.topology import TopologyModel
from agent.sim import control, lib_path
from agent.sim.profile import dump_profile, profile_from_topo
from tests.conftest import DATA, drain_nvml
from tests.daemon_harness import Node
from tests.test_sim_topologies import expected

TOPOLOGIES = sorted((DATA / "topologies").glob("*.txt"))
RANK = {"PIX": 5, "PXB": 4, "PHB": 3, "NODE": 2, "SYS": 1}


def cell_rank(cell: str) -> int:
    """How good a matrix cell is: NV# by link count above every PCIe level."""
    m = re.fullmatch(r"NV(\d+)", cell)
    return 100 + int(m.group(1)) if m else RANK[cell]


@pytest.fixture(scope="module")
def discovered(tmp_path_factory):
    """{file stem: (GPUs, links)} read through the simulated NVML, one init each."""
    out = {}
    root = tmp_path_factory.mktemp("topo")
    mp = pytest.MonkeyPatch()
    mp.setenv("GPU_AGENT_SIM_CONTROL", str(root))
    mp.delenv("GPU_AGENT_SIM_FAULTS", raising=False)
    try:
        for topo in TOPOLOGIES:
            path = root / f"{topo.stem}.yaml"
            path.write_text(dump_profile(profile_from_topo(topo.read_text(), "t", None,
                                                           str(topo))))
            mp.setenv("GPU_AGENT_SIM_PROFILE", str(path))
            drain_nvml()
            library.init(str(lib_path()))
            try:
                gpus = discovery.discover()
                links = discovery.read_links(gpus)
            finally:
                drain_nvml()
            out[topo.stem] = (gpus, links)
    finally:
        mp.undo()
    return out


@pytest.fixture(scope="module")
def models(discovered, fast_impl):
    """{file stem: (TopologyModel, GPUs)}, searched by the compiled module, then by the twin."""
    return {stem: (TopologyModel.from_links(gpus, links, topology_module=fast_impl.topology), gpus)
            for stem, (gpus, links) in discovered.items()}


def pick(model: TopologyModel, gpus, size: int, must=(), available=None,
         policy: str = "best-effort") -> list[int]:
    devices = full_gpu_devices(gpus)
    manager = ResourceManager(RESOURCE_GPU, devices, ResponseOptions(), topology=model,
                              allocation_policy=policy)
    ids = [d.id for d in devices]
    avail = ids if available is None else [ids[i] for i in available]
    got = manager.preferred([PreferredRequest(avail, [ids[i] for i in must], size)])[0]
    index = {d.id: d.gpu_index for d in devices}
    return [index[i] for i in got]


@pytest.mark.parametrize("topo", TOPOLOGIES, ids=[p.stem for p in TOPOLOGIES])
def test_sensible_picks_on_real_topologies(models, topo):
    model, gpus = models[topo.stem]
    matrix, numa = expected(topo)
    n = len(matrix)
    assert [model.link(a, b).label for a in range(n) for b in range(n) if a != b] == \
        [matrix[a][b] for a in range(n) for b in range(n) if a != b]  # read back as in the file
    pair = pick(model, gpus, 2)
    best_cell = max(cell_rank(matrix[a][b]) for a in range(n) for b in range(n) if a != b)
    assert cell_rank(matrix[pair[0]][pair[1]]) == best_cell, (pair, matrix)
    for size in range(1, n + 1):
        got = pick(model, gpus, size)
        assert len(set(got)) == size
        # on one NUMA node whenever one node holds `size` GPUs and NVLink does not say otherwise
        nv = any(c.startswith("NV") for row in matrix for c in row)
        homes = [node for node in set(numa) if node is not None and numa.count(node) >= size]
        if homes and not nv:
            assert len({numa[g] for g in got}) == 1, (size, got, numa)
        # the highest set score of all C(n, size) sets
        score = model.search.set_score(sum(1 << g for g in got))
        assert score == max(model.search.set_score(sum(1 << g for g in c))
                            for c in itertools.combinations(range(n), size))


def test_dgx1v_four_gpus_are_a_fully_nvlinked_quad(models):
    model, gpus = models["dgx1v-8x-v100-sxm2"]
    matrix, _numa = expected(DATA / "topologies" / "dgx1v-8x-v100-sxm2.txt")
    quad = pick(model, gpus, 4)
    assert sorted(quad) == [0, 1, 2, 3]
    assert all(matrix[a][b].startswith("NV") for a, b in itertools.combinations(quad, 2))
    # with GPU 1 taken, the best quad left is the other fully NVLinked one
    assert sorted(pick(model, gpus, 4, available=[0, 2, 3, 4, 5, 6, 7])) == [4, 5, 6, 7]
    # must-include GPU 5: its NVLinked peers on its socket
    three = pick(model, gpus, 3, must=[5])
    assert three[0] == 5 and all(matrix[5][g].startswith("NV") for g in three[1:])


@pytest.mark.parametrize("stem, size, want", [
    pytest.param("pcie-8x-pix-phb-sys", 2, "PIX", id="pix-phb-sys-pair"),
    pytest.param("pcie-8x-pix-pxb-sys", 2, "PIX", id="pix-pxb-sys-pair"),
    pytest.param("pcie-8x-p100-single-socket", 2, "PIX", id="p100-pair"),
    pytest.param("pcie-8x-a100-nvbridge-pairs", 2, "NV12", id="a100-bridge-pair"),
    pytest.param("workstation-4x-rtx3090-nvbridge-pairs", 2, "NV4", id="rtx3090-bridge-pair"),
])
def test_a_pcie_box_pair_shares_a_switch_or_a_bridge(models, stem, size, want):
    model, gpus = models[stem]
    matrix, _numa = expected(DATA / "topologies" / f"{stem}.txt")
    a, b = pick(model, gpus, size)
    assert matrix[a][b] == want
    # taking one GPU of that pair leaves its partner for the next pod only if nothing better
    rest = [g for g in range(len(gpus)) if g != a]
    c, d = pick(model, gpus, 2, available=rest)
    assert matrix[c][d] == want or b not in (c, d)


def test_all_sys_box_keeps_a_four_gpu_pod_on_one_socket(models):
    model, gpus = models["pcie-8x-rtx4090-all-sys"]
    _matrix, numa = expected(DATA / "topologies" / "pcie-8x-rtx4090-all-sys.txt")
    got = pick(model, gpus, 4, available=[0, 4, 5, 1, 6, 7, 2])
    assert len({numa[g] for g in got}) == 1 and set(got) == {4, 5, 6, 7}


def test_packed_fills_a_broken_island_before_a_whole_one(models):
    """On the NVBridge-pairs box: pair 0-1 is half used; packed gives GPU 1's partner-less
    pod slot there, best-effort the same for a single GPU (the tie-break), so a 2-GPU pod
    later still finds a whole bridged pair."""
    model, gpus = models["pcie-8x-a100-nvbridge-pairs"]
    matrix, _numa = expected(DATA / "topologies" / "pcie-8x-a100-nvbridge-pairs.txt")
    partner = next(b for b in range(8) if matrix[0][b] == "NV12")
    rest = [g for g in range(8) if g != 0]
    for policy in ("packed", "best-effort"):
        assert pick(model, gpus, 1, available=rest, policy=policy) == [partner]


def test_preferred_allocation_survives_a_gpu_falling_off_the_bus(fast_impl):
    """The model is built at start: a lost GPU changes no answer and fails no call."""
    with Node("pcie-8gpu", pure_python=fast_impl.pure_python) as node:
        agent = node.agent()
        agent.wait_registered()
        agent.wait_log(f"implementation {fast_impl.name}")
        uuids = [d.id for d in node.client.state().resource(RESOURCE_GPU).devices]
        request = dp.PreferredAllocationRequest(container_requests=[
            dp.ContainerPreferredAllocationRequest(available_deviceIDs=uuids,
                                                   allocation_size=2)])
        before = list(agent.stub().GetPreferredAllocation(request, timeout=10)
                      .container_responses[0].deviceIDs)
        control.lose(node.ctl, 0)
        control.lose(node.ctl, 1)
        try:
            after = list(agent.stub().GetPreferredAllocation(request, timeout=10)
                         .container_responses[0].deviceIDs)
        except grpc.RpcError as exc:  # pragma: no cover - the failure this test guards
            pytest.fail(f"GetPreferredAllocation failed after a GPU was lost: {exc}")
        assert after == before and len(after) == 2
