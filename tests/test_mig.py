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
        agent.wait_log(f"allocated to a container: {ids[0]} (MIG ")
        agent.stop()

        by_uuid = {i["uuid"]: (g["index"], k) for g in A100["gpus"]
                   for k, i in enumerate(_instances(g))}
        agent = node.agent("--mig-strategy", "mixed", "--device-id-strategy", "index",
                           "--device-list-strategy", "volume-mounts")
        for name in MIXED_A100:  # this agent's devices, not the stopped one's last lists
            agent.wait_registered(2, resource=name)
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


# -- a layout changed under the running agent (agent/rm/migwatch.py; the simulator's `mig`
# control records, agent/sim/mig.py) ---------------------------------------------------------


def test_a_layout_changed_while_the_agent_runs_reaches_kubelet_without_a_restart():
    from agent.sim import mig as sim_mig

    with Node("a100-mig") as node:
        agent = node.agent("--mig-strategy", "mixed", "--mig-check-interval", "0.5s")
        _wait_resources(agent, MIXED_A100)
        pid, since = agent.pid, __import__("time").monotonic_ns()
        # GPU 5 (2x 3g.40gb) becomes 7x 1g.10gb; GPU 4 keeps its 4g.40gb + 3g.40gb
        sim_mig.set_layout(node.ctl, 5, {"1g.10gb": 7}, profile=node.profile)
        want = {**MIXED_A100, "nvidia.com/mig-1g.10gb": 9 + 7, "nvidia.com/mig-3g.40gb": 2}
        agent.wait_for(lambda s: {r.name: len(r.devices) for r in s.resources.values()
                                  if r.devices} == want, "the new layout in kubelet")
        assert agent.pid == pid and agent.alive()
        assert "MIG layout changed: GPU " in agent.log
        for name in MIXED_A100:  # resources that stayed were never taken away
            assert node.client.zero_windows(name, since) == [], name
            assert node.client.state().resource(name).registrations == 1, name
        # the instances on GPU 5 can be allocated
        got = node.client.admit_pod("p", {"main": {"nvidia.com/mig-1g.10gb": 9 + 7}})
        assert len(got.container("main").allocation("nvidia.com/mig-1g.10gb").device_ids) == 16


def test_an_instance_destroyed_while_a_pod_holds_it_is_reported():
    from agent.sim import mig as sim_mig

    with Node("a100-mig") as node:
        agent = node.agent("--mig-strategy", "mixed", "--mig-check-interval", "0.5s",
                           "--reconcile-interval", "0.2s")
        _wait_resources(agent, MIXED_A100)
        held = node.client.admit_pod("p", {"main": {"nvidia.com/mig-7g.80gb": 1}}) \
            .container("main").allocation("nvidia.com/mig-7g.80gb").device_ids[0]
        node.status_when(lambda doc: (doc.get("state") or {}).get("attributed") == 1,
                         "the allocation matched to pod p")
        sim_mig.destroy(node.ctl, held)
        text = node.status_with("was destroyed while pod")
        assert held in text and "default/p" in text
        assert f"MIG device {held}" in agent.log and "delete the pod" in agent.log
        doc = node.status_when(lambda d: held in " ".join(d.get("migGoneInUse", [])),
                               "the destroyed device in status.json")
        assert "nvidia.com/mig-7g.80gb" not in {r["name"] for r in doc["resources"]}


def test_sim_mig_apply_reads_a_mig_parted_config_and_refuses_what_does_not_fit(tmp_path):
    from agent.errors import SimError
    from agent.sim import mig as sim_mig

    text = ("version: v1\nmig-configs:\n  all-1g:\n    - devices: all\n      mig-enabled: true\n"
            "      mig-devices:\n        \"1g.10gb\": 7\n  two:\n    - devices: [0, 1]\n"
            "      mig-enabled: false\n    - devices: [2]\n      mig-enabled: true\n"
            "      mig-devices: {\"3g.40gb\": 2}\n")
    assert sim_mig.layouts_from_mig_parted(text, "all-1g", 3) == {i: {"1g.10gb": 7}
                                                                 for i in range(3)}
    assert sim_mig.layouts_from_mig_parted(text, "two", 3) == {0: None, 1: None,
                                                              2: {"3g.40gb": 2}}
    with pytest.raises(SimError, match="several mig-configs"):
        sim_mig.layouts_from_mig_parted(text, None, 3)
    with pytest.raises(SimError, match="needs 8 slices"):
        sim_mig.check_layout(A100, 0, {"1g.10gb": 5, "3g.40gb": 1})
    with pytest.raises(SimError, match="no MIG profile '9g.90gb'"):
        sim_mig.check_layout(A100, 0, {"9g.90gb": 1})
    with pytest.raises(SimError, match="not MIG capable"):
        sim_mig.check_layout(load_profile("dgx1-v100"), 0, {"1g.10gb": 1})


# -- the H100 80GB and A30 profiles: names go-nvlib gives, NVIDIA's rules per strategy -------

