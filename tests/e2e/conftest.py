"""Fixtures of the end-to-end tests: one real cluster per run (tests/e2e/cluster.py), and per
test a `node` that starts gpu-agent on it, creates pods through the API server, reads what
their containers see (crictl exec) and cleans up after the test.

`make e2e` runs this directory once per pinned Kubernetes version (`--k8s VERSION`, or
$E2E_K8S; default the newest). Figures the cases measure (XID to allocatable, kubelet restart
to allocatable) go to .e2e/results/<version>.json for docs/e2e.md. Every wait follows the API's
watch streams or a process's state, bounded; none is a fixed sleep.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e import images
from tests.e2e.cluster import DEVICE_PLUGIN_DIR, NODE, ROOT, Agent, Cluster, Process, versions
from tests.e2e.kube import ApiError, gpu_pod, pod_phase, pod_reason

GPU = "nvidia.com/gpu"
NS = "default"
RESOURCE_API = "/apis/resource.k8s.io/v1"
DRIVER = "gpu.nvidia.com"  # gpu-agent's DRA driver name (NVIDIA's)
# the fault events and the GPUHealthy condition are test_events.py's: a DRA agent's Node
# events would be found there
QUIET = ("--fault-events", "false", "--node-condition", "false")
RESULTS = ROOT / ".e2e" / "results"
# how often kubelet's podresources is polled where no watch exists: under its rate limit
# (100 calls a second), and the resolution of the times measured that way
POLL = 0.02
# NVIDIA's plugin as its DaemonSet is commonly configured on a node without the NVIDIA runtime:
# the device list in NVIDIA_VISIBLE_DEVICES and the device nodes in the Allocate answer
# (gpu-agent's `--pass-device-specs` gives the same)
NVIDIA_CONFIG = """version: v1
flags:
  migStrategy: none
  plugin:
    passDeviceSpecs: true
    deviceListStrategy: envvar
    deviceIDStrategy: uuid
