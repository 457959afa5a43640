"""GPU faults in Kubernetes' own views (agent.kubeapi): the kubeconfig the agent reads, and the
Events and GPUHealthy condition it sends, to the fast tests' API server (tests/kube_api.py;
tests/e2e/test_faults.py checks the same against the real one).

End to end (`gpu-agent run` on the simulated NVML and kubelet): an XID on a GPU a pod holds
gives the Node an event, the pod an event naming its container, and the condition False naming
the GPU; its recovery gives the condition True and an event saying how long it was out; the
API server down meanwhile delays neither the withdrawal nor Allocate, and the condition is
right once it answers. The reporter alone: an event seen again is counted on the one posted,
each object gets at most 25 new ones, a full queue drops and counts, a refusal is counted and
not retried.
"""

from __future__ import annotations

import base64
import time

import pytest

from agent.errors import KubeApiError
from agent.kubeapi import faults
from agent.kubeapi.client import load_kubeconfig
from agent.sim import control
from agent.sim.profile import load_profile
from tests.daemon_harness import GPU, Node, unhealthy
from tests.kube_api import KubeApi

UUIDS = [g["uuid"] for g in load_profile("dgx1-v100")["gpus"]]
NODE = "gpu-node-1"


# -- the kubeconfig ------------------------------------------------------------------------------


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(text)
    return str(path)


KUBELET_CONF = """apiVersion: v1
kind: Config
clusters:
- name: default-cluster
  cluster:
    certificate-authority-data: {ca}
    server: https://10.0.0.1:6443
contexts:
- name: default-context
  context: {{cluster: default-cluster, namespace: default, user: default-auth}}
current-context: default-context
users:
- name: default-auth
  user:
    client-certificate: pki/kubelet-client-current.pem
    client-key: pki/kubelet-client-current.pem
"""


def test_the_kubelets_kubeconfig_gives_its_server_ca_and_rotating_client_certificate(tmp_path):
    # kubeadm's /etc/kubernetes/kubelet.conf: inline CA, the certificate by path (kubelet
    # rotates the file in place); paths are relative to the kubeconfig's directory
    path = _write(tmp_path, KUBELET_CONF.format(ca=base64.b64encode(b"PEM").decode()))
    cfg = load_kubeconfig(path)
    assert cfg.server == "https://10.0.0.1:6443"
    assert cfg.ca_data == b"PEM"
    assert cfg.cert_file == cfg.key_file == str(tmp_path / "pki" / "kubelet-client-current.pem")
    assert not cfg.token


def test_a_token_file_and_the_only_context_without_current_context(tmp_path):
    path = _write(tmp_path, "clusters:\n- name: c\n  cluster: {server: 'https://api:6443/', "
                            "certificate-authority: /etc/ca.crt}\nusers:\n- name: u\n  user: "
                            "{tokenFile: /var/run/token}\ncontexts:\n- name: x\n  context: "
                            "{cluster: c, user: u}\n")
    cfg = load_kubeconfig(path)
    assert (cfg.server, cfg.ca_file, cfg.token_file) == ("https://api:6443", "/etc/ca.crt",
                                                          "/var/run/token")


@pytest.mark.parametrize("text, expected", [
    ("current-context: a\ncontexts:\n- name: a\n  context: {cluster: c, user: u}\nclusters:\n"
     "- name: c\n  cluster: {server: 'https://x'}\nusers:\n- name: u\n  user:\n    exec: "
     "{command: aws}\n", "authenticates with exec, which gpu-agent does not run"),
    ("current-context: a\ncontexts: []\n", "no context named 'a'"),
    ("contexts: []\n", "no current-context"),
    ("- a list\n", "not a kubeconfig"),
    ("current-context: a\ncontexts:\n- name: a\n  context: {cluster: c}\nclusters:\n- name: c\n"
     "  cluster: {server: 'https://x', certificate-authority-data: '%%%'}\n",
     "certificate-authority-data is not base64"),
    ("current-context: a\ncontexts:\n- name: a\n  context: {cluster: c}\nclusters:\n- name: c\n"
     "  cluster: {server: 'x:6443'}\n", "has no https:// server"),
], ids=["exec-plugin", "no-such-context", "no-current-context", "not-a-mapping", "bad-base64",
        "no-scheme"])
def test_a_kubeconfig_the_agent_cannot_use_is_refused_naming_the_file_and_entry(
        tmp_path, text, expected):
    path = _write(tmp_path, text)
    with pytest.raises(KubeApiError) as err:
        load_kubeconfig(path)
    assert str(err.value).startswith(f"kubeconfig {path}: ") and expected in str(err.value)


def test_a_missing_kubeconfig_is_named(tmp_path):
    with pytest.raises(KubeApiError, match="kubeconfig /nonexistent/kc: No such file"):
        load_kubeconfig("/nonexistent/kc")


# -- the running agent ---------------------------------------------------------------------------


