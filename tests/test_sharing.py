"""Time-slicing through `gpu-agent run` on the simulated node, against the simulated kubelet:
what kubelet sees per `sharing.timeSlicing` config, what a container gets for its replicas,
the refusals, health of replicas, reloads, and MIG devices time-sliced.

Every rule is NVIDIA's, read in k8s-device-plugin v0.20.0 (the tags are used below):
- [IDS] internal/rm/devices.go NewAnnotatedID: a replica's ID is `<UUID>::<n>`, n from 0;
  internal/rm/device_map.go updateDeviceMapWithReplicas: a replica keeps its device's Index.
- [NAME] api/config/v1/resources.go DefaultSharedRename and replicas.go UnmarshalJSON:
  renameByDefault advertises `<name>.shared`; README "With CUDA Time-Slicing": 8 GPUs with
  `replicas: 10` advertise 80 nvidia.com/gpu, or 80 nvidia.com/gpu.shared with
  renameByDefault.
- [REST] device_map.go updateDeviceMapWithReplicas: devices of a listed resource that are not
  selected stay whole under the resource's own name.
- [FAIL] internal/rm/rm.go ValidateRequest + internal/plugin/server.go Allocate: with
  failRequestsGreaterThanOne, a container request of more than one device including replicas
  fails with `invalid allocation request for "<resource>": invalid request: maximum request
  size for shared resources is 1; found <n>`; without it, the request is served.
- [UNIQUE] server.go uniqueDeviceIDsFromAnnotatedDeviceIDs (v0.18 on): each device once in
  NVIDIA_VISIBLE_DEVICES, whichever of its replicas a container holds.
- [MIG] internal/rm/rm.go AddDefaultResourcesToConfig + the README: under mixed, each
  nvidia.com/mig-<profile> resource can be time-sliced; its replicas are `MIG-<uuid>::<n>`.
- [PREF] internal/rm/allocate.go greedyAlloc: `distributed` (the default) puts a container's
  replicas on the GPUs with the fewest replicas in use, `packed` on the most.
Beyond NVIDIA (docs/sharing.md): `rename` and `devices` are honoured (NVIDIA's binaries
ignore them, config.go DisableResourceNamingInConfig), a `devices` entry may carry its own
replica count, and an XID withdraws every replica of the GPU (health.go keeps one replica per
GPU, so NVIDIA withdraws one).
"""

from __future__ import annotations

import signal
from pathlib import Path

import grpc
import pytest

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from agent.kubelet.plugin import socket_name
from agent.sim import control
from agent.sim.kubelet import PodRejected
from agent.sim.profile import load_profile
from tests.daemon_harness import GPU, WAIT, Node

CONFIGS = Path(__file__).parent / "data" / "configs"
DGX = load_profile("dgx1-v100")
UUIDS = [g["uuid"] for g in sorted(DGX["gpus"], key=lambda g: g["index"])]
SHARED = "nvidia.com/gpu.shared"


def _config(node: Node, resources: str, **flags: bool) -> str:
    lines = ["version: v1", "sharing:", "  timeSlicing:"]
    lines += [f"    {k}: {str(v).lower()}" for k, v in flags.items()]
    lines += ["    resources:", *(f"    {line}" for line in resources.strip().splitlines())]
    return node.write("config.yaml", "\n".join(lines) + "\n")


def _ids(node: Node, resource: str) -> list[str]:
    """The IDs kubelet holds for `resource`, sorted."""
    r = node.client.state().resource(resource)
    return sorted(d.id for d in r.devices) if r is not None else []


def _wait_counts(agent, counts: dict[str, int]) -> None:
    def seen(state):
        return all((r := state.resource(n)) is not None and r.connected
                   and len(r.devices) == k for n, k in counts.items())
    agent.wait_for(seen, f"devices {counts}")


def _counts(node: Node) -> dict[str, int]:
    return {r.name: len(r.devices) for r in node.client.state().resources.values()
            if r.connected and r.devices}