H100 = load_profile("h100-mig")
# h100-mig under mixed with a pattern for the split 3g.40gb GPU instance of GPU 3 (its
# 1c.3g.40gb and 2c.3g.40gb compute instances have no default name: [DEFAULTS]); GPUs 2 and 7
# stay whole ([GPUMAP]); "+" is written "." in a name ([DEFAULTS]).
MIXED_H100 = {
    GPU: 2,
    "nvidia.com/mig-1g.10gb": 7 + 2,  # GPU 0: 7; GPU 1: 2
    "nvidia.com/mig-1g.10gb.me": 1,  # GPU 6
    "nvidia.com/mig-1g.20gb": 4,  # GPU 4
    "nvidia.com/mig-2g.20gb": 1,  # GPU 1
    "nvidia.com/mig-3g.40gb": 1 + 1,  # GPU 1; GPU 6
    "nvidia.com/mig-4g.40gb": 1,  # GPU 3
    "nvidia.com/mig-7g.80gb": 1,  # GPU 5
    "nvidia.com/mig-3g.40gb-split": 2,  # GPU 3: 1c.3g.40gb, 2c.3g.40gb ([MIGMAP] pattern)
}
MIXED_A30 = {
    "nvidia.com/mig-1g.6gb": 4 + 1,  # GPU 0: 4; GPU 3: 1
    "nvidia.com/mig-1g.6gb.me": 1,  # GPU 3
    "nvidia.com/mig-2g.12gb": 2 + 1,  # GPU 1: 2; GPU 3: 1
    "nvidia.com/mig-4g.24gb": 1,  # GPU 2
}


def test_h100_mixed_refuses_compute_instances_smaller_than_their_gpu_instance_by_default():
    with Node("h100-mig") as node:
        agent = node.agent("--mig-strategy", "mixed")
        assert agent.wait_exit() == 1  # [DEFAULTS] gives 1c.3g.40gb no name, [MIGMAP], [EXIT]
        assert "MIG profile '1c.3g.40gb' does not match any resource patterns" in agent.log


def test_h100_mixed_with_a_pattern_for_the_split_instance():
    with Node("h100-mig") as node:
        config = node.write("config.yaml", "version: v1\nresources:\n  mig:\n"
                                           "    - pattern: '*c.3g.40gb'\n"
                                           "      name: mig-3g.40gb-split\n")
        agent = node.agent("--mig-strategy", "mixed", "--config", config)
        _wait_resources(agent, MIXED_H100)
        assert _counts(node) == MIXED_H100
        split = {d.id for d in node.client.state().resource(
            "nvidia.com/mig-3g.40gb-split").devices}
        assert split == {i["uuid"] for i in _instances(H100["gpus"][3])
                         if i.get("compute_slices")}


@pytest.mark.parametrize("profile, strategy, expected", [
    ("h100-mig", "none", {GPU: 8}),
    ("a30-mig", "none", {GPU: 4}),
    ("a30-mig", "mixed", MIXED_A30),
])
def test_h100_and_a30_resources_per_strategy(profile, strategy, expected):
    with Node(profile) as node:
        agent = node.agent("--mig-strategy", strategy)
        _wait_resources(agent, expected)
        assert _counts(node) == expected


@pytest.mark.parametrize("profile", ["h100-mig", "a30-mig"])
def test_h100_and_a30_single_refuse_several_mig_device_types(profile):
    with Node(profile) as node:
        agent = node.agent("--mig-strategy", "single")
        assert agent.wait_exit() == 1
        assert "more than one MIG device type present on node" in agent.log  # [VALID]


def test_a30_single_on_a_uniform_layout_and_index_ids():
    from agent.sim import mig as sim_mig

    with Node("a30-mig") as node:
        for gpu in range(4):
            sim_mig.set_layout(node.ctl, gpu, {"2g.12gb": 2}, profile="a30-mig")
        agent = node.agent("--mig-strategy", "single", "--device-id-strategy", "index")
        res = agent.wait_registered()
        assert len(res.devices) == 8  # 4 GPUs x 2 MIG devices as nvidia.com/gpu
        got = node.client.admit_pod("p", {"main": {GPU: 2}}).container("main").allocation(GPU)
        visible = got.container_response.envs["NVIDIA_VISIBLE_DEVICES"].split(",")
        assert len(visible) == 2 and all(v.count(":") == 1 for v in visible)  # [IDS] i:j


