"""`gpu-agent demo`'s sharing step: a second agent on the demo's simulated node under NVIDIA's
time-slicing config, pods of one replica each, a two-replica pod refused, and an XID.

Owns: that step's output. Must not hold logic of its own: it drives `gpu-agent run`, the
simulated kubelet and `gpu-agent sim inject-xid` as an operator would, and prints what they
show.
"""

from __future__ import annotations

from pathlib import Path

from agent.demo.node import StepNode

CONFIG = """\
version: v1
sharing:
  timeSlicing:
    renameByDefault: true
    failRequestsGreaterThanOne: true
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""
SHARED = "nvidia.com/gpu.shared"


def run_sharing_step(work: Path, lib: str, profile: str, step: str, table, say,
                     wait_state) -> int:
    """Print the step; 0 when every stage happened as shown."""
    from agent.sim import control
    from agent.sim.kubelet import PodRejected

    root = work / "sharing"
    root.mkdir()
    config = root / "config.yaml"
    config.write_text(CONFIG)
    say(f"{step}. Sharing: time-slicing with NVIDIA's config, 4 replicas of each GPU "
        "(docs/sharing.md)", "  " + CONFIG.replace("\n", "\n  ").rstrip())
    with StepNode(root, profile, lib, "--config", str(config),
                  "--recovery-quiet-period", "1s") as node:
        client, agent, log, ctl = node.client, node.agent, node.log, node.ctl
        state = wait_state(client, lambda s: (r := s.resource(SHARED)) is not None
                           and r.connected and r.devices, agent, log, "the shared resource")
        res = state.resource(SHARED)
        print(f"  kubelet sees {SHARED}: {len(res.devices)} devices, IDs like "
              f"{sorted(d.id for d in res.devices)[0]}")
        rows, gpus = [], set()
        for i in range(3):
            pod = client.admit_pod(f"infer-{i}", {"main": {SHARED: 1}})
            alloc = pod.container("main").allocation(SHARED)
            env_ids = alloc.container_response.envs["NVIDIA_VISIBLE_DEVICES"]
            gpus.add(env_ids)
            rows.append([pod.name, alloc.device_ids[0], env_ids])
        print(table(["pod (1 replica)", "replica kubelet allocated", "NVIDIA_VISIBLE_DEVICES"],
                    rows))
        print(f"  distributed (the default replica policy): {len(gpus)} pods on {len(gpus)} "
              f"GPUs")
        try:
            client.admit_pod("wants-2", {"main": {SHARED: 2}})
            refused = ""
        except PodRejected as exc:
            refused = str(exc)
        print(f"  a pod asking for 2 (failRequestsGreaterThanOne): "
              f"{refused.split('desc = ')[-1] if refused else 'admitted (unexpected)'}")
        gpu = _gpu_index(profile, sorted(gpus)[0])
        control.inject_xid(str(ctl), gpu, 48)
        state = wait_state(client, lambda s: sum(not d.healthy for d in
                                                 s.resource(SHARED).devices) == 4,
                           agent, log, "the withdrawal of the GPU's replicas")
        res = state.resource(SHARED)
        print(f"  XID 48 on GPU {gpu}: its 4 replicas withdrawn, allocatable "
              f"{res.allocatable}/{res.capacity}")
        code = node.stop()
        return 0 if code == 0 and refused and len(gpus) == 3 else 1


def _gpu_index(profile: str, uuid: str) -> int:
    from agent.sim.profile import load_profile

    return next(g["index"] for g in load_profile(profile)["gpus"] if g["uuid"] == uuid)
