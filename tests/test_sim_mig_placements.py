"""MIG placements and instance creation through NVML on the simulated node.

Owns: checking, through unmodified pynvml, that the simulated library answers NVIDIA's GPU
instance placements (the MIG user guide's `nvidia-smi mig -lgipp` tables for H100/A100 80GB and
A30), places the instances a profile lists, and creates and destroys GPU and compute instances
with real NVML's return codes, each change reaching another process (a subprocess that loads the
library) on its next call. Must not patch pynvml or the library.
"""

from __future__ import annotations

import json
import subprocess
import sys
from ctypes import byref, c_uint

import pynvml as N
import pytest

from tests.conftest import ROOT

# NVML GPU instance profile IDs (nvmlGpuInstanceProfileInfo_t.id) and their placements,
# {starts}: size in memory slices, as NVIDIA's MIG user guide lists them
# (https://docs.nvidia.com/datacenter/tesla/mig-user-guide/, `nvidia-smi mig -lgipp`).
PLACEMENTS_80GB = {
    19: ([0, 1, 2, 3, 4, 5, 6], 1),  # 1g.10gb
    20: ([0, 1, 2, 3, 4, 5, 6], 1),  # 1g.10gb+me
    15: ([0, 2, 4, 6], 2),  # 1g.20gb
    14: ([0, 2, 4], 2),  # 2g.20gb
    9: ([0, 4], 4),  # 3g.40gb
    5: ([0], 4),  # 4g.40gb
    0: ([0], 8),  # 7g.80gb
}
PLACEMENTS_A30 = {
    14: ([0, 1, 2, 3], 1),  # 1g.6gb
    21: ([0, 1, 2, 3], 1),  # 1g.6gb+me
    5: ([0, 2], 2),  # 2g.12gb
    6: ([0, 2], 2),  # 2g.12gb+me
    0: ([0], 4),  # 4g.24gb
}
CI_FULL = {1: N.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, 3: N.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE}


def at_gpu(start: int, size: int):
    """A GPU instance placement as the WithPlacement call takes it: a pointer (pynvml passes
    its argument through, so a bare structure would go by value)."""
    return byref(N.c_nvmlGpuInstancePlacement_t(start, size))


def at_compute(start: int, size: int):
    return byref(N.c_nvmlComputeInstancePlacement_t(start, size))


def placements(device, profile_id: int) -> list[tuple[int, int]]:
    count = c_uint()
    N.nvmlDeviceGetGpuInstancePossiblePlacements(device, profile_id, None, byref(count))
    out = (N.c_nvmlGpuInstancePlacement_t * count.value)()
    N.nvmlDeviceGetGpuInstancePossiblePlacements(device, profile_id, out, byref(count))
    return [(p.start, p.size) for p in out[:count.value]]


def gpu_instances(device, profile_id: int) -> list:
    out = (N.c_nvmlGpuInstance_t * 16)()
    count = c_uint()
    N.nvmlDeviceGetGpuInstances(device, profile_id, out, byref(count))
    return list(out[:count.value])


def placement_of(gpu_instance) -> tuple[int, int]:
    info = N.nvmlGpuInstanceGetInfo(gpu_instance)
    return info.placement.start, info.placement.size


def mig_uuids(device) -> list[str]:
    out = []
    for k in range(N.nvmlDeviceGetMaxMigDeviceCount(device)):
        try:
            out.append(N.nvmlDeviceGetUUID(N.nvmlDeviceGetMigDeviceHandleByIndex(device, k)))
        except N.NVMLError_NotFound:
            break
    return out


# What another process sees of GPU `gpu`: its GPU instances (id, profile id, placement) and
# its MIG devices' UUIDs, as JSON.
PEEK = """
import json, sys
from ctypes import byref, c_uint
import pynvml as N
from agent.nvml import library
from agent.sim import lib_path
library.load(str(lib_path()))
N.nvmlInit()
h = N.nvmlDeviceGetHandleByIndex(int(sys.argv[1]))
gis = []
for p in range(N.NVML_GPU_INSTANCE_PROFILE_COUNT):
    try:
        pid = N.nvmlDeviceGetGpuInstanceProfileInfo(h, p).id
    except N.NVMLError:
        continue
    out, count = (N.c_nvmlGpuInstance_t * 16)(), c_uint()
    N.nvmlDeviceGetGpuInstances(h, pid, out, byref(count))
    for gi in out[:count.value]:
        info = N.nvmlGpuInstanceGetInfo(gi)
        gis.append([info.id, pid, info.placement.start, info.placement.size])
migs = []
for k in range(N.nvmlDeviceGetMaxMigDeviceCount(h)):
    try:
        migs.append(N.nvmlDeviceGetUUID(N.nvmlDeviceGetMigDeviceHandleByIndex(h, k)))
    except N.NVMLError_NotFound:
        break
print(json.dumps({"gis": sorted(gis), "migs": migs}))
"""


