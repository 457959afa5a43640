"""A simulated kubelet in a process of its own, for the benches that time the agent's Allocate
against a reference that has no kubelet.

Owns: starting `gpu-agent sim kubelet` as a subprocess and stopping it. Figures only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from agent.sim.kubelet import SimKubeletClient


class KubeletProcess:
    """`gpu-agent sim kubelet --dir KDIR` in a process of its own, serving once constructed.

    kubelet is a process of its own, and a Go one: its podresources answers and ListAndWatch
    streams do not wait for the Python lock of a bench caller. A simulated kubelet in the bench
    process would make the agent's podresources calls (a scrape, a reconcile) cost the caller
    that lock, which the agent's Allocate then seems to cost. Used where a bench compares the
    agent's Allocate with a reference that has no kubelet."""

    def __init__(self, kdir: str, env: dict):
        with open(os.path.join(os.path.dirname(kdir), "kubelet.log"), "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "agent", "sim", "kubelet",
                                          "--dir", kdir], env=env, stdout=log,
                                         stderr=subprocess.STDOUT)
        try:
            with SimKubeletClient(kdir) as client:
                client.wait_ready(timeout=30)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)
