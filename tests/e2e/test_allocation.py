"""Case 1 and case 6 of the real-Kubernetes issue: pods that get GPUs through gpu-agent on a
real kubelet and containerd, read from inside their containers, and the agent naming them.

For each device-list strategy containerd can honour, a pod asking for 2 GPUs is scheduled by
the real scheduler, admitted by kubelet's own device manager, and its container sees exactly the
device nodes of the GPUs kubelet assigned (podresources is the truth) and the matching
NVIDIA_VISIBLE_DEVICES:
- `envvar` and `volume-mounts` put the devices in the environment or as mounts for NVIDIA's
  runtime hook; without that hook (none here) the device nodes come from `passDeviceSpecs`, as
  NVIDIA's plugin does it (internal/plugin/server.go apiDeviceSpecs);
- `cdi-annotations` and `cdi-cri` hand containerd CDI names (`nvidia.com/gpu=<UUID>`) that it
  resolves in the spec NVIDIA's `nvidia-ctk cdi generate` wrote for this node: the nodes, the
  spec's environment (`NVIDIA_VISIBLE_DEVICES=void`) and its hooks (nvidia-cdi-hook) come from
  that spec, so the names gpu-agent hands out are checked against NVIDIA's own generator.
"""

from __future__ import annotations

import re
import urllib.request

import pytest

from tests.conftest import run_gpu_agent
from tests.daemon_harness import clean_env
from tests.e2e.conftest import GPU, minors, profile_gpus

VISIBLE = "NVIDIA_VISIBLE_DEVICES"
MOUNT_ROOT = "/var/run/nvidia-container-devices"  # NVIDIA's volume-mounts root

STRATEGIES = {
    "envvar": ["--device-list-strategy", "envvar", "--pass-device-specs"],
    "volume-mounts": ["--device-list-strategy", "volume-mounts", "--pass-device-specs"],
    "cdi-annotations": ["--device-list-strategy", "cdi-annotations"],
    "cdi-cri": ["--device-list-strategy", "cdi-cri"],
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_pod_sees_exactly_its_two_gpus(node, strategy):
    node.agent("dgx1-v100", *STRATEGIES[strategy])
    node.wait_allocatable(8, capacity=8)
    node.create_pod("two-gpus", {GPU: 2})
    node.wait_running("two-gpus")

    assigned = node.assigned("two-gpus")
    assert len(assigned) == 2, f"kubelet assigned {assigned}"
    seen = node.seen("two-gpus")
    assert seen.nodes == minors(assigned), seen.raw
    if strategy == "envvar":
        assert sorted(seen.env[VISIBLE].split(",")) == sorted(assigned)
    elif strategy == "volume-mounts":
        assert seen.env[VISIBLE] == MOUNT_ROOT
        assert seen.mounts == set(assigned)
    else:
        # the CDI spec's own environment and NVIDIA's hooks: the legacy device list is
        # "void" (nothing for the old runtime hook to add); the nodes came from CDI
        assert seen.env[VISIBLE] == "void"
        assert seen.mounts <= {"void"}
        # nvidia-cdi-hook create-symlinks ran in the container (the spec's hooks work here)
        assert "libcuda.so -> libcuda.so.1" in node.exec(
            "two-gpus", "ls -l /usr/lib/x86_64-linux-gnu/")


def test_four_gpus_on_the_dgx1_are_the_set_get_preferred_allocation_chose(node):
    agent = node.agent("dgx1-v100", "--pass-device-specs", env={"GPU_AGENT_LOG_LEVEL": "debug"})
    node.wait_allocatable(8)
    node.create_pod("four-gpus", {GPU: 4})
    node.wait_running("four-gpus")

    # the agent's answer to kubelet's GetPreferredAllocation (its debug line)
    match = re.search(r"nvidia\.com/gpu: preferred \[\[([^\]]*)\]\] for \[\(4, \[\]\)\]",
                      agent.log())
    assert match, agent.proc.tail()
    preferred = re.findall(r"'([^']+)'", match.group(1))
    assigned = node.assigned("four-gpus")
    assert sorted(assigned) == sorted(preferred)
    assert node.seen("four-gpus").nodes == minors(preferred)
    # and it is a quad whose six pairs are all NVLinked on the DGX-1 (0-3 or 4-7)
    index = {g["uuid"]: g["index"] for g in profile_gpus()}
    assert {index[u] for u in preferred} in ({0, 1, 2, 3}, {4, 5, 6, 7})


def test_the_agent_names_the_real_pod_in_metrics_and_state(node):
    agent = node.agent("dgx1-v100", "--pass-device-specs")
    node.wait_allocatable(8)
    node.create_pod("attributed", {GPU: 1})
    node.wait_running("attributed")
    uuid = node.assigned("attributed")[0]

    # the first scrape after the container runs names its pod (read from podresources)
    with urllib.request.urlopen(agent.metrics_url(), timeout=10) as resp:
        text = resp.read().decode()
    line = next((ln for ln in text.splitlines() if ln.startswith("gpu_agent_device_allocated{")
                 and f'uuid="{uuid}"' in ln and 'pod="attributed"' in ln), None)
    assert line is not None and line.endswith(" 1.0"), \
        [ln for ln in text.splitlines() if ln.startswith("gpu_agent_device_allocated{")]
    assert 'namespace="default"' in line and 'container="main"' in line

    # the journal's record, once the reconciler's pass attributed it
    agent.wait_log("attributed to pod default/attributed container main")
    shown = run_gpu_agent("state", "show", "--state-dir", agent.state, env=clean_env()).stdout
    assert "default/attributed" in shown and uuid in shown, shown
