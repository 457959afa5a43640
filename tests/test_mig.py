"""MIG strategies through `gpu-agent run` on the simulated a100-mig node (and variants of it
written per test), against the simulated kubelet: the resources and counts kubelet sees per
strategy, the layouts `single` refuses (exit 1 whatever failOnInitError says), Allocate of MIG
devices per device-list and device-ID strategy, `resources.mig` renames, health per instance.

Every rule is NVIDIA's, read at k8s-device-plugin commit 1b826acc6 (main, 2026):
- [GPUMAP] internal/rm/device_map.go buildGPUDeviceMap: a MIG-enabled GPU is left out of the
  full-GPU resources unless the strategy is none.
- [MIGMAP] device_map.go buildMigDeviceMap: each MIG device takes the first resources.mig
  pattern matching its profile name; none matching is an error.
- [DEFAULTS] internal/rm/rm.go AddDefaultResourcesToConfig: single adds the pattern "*" ->
  gpu; mixed adds, per profile whose compute instance is the whole GPU instance (C == G),
  the pattern <profile> -> mig-<profile> with "+" written "." (smaller compute instances
  get no default).
- [VALID] device_map.go assertAllMigDevicesAreValid: a MIG-enabled GPU without MIG devices is
  an error under single ("device N has no MIG devices configured"), a warning under mixed;
  single takes one MIG device type ("more than one MIG device type present on node").
- [UNIFORM] device_map.go buildDeviceMapFromConfigResources: single refuses full GPUs beside
  MIG devices ("all devices on the node must be configured with the same migEnabled value").
- [EXIT] cmd/nvidia-device-plugin/main.go startPlugins: GetPlugins' error ("error getting
  plugins") ends the plugin; failOnInitError only guards NVML init (internal/plugin/factory.go).
- [IDS] internal/rm/nvml_devices.go newMigDevice: the index ID is "<gpu index>:<MIG handle
  index>"; the ID is the MIG UUID.
- Profile names: vendored go-nvlib pkg/nvlib/device/mig_profile.go String().
"""

from __future__ import annotations

import uuid

import grpc
import pytest

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from agent.sim import control
from agent.sim.profile import dump_profile, gpu_bus_id, load_profile
from tests.daemon_harness import GPU, Node

A100 = load_profile("a100-mig")

# a100-mig under mixed: [GPUMAP] keeps GPUs 2, 6, 7 (MIG disabled; 7 only pending) whole,
# [DEFAULTS] names the rest by profile.
MIXED_A100 = {
    GPU: 3,
    "nvidia.com/mig-1g.10gb": 7 + 2,  # GPU 0: 7; GPU 1: 2
    "nvidia.com/mig-2g.20gb": 1,  # GPU 1
    "nvidia.com/mig-3g.40gb": 1 + 1 + 2,  # GPUs 1, 4, 5
    "nvidia.com/mig-4g.40gb": 1,  # GPU 4
    "nvidia.com/mig-7g.80gb": 1,  # GPU 3
}


def _instances(gpu: dict) -> list[dict]:
    return gpu.get("mig", {}).get("instances", [])


def _variant(node: Node, gpus: list[dict]) -> str:
    """A copy of a100-mig holding `gpus` (re-indexed, MIG UUIDs made unique), as a file."""
    profile = dict(A100)
    out = []
    for i, g in enumerate(gpus):
        g = {**g, "index": i, "minor": i, "uuid": f"GPU-{uuid.uuid5(uuid.NAMESPACE_OID, str(i))}",
             "serial": f"17000000{i:05d}", "pci": {**g["pci"], "bus_id": gpu_bus_id(i)}}
        if "mig" in g:
            g["mig"] = {**g["mig"], "instances": [
                {**inst, "uuid": f"MIG-{uuid.uuid5(uuid.NAMESPACE_OID, f'{i}/{k}')}"}
                for k, inst in enumerate(_instances(g))]}
        out.append(g)
    profile["gpus"] = out
    profile["pcie_topology"] = [row[:len(out)] for row in A100["pcie_topology"][:len(out)]]
    return node.write("variant.yaml", dump_profile(profile))


def _counts(node: Node) -> dict[str, int]:
    return {r.name: len(r.devices) for r in node.client.state().resources.values()
            if r.devices}


def _wait_resources(agent, names) -> None:
    agent.wait_for(lambda s: all((r := s.resource(n)) is not None and r.connected and r.devices
                                 for n in names), f"registration of {sorted(names)}")


