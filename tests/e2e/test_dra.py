"""DRA mode on the real kubelet, API server, scheduler and containerd (issue 39): gpu-agent
`--mode dra` publishes the node's GPUs in a ResourceSlice with the node's own identity,
kubelet's plugin watcher registers its kubelet plugin, the scheduler allocates a
ResourceClaim for one GPU from that slice through a DeviceClass written as NVIDIA's chart
writes it (kubernetes-sigs/dra-driver-nvidia-gpu v0.4.1 deployments/helm/.../
deviceclass-gpu.yaml), and the pod's container gets the device node and environment of its
claim, injected by containerd from the CDI spec the agent wrote at prepare; deleting the pod
unprepares the claim and removes the spec."""

from __future__ import annotations

import os
import signal
import time

import pytest

from agent.sim import control
from tests.e2e.cluster import NODE
from tests.e2e.conftest import (
    DRIVER,
    MPS_STAND_IN,
    NS,
    QUIET,
    RESOURCE_API,
    device_classes,
    profile_gpus,
    resource_claim,
    write_result,
)
from tests.e2e.kube import ApiError

CLASSES = device_classes()


@pytest.fixture
def dra(node):
    api = node.api
    made: list[str] = []

    def create(path: str, body: dict) -> None:
        api.create(path, body)
        made.append(f"{path}/{body['metadata']['name']}")

    yield create
    # deleted as kubectl deletes (kubelet stops the containers, then unprepares the claims),
    # and every claim unprepared before the node fixture stops the agents: a claim kubelet
    # could not unprepare would keep its pod in kubelet's hands through the later tests
    for name in node.pods:
        api.delete(f"/api/v1/namespaces/{NS}/pods/{name}")
    for name in node.pods:
        api.wait_gone(f"/api/v1/namespaces/{NS}/pods/{name}", timeout=90)
    node.pods = []
    for agent in node.agents:
        if agent.proc.alive():
            agent.status_when(lambda s: not (s.get("dra") or {}).get("preparedClaims"),
                              "every claim unprepared")
    for path in reversed(made):
        api.delete(path)
    try:  # the agent's slice outlives it (owned by the Node): the next test starts clean
        for s in api.get(f"{RESOURCE_API}/resourceslices")["items"]:
            api.delete(f"{RESOURCE_API}/resourceslices/{s['metadata']['name']}")
    except ApiError as exc:
        print(f"cleanup: slices not deleted: {exc}")


def _dra_agent(node, dra, *args: str, kubeconfig: str | None = None, env: dict | None = None,
               profile: str = "dgx1-v100"):
    """node.dra_agent(...), and the DeviceClasses the package ships (made through `dra`, so
    the test deletes them)."""
    agent, published = node.dra_agent(*args, kubeconfig=kubeconfig, env=env, profile=profile)
    for c in CLASSES:
        dra(f"{RESOURCE_API}/deviceclasses", c)
    return agent, published


def _taints_or_skip(k8s_version: str) -> None:
    if tuple(int(x) for x in k8s_version.split(".")[:2]) < (1, 37):
        pytest.skip(f"device taints are alpha in {k8s_version} (gate DRADeviceTaints, off "
                    f"here): beta from 1.36, GA from 1.37")


def _pod_with_claim(node, dra, pod: str, claim: str, count: int = 1, selector: str = "",
                    config: list | None = None, capacity: dict | None = None) -> None:
    """ResourceClaim `claim` (resource_claim's) and pod `pod` using it in its one container."""
    dra(f"{RESOURCE_API}/namespaces/{NS}/resourceclaims",
        resource_claim(claim, count, selector, config, capacity))
    node.create_pod_with_claim(pod, claim)


