"""GPU faults where operators look, on the real API server: the Events `kubectl describe pod`
and `kubectl describe node` show, and the Node condition GPUHealthy (agent.kubeapi).

The agent runs as the node (the kubelet's kubeconfig: the Node authorizer lets it post events,
read its pods and patch its own Node's status), or as user `gpu-agent` holding exactly the RBAC
the package ships (packaging/kubernetes/gpu-agent-rbac.yaml). Figures go to .e2e/results:
XID → the pod's event, the Node's event and the condition; the API server's return → the
condition right again. Nothing asserts on them; docs/e2e.md shows them.
"""

from __future__ import annotations

import time
import urllib.request

import pytest

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from agent.sim import control
from tests.e2e.cluster import NODE
from tests.e2e.conftest import GPU, POLL, profile_gpus, write_result

WAIT = 60.0


def _until(predicate, what: str, timeout: float = WAIT):
    """Ask `predicate` every POLL seconds until it answers something true; that answer."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(POLL)


def _condition(node, status: str, text: str = ""):
    c = node.condition()
    return c if c and c["status"] == status and text in c["message"] else None


def _ready(node) -> None:
    """The agent's 8 GPUs in kubelet, and its condition set True at start."""
    node.wait_allocatable(8)
    _until(lambda: _condition(node, "True"), "GPUHealthy=True at start")


def _pod_on_a_gpu(node, name: str) -> tuple[int, str, str]:
    """A running pod `name` holding one GPU: (the GPU's index, its UUID, the pod's UID)."""
    node.create_pod(name, {GPU: 1})
    node.wait_running(name)
    uuid = node.assigned(name)[0]
    index = next(g["index"] for g in profile_gpus() if g["uuid"] == uuid)
    return index, uuid, node.pod(name)["metadata"]["uid"]


def test_xid_79_on_a_held_gpu_is_in_describe_pod_and_node_until_the_reboot(node):
    boot_id = node.config("boot-1\n", "boot_id")
    env = {"GPU_AGENT_BOOT_ID_FILE": boot_id}
    agent = node.agent("dgx1-v100", env=env)  # as the node: the kubelet's kubeconfig
    _ready(node)
    index, uuid, uid = _pod_on_a_gpu(node, "held")
    # `gpu-agent status` names the pod on its GPU once the journal matched it to podresources
    agent.status_when(lambda d: any(
        dev["uuid"] == uuid and dev["heldBy"] == ["default/held/main"]
        for r in d["resources"] for dev in r["devices"]), "status naming the pod")

    start = time.monotonic()
    control.inject_xid(agent.control, index, 79)
    pod_event = _until(lambda: node.events("Pod", "held", uid, "GPUWithdrawn"),
                       "the pod's event")[0]
    write_result(node.results, "xid79_to_pod_event_s", round(time.monotonic() - start, 3))
    node_event = _until(lambda: node.events("Node", NODE, NODE, "GPUWithdrawn"),
                        "the Node's event")[0]
    write_result(node.results, "xid79_to_node_event_s", round(time.monotonic() - start, 3))
    cond = _until(lambda: _condition(node, "False", f"GPU {index} ({uuid})"), "GPUHealthy=False")
    write_result(node.results, "xid79_to_condition_s", round(time.monotonic() - start, 3))

    assert pod_event["type"] == "Warning" and pod_event["source"]["component"] == "gpu-agent"
    assert pod_event["message"] == (
        f"GPU {index} ({uuid}) that this pod uses (container main) reported XID 79 (GPU has "
        f"fallen off the bus): node reboot required; the GPU is withdrawn from scheduling; the "
        f"container may need a restart")
    assert node_event["message"].startswith(
        f"GPU {index} ({uuid}) withdrawn from scheduling (reboot class): XID 79 (GPU has fallen "
        f"off the bus)")
    assert cond["reason"] == "GPUsWithdrawn"
    # what an operator runs: kubectl describe shows the event on the pod, and the condition
    # and the event on the node
    described = node.cluster.kubectl("describe", "pod", "held")
    assert "GPUWithdrawn" in described and pod_event["message"] in " ".join(described.split())
    described = " ".join(node.cluster.kubectl("describe", "node", NODE).split())
    assert "GPUHealthy False" in described and cond["message"] in described
    assert node_event["message"] in described
    # the agent's log line names the pod too
    agent.wait_log(f"withdrawn: {uuid}; held by default/held/main")
    assert agent.status()["kubernetes"]["eventCounts"]["posted"] == 2

    # the reboot: a new boot ID, the agent starts again; the fault is cleared, and said so
    agent.proc.stop()
    node.config("boot-2\n", "boot_id")
    node.agent("dgx1-v100", env=env)
    node.wait_allocatable(8)
    back = _until(lambda: node.events("Node", NODE, NODE, "GPURecovered"), "the recovery event")
    assert f"GPU {index} ({uuid}) back in service: boot ID changed since reboot-class fault" in \
        back[0]["message"]
    cond = _until(lambda: _condition(node, "True"), "GPUHealthy=True after the reboot")
    assert cond["reason"] == "AllGPUsHealthy"