@pytest.fixture
def node():
    with Node() as n:
        yield n


def _start(node: Node, api: KubeApi, *args: str):
    api.kubeconfig(node.kubeconfig)
    agent = node.agent("--node-name", NODE, "--recovery-quiet-period", "1s", *args)
    agent.wait_registered()
    api.wait(lambda: (api.condition("GPUHealthy") or {}).get("status") == "True",
             "the condition asserted True at start")
    return agent


def test_an_xid_on_a_held_gpu_tells_the_node_the_pod_and_the_condition_until_it_recovers(node):
    api = KubeApi(NODE, pods={("default", "train"): "uid-train"})
    agent = _start(node, api)
    assert api.condition("GPUHealthy")["reason"] == "AllGPUsHealthy"
    pod = node.client.admit_pod("train", {"main": {GPU: 1}})
    uuid = pod.container("main").allocation(GPU).device_ids[0]
    index = UUIDS.index(uuid)
    node.status_with(f"GPU {index} {uuid} NUMA", "held by default/train/main")

    control.inject_xid(node.ctl, index, 48)
    withdrawn = api.wait(lambda: api.events_about("Pod", "train", "GPUWithdrawn"),
                         "the pod's event")[0]
    assert withdrawn["involvedObject"]["uid"] == "uid-train"
    assert withdrawn["type"] == "Warning" and withdrawn["source"]["component"] == "gpu-agent"
    assert withdrawn["message"] == (
        f"GPU {index} ({uuid}) that this pod uses (container main) reported XID 48 (double-bit "
        f"ECC error): GPU reset required; the GPU is withdrawn from scheduling; the container "
        f"may need a restart")
    on_node = api.wait(lambda: api.events_about("Node", NODE, "GPUWithdrawn"), "the node's")[0]
    assert on_node["involvedObject"]["uid"] == NODE  # what `kubectl describe node` matches
    assert on_node["metadata"]["namespace"] == "default"
    assert on_node["message"].startswith(f"GPU {index} ({uuid}) withdrawn from scheduling "
                                         f"(reset class): XID 48")
    cond = api.wait(lambda: (c := api.condition("GPUHealthy")) and c["status"] == "False" and c,
                    "GPUHealthy=False")
    assert cond["reason"] == "GPUsWithdrawn"
    assert cond["message"].startswith(f"1 GPU withdrawn: GPU {index} ({uuid}): XID 48")
    agent.wait_log(f"withdrawn: {uuid}; held by default/train/main")

    # after the quiet period and the probe it is back: the condition, and the node's event
    back = api.wait(lambda: api.events_about("Node", NODE, "GPURecovered"), "the recovery")[0]
    assert back["type"] == "Normal" and f"GPU {index} ({uuid}) back in service after" in \
        back["message"]
    cond = api.wait(lambda: (c := api.condition("GPUHealthy")) and c["status"] == "True" and c,
                    "GPUHealthy=True again")
    assert cond["reason"] == "AllGPUsHealthy"
    out = node.status_with("Kubernetes API (node gpu-node-1", "GPUHealthy=True")
    assert "events: 3 posted" in out and "0 dropped" in out
    assert agent.stop() == 0


def test_the_api_down_delays_neither_the_withdrawal_nor_allocate_and_is_caught_up(node):
    api = KubeApi(NODE)
    agent = _start(node, api)
    api.stop()
    control.inject_xid(node.ctl, 2, 79)
    agent.wait_for(lambda s: unhealthy(s.resource(GPU).latest_snapshot) == {UUIDS[2]},
                   "GPU 2 withdrawn while the API is down")
    pod = node.client.admit_pod("during-outage", {"main": {GPU: 2}})
    assert UUIDS[2] not in pod.container("main").allocation(GPU).device_ids
    node.status_with("not answering", "1 queued")
    api.start()
    cond = api.wait(lambda: (c := api.condition("GPUHealthy")) and c["status"] == "False" and c,
                    "the condition once the API answers")
    assert f"GPU 2 ({UUIDS[2]}): XID 79" in cond["message"]
    api.wait(lambda: api.events_about("Node", NODE, "GPUWithdrawn"), "the queued event")
    node.status_with("Kubernetes API (node gpu-node-1", ": answering;", "0 queued")
    assert agent.stop() == 0


def test_without_a_kubeconfig_the_agent_serves_and_says_events_wait_for_one(node):
    agent = node.agent()  # the harness's kubeconfig path: not written
    agent.wait_registered()
    agent.wait_log(f"no kubeconfig at {node.kubeconfig} yet")
    node.status_with(f"no kubeconfig at {node.kubeconfig}", "GPUHealthy not asserted yet")
    assert agent.stop() == 0


# -- the reporter alone --------------------------------------------------------------------------


