"""Real `nvidia-smi topo -m` matrices, turned into profiles and read back through NVML.

Owns: for every file in tests/data/topologies/, running `gpu-agent sim profile --from-topo`
as a command, loading the result in the simulated library, and checking that the GPU link
matrix NVML reports (NV# from NVLink state + remote PCI info / remote device type, otherwise
the PCIe common ancestor) equals the file cell for cell, and that NUMA nodes match. The
expected values come from this file's own small reading of the matrix, not from
agent.sim.profile; Hypothesis adds random matrices the rules can represent. Must not patch
pynvml.
"""

from __future__ import annotations

import re
from pathlib import Path

import pynvml
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.nvml import library
from agent.sim import lib_path
from agent.sim.profile import dump_profile, load_profile, profile_from_topo
from tests.conftest import DATA, drain_nvml, run_gpu_agent

TOPOLOGIES = sorted((DATA / "topologies").glob("*.txt"))
LEVEL_NAMES = {10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
TRAILING = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")




def expected(path: Path) -> tuple[list[list[str]], list[int | None]]:
    """The file's GPU matrix, and each GPU's NUMA node by the documented rule."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    header = lines[0]
    names = [c.strip() for c in re.split(r"\t" if "\t" in header else r"\s{2,}", header.strip())
             if c.strip()]
    n = sum(1 for c in names if re.fullmatch(r"GPU\d+", c))
    trailing = [c for c in names if c in TRAILING]
    nics = len(names) - n - len(trailing)
    matrix, numa_col, cpu_col = [], [], []
    for line in lines[1:]:
        tokens = line.split()
        if not re.fullmatch(r"GPU\d+", tokens[0]):
            continue
        matrix.append(tokens[1:n + 1])
        rest = tokens[1 + n + nics:]
        rest = [""] * (len(trailing) - len(rest)) + rest
        values = dict(zip(trailing, rest))
        numa_col.append(values.get("NUMA Affinity", ""))
        cpu_col.append(values.get("CPU Affinity", ""))
    groups = list(dict.fromkeys(c for c in cpu_col if c))
    numa = [int(v) if v.isdigit() else (groups.index(c) if c else None)
            for v, c in zip(numa_col, cpu_col)]
    return matrix, numa


def read_back() -> tuple[list[list[str]], list[int | None]]:
    """The link matrix and NUMA nodes the loaded profile shows through pynvml."""
    N = pynvml
    count = N.nvmlDeviceGetCount()
    handles = [N.nvmlDeviceGetHandleByIndex(i) for i in range(count)]

    def bus(pci) -> str:
        value = pci.busId
        return value.decode() if isinstance(value, bytes) else value

    index_of = {bus(N.nvmlDeviceGetPciInfo(h)): i for i, h in enumerate(handles)}
    direct = [[0] * count for _ in range(count)]
    switched = [0] * count
    for i, h in enumerate(handles):
        for link in range(N.NVML_NVLINK_MAX_LINKS):
            try:
                if not N.nvmlDeviceGetNvLinkState(h, link):
                    continue
            except N.NVMLError_NotSupported:
                continue
            remote = bus(N.nvmlDeviceGetNvLinkRemotePciInfo(h, link))
            if N.nvmlDeviceGetNvLinkRemoteDeviceType(h, link) == N.NVML_NVLINK_DEVICE_TYPE_SWITCH:
                assert remote not in index_of
                switched[i] += 1
            else:
                direct[i][index_of[remote]] += 1
    matrix = []
    for i, a in enumerate(handles):
        row = []
        for j, b in enumerate(handles):
            nv = direct[i][j] + (min(switched[i], switched[j]) if switched[i] and switched[j]
                                 else 0)
            if i == j:
                row.append("X")
            elif nv:
                row.append(f"NV{nv}")
            else:
                row.append(LEVEL_NAMES[N.nvmlDeviceGetTopologyCommonAncestor(a, b)])
        matrix.append(row)
    numa = []
    for h in handles:
        try:
            numa.append(N.nvmlDeviceGetNumaNodeId(h))
        except N.NVMLError_NotSupported:
            numa.append(None)
    return matrix, numa


@pytest.mark.parametrize("topo", TOPOLOGIES, ids=[p.stem for p in TOPOLOGIES])
def test_from_topo_reads_back_the_same_matrix(topo, tmp_path, sim_env):
    out = tmp_path / f"{topo.stem}.yaml"
    env = sim_env(str(out))
    run_gpu_agent("sim", "profile", "--from-topo", str(topo), "-o", str(out), env=env)
    want_matrix, want_numa = expected(topo)
    drain_nvml()
    library.init(str(lib_path()))
    try:
        got_matrix, got_numa = read_back()
    finally:
        drain_nvml()
    assert got_matrix == want_matrix
    assert got_numa == want_numa


@pytest.mark.parametrize("topo", TOPOLOGIES, ids=[p.stem for p in TOPOLOGIES])
def test_from_topo_is_deterministic_and_keeps_the_source(topo, tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    for out in (a, b):
        run_gpu_agent("sim", "profile", "--from-topo", str(topo), "--name", "t", "-o", str(out))
    assert a.read_text() == b.read_text()
    source = topo.read_text().splitlines()[0].removeprefix("# source:").strip()
    assert load_profile(str(a))["source"] == source


def test_nvswitch_rule_picks_the_fabric_by_link_count(tmp_path):
    """NV6 to 3 peers is 18 links (direct); NV18 to 3 peers is 54 (> 18: NVSwitch)."""
    links = {}
    for name in ("hgx-h100-4gpu-nv6", "gb200-4gpu"):
        out = tmp_path / f"{name}.yaml"
        run_gpu_agent("sim", "profile", "--from-topo", str(DATA / "topologies" / f"{name}.txt"),
                      "-o", str(out))
        links[name] = load_profile(str(out))["gpus"][0]["nvlinks"]
    assert sorted(links["hgx-h100-4gpu-nv6"]) == [1] * 6 + [2] * 6 + [3] * 6
    assert len(links["gb200-4gpu"]) == 18
    assert all(str(x).startswith("switch") for x in links["gb200-4gpu"])


def test_nv_pairs_get_node_or_sys_by_numa(tmp_path):
    out = tmp_path / "p.yaml"
    run_gpu_agent("sim", "profile", "--from-topo",
                  str(DATA / "topologies" / "dgx1v-8x-v100-sxm2.txt"), "-o", str(out))
    pcie = load_profile(str(out))["pcie_topology"]
    assert pcie[0][1] == "NODE"  # NV1, same socket
    assert pcie[0][4] == "SYS"   # NV2, other socket


def test_gpu_model_sets_name_and_ids(tmp_path):
    out = tmp_path / "p.yaml"
    run_gpu_agent("sim", "profile", "--from-topo",
                  str(DATA / "topologies" / "hgx-h100-8gpu.txt"), "--gpu-model",
                  "nvidia h100 80gb hbm3", "--name", "h", "-o", str(out))
    gpu = load_profile(str(out))["gpus"][0]
    assert gpu["name"] == "NVIDIA H100 80GB HBM3"
    assert gpu["pci"]["device_id"] == 0x233010DE
    assert gpu["compute_capability"] == [9, 0]


BAD_TOPOS = [
    pytest.param("no matrix here\n", "no header line with GPU0", id="no-header"),
    pytest.param("\tGPU0\tGPU1\nGPU0\t X \tPIX\nGPU1\tPHB\t X \n", "GPU0/GPU1 is PIX but",
                 id="asymmetric"),
    pytest.param("\tGPU0\tGPU1\nGPU0\t X \tFOO\nGPU1\tFOO\t X \n", "'FOO' is not a link code",
                 id="unknown-code"),
    pytest.param("\tGPU0\tGPU1\nGPU0\t X \tPIX\n", "expected rows GPU0..GPU1", id="missing-row"),
    pytest.param("\tGPU0\tGPU1\tGPU2\tGPU3\n"
                 "GPU0\t X \tNV12\tNV12\tPIX\n"
                 "GPU1\tNV12\t X \tPIX\tNV12\n"
                 "GPU2\tNV12\tPIX\t X \tNV12\n"
                 "GPU3\tPIX\tNV12\tNV12\t X \n",
                 "cannot be simulated", id="switched-gpus-without-nvlink"),
]


@pytest.mark.parametrize("text,message", BAD_TOPOS)
def test_bad_topology_is_a_clear_error(tmp_path, text, message):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    proc = run_gpu_agent("sim", "profile", "--from-topo", str(path), check=False)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


@st.composite
def topo_texts(draw):
    """A random `nvidia-smi topo -m` text: PCIe levels, direct NV# pairs or an NVSwitch fabric."""
    n = draw(st.integers(2, 8))
    numa = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    cells = [["X"] * n for _ in range(n)]
    fabric = draw(st.sampled_from([None, 12, 18]))
    budget = [18] * n
    for i in range(n):
        for j in range(i + 1, n):
            if fabric:
                cell = f"NV{fabric}"
            elif draw(st.booleans()) and min(budget[i], budget[j]) > 0:
                k = draw(st.integers(1, min(budget[i], budget[j], 6)))
                budget[i] -= k
                budget[j] -= k
                cell = f"NV{k}"
            else:
                cell = draw(st.sampled_from(["PIX", "PXB", "PHB", "NODE", "SYS"]))
            cells[i][j] = cells[j][i] = cell
    header = "\t" + "\t".join(f"GPU{i}" for i in range(n)) + "\tCPU Affinity\tNUMA Affinity"
    rows = [f"GPU{i}\t" + "\t".join(" X " if c == "X" else c for c in cells[i])
            + f"\t{numa[i] * 16}-{numa[i] * 16 + 15}\t{numa[i]}" for i in range(n)]
    return "\n".join([header, *rows]) + "\n", cells, numa


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=topo_texts())
def test_any_representable_matrix_reads_back(case, tmp_path, sim_env):
    text, cells, numa = case
    path = tmp_path / "random.yaml"
    path.write_text(dump_profile(profile_from_topo(text, "random")))
    sim_env(str(path))
    drain_nvml()
    library.init(str(lib_path()))
    try:
        assert read_back() == (cells, numa)
    finally:
        drain_nvml()
