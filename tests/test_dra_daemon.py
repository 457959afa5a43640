"""`gpu-agent run --mode dra` as a real process on the simulated node, against the fast tests'
API server and kubelet's side of the plugin API played by the test (tests/e2e/test_dra.py
has the real kubelet): the ResourceSlice published, the kubelet plugin registered where the
plugin watcher looks, a claim prepared into a CDI spec, no device-plugin resource registered,
and the mode not switched by a reload."""

from __future__ import annotations

import json
import os
import signal

import grpc
import pytest

from agent._proto.dra.v1 import api_pb2 as v1
from agent._proto.dra.v1 import api_pb2_grpc as v1_grpc
from agent._proto.drahealth.v1 import api_pb2 as health
from agent._proto.drahealth.v1 import api_pb2_grpc as health_grpc
from agent._proto.pluginregistration.v1 import api_pb2 as reg
from agent._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from agent.dra.plugin import socket_paths
from agent.sim import control
from agent.sim.profile import load_profile
from tests.conftest import run_gpu_agent
from tests.daemon_harness import Node, mig_uuids_by_nvml
from tests.kube_api import KubeApi

NODE = "gpu-node-1"
SLICE = f"{NODE}-gpu.nvidia.com"
GPUS = load_profile("dgx1-v100")["gpus"]


@pytest.fixture
def node():
    with Node() as n:
        yield n


def _start(node: Node, api: KubeApi, *args: str, register: bool = True):
    """The agent in DRA mode (`args` say so, default --mode dra); with `register`, kubelet's
    plugin watcher played (GetInfo, then registered) and the slice published."""
    api.kubeconfig(node.kubeconfig)
    agent = node.agent("--node-name", NODE, "--cdi-spec-dirs", node.path("cdi"),
                       "--kubelet-dir", node.root, *(args or ("--mode", "dra")))
    if register:
        _register(node, agent)
        api.wait(lambda: SLICE in api.slices, "the ResourceSlice")
    return agent


def _channel(path: str) -> grpc.Channel:
    return grpc.insecure_channel(f"unix:{path}", options=[("grpc.enable_http_proxy", 0)])


def _register(node: Node, agent) -> reg.PluginInfo:
    """What kubelet's plugin watcher does once the registration socket appears (it looks
    every second): GetInfo, then NotifyRegistrationStatus(registered). The plugin's info."""
    path = socket_paths(node.root)[1]
    agent.wait_log(f"registration at {path}")
    with _channel(path) as ch:
        stub = reg_grpc.RegistrationStub(ch)
        info = stub.GetInfo(reg.InfoRequest(), timeout=10)
        stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True),
                                      timeout=10)
    return info