"""


def pytest_addoption(parser):
    parser.addoption("--k8s", default=os.environ.get("E2E_K8S") or None,
                     help="the Kubernetes version of the end-to-end cluster (default: the "
                          "newest under tests/e2e/components)")


# What one end-to-end test may take (pyproject's 120 s is the fast suite's): room for a pod that
# waits for kubelet's resync (RUNNING_WAIT_S) after what its test did before. A test that needs
# more says so with its own mark.
TEST_TIMEOUT_S = 300


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT_S))


@pytest.fixture(scope="session")
def k8s_version(request) -> str:
    version = request.config.getoption("--k8s") or versions()[0]
    if version not in versions():
        raise pytest.UsageError(f"--k8s {version}: pinned versions are {', '.join(versions())}")
    return version


@pytest.fixture(scope="session")
def results(k8s_version):
    """Figures measured by the cases, written to .e2e/results/<version>.json at the end."""
    found: dict[str, object] = {}
    yield found
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{k8s_version}.json").write_text(json.dumps(
        {"kubernetes": k8s_version, "date": time.strftime("%Y-%m-%d %H:%M"), **found},
        indent=1, sort_keys=True) + "\n")


@pytest.fixture(scope="session")
def cluster(k8s_version):
    if os.geteuid() != 0:
        pytest.fail("the end-to-end cluster needs root (kubelet, containerd, mknod)")
    c = Cluster(k8s_version, keep=os.environ.get("E2E_KEEP") == "1")
    c.start()
    yield c
    c.stop()


@dataclass
class Seen:
    """What a container sees of its GPUs, read from inside it."""

    nodes: set[str]  # /dev/nvidia<N> (GPU nodes only)
    env: dict[str, str]  # NVIDIA_* and CUDA_* variables
    mounts: set[str] = field(default_factory=set)  # /var/run/nvidia-container-devices entries
    caps: set[str] = field(default_factory=set)  # /dev/nvidia-caps entries
    raw: str = ""


PROBE = ("for f in /dev/nvidia*; do echo node ${f#/dev/}; done; "
         "for f in /dev/nvidia-caps/*; do [ -e \"$f\" ] && echo cap ${f#/dev/nvidia-caps/}; done; "
         "for f in /var/run/nvidia-container-devices/*; do [ -e \"$f\" ] && "
         "echo mount ${f#/var/run/nvidia-container-devices/}; done; "
         "env | grep -E '^(NVIDIA|CUDA)_' | sed 's/^/env /'; true")


# How long a pod may take to run. Not 90 s: kubelet 1.37.2 starts a pod whose claim it could
# not yet read only at the pod's resync, 60-90 s later (docs/dra.md, the kubelet race).
RUNNING_WAIT_S = 150


class E2ENode:
    """The cluster's one node, as a test uses it. Each test's agents have a state directory
    and log of their own (an agent started again in the same test keeps them)."""

    made = 0

    def __init__(self, cluster: Cluster, results: dict):
        E2ENode.made += 1
        self.tag = E2ENode.made
        self.cluster = cluster
        self.api = cluster.api
        self.results = results
        self.agents: list[Agent] = []
        self.plugins: list[Process] = []  # other plugins a test started
        self.pods: list[str] = []

    # -- the agent -----------------------------------------------------------------------

    def agent(self, profile: str = "dgx1-v100", *args: str, config: str | None = None,
              name: str = "gpu-agent", env: dict | None = None,
              kubeconfig: str | None = None) -> Agent:
        agent = self.cluster.start_agent(profile, *args, name=f"{name}-{self.tag}",
                                         config=config, env=env, kubeconfig=kubeconfig)
        self.agents.append(agent)
        return agent

    def dra_agent(self, *args: str, kubeconfig: str | None = None, env: dict | None = None,
                  profile: str = "dgx1-v100") -> tuple[Agent, dict]:
        """The agent in DRA mode on `profile`'s node (`args` added, QUIET), its slice published
        (returned) and its plugin registered by kubelet, and the namespace able to take pods;
        the node's identity (the kubelet's kubeconfig) unless `kubeconfig` says otherwise."""
        agent = self.agent(profile, "--mode", "dra", "--kubelet-dir",
                           self.cluster.kubelet_root, *QUIET, *args, kubeconfig=kubeconfig,
                           env=env)
        try:
            published = self.api.wait_for(f"{RESOURCE_API}/resourceslices/{NODE}-{DRIVER}",
                                          lambda s: s, "the agent's ResourceSlice")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{self.logs(60)}") from None
        agent.status_when(lambda s: (s.get("dra") or {}).get("registered"),
                          "kubelet registering the DRA plugin")
        # the controller-manager makes the namespace's default service account a moment after
        # the cluster starts; the API server refuses pods until it is there
        self.api.wait_for(f"/api/v1/namespaces/{NS}/serviceaccounts/default", lambda sa: sa,
                          "the default service account")
        return agent, published

    def nvidia_plugin(self, profile: str = "dgx1-v100", config: str = NVIDIA_CONFIG) -> Process:
        """NVIDIA's k8s-device-plugin serving `profile`'s GPUs (the envvar strategy with
        passDeviceSpecs unless `config` says otherwise); stopped at the end of the test."""
        proc = self.cluster.start_nvidia_plugin(profile, config, name=f"nvidia-plugin-{self.tag}")
        self.plugins.append(proc)
        return proc

    def agent_identity(self) -> str:
        """A kubeconfig for user `gpu-agent` (a client certificate, as the kubelet's own is),
        with exactly the RBAC the package ships (packaging/kubernetes) applied."""
        import yaml

        from tests.e2e import pki

        for doc in yaml.safe_load_all((ROOT / "packaging" / "kubernetes" /
                                       "gpu-agent-rbac.yaml").read_text()):
            plural = {"ClusterRole": "clusterroles",
                      "ClusterRoleBinding": "clusterrolebindings"}[doc["kind"]]
            try:
                self.api.create(f"/apis/rbac.authorization.k8s.io/v1/{plural}", doc)
            except ApiError as exc:
                if exc.code != 409:  # applied by an earlier test of this cluster
                    raise
        return pki.client_certificate(self.cluster.pki, "gpu-agent", self.cluster.server)

    def events(self, kind: str, name: str, uid: str, reason: str | None = None) -> list[dict]:
        """The events `kubectl describe` shows for the object: matched by kind, name and UID
        (k8s.io/kubectl v0.37.2 pkg/describe/describe.go searchEvents; for a Node it asks
        again with the node's name as UID: "there are two UIDs for host events: controller
        use node.uid, kubelet use node.name", and gpu-agent does as kubelet)."""
        selector = urllib.parse.quote(f"involvedObject.kind={kind},involvedObject.name={name},"
                                      f"involvedObject.uid={uid}")
        items = self.api.get(f"/api/v1/events?fieldSelector={selector}")["items"]
        return [e for e in items if reason is None or e["reason"] == reason]

    def condition(self, type_: str = "GPUHealthy") -> dict | None:
        return next((c for c in self.node()["status"].get("conditions", [])
                     if c["type"] == type_), None)

    def plugin_channel(self, agent: Agent, resource: str = GPU):
        """A gRPC channel to `agent`'s device-plugin socket of `resource`: Allocate called as
        kubelet calls it (DevicePluginStub), without a pod."""
        import grpc

        socket = next(r["socket"] for r in agent.status()["resources"] if r["name"] == resource)
        return grpc.insecure_channel(f"unix:{DEVICE_PLUGIN_DIR}/{os.path.basename(socket)}")

    def config(self, text: str, name: str = "config.yaml") -> str:
        return self.cluster.write(name, text)

    # -- the node object -------------------------------------------------------------------

    def node(self) -> dict:
        return self.api.get(f"/api/v1/nodes/{NODE}")

    def allocatable(self, resource: str = GPU) -> int:
        return int(self.node()["status"].get("allocatable", {}).get(resource, "0"))

    def wait_node(self, predicate, what: str, timeout: float = 60) -> dict:
        try:
            return self.api.wait_for(f"/api/v1/nodes/{NODE}",
                                     lambda n: n if predicate(n["status"]) else None, what,
                                     timeout)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{self.logs()}") from None

    def wait_allocatable(self, count: int, resource: str = GPU, capacity: int | None = None,
                         timeout: float = 60, node_object: bool = True) -> float:
        """Until kubelet's device manager has `count` healthy devices of `resource` (what it
        admits pods by: podresources GetAllocatableResources) and, with `node_object`, the
        Node object shows that allocatable (and `capacity`), which the scheduler goes by and
        which kubelet updates every nodeStatusUpdateFrequency (10 s); returns the seconds it
        took."""
        start = time.monotonic()
        deadline = start + timeout
        while len(self.allocatable_ids(resource)) != count:
            if time.monotonic() > deadline:
                raise AssertionError(f"kubelet's device manager never had {count} healthy "
                                     f"{resource}: {sorted(self.allocatable_ids(resource))}\n"
                                     f"{self.logs()}")
            time.sleep(POLL)
        if not node_object:
            return time.monotonic() - start

        def shows(status):
            ok = int(status.get("allocatable", {}).get(resource, "0")) == count
            if capacity is not None:
                ok = ok and int(status.get("capacity", {}).get(resource, "0")) == capacity
            return ok
        self.wait_node(shows, f"{resource} allocatable {count}"
                       + (f", capacity {capacity}" if capacity is not None else ""),
                       max(1.0, deadline - time.monotonic()))
        return time.monotonic() - start

    # -- pods ------------------------------------------------------------------------------

    def create_pod(self, name: str, resources: dict[str, int] | None = None,
                   command: str = "sleep 3600", annotations: dict[str, str] | None = None
                   ) -> str:
        self.api.create(f"/api/v1/namespaces/{NS}/pods",
                        gpu_pod(name, NODE, resources, images.BUSYBOX, command, annotations))
        self.pods.append(name)
        return name

    def create_pod_with_claim(self, pod: str, claim: str, scheduling_gate: str = "") -> dict:
        """Pod `pod` whose one container uses the ResourceClaim `claim` (made already), held
        at `scheduling_gate` if one is named."""
        body = gpu_pod(pod, NODE, None, images.BUSYBOX)
        if scheduling_gate:
            body["spec"]["schedulingGates"] = [{"name": scheduling_gate}]
        body["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
        body["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
        made = self.api.create(f"/api/v1/namespaces/{NS}/pods", body)
        self.pods.append(pod)
        return made

    def pod(self, name: str) -> dict:
        return self.api.get(f"/api/v1/namespaces/{NS}/pods/{name}")

    def wait_pod(self, name: str, predicate, what: str, timeout: float = 90) -> dict:
        try:
            return self.api.wait_for(f"/api/v1/namespaces/{NS}/pods/{name}",
                                     lambda p: p if predicate(p) else None, f"pod {name} {what}",
                                     timeout)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{self.logs()}") from None

    def wait_running(self, name: str, timeout: float = RUNNING_WAIT_S) -> dict:
        """Until the pod runs; fails at once when it failed (with kubelet's reason)."""
        def running(pod):
            if pod_phase(pod) == "Failed":
                raise AssertionError(f"pod {name} failed: {pod_reason(pod)}\n{self.logs()}")
            return pod_phase(pod) == "Running" and all(
                cs.get("ready") for cs in pod["status"].get("containerStatuses", [{}]))
        return self.wait_pod(name, running, "Running", timeout)

    def wait_unschedulable(self, name: str, timeout: float = 60) -> dict:
        """Until the scheduler says the pod does not fit (`unschedulable`)."""
        return self.wait_pod(name, unschedulable, "Unschedulable", timeout)

    def delete_pods(self, *names: str, wait: bool = True) -> None:
        for name in names or list(self.pods):
            self.api.delete(f"/api/v1/namespaces/{NS}/pods/{name}", grace_seconds=0)
        if wait:
            for name in names or list(self.pods):
                self.api.wait_gone(f"/api/v1/namespaces/{NS}/pods/{name}", timeout=90)
        self.pods = [p for p in self.pods if names and p not in names]

    def assigned(self, pod: str, resource: str = GPU) -> list[str]:
        """The device IDs kubelet assigned to the pod's container, from kubelet's own
        podresources API (the truth the container should match)."""
        return self.assigned_all(resource).get(pod, [])

    def assigned_all(self, resource: str = GPU) -> dict[str, list[str]]:
        """Pod name -> the device IDs of `resource` kubelet assigned to it, in one List
        (kubelet rate-limits podresources: 100 calls a second, bursts of 10)."""
        from agent.kubelet.podresources import PodResourcesClient

        client = PodResourcesClient(self.cluster.podresources_socket)
        out: dict[str, list[str]] = {}
        try:
            for d in client.list():
                if d.namespace == NS and d.resource == resource:
                    out.setdefault(d.name, []).extend(d.device_ids)
            return out
        finally:
            client.close()

    def allocatable_ids(self, resource: str = GPU) -> set[str]:
        """The device IDs kubelet's device manager can allocate now (podresources
        GetAllocatableResources: healthy devices, as admission sees them)."""
        from agent.kubelet.podresources import PodResourcesClient

        client = PodResourcesClient(self.cluster.podresources_socket)
        try:
            return set(client.allocatable().get(resource, ()))
        finally:
            client.close()

    def container_id(self, pod: str) -> str:
        """The running container of the pod (by its UID: a deleted pod of the same name may
        still have a container being killed)."""
        uid = self.pod(pod)["metadata"]["uid"]
        out = self.cluster.crictl("ps", "-q", "--label",
                                  f"io.kubernetes.pod.uid={uid}").stdout.split()
        if len(out) != 1:
            raise AssertionError(f"pod {pod}: expected one running container, crictl found {out}")
        return out[0]

    def exec(self, pod: str, command: str) -> str:
        out = self.cluster.crictl("exec", self.container_id(pod), "/bin/sh", "-c", command)
        return out.stdout

    def seen(self, pod: str) -> Seen:
        """What the pod's container sees of NVIDIA's devices, read inside it."""
        text = self.exec(pod, PROBE)
        seen = Seen(set(), {}, raw=text)
        for line in text.splitlines():
            kind, _, value = line.partition(" ")
            if kind == "node" and re.fullmatch(r"nvidia\d+", value):
                seen.nodes.add(value)
            elif kind == "cap":
                seen.caps.add(value)
            elif kind == "mount":
                seen.mounts.add(value)
            elif kind == "env":
                key, _, val = value.partition("=")
                seen.env[key] = val
        return seen

    def logs(self, lines: int = 30) -> str:
        """The tails of the agent's and kubelet's logs, for a failure's message."""
        parts = []
        for agent in self.agents[-2:]:
            parts.append(f"--- {agent.name} log:\n{agent.proc.tail(lines)}")
        kubelet = self.cluster.procs.get("kubelet")
        if kubelet is not None:
            parts.append(f"--- kubelet log:\n{kubelet.tail(lines)}")
        return "\n".join(parts)

    def cleanup(self) -> None:
        try:
            self.delete_pods()
        except (ApiError, TimeoutError, OSError) as exc:
            print(f"cleanup: pods not deleted: {exc}")
        for proc in [a.proc for a in self.agents] + self.plugins:
            if proc.alive():
                proc.stop(signal.SIGTERM)
        if not self.cluster.procs.get("kubelet") or not self.cluster.procs["kubelet"].alive():
            self.cluster.start_kubelet()
            self.cluster.wait_node_ready()


@pytest.fixture
def node(cluster, results):
    n = E2ENode(cluster, results)
    yield n
    n.cleanup()


def device_classes() -> list[dict]:
    """The DeviceClasses the packages ship (NVIDIA's chart's, with nvidia.com/gpu mapped)."""
    import yaml

    return list(yaml.safe_load_all(
        (ROOT / "packaging/kubernetes/gpu-agent-dra-deviceclasses.yaml").read_text()))


def resource_claim(name: str, count: int = 1, selector: str = "",
                   config: list | None = None, capacity: dict | None = None) -> dict:
    """ResourceClaim `name` asking `count` devices (request "gpu") of the class gpu.nvidia.com,
    those `selector` (a CEL expression) admits, with `config` (spec.devices.config), and of
    each device `capacity` (KEP-5075: name -> quantity)."""
    exactly: dict = {"deviceClassName": DRIVER}
    if count != 1:
        exactly["count"] = count
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    devices: dict = {"requests": [{"name": "gpu", "exactly": exactly}]}
    if config:
        devices["config"] = config
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name}, "spec": {"devices": devices}}


def profile_gpus(profile: str = "dgx1-v100") -> list[dict]:
    """The simulated node's GPUs (index, uuid, minor, mig, ...), as its profile defines them."""
    from agent.sim import PROFILES_DIR
    from agent.sim.profile import load_profile

    return load_profile(str(PROFILES_DIR / f"{profile}.yaml"))["gpus"]


def minors(uuids, profile: str = "dgx1-v100") -> set[str]:
    """The /dev/nvidia<minor> names of the GPUs with these UUIDs."""
    by_uuid = {g["uuid"]: g for g in profile_gpus(profile)}
    return {f"nvidia{by_uuid[u]['minor']}" for u in uuids}


def unschedulable(pod: dict) -> bool:
    """The scheduler says `pod` does not fit (PodScheduled False, Unschedulable)."""
    return any(c["type"] == "PodScheduled" and c["status"] == "False"
               and c.get("reason") == "Unschedulable"
               for c in pod["status"].get("conditions", []))


def write_result(results: dict, key: str, value) -> None:
    results[key] = value
    print(f"measured {key}: {value}")


MPS_STAND_IN = str(ROOT / "agent" / "sim" / "bin" / "nvidia-cuda-mps-control")


@pytest.fixture
def mps_root(node):
    """The agent's --mps-root for the test; the daemons started under it killed at its end
    (after the agents, so that none starts one again)."""
    from agent.rm.sharing import mps_pipe_dir

    root = node.cluster.path("mps")
    yield root
    for agent in node.agents:
        if agent.proc.alive():
            agent.proc.stop(signal.SIGKILL)
    for uuid in os.listdir(root) if os.path.isdir(root) else ():
        pid_file = Path(mps_pipe_dir(root, uuid), "nvidia-cuda-mps-control.pid")
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
