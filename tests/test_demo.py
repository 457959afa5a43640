"""`gpu-agent demo` (the README's `make demo`) runs to the end and shows each step."""

from __future__ import annotations

import os
import re

import pytest
from conftest import run_gpu_agent

DGX1V_ROW3 = "GPU3  NV2   NV1   NV2   X     SYS   SYS   SYS   NV1"


@pytest.mark.parametrize("profile", ["dgx1-v100", "dgx-h100", "pcie-8gpu"])
def test_demo_walks_through_and_exits_zero(profile):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_AGENT_SIM_")}
    proc = run_gpu_agent("demo", "--profile", profile, env=env, timeout=120)
    out = proc.stdout
    steps = ("1. Simulated GPU node", "2. Topology", "3. Simulated kubelet",
             "4. The agent registers with kubelet", "5. Devices as kubelet sees them",
             "6. A 4-GPU pod", "7. Health signal path", "8. Kubelet restart",
             "9. Prometheus metrics and node feature labels", "10. MIG: node",
             "11. Sharing: time-slicing", "12. gpu-agent doctor", "13. Clean stop")
    positions = [out.find(f"== {step}") for step in steps]
    assert -1 not in positions and positions == sorted(positions), out
    assert "nvidia.com/gpu  gpu-agent-gpu.sock  1              yes" in out  # registered
    assert out.count("Healthy") == 8
    picked = re.search(r"preferred: GPUs ([\d, ]+) \(NUMA (\d)\); kubelet allocated: GPUs "
                       r"([\d, ]+)\n", out)
    assert picked and picked.group(1) == picked.group(3) and len(picked.group(1).split(",")) == 4
    assert "env NVIDIA_VISIBLE_DEVICES  GPU-" in out and "CDI device" in out
    assert "XidCriticalError  48" in out
    assert re.search(r"the agent withdrew GPU \d: kubelet got snapshot #\d+ with it Unhealthy, "
                     r"allocatable 7/8", out), out
    assert "and a passing NVML probe it is back, allocatable 8/8" in out
    assert re.search(r"nvidia.com/gpu  2 +open +8 +GPUs " + picked.group(1), out), out
    # the metrics step: the pod's 4 GPUs carry its labels in the scrape
    assert len(re.findall(r"GPU-\S+ +default/trainer +main\n", out)) == 4, out
    assert re.search(r"0 warn, 0 fail, \d+ skip: exit 0", out), out  # gpu-agent doctor
    assert "FAIL  devices.dev-char" in out  # ... and the node without its /dev/char links
    # the MIG step: a100-mig under mixed, GPU 5 reconfigured to 7x 1g.10gb while it runs
    assert re.search(r"nvidia.com/mig-1g.10gb +9 +16\n", out), out
    assert re.search(r"nvidia.com/mig-3g.40gb +4 +2\n", out), out
    assert "nvidia.com/gpu kept its registration (1) and its 3 devices throughout" in out
    # the sharing step: NVIDIA's documented config, 4 replicas of 8 GPUs, one replica a pod
    assert "kubelet sees nvidia.com/gpu.shared: 32 devices, IDs like GPU-" in out
    assert "distributed (the default replica policy): 3 pods on 3 GPUs" in out
    assert "a pod asking for 2 (failRequestsGreaterThanOne): invalid allocation request for " \
        '"nvidia.com/gpu.shared": invalid request: maximum request size for shared ' \
        "resources is 1; found 2" in out, out
    assert re.search(r"XID 48 on GPU \d: its 4 replicas withdrawn, allocatable 28/32", out), out
    assert "gpu-agent: SIGTERM → exit 0; its socket removed: yes" in out
    assert "simulated kubelet stopped (exit 0)" in out
    if profile == "dgx1-v100":
        assert DGX1V_ROW3 in out  # the hybrid cube-mesh, as nvidia-smi topo -m shows it
        # the pod's 4 GPUs share NUMA node 0, fully joined by NVLink
        assert picked.group(1) == "0, 1, 2, 3"
        assert "    GPU3  NV2   NV1   NV2   X\n" in out
    if profile == "dgx-h100":
        assert out.count("NV18") == 8 * 7 + 4 * 3  # the node, then the pod's 4 GPUs