def test_dra_mode_publishes_the_slice_registers_the_plugin_and_prepares_a_claim(node):
    api = KubeApi(NODE)
    agent = _start(node, api)
    spec = api.slices[SLICE]["spec"]
    assert [d["name"] for d in spec["devices"]] == [f"gpu-{g['minor']}" for g in GPUS]
    assert spec["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    registration = node.path("plugins_registry/gpu.nvidia.com-reg.sock")
    with _channel(registration) as ch:
        info = reg_grpc.RegistrationStub(ch).GetInfo(reg.InfoRequest(), timeout=10)
        assert info.endpoint == node.path("plugins/gpu.nvidia.com/dra.sock")
    api.claims[("ml", "train")] = {
        "metadata": {"namespace": "ml", "name": "train", "uid": "u-1"},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-3"}]}}}}
    with _channel(info.endpoint) as ch:
        out = v1_grpc.DRAPluginStub(ch).NodePrepareResources(v1.NodePrepareResourcesRequest(
            claims=[v1.Claim(namespace="ml", uid="u-1", name="train")]), timeout=10)
    assert out.claims["u-1"].error == ""
    assert list(out.claims["u-1"].devices[0].cdi_device_ids) == [
        "k8s.gpu.nvidia.com/claim=u-1-gpu-3"]
    cdi = json.loads(open(node.path("cdi/k8s.gpu.nvidia.com-claim_u-1.json")).read())
    assert cdi["containerEdits"]["env"] == [f"NVIDIA_VISIBLE_DEVICES={GPUS[3]['uuid']}"]
    status = node.status_when(lambda s: (s.get("dra") or {}).get("preparedClaims"),
                              "the status naming the prepared claim")
    assert status["dra"]["preparedClaims"] == ["ml/train"] and status["dra"]["registered"]
    assert node.client.state().resources == {}  # no device-plugin resource registered
    assert agent.stop() == 0
    assert not os.path.exists(registration)


def test_the_slice_waits_for_kubelet_to_register_the_plugin(node):
    """A slice published before kubelet has registered the plugin lets the scheduler place a
    pod whose prepare kubelet then refuses ("DRA driver gpu.nvidia.com is not registered"),
    retried only at its next sync of the pod, a minute or more later (seen in `make e2e` after
    an agent restart). So the agent holds the slice, says so, and publishes it at the
    registration."""
    api = KubeApi(NODE)
    agent = _start(node, api, register=False)
    agent.wait_log(f"ResourceSlice of {NODE}: published once kubelet registers the DRA plugin")
    status = node.status_when(lambda s: s.get("dra"), "the DRA status")
    assert status["dra"]["held"] and status["dra"]["registered"] is None
    assert SLICE not in api.slices
    shown = node.status_with("published once kubelet registers the plugin")
    assert "kubelet has not registered it yet" in shown, shown
    _register(node, agent)
    api.wait(lambda: SLICE in api.slices, "the ResourceSlice after the registration")
    assert len(api.slices[SLICE]["spec"]["devices"]) == len(GPUS)
    assert not node.status_when(lambda s: s["dra"]["registered"], "registered")["dra"]["held"]
    assert agent.stop() == 0


def test_a_reload_does_not_switch_the_mode(node):
    api = KubeApi(NODE)
    config = node.write("config.yaml", "version: v1\nagent:\n  mode: dra\n")
    agent = _start(node, api, "--config", config)
    node.write("config.yaml", "version: v1\nagent:\n  mode: device-plugin\n")
    agent.send(signal.SIGHUP)
    agent.wait_log("reload refused, keeping the running configuration: agent.mode: "
                   "'device-plugin' differs from the running 'dra'; a change of mode takes a "
                   f"restart (docs/dra.md) (file {config})")
    assert agent.stop() == 0


def test_a_withdrawn_gpu_is_tainted_in_the_slice_until_it_is_back(node):
    """KEP-5055: an XID's withdrawal taints that device (NoSchedule, the reason's XID as the
    value), a new generation of the pool; its recovery removes the taint, nothing restarted.
    KEP-4680: kubelet watching the devices' health sees it Unhealthy, then Healthy."""
    api = KubeApi(NODE)
    agent = _start(node, api, "--mode", "dra", "--recovery-quiet-period", "1s")
    gpu = GPUS[2]
    name = f"gpu-{gpu['minor']}"
    channel = _channel(node.path("plugins/gpu.nvidia.com/dra.sock"))
    watch = health_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
        health.NodeWatchResourcesRequest(), timeout=120)

    def health_of_gpu() -> tuple[int, str]:
        for d in next(watch).devices:
            if d.device == health.DeviceIdentifier(pool_name=NODE, device_name=name):
                return d.health, d.message
        raise AssertionError(f"{name} missing from the health stream")

    assert health_of_gpu() == (health.HEALTHY, "")
    control.inject_xid(node.ctl, gpu["index"], 48)  # a double-bit ECC error: reset class
    state, message = health_of_gpu()
    assert state == health.UNHEALTHY and "48" in message

    def taints():
        spec = api.slices[SLICE]["spec"]
        return {d["name"]: d.get("taints") for d in spec["devices"] if d.get("taints")}

    tainted = api.wait(taints, "the device tainted")
    assert list(tainted) == [f"gpu-{gpu['minor']}"]
    [taint] = tainted[f"gpu-{gpu['minor']}"]
    assert (taint["key"], taint["value"], taint["effect"]) == (
        "gpu.nvidia.com/unhealthy", "xid-48", "NoSchedule")
    assert api.slices[SLICE]["spec"]["pool"]["generation"] == 2
    # (the status shows a taint in the reboot-class test below, where none goes by itself:
    # here the status, written up to 1 s after a change, raced the 1 s quiet period on CI)
    api.wait(lambda: not taints(), "the taint removed once the GPU is back")
    assert api.slices[SLICE]["spec"]["pool"]["generation"] == 3
    assert health_of_gpu() == (health.HEALTHY, "")
    channel.close()
    assert agent.alive()


def test_a_reboot_class_fault_taints_no_execute_unless_configured_otherwise(node):
    """XID 79 (the GPU fell off the bus: only a reboot ends it) taints its device NoExecute,
    which evicts the pods using it; XID 48 (reset class) NoSchedule; XID 13 (application
    class, before both) none. agent.draRebootTaint NoSchedule, reloaded, turns the first into
    NoSchedule too, the withdrawal's time kept."""
    api = KubeApi(NODE)
    config = node.write("config.yaml", "version: v1\nagent:\n  mode: dra\n")
    agent = _start(node, api, "--config", config)
    reboot, reset, application = GPUS[1], GPUS[2], GPUS[3]
    control.inject_xid(node.ctl, application["index"], 13)  # delivered first, in order
    control.inject_xid(node.ctl, reboot["index"], 79)
    control.inject_xid(node.ctl, reset["index"], 48)

    def taints():
        spec = api.slices[SLICE]["spec"]
        return {d["name"]: d["taints"][0] for d in spec["devices"] if d.get("taints")}

    tainted = api.wait(lambda: len(taints()) == 2 and taints(), "both devices tainted")
    assert f"gpu-{application['minor']}" not in tainted
    first = tainted[f"gpu-{reboot['minor']}"]
    assert (first["value"], first["effect"]) == ("xid-79", "NoExecute")
    assert (tainted[f"gpu-{reset['minor']}"]["value"],
            tainted[f"gpu-{reset['minor']}"]["effect"]) == ("xid-48", "NoSchedule")
    status = node.status_when(lambda s: len(s["dra"]["tainted"]) == 2, "both in the status")
    assert status["dra"]["tainted"][f"gpu-{reboot['minor']}"].endswith("(NoExecute)")

    node.write("config.yaml", "version: v1\nagent:\n  mode: dra\n  draRebootTaint: NoSchedule\n")
    agent.send(signal.SIGHUP)
    now = api.wait(lambda: taints().get(f"gpu-{reboot['minor']}", {}).get("effect")
                   == "NoSchedule" and taints(), "the reboot-class taint NoSchedule")
    assert now[f"gpu-{reboot['minor']}"]["timeAdded"] == first["timeAdded"]
    assert agent.alive()


def test_a_slice_kubelet_deleted_is_published_again_at_the_next_registration(node):
    """kubelet deletes a driver's slices a while after its plugin goes (a restart of the
    agent re-creates the sockets); each new registration reads the slice again: after an
    unregistration, and after a restarted kubelet's, which comes with none before it."""
    api = KubeApi(NODE)
    _start(node, api)
    with _channel(node.path("plugins_registry/gpu.nvidia.com-reg.sock")) as ch:
        stub = reg_grpc.RegistrationStub(ch)
        for before in ([reg.RegistrationStatus(plugin_registered=False, error="restarting")],
                       []):
            with api._cv:
                del api.slices[SLICE]  # as kubelet cleans up after an unregistered driver
            for status in [*before, reg.RegistrationStatus(plugin_registered=True)]:
                stub.NotifyRegistrationStatus(status, timeout=10)
            api.wait(lambda: SLICE in api.slices, "the slice published again")
            assert len(api.slices[SLICE]["spec"]["devices"]) == len(GPUS)


def test_status_metrics_and_doctor_cover_dra_mode(node):
    """Issue 39 item 8: a prepared claim shows with its pod in `gpu-agent status` and the
    metrics, a taint in both and as a doctor warning; the doctor's DRA checks find the sockets
    and the registration, and its device-plugin registration checks skip."""
    from tests.test_metrics import metrics_port, samples

    api = KubeApi(NODE)
    agent = _start(node, api)
    api.claims[("ml", "train")] = {
        "metadata": {"namespace": "ml", "name": "train", "uid": "u-1"},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-3"}]}},
            "reservedFor": [{"resource": "pods", "name": "trainer-0", "uid": "p-1"}]}}
    with _channel(node.path("plugins/gpu.nvidia.com/dra.sock")) as ch:
        out = v1_grpc.DRAPluginStub(ch).NodePrepareResources(v1.NodePrepareResourcesRequest(
            claims=[v1.Claim(namespace="ml", uid="u-1", name="train")]), timeout=10)
    assert out.claims["u-1"].error == ""
    control.inject_xid(node.ctl, GPUS[5]["index"], 79)
    tainted = f"gpu-{GPUS[5]['minor']}"
    node.status_when(lambda s: s["dra"]["tainted"] and s["dra"]["claims"], "claim and taint")

    shown = node.status_with("claim ml/train: gpu-3 for pod trainer-0", f"{tainted}: XID 79")
    assert "claim ml/train: gpu-3 for pod trainer-0" in shown, shown
    assert "(NoExecute)" in shown, shown

    port = metrics_port(node)
    assert samples(port, "gpu_agent_dra_claim_prepared") == [
        ({"namespace": "ml", "claim": "train", "device": "gpu-3", "pod": "trainer-0"}, 1.0)]
    assert samples(port, "gpu_agent_dra_device_tainted") == [
        ({"driver": "gpu.nvidia.com", "device": tainted, "value": "xid-79",
          "effect": "NoExecute"}, 1.0)]
    assert samples(port, "gpu_agent_dra_registered") == [({"driver": "gpu.nvidia.com"}, 1.0)]
    assert samples(port, "gpu_agent_dra_slice_published") == [
        ({"driver": "gpu.nvidia.com"}, 1.0)]
    [(_, generation)] = samples(port, "gpu_agent_dra_slice_generation")
    assert generation == api.slices[SLICE]["spec"]["pool"]["generation"]
    [(_, prepares)] = samples(port, "gpu_agent_rpc_duration_seconds_count",
                              method="NodePrepareResources", resource="gpu.nvidia.com")
    assert prepares == 1.0

    proc = run_gpu_agent("doctor", "--json", "--mode", "dra", "--kubelet-dir", node.root,
                         "--state-dir", node.state, "--kubelet-socket", node.kubelet_socket,
                         env=node.env(), check=False)
    checks = {c["id"]: c for c in json.loads(proc.stdout)["checks"]}
    assert checks["dra.sockets"]["status"] == "ok", checks["dra.sockets"]
    assert checks["dra.driver"]["status"] == "warn", checks["dra.driver"]
    assert f"{tainted}: XID 79" in checks["dra.driver"]["found"]
    for check in ("kubelet.socket", "kubelet.allocatable", "kubelet.registration"):
        assert checks[check]["status"] == "skip", checks[check]
    assert agent.alive()