def test_mixed_advertises_each_profile_and_the_gpus_without_mig():
    with Node("a100-mig") as node:
        agent = node.agent("--mig-strategy", "mixed")
        _wait_resources(agent, MIXED_A100)
        assert _counts(node) == MIXED_A100
        state = node.client.state()
        mig_uuids = {i["uuid"] for g in A100["gpus"] for i in _instances(g)
                     if g.get("mig", {}).get("mode") == "enabled"}
        advertised = {d.id for r in state.resources.values() if r.name != GPU
                      for d in r.devices}
        assert advertised == mig_uuids  # [IDS]: MIG UUIDs
        assert {d.id for d in state.resource(GPU).devices} == \
            {A100["gpus"][i]["uuid"] for i in (2, 6, 7)}


def test_mixed_allocate_hands_out_mig_uuids_or_gpu_colon_mig_indexes():
    with Node("a100-mig") as node:
        agent = node.agent("--mig-strategy", "mixed")
        _wait_resources(agent, MIXED_A100)
        got = node.client.admit_pod("p", {"main": {"nvidia.com/mig-1g.10gb": 2}})
        alloc = got.container("main").allocation("nvidia.com/mig-1g.10gb")
        ids = list(alloc.device_ids)
        assert all(i.startswith("MIG-") for i in ids)
        assert alloc.container_response.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(ids)
        agent.stop()

        by_uuid = {i["uuid"]: (g["index"], k) for g in A100["gpus"]
                   for k, i in enumerate(_instances(g))}
        agent = node.agent("--mig-strategy", "mixed", "--device-id-strategy", "index",
                           "--device-list-strategy", "volume-mounts")
        _wait_resources(agent, MIXED_A100)
        got = node.client.admit_pod("q", {"main": {"nvidia.com/mig-3g.40gb": 1}})
        alloc = got.container("main").allocation("nvidia.com/mig-3g.40gb")
        gpu, k = by_uuid[alloc.device_ids[0]]
        mounts = [m.container_path for m in alloc.container_response.mounts]
        assert mounts == [f"/var/run/nvidia-container-devices/{gpu}:{k}"]  # [IDS]


def test_resources_mig_pattern_renames_before_the_defaults():
    with Node("a100-mig") as node:
        config = node.write("config.yaml", "version: v1\nresources:\n  mig:\n"
                                           "    - pattern: '1g.*'\n      name: mig-small\n")
        agent = node.agent("--mig-strategy", "mixed", "--config", config)
        expected = {("nvidia.com/mig-small" if k == "nvidia.com/mig-1g.10gb" else k): v
                    for k, v in MIXED_A100.items()}
        _wait_resources(agent, expected)
        assert _counts(node) == expected  # [MIGMAP]: the configured pattern first


@pytest.mark.parametrize("fail_on_init_error", ["true", "false"])
def test_single_refuses_several_mig_device_types_and_exits(fail_on_init_error):
    with Node("a100-mig") as node:
        agent = node.agent("--mig-strategy", "single",
                           "--fail-on-init-error", fail_on_init_error)
        assert agent.wait_exit() == 1  # [EXIT]
        assert "more than one MIG device type present on node" in agent.log  # [VALID]
        assert node.client.state().resource(GPU) is None


def test_single_advertises_the_mig_devices_of_a_uniform_node_as_gpus():
    with Node("a100-mig") as node:
        node.profile = _variant(node, [A100["gpus"][0]] * 3)  # 3 GPUs of 7x 1g.10gb
        agent = node.agent("--mig-strategy", "single")
        res = agent.wait_registered()
        assert len(res.devices) == 21 and all(d.id.startswith("MIG-") for d in res.devices)
        assert _counts(node) == {GPU: 21}  # [DEFAULTS]: single names every profile gpu


def test_single_refuses_mig_devices_beside_full_gpus():
    with Node("a100-mig") as node:
        node.profile = _variant(node, [A100["gpus"][0], A100["gpus"][2]])
        agent = node.agent("--mig-strategy", "single")
        assert agent.wait_exit() == 1
        assert "all devices on the node must be configured with the same migEnabled " \
            "value" in agent.log  # [UNIFORM]


