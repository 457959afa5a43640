"""GPU discovery and the link model, read through pynvml from the simulated NVML."""

from __future__ import annotations

import pytest

from agent.nvml import discovery
from agent.sim.profile import load_profile
from tests.daemon_harness import Node


@pytest.mark.parametrize("profile", ["dgx1-v100", "dgx-h100", "pcie-8gpu", "a100-mig"])
def test_discovery_reports_every_gpu_of_the_profile(node, profile):
    node(profile)
    spec = load_profile(profile)
    gpus = discovery.discover()
    assert [g.index for g in gpus] == [g["index"] for g in spec["gpus"]]
    assert [g.uuid for g in gpus] == [g["uuid"] for g in spec["gpus"]]
    assert [g.minor for g in gpus] == [g["minor"] for g in spec["gpus"]]
    assert [g.numa_node for g in gpus] == [g.get("numa_node") for g in spec["gpus"]]
    assert [g.memory_total for g in gpus] == [g["memory"]["total"] for g in spec["gpus"]]
    assert [g.mig_enabled for g in gpus] == [g.get("mig", {}).get("mode") == "enabled"
                                             for g in spec["gpus"]]


def test_a_lost_gpu_is_left_out_and_the_others_are_found(node, caplog):
    node("dgx1-v100", faults="lost=1")
    gpus = discovery.discover()
    assert [g.index for g in gpus] == [0, 2, 3, 4, 5, 6, 7]
    assert "GPU index 1 is lost" in caplog.text


def test_a_lost_gpu_is_not_in_the_link_model_and_the_other_links_hold(node):
    node("dgx1-v100")
    full = discovery.read_links(discovery.discover())
    assert full[(0, 3)].label == "NV2" and full[(0, 1)].label == "NV1"
    node("dgx1-v100", faults="lost=1")
    links = discovery.read_links(discovery.discover())
    assert (0, 1) not in links  # GPU 1 is not in the model at all
    assert links[(0, 3)] == full[(0, 3)]


def test_the_agent_starts_and_advertises_the_gpus_left_when_one_is_lost():
    with Node("dgx1-v100") as n:
        agent = n.agent(env=n.env(GPU_AGENT_SIM_FAULTS="lost=1"))
        devices = agent.wait_registered().devices
        assert len(devices) == 7
        assert all(d.health == "Healthy" for d in devices)
        assert "GPU index 1 is lost" in agent.log
        assert agent.stop() == 0
