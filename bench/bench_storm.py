"""Allocate during an XID storm, with the fault events and the GPUHealthy condition on, on the
real API server of tests/e2e's cluster.

Owns: timing what kubelet waits for (an Allocate call on the agent's socket, one GPU, a new
channel's first call excluded) in a quiet window and in a window of 1,000 XIDs in 10 s on
another GPU that a running pod holds (so the agent posts the Node's and the pod's events and
patches the condition meanwhile), and counting the events the storm made. Figures only;
tests/e2e/test_events.py asserts behaviour.
"""

from __future__ import annotations

import os
import threading
import time

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from agent.sim import control
from bench import Section, percentile, ratio_row
from tests.e2e.cluster import Cluster, versions
from tests.e2e.conftest import E2ENode, profile_gpus

GPU = "nvidia.com/gpu"
WINDOW_S = 10.0
XIDS = 1000


def _window(stub, uuid: str, seconds: float) -> list[float]:
    """Allocate latencies (seconds), one call after the other for `seconds`."""
    request = dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(
        devices_ids=[uuid])])
    times = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        stub.Allocate(request, timeout=10)
        times.append(time.perf_counter() - start)
    return times


def _storm(ctl: str, index: int) -> None:
    begin = time.monotonic()
    for second in range(int(WINDOW_S)):
        control.inject_xids(ctl, [(index, 48)] * (XIDS // int(WINDOW_S)))
        time.sleep(max(0.0, begin + second + 1 - time.monotonic()))  # the storm's pace


def run() -> Section:
    version = versions()[0]
    section = Section(
        title="Allocate during an XID storm, fault events on (real API server)",
        method=(f"On the end-to-end cluster (Kubernetes {version}), gpu-agent as the node (the "
                "kubelet's kubeconfig) with events and the GPUHealthy condition on. Allocate "
                "calls for one healthy GPU straight to the agent's socket, one after the other, "
                f"for {WINDOW_S:g} s: first with nothing else happening, then while {XIDS} "
                f"reset-class XIDs arrive in {WINDOW_S:g} s (100 a second) on another GPU "
                "that a running pod holds. The ratio is against the quiet window's median."),
        header=["window", "calls", "median", "p99", "vs quiet"],
    )
    if os.geteuid() != 0:
        section.notes.append("not run: the cluster needs root (kubelet, containerd, mknod)")
        return section
    cluster = Cluster(version)
    cluster.start()
    try:
        node = E2ENode(cluster, {})
        agent = node.agent("dgx1-v100", "--recovery-quiet-period", "2s")
        node.wait_allocatable(8)
        node.create_pod("storm-holder", {GPU: 1})
        node.wait_running("storm-holder")
        held = node.assigned("storm-holder")[0]
        gpus = profile_gpus()
        index = next(g["index"] for g in gpus if g["uuid"] == held)
        other = next(g["uuid"] for g in gpus if g["uuid"] != held)
        with node.plugin_channel(agent) as channel:
            stub = dp_grpc.DevicePluginStub(channel)
            _window(stub, other, 1.0)  # the channel connected, the code paths warm
            quiet = _window(stub, other, WINDOW_S)
            before = dict(agent.status()["kubernetes"]["eventCounts"])
            storm = threading.Thread(target=_storm, args=(agent.control, index))
            storm.start()
            stormy = _window(stub, other, WINDOW_S)
            storm.join()
        agent.wait_log("healthy again")
        after = agent.status()["kubernetes"]["eventCounts"]
        node.cleanup()
    finally:
        cluster.stop()
    base = percentile(quiet, 50)
    section.rows.append(ratio_row("quiet", quiet, base, 2))
    section.rows.append(ratio_row(f"{XIDS} XIDs in {WINDOW_S:g} s on another GPU", stormy,
                                  base, 2))
    made = {k: after[k] - before[k] for k in after}
    section.notes.append(
        f"Events the storm made: {made['posted']} posted, {made['counted']} counted on one "
        f"already posted, {made['limited']} over the rate limit, {made['dropped']} dropped.")
    return section