def test_a_mig_enabled_gpu_without_mig_devices_is_refused_by_single_and_skipped_by_mixed():
    with Node("a100-mig") as node:
        empty = {**A100["gpus"][3], "mig": {**A100["gpus"][3]["mig"], "instances": []}}
        node.profile = _variant(node, [A100["gpus"][0], empty])
        agent = node.agent("--mig-strategy", "single")
        assert agent.wait_exit() == 1
        assert "device 1 has no MIG devices configured" in agent.log  # [VALID]
        agent = node.agent("--mig-strategy", "mixed")
        _wait_resources(agent, ["nvidia.com/mig-1g.10gb"])
        assert _counts(node) == {"nvidia.com/mig-1g.10gb": 7}
        assert "device 1 has no MIG devices configured" in agent.log  # a warning only


def test_a_reload_to_a_refused_layout_keeps_serving_the_running_one():
    with Node("a100-mig") as node:
        config = node.write("config.yaml", "version: v1\nflags:\n  migStrategy: mixed\n")
        agent = node.agent("--config", config)
        _wait_resources(agent, MIXED_A100)
        node.write("config.yaml", "version: v1\nflags:\n  migStrategy: single\n")
        agent.send(__import__("signal").SIGHUP)
        agent.wait_log("reload refused")
        assert "more than one MIG device type present on node" in agent.log
        assert agent.alive() and _counts(node) == MIXED_A100


def test_xid_on_one_instance_withdraws_that_mig_device_and_on_the_gpu_all_of_them():
    gpu = A100["gpus"][1]  # 3g.40gb, 2g.20gb, 2x 1g.10gb
    one = _instances(gpu)[2]
    with Node("a100-mig") as node:
        agent = node.agent("--mig-strategy", "mixed", "--recovery-quiet-period", "0.5s")
        _wait_resources(agent, MIXED_A100)

        def unhealthy(state):
            return {d.id for r in state.resources.values() for d in r.devices if not d.healthy}

        control.inject_xid(node.ctl, 1, 48, gi=one["gi"], ci=one["ci"])
        agent.wait_for(lambda s: unhealthy(s) == {one["uuid"]}, "one MIG device withdrawn")
        agent.wait_for(lambda s: not unhealthy(s), "the MIG device back after the quiet period")
        control.inject_xid(node.ctl, 1, 48)  # no instance: the whole GPU
        every = {i["uuid"] for i in _instances(gpu)}
        agent.wait_for(lambda s: unhealthy(s) == every, "every MIG device of GPU 1 withdrawn")
        agent.wait_for(lambda s: not unhealthy(s), "all back after the quiet period")


def test_sighup_moves_between_strategies_and_gpu_never_drops_to_zero():
    with Node("a100-mig") as node:
        config = node.write("config.yaml", "version: v1\nflags:\n  migStrategy: none\n")
        agent = node.agent("--config", config)
        agent.wait_registered()
        assert _counts(node) == {GPU: 8}
        node.write("config.yaml", "version: v1\nflags:\n  migStrategy: mixed\n")
        agent.send(__import__("signal").SIGHUP)
        _wait_resources(agent, MIXED_A100)
        agent.wait_for(lambda s: len(s.resource(GPU).devices) == 3, "nvidia.com/gpu down to 3")
        assert _counts(node) == MIXED_A100
        # the resource that stays (nvidia.com/gpu) was never taken away from kubelet
        assert node.client.zero_windows(GPU) == []
        assert node.client.state().resource(GPU).registrations == 1


def test_preferred_allocation_keeps_mig_devices_on_one_parent_gpu():
    with Node("a100-mig") as node:
        agent = node.agent("--mig-strategy", "mixed")
        _wait_resources(agent, MIXED_A100)
        parent = {i["uuid"]: g["index"] for g in A100["gpus"] for i in _instances(g)}
        small = sorted(d.id for d in node.client.state().resource(
            "nvidia.com/mig-1g.10gb").devices)  # 7 on GPU 0, 2 on GPU 1
        channel = grpc.insecure_channel(f"unix:{node.kdir}/gpu-agent-mig-1g.10gb.sock")
        stub = dp_grpc.DevicePluginStub(channel)

        def prefer(size, must=()):
            got = stub.GetPreferredAllocation(dp.PreferredAllocationRequest(container_requests=[
                dp.ContainerPreferredAllocationRequest(available_deviceIDs=small,
                                                       must_include_deviceIDs=list(must),
                                                       allocation_size=size)]), timeout=10)
            return [parent[i] for i in got.container_responses[0].deviceIDs]

        assert prefer(3) == [0, 0, 0]  # the one parent that holds three
        on_1 = [i for i in small if parent[i] == 1]
        assert prefer(2, must=on_1[:1]) == [1, 1]  # its sibling on GPU 1, not one of GPU 0's
        channel.close()