def peek(env: dict, gpu: int) -> dict:
    """GPU `gpu` as a second process that loads the library sees it."""
    out = subprocess.run([sys.executable, "-c", PEEK, str(gpu)], env=env, cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout)


@pytest.mark.parametrize("profile, gpu, table", [
    pytest.param("h100-mig", 0, PLACEMENTS_80GB, id="h100-80gb"),
    pytest.param("a100-mig", 0, PLACEMENTS_80GB, id="a100-80gb"),
    pytest.param("a30-mig", 0, PLACEMENTS_A30, id="a30-24gb"),
])
def test_possible_placements_are_nvidias(node, profile, gpu, table):
    node(profile)
    device = N.nvmlDeviceGetHandleByIndex(gpu)
    for profile_id, (starts, size) in table.items():
        count = c_uint()
        N.nvmlDeviceGetGpuInstancePossiblePlacements(device, profile_id, None, byref(count))
        assert count.value == len(starts), profile_id  # NULL placements: the count only
        assert placements(device, profile_id) == [(s, size) for s in starts], profile_id


def test_possible_placements_answer_with_mig_disabled_and_refuse_unknown_profiles(node):
    node("h100-mig")
    disabled = N.nvmlDeviceGetHandleByIndex(2)  # MIG capable, MIG disabled
    assert N.nvmlDeviceGetMigMode(disabled)[0] == 0
    assert placements(disabled, 19) == [(s, 1) for s in range(7)]
    with pytest.raises(N.NVMLError_InvalidArgument):
        placements(disabled, 99)
    with pytest.raises(N.NVMLError_NotSupported):  # no MIG at all
        node("dgx1-v100")
        placements(N.nvmlDeviceGetHandleByIndex(0), 19)