def test_a_dynamic_mig_gpu_publishes_its_placements_and_a_claim_gets_one_made(tmp_path):
    """KEP-4815, agent.draDynamicMig: GPU 2 of h100-mig (MIG enabled, no instance) published
    as every placement of every profile, consuming the memory slices of its placement from
    the GPU's counter set (a slice of its own, all of one pool generation); a claim for one
    gets its MIG device made at prepare (NVML shows it), destroyed at unprepare."""
    with Node("h100-mig") as node:
        control.append_record(node.ctl, "mig gpu=2 mode=enabled")
        api = KubeApi(NODE)
        api.kubeconfig(node.kubeconfig)
        agent = node.agent("--node-name", NODE, "--cdi-spec-dirs", node.path("cdi"),
                           "--kubelet-dir", node.root, "--mode", "dra",
                           "--dra-dynamic-mig", "2")
        _register(node, agent)
        gpu = load_profile("h100-mig")["gpus"][2]
        parts_slice, counters_slice = f"{SLICE}-gpu-{gpu['minor']}", f"{SLICE}-counters"
        api.wait(lambda: parts_slice in api.slices and counters_slice in api.slices,
                 "the partitions' and the counters' slices")
        [counter_set] = api.slices[counters_slice]["spec"]["sharedCounters"]
        assert counter_set["name"] == f"gpu-{gpu['minor']}-counter-set"
        assert "devices" not in api.slices[counters_slice]["spec"]
        pools = {s["spec"]["pool"]["generation"] for s in api.slices.values()}
        assert len(pools) == 1 and all(s["spec"]["pool"]["resourceSliceCount"] == 3
                                       for s in api.slices.values())
        parts = {d["name"]: d for d in api.slices[parts_slice]["spec"]["devices"]}
        assert len(parts) == 25  # nvidia-smi mig -lgipp on an H100 80GB: 25 placements
        one = parts[f"gpu-{gpu['minor']}-mig-1g10gb-19-3"]
        assert one["consumesCounters"] == [{"counterSet": counter_set["name"], "counters": {
            "memory-slice-3": {"value": "1"}, "compute-slices": {"value": "1"}}}]
        assert "uuid" not in one["attributes"]
        static = [d["name"] for d in api.slices[SLICE]["spec"]["devices"]]
        assert not any(n.startswith(f"gpu-{gpu['minor']}-") for n in static)

        api.claims[("ml", "slice")] = {
            "metadata": {"namespace": "ml", "name": "slice", "uid": "u-1"},
            "status": {"allocation": {"devices": {"results": [
                {"request": "mig", "driver": "gpu.nvidia.com", "pool": NODE,
                 "device": f"gpu-{gpu['minor']}-mig-1g10gb-19-3"}]}}}}
        dra_sock = node.path("plugins/gpu.nvidia.com/dra.sock")
        claim = v1.Claim(namespace="ml", uid="u-1", name="slice")
        with _channel(dra_sock) as ch:
            out = v1_grpc.DRAPluginStub(ch).NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[claim]), timeout=30)
        assert out.claims["u-1"].error == ""
        cdi = json.loads(open(node.path("cdi/k8s.gpu.nvidia.com-claim_u-1.json")).read())
        [uuid] = cdi["containerEdits"]["env"][0].removeprefix("NVIDIA_VISIBLE_DEVICES=").split(",")
        def migs_seen_by_another_process() -> list[str]:
            return mig_uuids_by_nvml(node.env(), 2)

        assert uuid.startswith("MIG-") and migs_seen_by_another_process() == [uuid]
        with _channel(dra_sock) as ch:
            out = v1_grpc.DRAPluginStub(ch).NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=[claim]), timeout=30)
        assert out.claims["u-1"].error == "", agent.log + open(os.path.join(node.ctl, control.LOG_NAME)).read()
        assert migs_seen_by_another_process() == []
        assert agent.stop() == 0