def _reporter(api: KubeApi, tmp_path, out: dict | None = None, holders=lambda ids: []):
    r = faults.FaultReporter(kubeconfig=api.kubeconfig(str(tmp_path / "kc")), node=NODE,
                             events=True, condition=True, gpus_out=lambda: dict(out or {}),
                             holders=holders, on_change=api.poke)
    return r


def _flip(index: int, healthy: bool, reason: str = "XID 79 (GPU has fallen off the bus)"):
    return {"time": time.time(), "gpuIndex": index, "gpuUuid": UUIDS[index],
            "devices": [UUIDS[index]], "healthy": healthy, "reason": reason,
            "xid": 79, "action": "reboot"}


def _settled(api: KubeApi, r: faults.FaultReporter, posted: int, counted: int):
    return api.wait(lambda: r.counts["posted"] == posted and r.counts["counted"] == counted
                    and not r.status()["queued"], f"{posted} posted, {counted} counted: "
                    f"{r.counts}")


def test_a_flapping_gpu_counts_on_the_events_posted_and_a_full_queue_drops(tmp_path):
    api = KubeApi(NODE)
    api.stop()
    r = _reporter(api, tmp_path)
    r.start()
    try:
        for _ in range(150):  # 300 flips while the API is down: 256 wait, 44 are dropped
            r.notify(_flip(1, healthy=False))
            r.notify(_flip(1, healthy=True, reason="no critical event for 1 s"))
        api.wait(lambda: r.counts["dropped"] == 300 - faults.QUEUE_MAX, "the drops")
        api.start()
        _settled(api, r, posted=2, counted=faults.QUEUE_MAX - 2)
        events = api.events_about("Node", NODE)
        assert sorted(e["count"] for e in events) == [faults.QUEUE_MAX // 2] * 2
        assert api.condition("GPUHealthy")["status"] == "True"
    finally:
        r.stop()


def test_each_object_gets_25_new_events_then_the_rest_are_limited(tmp_path):
    api = KubeApi(NODE)
    r = _reporter(api, tmp_path)
    r.start()
    try:
        for i in range(30):
            r.notify(_flip(0, healthy=False, reason=f"reason {i}"))
        api.wait(lambda: r.counts["posted"] + r.counts["limited"] == 30, "30 handled")
        assert (r.counts["posted"], r.counts["limited"]) == (faults.SPAM_BURST, 30 - 25)
    finally:
        r.stop()


def test_a_kubeconfig_that_comes_later_is_taken_up_as_it_is_written(tmp_path):
    """In a directory made after the start too: the reporter waits for both with inotify
    (tests/test_idle.py: its thread sleeps meanwhile)."""
    api = KubeApi(NODE)
    path = tmp_path / "etc" / "kubernetes" / "kubelet.conf"
    r = faults.FaultReporter(kubeconfig=str(path), node=NODE, events=True, condition=True,
                             gpus_out=dict, holders=lambda ids: [], on_change=api.poke)
    r.start()
    try:
        api.wait(lambda: r.status()["api"] == f"no kubeconfig at {path}", "the wait")
        path.parent.mkdir(parents=True)
        api.kubeconfig(str(path))
        api.wait(lambda: (api.condition("GPUHealthy") or {}).get("status") == "True",
                 "the condition, once the kubeconfig is there")
        r.notify(_flip(2, healthy=False))
        _settled(api, r, posted=1, counted=0)
    finally:
        r.stop()


def test_a_refused_event_is_counted_not_retried_and_the_condition_still_set(tmp_path):
    api = KubeApi(NODE)
    api.refuse.add("/api/v1/namespaces/default/events")
    r = _reporter(api, tmp_path, out={UUIDS[4]: (4, "XID 79 (GPU has fallen off the bus)")})
    r.start()
    try:
        r.notify(_flip(4, healthy=False))
        api.wait(lambda: r.counts["failed"] == 1, "the refusal counted")
        api.wait(lambda: (api.condition("GPUHealthy") or {}).get("status") == "False",
                 "the condition")
        refused = [q for q in api.requests if q[0] == "POST"]
        assert len(refused) == 1 and r.status()["api"] == "answering"
    finally:
        r.stop()


def test_the_pods_holding_the_gpu_each_get_one_event_naming_their_containers(tmp_path):
    api = KubeApi(NODE, pods={("ml", "a"): "uid-a", ("ml", "b"): "uid-b"})
    held = [("ml", "a", "trainer"), ("ml", "a", "sidecar"), ("ml", "b", "main")]
    r = _reporter(api, tmp_path, holders=lambda ids: held if UUIDS[6] in ids else [])
    r.start()
    try:
        r.notify(_flip(6, healthy=False))
        _settled(api, r, posted=3, counted=0)
        a = api.events_about("Pod", "a")[0]
        assert "(container sidecar, trainer)" in a["message"] and \
            a["involvedObject"]["namespace"] == a["metadata"]["namespace"] == "ml"
        assert api.events_about("Pod", "b")[0]["involvedObject"]["uid"] == "uid-b"
    finally:
        r.stop()
