"""A second simulated node for a step of `gpu-agent demo` (MIG, sharing): its own kubelet
directory, simulated NVML control directory and simulated kubelet, and `gpu-agent run` on it.

Owns: starting and cleaning up that node. Must not hold a step's logic or output.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path


class StepNode:
    """`with StepNode(root, profile, lib, *run_args) as node:` gives `node.client` (the
    simulated kubelet's), `node.agent` (the process), `node.log`, `node.ctl`; `stop()` stops
    the agent cleanly and returns its exit code."""

    def __init__(self, root: Path, profile: str, lib: str, *run_args: str):
        from agent.sim.kubelet import SimKubelet, SimKubeletClient

        self.kdir, self.ctl = root / "device-plugins", root / "simctl"
        self.kdir.mkdir(parents=True)
        self.ctl.mkdir()
        env = {**os.environ, "GPU_AGENT_SIM_PROFILE": profile,
               "GPU_AGENT_SIM_CONTROL": str(self.ctl)}
        args = ["run", "--kubelet-socket", str(self.kdir / "kubelet.sock"),
                "--pod-resources-socket", "", "--nvml-library", lib, "--state-dir",
                str(root / "state"), "--metrics-address", "", "--nfd-features-file", "",
                *run_args]
        self._quiet = logging.getLogger("agent.sim")  # the kubelet runs in the demo's process
        self._level = self._quiet.level
        self._quiet.setLevel(logging.WARNING)
        self.kubelet = SimKubelet(str(self.kdir))
        self.kubelet.start()
        self.client = SimKubeletClient(str(self.kdir))
        self.log = root / "agent.log"
        with open(self.log, "wb") as out:
            self.agent: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, "-m", "agent", *args], env=env, stdout=out,
                stderr=subprocess.STDOUT)

    def stop(self) -> int:
        self.agent.send_signal(signal.SIGTERM)
        code = self.agent.wait(10)
        self.agent = None
        return code

    def __enter__(self) -> StepNode:
        return self

    def __exit__(self, *exc) -> None:
        if self.agent is not None:
            self.agent.kill()
            self.agent.wait()
        self.client.close()
        self.kubelet.stop()
        self._quiet.setLevel(self._level)