def _stub(node: Node, resource: str) -> dp_grpc.DevicePluginStub:
    channel = grpc.insecure_channel(f"unix:{node.kdir}/{socket_name(resource)}",
                                    options=[("grpc.enable_http_proxy", 0)])
    return dp_grpc.DevicePluginStub(channel)


def _allocate(node: Node, resource: str, ids: list[str]) -> dp.ContainerAllocateResponse:
    response = _stub(node, resource).Allocate(dp.AllocateRequest(container_requests=[
        dp.ContainerAllocateRequest(devices_ids=ids)]), timeout=WAIT)
    return response.container_responses[0]


def test_nvidia_documented_config_advertises_ten_replicas_of_each_gpu_as_gpu_shared():
    with Node() as node:
        agent = node.agent("--config", str(CONFIGS / "nvidia-time-slicing.yaml"))
        _wait_counts(agent, {SHARED: 80})  # [NAME]: 8 GPUs x 10, renamed by default
        assert _counts(node) == {SHARED: 80}  # nothing left under nvidia.com/gpu
        assert _ids(node, SHARED) == sorted(f"{u}::{n}" for u in UUIDS for n in range(10))  # [IDS]
        agent.wait_log("resource nvidia.com/gpu.shared: 80 devices")


def test_replicas_4_on_8_gpus_is_32_annotated_devices_under_the_same_name():
    with Node() as node:
        config = _config(node, "- name: nvidia.com/gpu\n  replicas: 4")
        agent = node.agent("--config", config)
        _wait_counts(agent, {GPU: 32})
        assert _ids(node, GPU) == sorted(f"{u}::{n}" for u in UUIDS for n in range(4))
        # kubelet admits 32 single-GPU pods, and a 33rd finds nothing left
        for i in range(32):
            node.client.admit_pod(f"p{i}", {"main": {GPU: 1}})
        with pytest.raises(PodRejected):
            node.client.admit_pod("p32", {"main": {GPU: 1}})


def test_a_container_gets_the_gpu_behind_its_replica_once_in_every_strategy():
    with Node() as node:
        config = _config(node, "- name: nvidia.com/gpu\n  replicas: 4")
        agent = node.agent("--config", config, "--device-list-strategy", "envvar,volume-mounts",
                           "--pass-device-specs")
        _wait_counts(agent, {GPU: 32})
        got = _allocate(node, GPU, [f"{UUIDS[3]}::1", f"{UUIDS[3]}::2", f"{UUIDS[5]}::0"])
        # [UNIQUE]: GPU 3 once; volume-mounts wins the env as in NVIDIA's plugin
        assert [m.container_path for m in got.mounts] == [
            f"/var/run/nvidia-container-devices/{UUIDS[3]}",
            f"/var/run/nvidia-container-devices/{UUIDS[5]}"]
        nodes = [d.container_path for d in got.devices if d.container_path.startswith(
            "/dev/nvidia") and d.container_path[len("/dev/nvidia"):].isdigit()]
        assert nodes == ["/dev/nvidia3", "/dev/nvidia5"]
        agent.wait_log(f"{UUIDS[3]}::1 (replica of GPU 3 {UUIDS[3]})")
        agent.stop()

        agent = node.agent("--config", config, "--device-id-strategy", "index")
        agent.wait_registered(2)  # this agent's devices, not the stopped one's last list
        _wait_counts(agent, {GPU: 32})
        got = _allocate(node, GPU, [f"{UUIDS[6]}::3", f"{UUIDS[2]}::0", f"{UUIDS[6]}::0"])
        assert got.envs["NVIDIA_VISIBLE_DEVICES"] == "6,2"  # [IDS]: the replica's index


