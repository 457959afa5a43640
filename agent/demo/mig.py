"""`gpu-agent demo`'s MIG step: a second simulated node (a100-mig) under migStrategy mixed,
reconfigured while the agent runs, and kubelet seeing the new resources.

Owns: that step's output. Must not hold logic of its own: it drives `gpu-agent run`, the
simulated kubelet and `gpu-agent sim mig` as an operator would, and prints what they show.
"""

from __future__ import annotations

import time
from pathlib import Path

from agent.demo.node import StepNode

PROFILE = "a100-mig"


def _counts(state) -> dict[str, int]:
    return {r.name: len(r.devices) for r in state.resources.values()
            if r.connected and r.devices}


def run_mig_step(work: Path, lib: str, step: str, table, say, wait_state) -> int:
    """Print the step; 0 when every stage happened as shown."""
    from agent.sim import mig as sim_mig

    say(f"{step}. MIG: node '{PROFILE}' under migStrategy mixed, reconfigured while it runs",
        "  gpu-agent run --mig-strategy mixed --mig-check-interval 1s ...")
    with StepNode(work / "mig", PROFILE, lib, "--mig-strategy", "mixed",
                  "--mig-check-interval", "1s") as node:
        client, agent, log, ctl = node.client, node.agent, node.log, node.ctl
        state = wait_state(client, lambda s: len(_counts(s)) >= 6, agent, log,
                           "the MIG resources")
        before = _counts(state)
        print(table(["resource", "devices"], sorted(before.items())))
        print("  GPU 5 (2x 3g.40gb) becomes 7x 1g.10gb: gpu-agent sim mig apply FILE, with "
              "FILE in nvidia-mig-parted's shape (mig-devices: {\"1g.10gb\": 7})")
        t0 = time.monotonic()
        sim_mig.set_layout(str(ctl), 5, {"1g.10gb": 7}, PROFILE)
        # each resource reaches kubelet on its own stream: wait for both that change
        small, gone = "nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb"
        want = {small: before[small] + 7, gone: before[gone] - 2}
        state = wait_state(client, lambda s: all(_counts(s).get(n, 0) == c
                                                 for n, c in want.items()),
                           agent, log, "the new layout")
        after = _counts(state)
        print(f"  kubelet saw it {time.monotonic() - t0:.2f} s later, from the same agent "
              f"(pid {agent.pid}, no restart):")
        print(table(["resource", "before", "after"],
                    [[n, before.get(n, 0), after.get(n, 0)] for n in sorted(set(before) |
                                                                           set(after))]))
        kept = state.resource("nvidia.com/gpu")
        print(f"  nvidia.com/gpu kept its registration ({kept.registrations}) and its "
              f"{len(kept.devices)} devices throughout (docs/mig.md)")
        return node.stop()