@pytest.mark.parametrize("identity", ["node", "gpu-agent"])
def test_a_pod_with_a_claim_gets_its_gpu_from_the_agents_cdi_spec(node, dra, identity):
    """With the node's identity (the Node authorizer), and as user gpu-agent holding exactly
    the RBAC the package ships (packaging/kubernetes/gpu-agent-rbac.yaml)."""
    gpus = {g["minor"]: g for g in profile_gpus()}
    agent, published = _dra_agent(node, dra, kubeconfig=node.agent_identity()
                                  if identity == "gpu-agent" else None)
    assert published["spec"]["nodeName"] == NODE
    assert sorted(d["name"] for d in published["spec"]["devices"]) == sorted(
        f"gpu-{m}" for m in gpus)
    _pod_with_claim(node, dra, "with-claim", "one-gpu")
    node.wait_running("with-claim")

    claim = node.api.get(f"{RESOURCE_API}/namespaces/{NS}/resourceclaims/one-gpu")
    results = claim["status"]["allocation"]["devices"]["results"]
    assert [(r["driver"], r["pool"]) for r in results] == [(DRIVER, NODE)]
    minor = int(results[0]["device"].removeprefix("gpu-"))
    seen = node.seen("with-claim")
    assert seen.nodes == {f"nvidia{minor}"}, seen.raw
    assert seen.env["NVIDIA_VISIBLE_DEVICES"] == gpus[minor]["uuid"]
    spec = os.path.join(node.cluster.cdi_dir, f"k8s.gpu.nvidia.com-claim_{claim['metadata']['uid']}.json")
    assert os.path.exists(spec)
    status = agent.status_when(lambda s: s["dra"]["preparedClaims"], "the prepared claim")
    assert status["dra"]["preparedClaims"] == [f"{NS}/one-gpu"]

    node.delete_pods("with-claim")
    agent.status_when(lambda s: not s["dra"]["preparedClaims"], "the claim unprepared")
    assert not os.path.exists(spec)


def test_an_unchanged_pod_asking_nvidia_com_gpu_2_runs_through_dra(node, dra, k8s_version):
    """KEP-5004, GA in Kubernetes 1.37: the DeviceClass maps nvidia.com/gpu, the scheduler
    makes the pod's claim, kubelet has the agent prepare it; no device plugin runs."""
    if tuple(int(x) for x in k8s_version.split(".")[:2]) < (1, 37):
        pytest.skip(f"the extended-resource mapping is alpha in {k8s_version} (gate "
                    f"DRAExtendedResource, off here): GA from 1.37")
    gpus = {g["uuid"]: g for g in profile_gpus()}
    _dra_agent(node, dra)
    node.create_pod("two-gpus", {"nvidia.com/gpu": 2})
    node.wait_running("two-gpus")
    seen = node.seen("two-gpus")
    uuids = seen.env["NVIDIA_VISIBLE_DEVICES"].split(",")
    assert len(uuids) == 2 and set(uuids) <= set(gpus), seen.raw
    assert seen.nodes == {f"nvidia{gpus[u]['minor']}" for u in uuids}, seen.raw


