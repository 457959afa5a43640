"""agent/nvml/mig.py: MIG devices read through pynvml from the simulated NVML, and their
profile names computed as go-nvlib computes them (k8s-device-plugin's vendored
github.com/NVIDIA/go-nvlib pkg/nvlib/device/mig_profile.go: getMigMemorySizeGB and
MigProfileInfo.String(); mig_device.go GetProfile; device.go VisitMigDevices)."""

from __future__ import annotations

import pytest

from agent.nvml import discovery, mig
from agent.sim.profile import load_profile

GIB = 1 << 30


@pytest.mark.parametrize("total_gib, memory_mb, gb", [
    # A100-SXM4-40GB (40 GiB): 1g.5gb, 2g.10gb, 3g.20gb, 7g.40gb as nvidia-smi mig -lgip lists
    (40, 4864, 5), (40, 9984, 10), (40, 20096, 20), (40, 40192, 40),
    # A100-SXM4-80GB: 1g.10gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb
    (80, 9728, 10), (80, 19968, 20), (80, 40192, 40), (80, 80896, 80),
])
def test_memory_gb_rounds_the_share_up_to_eighths_of_the_whole_gb(total_gib, memory_mb, gb):
    assert mig.memory_gb(total_gib * GIB, memory_mb) == gb


def test_memory_gb_counts_a_partial_gib_of_the_parent_as_a_whole_one():
    # go-nvlib: totalMemGB = ceil(total / 1 GiB); an 80 GB part reporting 79.65 GiB is 80
    assert mig.memory_gb(85520809984, 9856) == 10


@pytest.mark.parametrize("ci, gi, gb, suffix, name", [
    (1, 1, 10, "", "1g.10gb"),
    (3, 3, 40, "", "3g.40gb"),
    (1, 3, 20, "", "1c.3g.20gb"),  # a compute instance smaller than its GPU instance
    (2, 4, 20, "", "2c.4g.20gb"),
    (1, 1, 10, "+me", "1g.10gb+me"),
    (1, 1, 10, "-me", "1g.10gb-me"),
])
def test_profile_name_is_go_nvlibs(ci, gi, gb, suffix, name):
    assert mig.profile_name(ci, gi, gb, suffix) == name


def test_read_mig_devices_of_a100_mig_match_the_profiles_the_driver_lists(node):
    node("a100-mig")
    spec = load_profile("a100-mig")
    found = mig.read_mig_devices(discovery.discover())
    expected = []
    for g in spec["gpus"]:
        m = g.get("mig", {})
        if m.get("mode") != "enabled":
            continue  # GPU 7: enabling is pending, the current mode counts (as NVIDIA)
        names = {p["nvml_profile"]: p["name"] for p in m["profiles"]}
        expected += [(g["index"], k, i["uuid"], i["gi"], i["ci"], names[i["profile"]])
                     for k, i in enumerate(m["instances"])]
    assert [(d.parent.index, d.index, d.uuid, d.gi, d.ci, d.profile) for d in found] == expected
    assert {d.index_id for d in found if d.parent.index == 1} == {"1:0", "1:1", "1:2", "1:3"}


def test_gpus_without_mig_have_no_mig_devices(node):
    node("dgx1-v100")
    assert mig.read_mig_devices(discovery.discover()) == []


def test_sim_mig_records_change_the_layout_every_reader_sees(node, sim_control):
    from agent.sim import mig as sim_mig

    node("a100-mig")
    gpus = discovery.discover()
    before = {d.uuid: d for d in mig.read_mig_devices(gpus) if d.parent.index == 5}
    assert sorted(d.profile for d in before.values()) == ["3g.40gb", "3g.40gb"]
    shape = mig.layout(gpus)
    # the two 3g.40gb take all eight memory slices (placements 0:4 and 4:4): no 1g.10gb fits
    sim_mig.create(sim_control, 5, "1g.10gb", profile="a100-mig")
    assert mig.layout(gpus) == shape
    keep, gone = [d for d in mig.read_mig_devices(gpus) if d.parent.index == 5]
    sim_mig.destroy(sim_control, gone.uuid)  # frees slices 4-7
    shape = mig.layout(gpus)
    sim_mig.create(sim_control, 5, "2g.20gb", profile="a100-mig")  # at 4:2
    sim_mig.create(sim_control, 5, "3g.40gb", profile="a100-mig")  # no room: nothing made
    after = [d for d in mig.read_mig_devices(gpus) if d.parent.index == 5]
    assert [d.profile for d in after] == ["3g.40gb", "2g.20gb"]
    assert after[0].uuid == keep.uuid  # the instance there keeps its UUID
    new = after[1]
    assert new.uuid.startswith("MIG-") and new.uuid not in before and new.gi != keep.gi
    assert mig.layout(gpus) != shape
    sim_mig.destroy(sim_control, new.uuid)
    assert mig.layout(gpus) == shape
    sim_mig.set_layout(sim_control, 5, None, profile="a100-mig")  # MIG off
    assert [g.mig_enabled for g in discovery.discover() if g.index == 5] == [False]
    sim_mig.set_layout(sim_control, 5, {"2g.20gb": 3}, profile="a100-mig")
    assert [d.profile for d in mig.read_mig_devices(discovery.discover())
            if d.parent.index == 5] == ["2g.20gb"] * 3


def test_gpu_agent_sim_mig_apply_takes_a_mig_parted_file(node, sim_control, tmp_path):
    from tests.conftest import run_gpu_agent

    node("a100-mig")
    config = tmp_path / "mig.yaml"
    config.write_text("version: v1\nmig-configs:\n  small:\n    - devices: [4, 5]\n"
                      "      mig-enabled: true\n      mig-devices:\n        \"1g.10gb\": 7\n"
                      "    - devices: [0]\n      mig-enabled: false\n")
    out = run_gpu_agent("sim", "mig", "apply", str(config), "--control-dir", str(sim_control),
                        "--profile", "a100-mig")
    assert out.stdout.splitlines() == ["mig gpu=0 mode=disabled", "mig gpu=4 layout=1g.10gb:7",
                                       "mig gpu=5 layout=1g.10gb:7"]
    found = mig.read_mig_devices(discovery.discover())
    assert [d.profile for d in found if d.parent.index in (4, 5)] == ["1g.10gb"] * 14
    assert not [d for d in found if d.parent.index == 0]
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: v1\nmig-configs:\n  big:\n    - devices: all\n"
                   "      mig-enabled: true\n      mig-devices: {\"7g.80gb\": 2}\n")
    out = run_gpu_agent("sim", "mig", "apply", str(bad), "--control-dir", str(sim_control),
                        "--profile", "a100-mig", check=False)
    assert out.returncode == 2 and "GPU 0: the layout {'7g.80gb': 2} needs 14 slices" in out.stderr
