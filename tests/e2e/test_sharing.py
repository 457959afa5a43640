"""Case 5 of the real-Kubernetes issue: MIG (the `mixed` strategy on the a100-mig node), time-slicing
and MPS on the real kubelet and containerd, read from inside the containers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.rm.sharing import mps_shm_dir
from tests.e2e.conftest import GPU, MPS_STAND_IN, profile_gpus

MIG_1G = "nvidia.com/mig-1g.10gb"
MPS = "nvidia.com/gpu-mps"


def _mig_instances(profile: str, name: str) -> dict[str, tuple[dict, dict]]:
    """MIG UUID -> (GPU, instance) of every MIG device of profile `name` on the MIG-enabled
    GPUs of the node profile."""
    out = {}
    for gpu in profile_gpus(profile):
        mig = gpu.get("mig") or {}
        if mig.get("mode") != "enabled":
            continue
        names = {p["nvml_profile"]: p["name"] for p in mig["profiles"]}
        for inst in mig.get("instances", []):
            if names[inst["profile"]] == name and not inst.get("compute_slices"):
                out[inst["uuid"]] = (gpu, inst)
    return out


@pytest.mark.parametrize("strategy", ["envvar", "cdi-cri"])
def test_a_pod_asking_for_a_mig_device_sees_that_device(node, strategy):
    args = ["--device-list-strategy", strategy]
    if strategy == "envvar":
        args.append("--pass-device-specs")
    agent = node.agent("a100-mig", "--mig-strategy", "mixed", *args)
    instances = _mig_instances("a100-mig", "1g.10gb")
    node.wait_allocatable(len(instances), MIG_1G)
    node.create_pod("mig", {MIG_1G: 1})
    node.wait_running("mig")

    [uuid] = node.assigned("mig", MIG_1G)
    gpu, inst = instances[uuid]
    seen = node.seen("mig")
    assert seen.nodes == {f"nvidia{gpu['minor']}"}, seen.raw
    # the GPU instance's and compute instance's capability nodes, numbered as the driver's
    # mig-minors says (NVIDIA: internal/rm/nvml_devices.go GetPaths)
    minors = dict(line.rsplit(" ", 1) for line in Path(
        agent.root, "proc/driver/nvidia-caps/mig-minors").read_text().splitlines())
    gi = f"gpu{gpu['minor']}/gi{inst['gi']}"
    assert seen.caps == {f"nvidia-cap{minors[gi + '/access']}",
                         f"nvidia-cap{minors[gi + '/ci' + str(inst['ci']) + '/access']}"}
    if strategy == "envvar":
        assert seen.env["NVIDIA_VISIBLE_DEVICES"] == uuid
    else:  # resolved by containerd in the spec NVIDIA's nvidia-ctk wrote for this node
        assert seen.env["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_four_pods_share_one_gpu_time_sliced(node):
    config = node.config("version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                         "    - name: nvidia.com/gpu\n      replicas: 4\n")
    node.agent("dgx1-v100", "--pass-device-specs", "--shared-devices-allocation-policy",
               "packed", config=config)
    node.wait_allocatable(32)
    pods = [node.create_pod(f"ts{i}", {GPU: 1}) for i in range(4)]
    for pod in pods:
        node.wait_running(pod)

    held = node.assigned_all()
    replicas = [held[p][0] for p in pods]
    assert len(set(replicas)) == 4, replicas  # four replicas ...
    gpus = {r.split("::")[0] for r in replicas}
    assert len(gpus) == 1, replicas  # ... of one GPU, packed
    [uuid] = gpus
    index = {g["uuid"]: g["minor"] for g in profile_gpus()}
    for pod in pods:
        seen = node.seen(pod)
        assert seen.nodes == {f"nvidia{index[uuid]}"}, seen.raw
        assert seen.env["NVIDIA_VISIBLE_DEVICES"] == uuid


def test_an_mps_pod_gets_its_daemons_pipe_shm_and_share(node, mps_root):
    config = node.config("version: v1\nsharing:\n  mps:\n    resources:\n"
                         "    - name: nvidia.com/gpu\n      replicas: 4\n      devices: [0]\n"
                         f"      rename: {MPS}\n")
    node.agent("dgx1-v100", "--pass-device-specs", "--mps-root", mps_root,
               "--mps-control", MPS_STAND_IN, config=config)
    node.wait_allocatable(4, MPS)  # GPU 0 as 4 MPS replicas (GPUs 1-7 stay whole)
    gpu0 = profile_gpus()[0]
    Path(mps_shm_dir(mps_root)).mkdir(parents=True, exist_ok=True)
    Path(mps_shm_dir(mps_root), "from-the-host").write_text("shared")
    node.create_pod("mps", {MPS: 1})
    node.wait_running("mps")
    [replica] = node.assigned("mps", MPS)
    assert replica.startswith(gpu0["uuid"] + "::")

    seen = node.seen("mps")
    assert seen.nodes == {"nvidia0"}, seen.raw
    assert seen.env["NVIDIA_VISIBLE_DEVICES"] == gpu0["uuid"]
    # NVIDIA's (internal/plugin/mps.go): the pipe directory and /dev/shm; ours: the share
    assert seen.env["CUDA_MPS_PIPE_DIRECTORY"] == f"/mps/{MPS}/pipe"
    assert seen.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert seen.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096MB"  # 16 GiB / 4
    inside = node.exec("mps", f"ls /mps/{MPS}/pipe; cat /dev/shm/from-the-host")
    assert "nvidia-cuda-mps-control.pid" in inside and "control" in inside.split()
    assert inside.rstrip().endswith("shared")