def test_an_xid_79_taints_the_gpu_in_the_slice_until_the_node_reboots(node, dra, k8s_version):
    """KEP-5055 (device taints GA in 1.37): XID 79 (reboot class) on the GPU a running pod's
    claim holds taints its device NoExecute in the slice, so kube-controller-manager's device
    taint eviction deletes that pod, and a claim for all eight GPUs is not allocated; after
    the reboot (a new boot ID, the agent started again) the taint is gone and the claim's pod
    runs."""
    _taints_or_skip(k8s_version)
    boot_id = node.config("boot-1\n", "boot_id")
    env = {"GPU_AGENT_BOOT_ID_FILE": boot_id}
    agent, _ = _dra_agent(node, dra, env=env)
    name = f"{NODE}-{DRIVER}"
    _pod_with_claim(node, dra, "on-the-gpu", "on-the-gpu")
    node.wait_running("on-the-gpu")
    claim = node.api.get(f"{RESOURCE_API}/namespaces/{NS}/resourceclaims/on-the-gpu")
    device = claim["status"]["allocation"]["devices"]["results"][0]["device"]
    gpu = next(g for g in profile_gpus() if f"gpu-{g['minor']}" == device)

    start = time.monotonic()
    control.inject_xid(agent.control, gpu["index"], 79)
    tainted = node.api.wait_for(
        f"{RESOURCE_API}/resourceslices/{name}",
        lambda s: [d for d in s["spec"]["devices"] if d.get("taints")], "the device tainted")
    write_result(node.results, "dra_xid79_to_slice_taint_s", round(time.monotonic() - start, 3))
    assert [(d["name"], d["taints"][0]["value"], d["taints"][0]["effect"]) for d in tainted] == [
        (device, "xid-79", "NoExecute")]
    # evicted: kube-controller-manager's device taint eviction deletes the pod
    node.api.wait_gone(f"/api/v1/namespaces/{NS}/pods/on-the-gpu", timeout=90)
    write_result(node.results, "dra_xid79_to_pod_evicted_s", round(time.monotonic() - start, 3))
    node.pods.remove("on-the-gpu")

    _pod_with_claim(node, dra, "all-gpus", "all-gpus", count=8)
    node.wait_unschedulable("all-gpus")

    kubelet = node.cluster.procs["kubelet"]
    seen = len(kubelet.log())
    agent.proc.stop()  # the reboot: the agent starts again and reads a new boot ID
    node.config("boot-2\n", "boot_id")
    node.agent("dgx1-v100", "--mode", "dra", "--kubelet-dir", node.cluster.kubelet_root,
               *QUIET, env=env)
    node.api.wait_for(f"{RESOURCE_API}/resourceslices/{name}",
                      lambda s: not any(d.get("taints") for d in s["spec"]["devices"]),
                      "the taint gone after the reboot")
    untainted = time.monotonic()
    node.wait_running("all-gpus")
    write_result(node.results, "dra_reboot_untaint_to_running_s",
                 round(time.monotonic() - untainted, 3))
    assert len(node.seen("all-gpus").nodes) == 8
    # the untainted slice came only once kubelet had registered the restarted plugin, so no
    # prepare was refused for it (kubelet retries one at its next sync of the pod, a minute or
    # more later: dra_plugin_manager.go "DRA driver %s is not registered")
    refused = [line for line in kubelet.log()[seen:].splitlines() if "is not registered" in line]
    assert not refused, refused


def test_a_reset_class_taint_goes_by_itself_and_a_claim_then_gets_the_gpu(node, dra,
                                                                         k8s_version):
    """XID 48 (a double-bit ECC error: reset class) taints its device NoSchedule; the GPU
    recovers (the recovery quiet period passes with nothing pending) and the taint goes with
    nothing restarted, the same agent and kubelet, and a claim for all eight GPUs then runs."""
    _taints_or_skip(k8s_version)
    agent, _ = _dra_agent(node, dra, "--recovery-quiet-period", "10s")
    name = f"{NODE}-{DRIVER}"
    gpu = profile_gpus()[5]
    control.inject_xid(agent.control, gpu["index"], 48)
    tainted = node.api.wait_for(
        f"{RESOURCE_API}/resourceslices/{name}",
        lambda s: [d for d in s["spec"]["devices"] if d.get("taints")], "the device tainted")
    assert [(d["name"], d["taints"][0]["value"], d["taints"][0]["effect"]) for d in tainted] == [
        (f"gpu-{gpu['minor']}", "xid-48", "NoSchedule")]
    start = time.monotonic()
    node.api.wait_for(f"{RESOURCE_API}/resourceslices/{name}",
                      lambda s: not any(d.get("taints") for d in s["spec"]["devices"]),
                      "the taint gone after the quiet period", timeout=60)
    write_result(node.results, "dra_reset_class_taint_to_removed_after_10s_quiet_s",
                 round(time.monotonic() - start, 3))
    _pod_with_claim(node, dra, "all-eight", "all-eight", count=8)
    node.wait_running("all-eight")
    assert len(node.seen("all-eight").nodes) == 8
    assert agent.proc.alive()