@pytest.mark.parametrize("profile, gpu, expected", [
    # instances listed in the profile get the first placements that let all of them fit
    pytest.param("h100-mig", 0, [(s, 1) for s in range(7)], id="h100-7x1g"),
    # 3g.40gb + 2g.20gb + 2x 1g.10gb: the 3g.40gb cannot start at 0 (the 1g.10gb would have
    # no start left), so it goes to 4:4
    pytest.param("h100-mig", 1, [(0, 2), (2, 1), (3, 1), (4, 4)], id="h100-balanced"),
    pytest.param("h100-mig", 4, [(0, 2), (2, 2), (4, 2), (6, 2)], id="h100-4x1g.20gb"),
    pytest.param("h100-mig", 5, [(0, 8)], id="h100-7g"),
    pytest.param("a100-mig", 5, [(0, 4), (4, 4)], id="a100-2x3g"),
    pytest.param("a30-mig", 3, [(0, 1), (1, 1), (2, 2)], id="a30-mixed"),
])
def test_existing_instances_got_placements(node, profile, gpu, expected):
    node(profile)
    device = N.nvmlDeviceGetHandleByIndex(gpu)
    got = []
    for p in range(N.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            pid = N.nvmlDeviceGetGpuInstanceProfileInfo(device, p).id
        except N.NVMLError:
            continue
        got += [placement_of(gi) for gi in gpu_instances(device, pid)]
    assert sorted(got) == expected


def test_create_and_destroy_gpu_and_compute_instances_seen_by_another_process(node):
    env = node("h100-mig")
    gpu = 2
    device = N.nvmlDeviceGetHandleByIndex(gpu)
    with pytest.raises(N.NVMLError_NotSupported):  # MIG disabled
        N.nvmlDeviceCreateGpuInstance(device, 19)
    from agent.sim import mig as sim_mig

    sim_mig.set_layout(env["GPU_AGENT_SIM_CONTROL"], gpu, {}, profile="h100-mig")  # MIG on
    assert N.nvmlDeviceGetGpuInstanceRemainingCapacity(device, 19) == 7
    assert N.nvmlDeviceGetGpuInstanceRemainingCapacity(device, 9) == 2

    placement = at_gpu(2, 1)
    gi = N.nvmlDeviceCreateGpuInstanceWithPlacement(device, 19, placement)
    info = N.nvmlGpuInstanceGetInfo(gi)
    assert (info.profileId, info.placement.start, info.placement.size) == (19, 2, 1)
    assert N.nvmlDeviceGetIndex(info.device) == gpu
    assert N.nvmlDeviceGetGpuInstanceRemainingCapacity(device, 19) == 6
    assert N.nvmlDeviceGetGpuInstanceRemainingCapacity(device, 9) == 1  # 0:4 overlaps 2

    # the same slice again, a 2g.20gb over it, a placement the profile lacks
    with pytest.raises(N.NVMLError_InsufficientResources):
        N.nvmlDeviceCreateGpuInstanceWithPlacement(device, 19, placement)
    with pytest.raises(N.NVMLError_InsufficientResources):
        N.nvmlDeviceCreateGpuInstanceWithPlacement(device, 14, at_gpu(2, 2))
    with pytest.raises(N.NVMLError_InvalidArgument):
        N.nvmlDeviceCreateGpuInstanceWithPlacement(device, 14, at_gpu(1, 2))
    with pytest.raises(N.NVMLError_InvalidArgument):
        N.nvmlDeviceCreateGpuInstanceWithPlacement(device, 19, at_gpu(7, 1))

    # a GPU instance without a compute instance is listed, but is no MIG device
    assert [N.nvmlGpuInstanceGetInfo(g).id for g in gpu_instances(device, 19)] == [info.id]
    assert mig_uuids(device) == []
    assert peek(env, gpu) == {"gis": [[info.id, 19, 2, 1]], "migs": []}

    # a compute instance of all its slices makes a MIG device, with a UUID, everywhere
    assert N.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, CI_FULL[1]) == 1
    ci = N.nvmlGpuInstanceCreateComputeInstance(gi, CI_FULL[1])
    assert N.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, CI_FULL[1]) == 0
    ci_info = N.nvmlComputeInstanceGetInfo(ci)
    assert (ci_info.placement.start, ci_info.placement.size) == (0, 1)
    assert N.nvmlGpuInstanceGetInfo(ci_info.gpuInstance).id == info.id
    (uuid,) = mig_uuids(device)
    assert uuid.startswith("MIG-")
    mig = N.nvmlDeviceGetHandleByUUID(uuid)
    assert (N.nvmlDeviceGetGpuInstanceId(mig), N.nvmlDeviceGetComputeInstanceId(mig)) == \
        (info.id, ci_info.id)
    assert peek(env, gpu) == {"gis": [[info.id, 19, 2, 1]], "migs": [uuid]}

    # the GPU instance is in use while it has a compute instance
    with pytest.raises(N.NVMLError_InUse):
        N.nvmlGpuInstanceDestroy(gi)
    N.nvmlComputeInstanceDestroy(ci)
    assert mig_uuids(device) == [] and peek(env, gpu)["migs"] == []
    N.nvmlGpuInstanceDestroy(gi)
    assert gpu_instances(device, 19) == []
    assert peek(env, gpu) == {"gis": [], "migs": []}
    assert N.nvmlDeviceGetGpuInstanceRemainingCapacity(device, 19) == 7
    assert N.nvmlDeviceGetGpuInstanceRemainingCapacity(device, 9) == 2
    with pytest.raises(N.NVMLError_InvalidArgument):  # its handle is gone with it
        N.nvmlGpuInstanceGetInfo(gi)


def test_create_without_placement_takes_the_lowest_free_one(node):
    env = node("h100-mig")
    device = N.nvmlDeviceGetHandleByIndex(2)
    from agent.sim import mig as sim_mig

    sim_mig.set_layout(env["GPU_AGENT_SIM_CONTROL"], 2, {}, profile="h100-mig")
    first = N.nvmlDeviceCreateGpuInstance(device, 9)  # 3g.40gb at 0:4
    second = N.nvmlDeviceCreateGpuInstance(device, 9)  # then 4:4
    assert [placement_of(first), placement_of(second)] == [(0, 4), (4, 4)]
    with pytest.raises(N.NVMLError_InsufficientResources):  # all eight memory slices taken
        N.nvmlDeviceCreateGpuInstance(device, 19)
    assert N.nvmlDeviceGetGpuInstanceRemainingCapacity(device, 19) == 0
    # a compute instance smaller than its GPU instance, at a placement of its own
    ci = N.nvmlGpuInstanceCreateComputeInstanceWithPlacement(
        second, CI_FULL[1], at_compute(2, 1))
    assert N.nvmlComputeInstanceGetInfo(ci).placement.start == 2
    with pytest.raises(N.NVMLError_InsufficientResources):
        N.nvmlGpuInstanceCreateComputeInstanceWithPlacement(
            second, CI_FULL[1], at_compute(2, 1))
    with pytest.raises(N.NVMLError_InsufficientResources):  # 3c overlaps it
        N.nvmlGpuInstanceCreateComputeInstance(second, CI_FULL[3])
    name = N.nvmlDeviceGetName(N.nvmlDeviceGetHandleByUUID(mig_uuids(device)[0]))
    assert name.endswith("MIG 1c.3g.40gb")
    assert peek(env, 2)["gis"] == [[1, 9, 0, 4], [2, 9, 4, 4]]