def test_a_reload_makes_a_gpu_shareable_by_consumable_capacity(node):
    """agent.draSharedGpus (KEP-5075) applied by a SIGHUP: GPU 0's device allows several
    allocations, its memory and cores consumable with request policies (a claim naming no
    memory takes all of it: the GPU whole), the other GPUs unchanged."""
    api = KubeApi(NODE)
    config = node.write("config.yaml", "version: v1\nagent:\n  mode: dra\n")
    agent = _start(node, api, "--config", config)
    node.write("config.yaml", "version: v1\nagent:\n  mode: dra\n  draSharedGpus: [0]\n")
    agent.send(signal.SIGHUP)

    def device(minor: int) -> dict:
        return next(d for d in api.slices[SLICE]["spec"]["devices"]
                    if d["name"] == f"gpu-{minor}")

    gpu0, gpu1 = GPUS[0], GPUS[1]
    api.wait(lambda: device(gpu0["minor"]).get("allowMultipleAllocations"),
             "GPU 0 shareable after the reload")
    memory = device(gpu0["minor"])["capacity"]["memory"]
    assert memory["requestPolicy"] == {"default": memory["value"],
                                       "validRange": {"min": "1Gi"}}
    assert device(gpu0["minor"])["capacity"]["cores"] == {"value": "100", "requestPolicy": {
        "default": "0", "validRange": {"min": "0", "step": "1"}}}
    assert "allowMultipleAllocations" not in device(gpu1["minor"])
    assert agent.alive()