def test_pass_device_specs_gives_the_parent_node_and_both_capability_nodes():
    # NVIDIA: internal/rm/nvml_devices.go GetPaths (parent /dev/nvidia<minor>, then the GPU
    # instance's and the compute instance's /dev/nvidia-caps node, their minors from
    # /proc/driver/nvidia-caps/mig-minors as internal/mig/mig-dp.go reads it)
    import os

    from agent.sim import driver_tree

    with Node("a100-mig") as node:
        root = os.path.join(node.root, "host")
        driver_tree.build(root, "a100-mig")
        minors = os.path.join(root, "proc/driver/nvidia-caps/mig-minors")
        agent = node.agent("--mig-strategy", "mixed", "--pass-device-specs", "--dev-root", root,
                           env=node.env(GPU_AGENT_MIG_MINORS_FILE=minors))
        _wait_resources(agent, MIXED_A100)
        alloc = node.client.admit_pod("p", {"main": {"nvidia.com/mig-2g.20gb": 1}}) \
            .container("main").allocation("nvidia.com/mig-2g.20gb")
        inst = next(i for i in _instances(A100["gpus"][1]) if i["uuid"] == alloc.device_ids[0])
        lines = dict(line.rsplit(" ", 1) for line in open(minors).read().splitlines())
        gi_cap = lines[f"gpu1/gi{inst['gi']}/access"]
        ci_cap = lines[f"gpu1/gi{inst['gi']}/ci{inst['ci']}/access"]
        specs = [(d.container_path, d.host_path) for d in alloc.container_response.devices]
        assert [c for c, _ in specs] == [
            "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia1",
            f"/dev/nvidia-caps/nvidia-cap{gi_cap}", f"/dev/nvidia-caps/nvidia-cap{ci_cap}"]
        assert all(h == os.path.join(root, c.lstrip("/")) for c, h in specs)


@pytest.mark.parametrize("id_strategy", ["uuid", "index"])
def test_cdi_check_finds_mig_device_names_in_a_spec_written_as_the_toolkit_writes_them(
        id_strategy):
    # nvidia-ctk cdi generate names a MIG device "<GPU index>:<MIG index>" and by its UUID
    # (the simulated driver tree writes the spec that way); a spec without them is reported
    import os

    from agent.sim import driver_tree

    with Node("a100-mig") as node:
        root = os.path.join(node.root, "host")
        driver_tree.build(root, "a100-mig")
        spec_dir = os.path.join(root, "etc/cdi")
        args = ["--mig-strategy", "mixed", "--device-list-strategy", "cdi-cri",
                "--device-id-strategy", id_strategy, "--cdi-spec-dirs", spec_dir]
        agent = node.agent(*args)
        _wait_resources(agent, MIXED_A100)
        doc = node.status_when(lambda d: d.get("cdi") is not None, "the CDI check")
        assert doc["cdi"]["ok"] and doc["cdi"]["wanted"] == sum(MIXED_A100.values())
        alloc = node.client.admit_pod("p", {"main": {"nvidia.com/mig-3g.40gb": 1}}) \
            .container("main").allocation("nvidia.com/mig-3g.40gb")
        name = alloc.container_response.cdi_devices[0].name
        assert name.startswith("nvidia.com/gpu=") and \
            (":" in name if id_strategy == "index" else "=MIG-" in name)
        agent.stop()

        import yaml

        path = os.path.join(spec_dir, "nvidia.yaml")
        spec = yaml.safe_load(open(path).read())
        mig_names = {d["name"] for d in spec["devices"]
                     if ":" in d["name"] or d["name"].startswith("MIG-")}
        assert len(mig_names) == 2 * 16  # index and UUID names of the 16 MIG devices
        spec["devices"] = [d for d in spec["devices"] if d["name"] not in mig_names]
        with open(path, "w") as f:
            f.write(yaml.safe_dump(spec))
        agent = node.agent(*args)
        _wait_resources(agent, MIXED_A100)
        doc = node.status_when(lambda d: d.get("cdi") is not None and d["cdi"]["missing"],
                               "the CDI check's missing names")
        assert len(doc["cdi"]["missing"]) == 16 and not doc["cdi"]["ok"]  # the MIG devices


def test_a_pending_mig_mode_change_is_advertised_by_the_current_mode_and_reported():
    # go-nvlib IsMigEnabled (what NVIDIA's plugin asks) reads the current mode only; a100-mig's
    # GPU 7 has MIG disabled now and enabled pending a reset: a whole GPU under every strategy
    gpu7 = A100["gpus"][7]
    with Node("a100-mig") as node:
        agent = node.agent("--mig-strategy", "mixed")
        _wait_resources(agent, MIXED_A100)
        assert gpu7["uuid"] in {d.id for d in node.client.state().resource(GPU).devices}
        note = (f"GPU 7 {gpu7['uuid']}: MIG mode change pending (MIG enabled after the next GPU "
                f"reset); advertised by its current mode (MIG disabled)")
        assert note in agent.log
        doc = node.status_when(lambda d: d.get("migPending"), "the pending change")
        assert doc["migPending"] == [note]
        assert "GPU 7: MIG mode change pending" in node.status_with("MIG mode change pending")


def test_h100_single_on_a_uniform_layout_advertises_every_mig_device_as_a_gpu():
    from agent.sim import mig as sim_mig

    with Node("h100-mig") as node:
        for gpu in range(8):
            sim_mig.set_layout(node.ctl, gpu, {"1g.20gb": 4}, profile="h100-mig")
        agent = node.agent("--mig-strategy", "single")
        res = agent.wait_registered()
        assert len(res.devices) == 32 and _counts(node) == {GPU: 32}  # [DEFAULTS], [VALID]
        assert all(d.id.startswith("MIG-") for d in res.devices)