def _resource_health(pod: dict) -> list[tuple[str, str]]:
    """(resource ID, health) of the pod's container's claims, as kubelet reports them."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return [(r["resourceID"], r.get("health", ""))
            for c in statuses for a in c.get("allocatedResourcesStatus") or []
            for r in a.get("resources") or []]


def test_a_running_pods_gpu_shows_unhealthy_in_its_status_after_an_xid_and_healthy_after(
        node, dra):
    """KEP-4680 (ResourceHealthStatus: beta from 1.36; the e2e cluster turns the gate on for
    older kubelets): kubelet watches the agent's NodeWatchResources and writes the device's
    health into the pod's containerStatuses[].allocatedResourcesStatus."""
    agent, _ = _dra_agent(node, dra, "--recovery-quiet-period", "5s")
    # named as the pod names its claim: kubelet 1.34 matches the container's claim by the
    # ResourceClaim's name (cm/dra/manager.go UpdateAllocatedResourcesStatus); 1.37 by either
    _pod_with_claim(node, dra, "watched", "gpu")
    node.wait_running("watched")
    claim = node.api.get(f"{RESOURCE_API}/namespaces/{NS}/resourceclaims/gpu")
    device = claim["status"]["allocation"]["devices"]["results"][0]["device"]
    # the device's first CDI ID (kubelet's manager.go: driver/pool/device when it has none)
    resource = f"k8s.{DRIVER}/claim={claim['metadata']['uid']}-{device}"
    pod = f"/api/v1/namespaces/{NS}/pods/watched"
    node.api.wait_for(pod, lambda p: (resource, "Healthy") in _resource_health(p),
                      "the GPU Healthy in the pod's status")
    gpu = next(g for g in profile_gpus() if f"gpu-{g['minor']}" == device)
    start = time.monotonic()
    control.inject_xid(agent.control, gpu["index"], 48)
    node.api.wait_for(pod, lambda p: (resource, "Unhealthy") in _resource_health(p),
                      "the GPU Unhealthy in the pod's status", timeout=60)
    write_result(node.results, "dra_xid_to_pod_status_unhealthy_s",
                 round(time.monotonic() - start, 3))
    node.api.wait_for(pod, lambda p: (resource, "Healthy") in _resource_health(p),
                      "the GPU Healthy again after recovery", timeout=90)
    write_result(node.results, "dra_xid_to_pod_status_healthy_again_after_5s_quiet_s",
                 round(time.monotonic() - start, 3))
    assert agent.proc.alive()


def test_a_claim_for_two_gpus_chosen_by_product_name_gets_both(node, dra):
    """A claim for two GPUs chosen by a CEL selector on productName (an attribute NVIDIA's
    driver publishes): the container has both GPUs' nodes and UUIDs."""
    gpus = {g["uuid"]: g for g in profile_gpus()}
    _dra_agent(node, dra)
    product = next(iter(gpus.values()))["name"]
    _pod_with_claim(node, dra, "two-by-name", "two-by-name", count=2,
                    selector=f"device.attributes['{DRIVER}'].productName == '{product}'")
    node.wait_running("two-by-name")
    seen = node.seen("two-by-name")
    uuids = seen.env["NVIDIA_VISIBLE_DEVICES"].split(",")
    assert len(uuids) == 2 and seen.nodes == {f"nvidia{gpus[u]['minor']}" for u in uuids}