def test_fail_requests_greater_than_one_refuses_with_nvidias_words_and_keeps_serving():
    with Node() as node:
        config = _config(node, "- name: nvidia.com/gpu\n  replicas: 2",
                         failRequestsGreaterThanOne=True)
        agent = node.agent("--config", config)
        _wait_counts(agent, {GPU: 16})
        with pytest.raises(grpc.RpcError) as info:
            _allocate(node, GPU, [f"{UUIDS[0]}::0", f"{UUIDS[1]}::0"])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == (  # [FAIL]
            'invalid allocation request for "nvidia.com/gpu": invalid request: maximum '
            'request size for shared resources is 1; found 2')
        with pytest.raises(PodRejected) as rejected:
            node.client.admit_pod("two", {"main": {GPU: 2}})
        assert "maximum request size for shared resources is 1; found 2" in str(rejected.value)
        one = node.client.admit_pod("one", {"main": {GPU: 1}})
        replica = one.container("main").devices(GPU)[0]
        assert one.container("main").allocation(GPU).container_response.envs[
            "NVIDIA_VISIBLE_DEVICES"] == replica.split("::")[0]

        # without it, NVIDIA serves the same request (false is its default for time-slicing)
        _config(node, "- name: nvidia.com/gpu\n  replicas: 2")
        agent.send(signal.SIGHUP)
        agent.wait_log("configuration reloaded (reload 1)")
        got = _allocate(node, GPU, [f"{UUIDS[0]}::0", f"{UUIDS[1]}::0"])
        assert got.envs["NVIDIA_VISIBLE_DEVICES"] == f"{UUIDS[0]},{UUIDS[1]}"


def test_devices_rename_and_a_count_per_gpu():
    with Node() as node:
        config = _config(node, f"""
- name: nvidia.com/gpu
  rename: nvidia.com/gpu-shared
  replicas: 2
  devices: [0, "1", {{device: "{UUIDS[2]}", replicas: 8}}]
""")
        agent = node.agent("--config", config)
        # [REST]: GPUs 3-7 stay whole; 0 and 1 x 2 and GPU 2 x 8 under the rename
        _wait_counts(agent, {GPU: 5, "nvidia.com/gpu-shared": 12})
        assert _ids(node, GPU) == sorted(UUIDS[3:])
        assert _ids(node, "nvidia.com/gpu-shared") == sorted([
            f"{UUIDS[0]}::0", f"{UUIDS[0]}::1", f"{UUIDS[1]}::0", f"{UUIDS[1]}::1",
            *(f"{UUIDS[2]}::{n}" for n in range(8))])


def test_a_listed_device_the_node_lacks_is_logged_and_the_rest_shared():
    with Node() as node:
        config = _config(node, "- name: nvidia.com/gpu\n  replicas: 2\n  devices: [1, 12]")
        agent = node.agent("--config", config)
        _wait_counts(agent, {GPU: 9})
        agent.wait_log("sharing.timeSlicing.resources[0].devices: nvidia.com/gpu has no "
                       "device 12 on this node: left out")


def test_preferred_allocation_spreads_replicas_or_packs_them_as_the_policy_says():
    with Node() as node:
        config = _config(node, "- name: nvidia.com/gpu\n  replicas: 4")
        agent = node.agent("--config", config)
        _wait_counts(agent, {GPU: 32})
        got = node.client.admit_pod("spread", {"main": {GPU: 2}})
        alloc = got.container("main").allocation(GPU)
        assert alloc.preferred_called
        gpus = {i.split("::")[0] for i in alloc.device_ids}
        assert len(gpus) == 2  # [PREF] distributed: two GPUs
        agent.stop()

        # NVIDIA's v0.20 setting, by its env name (cmd/nvidia-device-plugin/main.go)
        agent = node.agent("--config", config,
                           env=node.env(SHARED_DEVICES_ALLOCATION_POLICY="packed"))
        # this agent's devices: kubelet marked the stopped one's unhealthy, and a pod admitted
        # on that list is refused (seen under stress-ng)
        agent.wait_registered(2)
        _wait_counts(agent, {GPU: 32})
        got = node.client.admit_pod("packed", {"main": {GPU: 2}})
        gpus = {i.split("::")[0] for i in got.container("main").devices(GPU)}
        assert len(gpus) == 1  # [PREF] packed: one GPU


