"""Pod created → container running with its GPUs, on the real kubelet of tests/e2e's cluster.

Owns: timing what an operator waits for when a GPU pod starts, through the real API server,
scheduler, kubelet and containerd (`make e2e`'s cluster, the newest pinned Kubernetes): from the
pod's creation to the watch showing its container ready, for pods asking for one GPU served by
gpu-agent, by NVIDIA's k8s-device-plugin (built by scripts/e2e-build, on the same simulated
NVML), and for pods asking for no GPU (what the cluster costs without any plugin).
Figures only; tests/e2e asserts behaviour.
"""

from __future__ import annotations

import os
import signal
import time

from bench import Section, percentile, ratio_row
from tests.e2e.cluster import Cluster, pinned, versions
from tests.e2e.conftest import E2ENode

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


def _series(node: E2ENode, prefix: str, resources: dict | None) -> list[float]:
    return [_started(node, f"{prefix}-{i}", resources) for i in range(PODS)]


def run() -> Section:
    version = versions()[0]
    section = Section(
        title="Real kubelet: pod created → container running with its GPU",
        method=(f"On the end-to-end cluster (tests/e2e, Kubernetes {version}, containerd, "
                "this machine's cgroup v1): from the pod's creation through the API server to "
                "the watch showing its container ready (scheduling, kubelet's admission and "
                "Allocate, the sandbox, the container's start), one pod at a time, each deleted "
                f"before the next; {PODS} pods per row, one GPU each (passDeviceSpecs). The "
                "ratio is against the median of pods asking for no GPU in the same run."),
        header=["pods served by", "pods", "median", "p99", "vs no GPU"],
    )
    if os.geteuid() != 0:
        section.notes.append("not run: the cluster needs root (kubelet, containerd, mknod)")
        return section
    cluster = Cluster(version)
    cluster.start()
    try:
        node = E2ENode(cluster, {})
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
    section.notes.append(
        f"NVIDIA's plugin is {NVIDIA_VERSION}, the newest the Go module proxy serves (v0.20.0 "
        "is refused), configured as gpu-agent is here: the envvar strategy with "
        "passDeviceSpecs, UUIDs. Kubelet asks both for a preferred allocation before "
        "Allocate; gpu-agent's row includes its journal record written before each Allocate "
        "answer.")
    section.notes.append(
        "A pod's start here is the cluster's work (scheduling, the sandbox, the container); the "
        "plugin's part is its Allocate answer, about half a millisecond (the median of "
        "\"Allocate, 1 caller\" in the device-plugin section). "
        "From run to run on this 2-vCPU machine the medians move by tens of milliseconds, "
        "more than the rows differ.")
    return section