@pytest.mark.parametrize("option", ["--dra-dynamic-mig", "--dra-shared-gpus"])
def test_an_api_server_older_than_1_36_gets_no_partitions_nor_shares(option):
    """Partitionable devices and consumable capacity are beta from Kubernetes 1.36; an older
    API server drops their fields, and its scheduler would give claims overlapping MIG
    placements or a GPU many times whole. Against a 1.35 API server the agent publishes those
    GPUs as they stand and says why."""
    with Node("h100-mig") as node:
        control.append_record(node.ctl, "mig gpu=2 mode=enabled")
        api = KubeApi(NODE)
        api.kubernetes = (1, 35)
        api.kubeconfig(node.kubeconfig)
        agent = node.agent("--node-name", NODE, "--cdi-spec-dirs", node.path("cdi"),
                           "--kubelet-dir", node.root, "--mode", "dra", option, "all")
        _register(node, agent)
        api.wait(lambda: SLICE in api.slices, "the ResourceSlice")
        agent.wait_log(f"agent.{'draDynamicMig' if 'mig' in option else 'draSharedGpus'}: "
                       f"the API server is Kubernetes 1.35;")
        assert list(api.slices) == [SLICE]
        assert not any(d.get("allowMultipleAllocations")
                       for d in api.slices[SLICE]["spec"]["devices"])
        assert agent.stop() == 0