@pytest.mark.parametrize("kubelet_restarted", ["while the agent is dead", "after the agent"])
def test_a_claim_prepared_before_an_agent_sigkill_and_a_kubelet_restart_is_unprepared_once(
        node, dra, kubelet_restarted):
    """The agent killed with SIGKILL while its claim's pod runs, and kubelet restarted, either
    while the agent is dead (it finds the dead agent's registration socket) or after the agent
    was started again (systemd's Restart=): deleting the pod has the new agent unprepare the
    claim, from its record, exactly once, and the CDI spec is gone."""
    agent, _ = _dra_agent(node, dra)
    _pod_with_claim(node, dra, "outlives", "outlives")
    node.wait_running("outlives")
    claim = node.api.get(f"{RESOURCE_API}/namespaces/{NS}/resourceclaims/outlives")
    spec = os.path.join(node.cluster.cdi_dir,
                        f"k8s.gpu.nvidia.com-claim_{claim['metadata']['uid']}.json")
    agent.status_when(lambda s: s["dra"]["preparedClaims"], "the prepared claim")

    cluster = node.cluster

    def restart_kubelet() -> None:
        cluster.procs["kubelet"].stop()
        cluster.start_kubelet()
        cluster.wait_node_ready()

    agent.proc.stop(signal.SIGKILL)
    if kubelet_restarted == "while the agent is dead":
        restart_kubelet()
    again = node.agent("dgx1-v100", "--mode", "dra", "--kubelet-dir", cluster.kubelet_root,
                       *QUIET)
    # the same state directory: status.json is the killed agent's until the new one writes
    mine = again.proc.pid
    if kubelet_restarted == "after the agent":
        before = again.status_when(lambda s: s["pid"] == mine and s["dra"]["registered"],
                                   "kubelet registering the restarted agent's plugin")
        cluster.procs["kubelet"].stop()
        cluster.start_kubelet()
        started = time.monotonic()
        again.status_when(lambda s: s["dra"]["registrations"] > before["dra"]["registrations"],
                          "the new kubelet registering the plugin")
        # kubelet's plugin watcher finds the socket when it starts and its reconciler
        # registers it (pkg/kubelet/pluginmanager, a pass every second)
        write_result(node.results, "dra_kubelet_start_to_plugin_registered_s",
                     round(time.monotonic() - started, 3))
        cluster.wait_node_ready()
    again.status_when(lambda s: s["pid"] == mine and s["dra"]["registered"],
                      "kubelet registering the restarted agent's plugin")
    assert again.status()["dra"]["preparedClaims"] == [f"{NS}/outlives"]  # from its record
    assert os.path.exists(spec)
    node.wait_running("outlives")  # the container kept through both restarts

    start = time.monotonic()
    node.api.delete(f"/api/v1/namespaces/{NS}/pods/outlives")
    again.status_when(lambda s: not s["dra"]["preparedClaims"], "the claim unprepared",
                      timeout=120)
    write_result(node.results, f"dra_pod_deleted_to_unprepared_after_agent_kill_kubelet_"
                 f"restart_{kubelet_restarted.replace(' ', '_')}_s",
                 round(time.monotonic() - start, 3))
    assert not os.path.exists(spec)
    unprepared = f"claim {NS}/outlives ({claim['metadata']['uid']}) unprepared"
    assert again.log().count(unprepared) == 1  # both processes write the same log


def _wait_prepare_failed(node, pod: str, reason: str) -> str:
    """The message of kubelet's FailedPrepareDynamicResources event for `pod` (as `kubectl
    describe pod` shows it) that has `reason` in it: kubelet tries again, and an attempt
    before the test finished setting the claim up has a reason of its own."""
    uid = node.pod(pod)["metadata"]["uid"]
    deadline = time.monotonic() + 90
    seen: list[str] = []
    while time.monotonic() < deadline:
        seen = [e["message"] for e in node.events("Pod", pod, uid,
                                                  "FailedPrepareDynamicResources")]
        if any(reason in m for m in seen):
            return next(m for m in seen if reason in m)
        time.sleep(0.2)
    raise AssertionError(f"no FailedPrepareDynamicResources event for {pod} saying {reason!r}"
                         f" (seen: {seen})\n{node.logs(40)}")


