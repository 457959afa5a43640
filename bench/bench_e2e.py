"""Pod created → container running with its GPUs, on the real kubelet of tests/e2e's cluster.

Owns: timing what an operator waits for when a GPU pod starts, through the real API server,
scheduler, kubelet and containerd (`make e2e`'s cluster, the newest pinned Kubernetes): from the
pod's creation to the watch showing its container ready, for pods asking for one GPU served by
gpu-agent in DRA mode (through a ResourceClaim made before the pod, and an unchanged pod asking
nvidia.com/gpu that the DeviceClass maps), by gpu-agent as a device plugin, by NVIDIA's
k8s-device-plugin (built by scripts/e2e-build, on the same simulated NVML), and for pods asking
for no GPU (what the cluster costs without any plugin). Figures only; tests/e2e asserts
behaviour.
"""

from __future__ import annotations

import os
import signal
import time

from bench import Section, percentile, ratio_row
from tests.e2e.cluster import Cluster, pinned, versions
from tests.e2e.conftest import NS, RESOURCE_API, E2ENode, device_classes, resource_claim

PODS = 20
NVIDIA_VERSION = pinned("k8s-device-plugin", "github.com/NVIDIA/k8s-device-plugin")
GPU = "nvidia.com/gpu"


def _started(node: E2ENode, name: str, resources: dict | None) -> float:
    """Seconds from creating the pod to the watch showing its container ready."""
    start = time.monotonic()
    node.create_pod(name, resources)
    node.wait_running(name)
    elapsed = time.monotonic() - start
    node.delete_pods(name)
    return elapsed


# A pod start longer than this waited for kubelet's resync (docs/dra.md, the kubelet race)
RESYNC_S = 30


def _series(node: E2ENode, prefix: str, resources: dict | None) -> list[float]:
    return [_started(node, f"{prefix}-{i}", resources) for i in range(PODS)]


def _claim_started(node: E2ENode, name: str) -> float:
    """A ResourceClaim for one GPU of the class gpu.nvidia.com, made first; then the seconds
    from creating the pod that uses it to the watch showing its container ready."""
    claims = f"{RESOURCE_API}/namespaces/{NS}/resourceclaims"
    node.api.create(claims, resource_claim(name))
    start = time.monotonic()
    node.create_pod_with_claim(name, name)
    node.wait_running(name)
    elapsed = time.monotonic() - start
    node.delete_pods(name)
    node.api.delete(f"{claims}/{name}")
    return elapsed


def _dra(node: E2ENode) -> tuple[list[float], list[float]]:
    """gpu-agent in DRA mode with the DeviceClasses the package ships: (pods with a claim,
    unchanged pods asking nvidia.com/gpu: 1); then the agent stopped and its slice and classes
    deleted, so that the device-plugin rows meet a node without them."""
    classes = device_classes()
    for c in classes:
        node.api.create(f"{RESOURCE_API}/deviceclasses", c)
    agent, _ = node.dra_agent()
    with_claim = [_claim_started(node, f"claim-{i}") for i in range(PODS)]
    mapped = _series(node, "mapped", {GPU: 1})
    agent.status_when(lambda s: not s["dra"]["preparedClaims"], "every claim unprepared")
    agent.proc.stop(signal.SIGTERM)
    for s in node.api.get(f"{RESOURCE_API}/resourceslices")["items"]:
        node.api.delete(f"{RESOURCE_API}/resourceslices/{s['metadata']['name']}")
    for c in classes:
        node.api.delete(f"{RESOURCE_API}/deviceclasses/{c['metadata']['name']}")
    return with_claim, mapped


def run() -> Section:
    version = versions()[0]
    section = Section(
        title="Real kubelet: pod created → container running with its GPU",
        method=(f"On the end-to-end cluster (tests/e2e, Kubernetes {version}, containerd, "
                "this machine's cgroup v1): from the pod's creation through the API server to "
                "the watch showing its container ready (scheduling, kubelet's admission and "
                "Allocate or the claim's preparation, the sandbox, the container's start), one "
                f"pod at a time, each deleted before the next; {PODS} pods per row, one GPU "
                "each (device plugins: passDeviceSpecs; DRA: the DeviceClasses the package "
                "ships, the claim made before the pod is). The ratio is against the median of "
                "pods asking for no GPU in the same run."),
        header=["pods served by", "pods", "median", "p99", "vs no GPU"],
    )
    if os.geteuid() != 0:
        section.notes.append("not run: the cluster needs root (kubelet, containerd, mknod)")
        return section
    cluster = Cluster(version, keep=os.environ.get("E2E_KEEP") == "1")  # its logs, as make e2e
    cluster.start()
    try:
        node = E2ENode(cluster, {})
        # DRA first, on a node no device plugin has registered nvidia.com/gpu with (kubelet
        # keeps a stopped plugin's resource a while, and the scheduler then takes the
        # device-plugin path for nvidia.com/gpu)
        with_claim, mapped = _dra(node)
        node.agent("dgx1-v100", "--pass-device-specs")
        node.wait_allocatable(8)
        agent = _series(node, "agent", {GPU: 1})
        floor = _series(node, "nogpu", None)
        node.agents[-1].proc.stop(signal.SIGTERM)
        node.wait_allocatable(0, node_object=False)
        node.nvidia_plugin()
        node.wait_allocatable(8)
        nvidia = _series(node, "nvidia", {GPU: 1})
        node.cleanup()
    finally:
        cluster.stop()
    base = percentile(floor, 50)
    section.rows.append(ratio_row("no plugin (the pod asks for no GPU)", floor, base))
    section.rows.append(ratio_row("gpu-agent", agent, base))
    section.rows.append(ratio_row(f"NVIDIA's k8s-device-plugin {NVIDIA_VERSION}", nvidia,
                                  base))
    section.rows.append(ratio_row("gpu-agent, DRA mode: a pod with a ResourceClaim", with_claim,
                                  base))
    section.rows.append(ratio_row("gpu-agent, DRA mode: an unchanged pod asking nvidia.com/gpu: "
                                  "1 (the DeviceClass maps it)", mapped, base))
    section.notes.append(
        f"NVIDIA's plugin is {NVIDIA_VERSION}, the newest the Go module proxy serves (v0.20.0 "
        "is refused), configured as gpu-agent is here: the envvar strategy with "
        "passDeviceSpecs, UUIDs. Kubelet asks both for a preferred allocation before "
        "Allocate; gpu-agent's row includes its journal record written before each Allocate "
        "answer.")
    section.notes.append(
        "A pod's start here is the cluster's work (scheduling, the sandbox, the container); the "
        "plugin's part is its Allocate answer, about half a millisecond (the median of "
        "\"Allocate, 1 caller\" in the device-plugin section), and in DRA mode its "
        "NodePrepareResources answer (the DRA section), besides the scheduler's allocation "
        "of the claim (DRA's rows: the claim's CDI spec is injected by containerd; the "
        "mapped pod's claim is made by the scheduler). "
        "From run to run on this 2-vCPU machine the medians move by tens of milliseconds, "
        "more than the rows differ.")
    resynced = sum(1 for t in with_claim + mapped if t > RESYNC_S)
    section.notes.append(
        f"DRA rows: {resynced} of {len(with_claim) + len(mapped)} pods took over {RESYNC_S} s: "
        "kubelet read the claim before the API server's Node authorizer had linked the pod "
        "just bound to it, was refused, and tried again only at the pod's resync, 60-90 s "
        "later (a kubelet race that never reaches the agent: docs/dra.md). Such a pod is the "
        "p99 of its row.")
    return section