def test_a_created_instance_survives_a_restart_of_the_library(node):
    """State comes from the log: a process that starts later replays the creates."""
    env = node("a30-mig")
    device = N.nvmlDeviceGetHandleByIndex(2)  # 4g.24gb
    (gi,) = gpu_instances(device, 0)
    (ci,) = [N.nvmlGpuInstanceGetComputeInstanceById(gi, 0)]
    N.nvmlComputeInstanceDestroy(ci)
    N.nvmlGpuInstanceDestroy(gi)
    made = N.nvmlDeviceCreateGpuInstanceWithPlacement(device, 5, at_gpu(2, 2))
    N.nvmlGpuInstanceCreateComputeInstance(made, N.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE)
    uuids = mig_uuids(device)
    from tests.conftest import drain_nvml

    drain_nvml()
    N.nvmlInit()
    device = N.nvmlDeviceGetHandleByIndex(2)
    assert mig_uuids(device) == uuids and peek(env, 2)["migs"] == uuids
    assert [placement_of(g) for g in gpu_instances(device, 5)] == [(2, 2)]


# ---- the commands and the profile check (Python, agent/sim/mig.py and profile.py) ----

def test_sim_mig_create_with_a_placement(node, sim_control):
    from tests.conftest import run_gpu_agent

    env = node("h100-mig")
    from agent.sim import mig as sim_mig

    sim_mig.set_layout(sim_control, 2, {}, profile="h100-mig")
    out = run_gpu_agent("sim", "mig", "create", "--gpu", "2", "--placement", "4", "3g.40gb",
                        "--control-dir", str(sim_control), "--profile", "h100-mig")
    assert out.stdout.splitlines() == ["mig gpu=2 create=3g.40gb placement=4"]
    device = N.nvmlDeviceGetHandleByIndex(2)
    assert [placement_of(g) for g in gpu_instances(device, 9)] == [(4, 4)]
    assert len(mig_uuids(device)) == 1 and peek(env, 2)["gis"] == [[1, 9, 4, 4]]
    out = run_gpu_agent("sim", "mig", "create", "--gpu", "2", "--placement", "2", "3g.40gb",
                        "--control-dir", str(sim_control), "--profile", "h100-mig", check=False)
    assert out.returncode == 2 and "3g.40gb has placements [0, 4] (size 4), not 2" in out.stderr


def test_layouts_that_do_not_fit_the_placements_are_refused(node, sim_control):
    from agent.errors import SimError
    from agent.sim import mig as sim_mig
    from agent.sim.profile import load_profile

    a100 = load_profile("a100-mig")
    # 7 compute slices, but the two 3g.40gb take all eight memory slices
    with pytest.raises(SimError, match="does not fit the placements"):
        sim_mig.check_layout(a100, 0, {"3g.40gb": 2, "1g.10gb": 1})
    sim_mig.check_layout(a100, 0, {"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2})  # fits
    # the library refuses such a layout record too: nothing changes
    node("a100-mig")
    device = N.nvmlDeviceGetHandleByIndex(5)
    before = mig_uuids(device)
    from agent.sim.control import append_record

    append_record(sim_control, "mig gpu=5 layout=3g.40gb:2,1g.10gb:1")
    assert mig_uuids(device) == before


def test_a_profile_whose_instances_do_not_fit_is_refused_by_both_readers(node, tmp_path,
                                                                       monkeypatch):
    from agent.errors import SimError
    from agent.sim.profile import load_profile
    from tests.conftest import drain_nvml

    text = (ROOT / "agent/sim/profiles/h100-mig.yaml").read_text()
    extra = ('        - gi: 2\n          ci: 0\n          profile: 2\n'
             '          uuid: "MIG-6b3d5c8f-f5d2-5c36-8006-a8c3da76a680"\n')
    anchor = '          uuid: "MIG-23f263d7-380d-5902-83b9-357fca112869"\n'
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace(anchor, anchor + extra))  # GPU 6: 1g.10gb+me + 2x 3g.40gb
    with pytest.raises(SimError, match="gpus\\[6\\].mig.instances: they do not fit"):
        load_profile(str(bad))
    node("h100-mig")
    drain_nvml()
    monkeypatch.setenv("GPU_AGENT_SIM_PROFILE", str(bad))
    with pytest.raises(N.NVMLError_Unknown):
        N.nvmlInit()