def test_bad_claims_fail_prepare_with_the_reason_in_the_pods_events(node, dra):
    """A claim carrying NVIDIA's GpuConfig with a value out of range (101 %), and one
    whose allocation names a device this node does not publish (written by hand into the
    claim's status, as a broken controller could): kubelet's event on each pod says why,
    nothing is prepared for them, and a good claim runs beside them."""
    agent, _ = _dra_agent(node, dra)
    claims = f"{RESOURCE_API}/namespaces/{NS}/resourceclaims"
    dra(claims, resource_claim("bad-config", config=[
        {"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": {
                "strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 101}}}}}]))
    node.create_pod_with_claim("bad-config", "bad-config")

    # a claim allocated by hand to gpu-99 of this node's pool and reserved for its pod, which
    # waits at a scheduling gate until then (kubelet's first attempt meets the whole claim)
    dra(claims, resource_claim("missing-device"))
    made = node.create_pod_with_claim("missing-device", "missing-device",
                                      scheduling_gate="gpu-agent.test/claim-allocated")
    node.api.request("PATCH", f"{claims}/missing-device/status", {"status": {
        "allocation": {
            "devices": {"results": [
                {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-99"}]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}},
        "reservedFor": [{"resource": "pods", "name": "missing-device",
                         "uid": made["metadata"]["uid"]}]}},
        content_type="application/merge-patch+json")
    node.api.request("PATCH", f"/api/v1/namespaces/{NS}/pods/missing-device",
                     {"spec": {"schedulingGates": []}},
                     content_type="application/merge-patch+json")

    # the first line of the error the agent answers, as kubelet's event on the pod shows it
    _wait_prepare_failed(node, "bad-config",
                         f"NodePrepareResources failed for ResourceClaim bad-config: claim "
                         f"{NS}/bad-config: config[0] (from FromClaim) parameters.sharing."
                         f"mpsConfig.defaultActiveThreadPercentage: 101: an active thread "
                         f"percentage is an integer from 0 to 100")
    _wait_prepare_failed(node, "missing-device",
                         f"NodePrepareResources failed for ResourceClaim missing-device: claim "
                         f"{NS}/missing-device asks for device gpu-99 of pool {NODE}, which "
                         f"node {NODE} does not have")

    # nothing made for them, and the agent goes on preparing good claims
    assert not [f for f in os.listdir(node.cluster.cdi_dir) if "claim_" in f]
    _pod_with_claim(node, dra, "good", "good")
    node.wait_running("good")
    status = agent.status_when(lambda s: s["dra"]["preparedClaims"], "the good claim")
    assert status["dra"]["preparedClaims"] == [f"{NS}/good"]
    for pod in ("bad-config", "missing-device"):
        assert node.pod(pod)["status"]["phase"] == "Pending"


def _gpu_config(sharing: dict) -> list:
    """spec.devices.config with NVIDIA's opaque GpuConfig (api/nvidia.com/resource/v1beta1
    gpuconfig.go, sharing.go; its demo specs/quickstart gpu-test4.yaml and gpu-test-mps.yaml
    share one claim between pods this way)."""
    return [{"opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": sharing}}}]


def test_two_pods_share_one_gpu_through_a_claim_with_time_slicing(node, dra):
    """Both pods run on the claim's one GPU; its time slice set as NVIDIA's driver sets it
    (nvidia-smi -c DEFAULT, then compute-policy --set-timeslice 1 for Short)."""
    agent, _ = _dra_agent(node, dra)
    dra(f"{RESOURCE_API}/namespaces/{NS}/resourceclaims", resource_claim(
        "time-sliced", config=_gpu_config({"strategy": "TimeSlicing",
                                           "timeSlicingConfig": {"interval": "Short"}})))
    for pod in ("ts-a", "ts-b"):
        node.create_pod_with_claim(pod, "time-sliced")
    for pod in ("ts-a", "ts-b"):
        node.wait_running(pod)
    a, b = node.seen("ts-a"), node.seen("ts-b")
    assert a.env["NVIDIA_VISIBLE_DEVICES"] == b.env["NVIDIA_VISIBLE_DEVICES"], (a.raw, b.raw)
    assert a.nodes == b.nodes and len(a.nodes) == 1
    uuid = a.env["NVIDIA_VISIBLE_DEVICES"]
    calls = open(os.path.join(agent.root, "var/log/nvidia-smi.log")).read().splitlines()
    assert calls[-2:] == [f"-i {uuid} -c DEFAULT", f"compute-policy -i {uuid} --set-timeslice 1"]


def test_two_pods_share_one_gpu_through_a_claim_with_mps_and_carry_its_limits(node, mps_root,
                                                                            dra):
    # mps_root before dra: its end (the daemons killed) comes after dra's (the pods deleted,
    # their claims unprepared by the agent)
    """The GPU's MPS control daemon runs (the agent's, with the config's defaults); both
    pods' containers get its pipe directory and /dev/shm, and the limits in their
    environment."""
    _dra_agent(node, dra, "--mps-root", mps_root, "--mps-control", MPS_STAND_IN)
    dra(f"{RESOURCE_API}/namespaces/{NS}/resourceclaims", resource_claim(
        "mps-shared", config=_gpu_config({"strategy": "MPS", "mpsConfig": {
            "defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "8Gi"}})))
    for pod in ("mps-a", "mps-b"):
        node.create_pod_with_claim(pod, "mps-shared")
    for pod in ("mps-a", "mps-b"):
        node.wait_running(pod)
    seen = [node.seen(p) for p in ("mps-a", "mps-b")]
    assert seen[0].env["NVIDIA_VISIBLE_DEVICES"] == seen[1].env["NVIDIA_VISIBLE_DEVICES"]
    uuid = seen[0].env["NVIDIA_VISIBLE_DEVICES"]
    for s in seen:
        assert (s.env["CUDA_MPS_PIPE_DIRECTORY"], s.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"],
                s.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) == (
            "/tmp/nvidia-mps", "50", "0=8192M"), s.raw
    inside = node.exec("mps-b", "ls /tmp/nvidia-mps")
    assert "nvidia-cuda-mps-control.pid" in inside.split()
    log = open(os.path.join(mps_root, uuid, "log", "control.log")).read()
    assert "set_default_active_thread_percentage 50" in log
    assert "set_default_device_pinned_mem_limit 0 8192M" in log


def test_claims_of_20gi_share_one_80gb_gpu_by_capacity_and_one_more_of_30gi_waits(
        node, mps_root, dra, k8s_version):
    """KEP-5075 (DRAConsumableCapacity, beta from 1.36): GPU 0 published as shareable
    (agent.draSharedGpus); three claims of 20Gi are allocated to it and run, each container
    with its MPS share; a fourth of 30Gi does not fit the 80 GB and stays pending. On an
    older API server the agent refuses to publish the share."""
    gpu = profile_gpus("dgx-h100")[0]
    agent, published = _dra_agent(node, dra, "--dra-shared-gpus", "0", "--mps-root", mps_root,
                                  "--mps-control", MPS_STAND_IN, profile="dgx-h100")
    if tuple(int(x) for x in k8s_version.split(".")[:2]) < (1, 36):
        # consumable capacity is alpha there (DRAConsumableCapacity, off): the agent says so
        # and publishes the GPU whole
        agent.wait_log(f"agent.draSharedGpus: the API server is Kubernetes {k8s_version[:4]};")
        assert not any(d.get("allowMultipleAllocations") for d in published["spec"]["devices"])
        return
    shareable = "device.allowMultipleAllocations"
    # One after another: kube-scheduler 1.37.2 counts a claim it has just allocated twice for
    # a moment (its assume cache's copy and its in-flight one until the pod's PreBind ends:
    # dra_manager.go GatherAllocatedState, dynamicresources.go prebindSuccessCleanup), and a
    # third 20Gi claim placed in that moment finds 80Gi taken and waits for a requeue that may
    # come minutes later (docs/dra.md, consumable capacity).
    for i in range(3):
        _pod_with_claim(node, dra, f"share-{i}", f"share-{i}", selector=shareable,
                        capacity={"memory": "20Gi"})
        node.wait_running(f"share-{i}")
    for i in range(3):
        claim = node.api.get(f"{RESOURCE_API}/namespaces/{NS}/resourceclaims/share-{i}")
        [result] = claim["status"]["allocation"]["devices"]["results"]
        assert (result["device"], result["consumedCapacity"]["memory"]) == (
            f"gpu-{gpu['minor']}", "20Gi")
        seen = node.seen(f"share-{i}")
        assert seen.env["NVIDIA_VISIBLE_DEVICES"] == gpu["uuid"], seen.raw
        assert seen.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M", seen.raw
        assert seen.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(
            -(-100 * 20 * 1024 // (gpu["memory"]["total"] >> 20))), seen.raw
    _pod_with_claim(node, dra, "share-3", "share-3", selector=shareable,
                    capacity={"memory": "30Gi"})
    node.wait_unschedulable("share-3")


def _mig_uuids_by_nvml(node, profile: str, index: int) -> list[str]:
    """The MIG devices of GPU `index` as another process reads them through the simulated
    NVML of the node (the agent's control log)."""
    from tests.daemon_harness import clean_env, mig_uuids_by_nvml
    from tests.e2e.cluster import profile_path

    return mig_uuids_by_nvml(clean_env(GPU_AGENT_SIM_PROFILE=str(profile_path(profile)),
                                       GPU_AGENT_SIM_CONTROL=node.cluster.path(
                                           f"simctl-{profile}")), index)


def test_mig_devices_are_made_at_prepare_without_overlap_and_destroyed_at_unprepare(
        node, dra, k8s_version):
    """KEP-4815 (DRAPartitionableDevices, beta from 1.36), agent.draDynamicMig: GPU 2 of
    h100-mig, MIG enabled with no instance, published as its placements; two claims for
    1g.10gb get two placements, each a MIG device made at prepare (NVML lists it; the
    container gets it and its capability nodes); a claim for 7g.80gb, which overlaps them,
    waits; once the two pods go their MIG devices are destroyed and the 7g.80gb one runs. On
    an older API server the agent publishes no partition and says why."""
    profile = "h100-mig"
    gpu = profile_gpus(profile)[2]
    ctl = node.cluster.path(f"simctl-{profile}")
    os.makedirs(ctl, exist_ok=True)
    control.append_record(ctl, "mig gpu=2 mode=enabled")
    agent, _ = _dra_agent(node, dra, "--dra-dynamic-mig", "2", profile=profile)
    if tuple(int(x) for x in k8s_version.split(".")[:2]) < (1, 36):
        # partitionable devices are alpha there (DRAPartitionableDevices, off; counters beside
        # their devices): the agent says so and publishes no partition
        agent.wait_log(f"agent.draDynamicMig: the API server is Kubernetes {k8s_version[:4]};")
        names = [s["metadata"]["name"] for s in node.api.get(
            f"{RESOURCE_API}/resourceslices")["items"]]
        assert names == [f"{NODE}-{DRIVER}"], names
        return

    def mig_claim(name: str, mig_profile: str) -> None:
        body = resource_claim(name, selector=(
            f"device.attributes['{DRIVER}'].profile == '{mig_profile}' && "
            f"device.attributes['{DRIVER}'].parentUUID == '{gpu['uuid']}'"))
        body["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "mig.nvidia.com"
        dra(f"{RESOURCE_API}/namespaces/{NS}/resourceclaims", body)
        node.create_pod_with_claim(name, name)

    start = time.monotonic()
    for name in ("mig-a", "mig-b"):
        mig_claim(name, "1g.10gb")
    for name in ("mig-a", "mig-b"):
        node.wait_running(name)
    write_result(node.results, "dra_two_mig_pods_made_at_prepare_to_running_s",
                 round(time.monotonic() - start, 3))
    devices = [node.api.get(f"{RESOURCE_API}/namespaces/{NS}/resourceclaims/{n}")["status"][
        "allocation"]["devices"]["results"][0]["device"] for n in ("mig-a", "mig-b")]
    assert len(set(devices)) == 2 and all(d.startswith(f"gpu-{gpu['minor']}-mig-1g10gb-19-")
                                          for d in devices), devices
    made = _mig_uuids_by_nvml(node, profile, 2)
    seen = {n: node.seen(n) for n in ("mig-a", "mig-b")}
    assert sorted(s.env["NVIDIA_VISIBLE_DEVICES"] for s in seen.values()) == made
    assert all(len(s.caps) == 2 and s.nodes == {f"nvidia{gpu['minor']}"}
               for s in seen.values()), [s.raw for s in seen.values()]

    mig_claim("mig-whole", "7g.80gb")
    node.wait_unschedulable("mig-whole")
    gone = time.monotonic()
    node.delete_pods("mig-a", "mig-b")  # at once: kubelet stops them after they are gone
    node.wait_running("mig-whole")  # its prepare waits for theirs to be unprepared
    write_result(node.results, "dra_mig_whole_running_after_delete_s",
                 round(time.monotonic() - gone, 3))
    [whole] = _mig_uuids_by_nvml(node, profile, 2)
    assert whole not in made
    assert node.seen("mig-whole").env["NVIDIA_VISIBLE_DEVICES"] == whole