def test_an_xid_storm_makes_a_handful_of_events_with_the_shipped_rbac(node):
    agent = node.agent("dgx1-v100", "--recovery-quiet-period", "2s",
                       kubeconfig=node.agent_identity())
    _ready(node)
    index, uuid, uid = _pod_on_a_gpu(node, "storm")

    def ours() -> list[dict]:  # gpu-agent's events on the Node and the pod (not kubelet's)
        return [e for e in node.events("Node", NODE, NODE) + node.events("Pod", "storm", uid)
                if e["source"].get("component") == "gpu-agent"]

    before = {e["metadata"]["name"] for e in ours()}  # an earlier test's, on the same Node
    # 1,000 reset-class XIDs on one GPU in 10 s, in batches of 100 a second
    begin = time.monotonic()
    for second in range(10):
        control.inject_xids(agent.control, [(index, 48)] * 100)
        time.sleep(max(0.0, begin + second + 1 - time.monotonic()))  # the storm's pace
    agent.wait_log("healthy again")  # 2 s without one, and the probe passed
    _until(lambda: _condition(node, "True"), "GPUHealthy=True after the storm")
    _until(lambda: node.events("Node", NODE, NODE, "GPURecovered"), "the recovery event")
    events = [e for e in ours() if e["metadata"]["name"] not in before]
    write_result(node.results, "xid_storm_1000_events", len(events))
    assert len(events) <= 5, [(e["reason"], e["message"], e.get("count")) for e in events]
    counts = agent.status()["kubernetes"]["eventCounts"]
    assert counts["failed"] == 0 and counts["dropped"] == 0, counts


def _allocate(node, agent, uuid: str) -> dp.AllocateResponse:
    """An Allocate call as kubelet makes it, straight to the agent's socket."""
    with node.plugin_channel(agent) as channel:
        return dp_grpc.DevicePluginStub(channel).Allocate(dp.AllocateRequest(
            container_requests=[dp.ContainerAllocateRequest(devices_ids=[uuid])]), timeout=10)


@pytest.mark.timeout(420)  # a 30 s outage, then the informers' own backoff (up to minutes)
def test_the_api_server_down_30_s_delays_no_withdrawal_or_allocate_and_is_caught_up(node):
    cluster = node.cluster
    agent = node.agent("dgx1-v100", kubeconfig=node.agent_identity())
    _ready(node)
    gpus = profile_gpus()

    cluster.stop_apiserver()
    down = time.monotonic()
    try:
        control.inject_xid(agent.control, 5, 79)
        # kubelet's device manager learns of it from the agent's stream, API or not
        _until(lambda: gpus[5]["uuid"] not in node.allocatable_ids(), "GPU 5 withdrawn")
        answer = _allocate(node, agent, gpus[6]["uuid"])
        assert answer.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == gpus[6]["uuid"]
        doc = agent.status_when(lambda d: d["kubernetes"]["queued"] >= 1 and
                                d["kubernetes"]["api"] != "answering", "the event queued")
        assert "not answering" in doc["kubernetes"]["api"]
        time.sleep(max(0.0, down + 30 - time.monotonic()))  # the outage lasts 30 s
    finally:
        ready = cluster.start_apiserver()
    _until(lambda: _condition(node, "False", f"GPU 5 ({gpus[5]['uuid']})"),
           "GPUHealthy=False once the API answers")
    write_result(node.results, "api_back_to_condition_s", round(time.monotonic() - ready, 3))
    _until(lambda: node.events("Node", NODE, NODE, "GPUWithdrawn"), "the queued event")
    doc = agent.status_when(lambda d: d["kubernetes"]["api"] == "answering" and
                            d["kubernetes"]["queued"] == 0, "the queue drained")
    with urllib.request.urlopen(agent.metrics_url(), timeout=10) as resp:
        metrics = resp.read().decode()
    dropped = doc["kubernetes"]["eventCounts"]["dropped"]
    assert f'gpu_agent_kubernetes_events_total{{outcome="dropped"}} {float(dropped)}' in metrics
    assert "gpu_agent_kubernetes_api_up 1.0" in metrics
    # the scheduler's and kubelet's informers come back after the outage on a backoff of their
    # own (client-go's reflectors; on 1.34 kubelet listed pods again a minute later): the next
    # test's pods wait for that, so this one ends when a pod is scheduled and runs again
    node.create_pod("after-the-outage")
    node.wait_running("after-the-outage", timeout=240)
    write_result(node.results, "api_back_to_pod_running_s", round(time.monotonic() - ready, 3))
