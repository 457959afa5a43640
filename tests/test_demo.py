"""`gpu-agent demo` (the README's `make demo`) runs to the end and shows each step."""

from __future__ import annotations

import os

import pytest
from conftest import run_gpu_agent

DGX1V_ROW3 = "GPU3  NV2   NV1   NV2   X     SYS   SYS   SYS   NV1"


@pytest.mark.parametrize("profile", ["dgx1-v100", "dgx-h100", "pcie-8gpu"])
def test_demo_walks_through_and_exits_zero(profile):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_AGENT_SIM_")}
    proc = run_gpu_agent("demo", "--profile", profile, env=env, timeout=120)
    out = proc.stdout
    for step in ("1. Simulated GPU node", "2. Topology", "3. Simulated kubelet",
                 "4. Health signal path", "5. Clean stop"):
        assert f"== {step}" in out, out
    assert "XidCriticalError  79" in out
    assert "simulated kubelet stopped (exit 0)" in out
    if profile == "dgx1-v100":
        assert DGX1V_ROW3 in out  # the hybrid cube-mesh, as nvidia-smi topo -m shows it
    if profile == "dgx-h100":
        assert out.count("NV18") == 8 * 7
