"""Case 7 of the real-Kubernetes issue: switching a node from NVIDIA's k8s-device-plugin to
gpu-agent, with pods running, in the order docs/install.md recommends: start gpu-agent, see it
registered, stop NVIDIA's plugin (its DaemonSet deleted); and the rollback.

NVIDIA's plugin is the real one, built from its Go module by scripts/e2e-build (v0.19.1: the
newest the Go module proxy serves; v0.20.0 is refused), on the same simulated NVML and driver
tree as gpu-agent. Two plugins registering one resource, the first one going away: what the
real kubelet does then differs by version (pkg/kubelet/cm/devicemanager):
- 1.34 keeps one client per resource: the second registration replaces the first, and when
  the first one's stream ends its clean-up finds the client by resource name, which is now
  gpu-agent's, and disconnects it (plugin/v1beta1/handler.go runClient): every device turns
  unhealthy until gpu-agent registers again, which it does as soon as kubelet drops its stream;
- 1.37 keeps every client per resource and socket path: the old one's end removes only its own
  endpoint, and gpu-agent's devices stay healthy throughout.
Either way running pods keep their GPUs (kubelet's checkpoint holds them by device ID, the same
GPU UUIDs under both plugins) and new pods are admitted on the GPUs no running pod holds.
"""

from __future__ import annotations

import signal
import threading
import time
import urllib.request

from agent.errors import PodResourcesError
from tests.e2e.conftest import GPU, POLL, minors, write_result


def _healthy_samples(node, stop: threading.Event, samples: list[tuple[float, int]]) -> None:
    while not stop.is_set():
        try:
            samples.append((time.monotonic(), len(node.allocatable_ids())))
        except PodResourcesError as exc:  # rate-limited or busy: a gap in the samples
            samples.append((time.monotonic(), -1))
            print(f"sample missed: {exc}")
        stop.wait(POLL)


def _sees_its_gpus_as_nvidia_gives_them(node, pod: str, uuids: list[str]) -> None:
    """NVIDIA's envvar strategy with passDeviceSpecs (internal/plugin/server.go
    getAllocateResponse, apiDeviceSpecs): NVIDIA_VISIBLE_DEVICES lists the UUIDs, and the
    container has exactly those GPUs' device nodes. gpu-agent's `--pass-device-specs` answer
    must read the same from inside the container."""
    seen = node.seen(pod)
    assert sorted(seen.env["NVIDIA_VISIBLE_DEVICES"].split(",")) == sorted(uuids), seen.raw
    assert seen.nodes == minors(uuids), seen.raw


def test_switching_from_nvidias_plugin_keeps_running_pods_and_admits_new_ones(node):
    cluster = node.cluster
    old = node.nvidia_plugin()
    node.wait_allocatable(8)
    for name in ("old-a", "old-b"):
        node.create_pod(name, {GPU: 2})
    for name in ("old-a", "old-b"):
        node.wait_running(name)
    before = node.assigned_all()
    for pod, uuids in before.items():
        _sees_its_gpus_as_nvidia_gives_them(node, pod, uuids)
    seen_before = {p: node.seen(p).nodes for p in ("old-a", "old-b")}

    # 1. gpu-agent starts beside the old plugin and registers the same resource
    agent = node.agent("dgx1-v100", "--pass-device-specs")
    agent.wait_log("registered nvidia.com/gpu with kubelet")
    node.wait_allocatable(8)

    # 2. NVIDIA's plugin stops (its DaemonSet deleted); kubelet's count is sampled meanwhile
    deregistered = cluster.procs["kubelet"].log().count('"Deregistered client"')
    samples: list[tuple[float, int]] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_healthy_samples, args=(node, stop, samples))
    sampler.start()
    try:
        assert old.stop(signal.SIGTERM) == 0, old.tail()
        deadline = time.monotonic() + 60
        while cluster.procs["kubelet"].log().count('"Deregistered client"') == deregistered:
            assert time.monotonic() < deadline, cluster.procs["kubelet"].tail()
            time.sleep(POLL)
        node.wait_allocatable(8)
    finally:
        stop.set()
        sampler.join()
    zero = [t for t, n in samples if n == 0]
    write_result(node.results, "migration_zero_allocatable_s",
                 round(zero[-1] - zero[0] + POLL, 3) if zero else 0.0)
    write_result(node.results, "migration_reregistered_by_agent",
                 agent.log().count("registered nvidia.com/gpu with kubelet"))

    # 3. the running pods kept their GPUs; new pods get the others
    for name in ("new-a", "new-b"):
        node.create_pod(name, {GPU: 2})
    for name in ("new-a", "new-b"):
        node.wait_running(name)
    after = node.assigned_all()
    assert {p: sorted(after[p]) for p in before} == {p: sorted(ids) for p, ids in before.items()}
    assert {p: node.seen(p).nodes for p in ("old-a", "old-b")} == seen_before
    held = [u for ids in after.values() for u in ids]
    assert len(held) == len(set(held)) == 8, after
    for pod in ("new-a", "new-b"):
        _sees_its_gpus_as_nvidia_gives_them(node, pod, after[pod])
    # gpu-agent's metrics name NVIDIA's plugin's pods too (podresources at scrape time; they
    # are not in its journal)
    with urllib.request.urlopen(agent.metrics_url(), timeout=10) as resp:
        text = resp.read().decode()
    for pod, ids in after.items():
        for uuid in ids:
            assert any(ln.startswith("gpu_agent_device_allocated{") and f'uuid="{uuid}"' in ln
                       and f'pod="{pod}"' in ln and ln.endswith(" 1.0")
                       for ln in text.splitlines()), (pod, uuid)


def test_rolling_back_stop_gpu_agent_first_then_start_nvidias_plugin(node):
    # The other way round, NVIDIA's plugin does not register again when kubelet (<= 1.36)
    # drops it (it restarts its plugins only when kubelet.sock is created anew or on SIGHUP:
    # cmd/nvidia-device-plugin/main.go, the loop after `restart:`): the node would
    # keep 0 allocatable GPUs until that plugin restarts. Stopping gpu-agent first leaves a
    # gap instead, during which new pods wait and running ones keep their GPUs.
    agent = node.agent("dgx1-v100", "--pass-device-specs")
    node.wait_allocatable(8)
    node.create_pod("kept", {GPU: 2})
    node.wait_running("kept")
    held = sorted(node.assigned("kept"))

    assert agent.proc.stop(signal.SIGTERM) == 0
    node.wait_allocatable(0, node_object=False)  # kubelet saw gpu-agent's stream end
    node.nvidia_plugin()
    node.wait_allocatable(8)
    node.create_pod("after-rollback", {GPU: 2})
    node.wait_running("after-rollback")
    after = node.assigned_all()
    assert sorted(after["kept"]) == held
    assert not set(after["after-rollback"]) & set(held)
    _sees_its_gpus_as_nvidia_gives_them(node, "after-rollback", after["after-rollback"])
