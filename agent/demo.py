"""`gpu-agent demo` (the README's `make demo`): a narrated walk through a simulated GPU node.

Owns: the walk-through and its short tables. It starts the simulated kubelet as a real
subprocess, loads the simulated NVML in this process (as the agent does), and drives faults
through `gpu-agent sim`. Must not contain agent logic: it only shows what the parts do.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

XID_EVENT = 0x8


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "  ") -> str:
    """A plain-text table with a header rule, columns padded to their widest cell."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [indent + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
             for row in cells]
    lines.insert(1, indent + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def say(step: str, text: str = "") -> None:
    print(f"\n== {step}")
    if text:
        print(text)
    sys.stdout.flush()


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.0f} GiB"


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"simulated kubelet exited early with code {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear within {timeout:.0f} s")
        time.sleep(0.05)


def run_demo(profile: str = "dgx1-v100", keep: bool = False) -> int:
    import pynvml

    from agent import _fast
    from agent.nvml import discovery, library
    from agent.sim import control, lib_path
    from agent.sim.kubelet import SimKubeletClient

    work = Path(tempfile.mkdtemp(prefix="gademo"))
    ctl = work / "simctl"
    ctl.mkdir()
    dp_dir = work / "device-plugins"
    dp_dir.mkdir()
    os.environ["GPU_AGENT_SIM_PROFILE"] = profile
    os.environ["GPU_AGENT_SIM_CONTROL"] = str(ctl)
    kubelet = None
    try:
        path = str(lib_path())
        library.init(path)
        say(f"1. Simulated GPU node '{profile}'",
            f"  NVML library: {path} (the same ABI as the driver's libnvidia-ml.so.1)\n"
            f"  driver {pynvml.nvmlSystemGetDriverVersion()}, "
            f"CUDA {pynvml.nvmlSystemGetCudaDriverVersion()}")
        gpus = discovery.discover()
        print(table(
            ["GPU", "name", "UUID", "PCI bus id", "NUMA", "memory", "CC", "MIG"],
            [[g.index, g.name, g.uuid, g.pci_bus_id,
              "-" if g.numa_node is None else g.numa_node, _gib(g.memory_total),
              "{}.{}".format(*g.compute_capability), "on" if g.mig_enabled else "off"] for g in gpus],
        ))

        links = discovery.read_links(gpus)
        say("2. Topology read back through NVML (as `nvidia-smi topo -m` shows it)")
        print(table(["", *[f"GPU{g.index}" for g in gpus]],
                    [[f"GPU{a.index}", *["X" if a.index == b.index
                                         else links[(a.index, b.index)].label for b in gpus]]
                     for a in gpus]))

        say("3. Simulated kubelet", f"  gpu-agent sim kubelet --dir {dp_dir}")
        kubelet = subprocess.Popen(
            [sys.executable, "-m", "agent", "sim", "kubelet", "--dir", str(dp_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _wait_for(dp_dir / "kubelet.sock", kubelet)
        state = SimKubeletClient(str(dp_dir)).state()
        print(f"  listening on {dp_dir / 'kubelet.sock'} (pid {kubelet.pid}); "
              f"registered device plugins: {len(state.registrations)}")
        print("  (the agent registers nvidia.com/gpu here once `gpu-agent run` lands)")

        say("4. Health signal path: NVML event → agent._fast event loop",
            f"  hot paths: {_fast.IMPLEMENTATION}")
        events = _fast.events_impl
        with events.EventSet(path) as es:
            for g in gpus:
                es.register(g.index, XID_EVENT)
            victim = gpus[min(3, len(gpus) - 1)]
            print(f"  registered XidCriticalError on {len(gpus)} GPUs; injecting: "
                  f"gpu-agent sim inject-xid --gpu {victim.index} --xid 79")
            control.check_gpu(victim.index)  # validate first: time the delivery only
            t0 = time.perf_counter()
            control.inject_xid(str(ctl), victim.index, 79)
            ev = es.wait(2000)
            dt = (time.perf_counter() - t0) * 1e6
            if ev is None:
                raise RuntimeError("the injected XID was not delivered")
            print(table(["GPU", "UUID", "event", "XID", "delivered in"],
                        [[ev.index, ev.uuid, "XidCriticalError", ev.xid, f"{dt:.0f} µs"]]))

        say("5. Clean stop")
        kubelet.terminate()
        code = kubelet.wait(10)
        kubelet = None
        print(f"  simulated kubelet stopped (exit {code}); NVML shut down")
        library.shutdown()
        return 0 if code == 0 else 1
    finally:
        if kubelet is not None:
            kubelet.kill()
            kubelet.wait()
        if keep:
            print(f"\n(kept {work})")
        else:
            shutil.rmtree(work, ignore_errors=True)