def test_an_xid_withdraws_every_replica_of_the_gpu_and_only_those():
    with Node() as node:
        config = _config(node, "- name: nvidia.com/gpu\n  replicas: 4")
        agent = node.agent("--config", config, "--recovery-quiet-period", "0.5s")
        _wait_counts(agent, {GPU: 32})
        versions = len(node.client.snapshots(GPU))

        def unhealthy(state):
            return {d.id for d in state.resource(GPU).devices if not d.healthy}

        control.inject_xid(node.ctl, 3, 48)
        agent.wait_for(lambda s: unhealthy(s) == {f"{UUIDS[3]}::{n}" for n in range(4)},
                       "GPU 3's four replicas withdrawn")
        # one transition: the four went in one snapshot
        withdrawn = [s for s in node.client.snapshots(GPU)[versions:]
                     if any(d.health != "Healthy" for d in s.devices)]
        assert sum(d.health != "Healthy" for d in withdrawn[0].devices) == 4
        out = node.status_with(f"GPU 3 {UUIDS[3]} NUMA 0: unhealthy (XID 48")
        assert f"GPU 3 {UUIDS[3]} NUMA 0: unhealthy (XID 48" in out
        assert "GPU reset required) [4 devices]" in out  # the replicas on one line
        assert f"GPU 2 {UUIDS[2]} NUMA 0: healthy [4 devices]" in out
        agent.wait_for(lambda s: not unhealthy(s), "the replicas back after the quiet period")


def test_sighup_turns_sharing_on_changes_it_and_turns_it_off_without_a_restart():
    with Node() as node:
        config = node.write("config.yaml", "version: v1\n")
        agent = node.agent("--config", config)
        _wait_counts(agent, {GPU: 8})
        for resources, counts in (("- name: nvidia.com/gpu\n  replicas: 4", {GPU: 32}),
                                  ("- name: nvidia.com/gpu\n  replicas: 2", {GPU: 16})):
            _config(node, resources)
            agent.send(signal.SIGHUP)
            _wait_counts(agent, counts)
        _config(node, "- name: nvidia.com/gpu\n  replicas: 2", renameByDefault=True)
        agent.send(signal.SIGHUP)
        _wait_counts(agent, {SHARED: 16})
        agent.wait_for(lambda s: not s.resource(GPU).connected or not s.resource(GPU).devices,
                       "nvidia.com/gpu gone")
        node.write("config.yaml", "version: v1\n")
        agent.send(signal.SIGHUP)
        _wait_counts(agent, {GPU: 8})
        assert _ids(node, GPU) == sorted(UUIDS)
        state = node.client.state()
        assert state.resource(GPU).registrations == 2  # back after gpu.shared
        assert agent.alive()


def test_mig_devices_are_time_sliced_per_profile_under_mixed():
    with Node("a100-mig") as node:
        config = _config(node, "- name: nvidia.com/mig-1g.10gb\n  replicas: 3",
                         renameByDefault=True)
        agent = node.agent("--config", config, "--mig-strategy", "mixed")
        name = "nvidia.com/mig-1g.10gb.shared"
        # a100-mig has nine 1g.10gb devices (tests/test_mig.py MIXED_A100); the other
        # profiles stay as they are
        _wait_counts(agent, {name: 27, "nvidia.com/mig-3g.40gb": 4})  # [MIG]
        ids = _ids(node, name)
        bases = sorted({i.split("::")[0] for i in ids})
        assert len(bases) == 9 and all(b.startswith("MIG-") for b in bases)
        assert ids == sorted(f"{b}::{n}" for b in bases for n in range(3))
        got = node.client.admit_pod("p", {"main": {name: 1}})
        replica = got.container("main").devices(name)[0]
        env = got.container("main").allocation(name).container_response.envs
        assert env["NVIDIA_VISIBLE_DEVICES"] == replica.split("::")[0]
