"""NVML event delivery through agent._fast events: injected XID → `EventSet.wait()` returns,
compiled vs pure-Python twin, on the simulated NVML.

Owns: a child process per implementation (a process holds one NVML library and one
implementation choice), which reports its samples as JSON on stdout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from bench import Section, summarize

SAMPLES = 300


def _child(impl: str) -> None:
    """Runs in the child: one waiter thread blocked in wait(), the main thread injects."""
    from agent._fast import _events_py, events
    from agent.nvml import library
    from agent.sim import control, lib_path

    module = events if impl == "cython" else _events_py
    path = str(lib_path())
    library.init(path)
    ctl = os.environ["GPU_AGENT_SIM_CONTROL"]
    samples = []
    with module.EventSet(path) as es:
        es.register(3, 0x8)
        got = threading.Event()
        stamp = {}

        def waiter():
            while len(samples) < SAMPLES:
                ev = es.wait(1000)
                if ev is not None:
                    stamp["t1"] = time.perf_counter()
                    got.set()

        thread = threading.Thread(target=waiter, daemon=True)
        thread.start()
        for _ in range(SAMPLES):
            got.clear()
            time.sleep(0.002)  # let the waiter block in nvmlEventSetWait_v2 again
            t0 = time.perf_counter()
            control.inject_xid(ctl, 3, 79)
            if not got.wait(5):
                raise SystemExit("event not delivered within 5 s")
            samples.append(stamp["t1"] - t0)
        thread.join(5)
    json.dump(samples, sys.stdout)


def run() -> Section:
    section = Section(
        title="Event delivery: injected XID → EventSet.wait() returns",
        method=(f"Simulated NVML (dgx1-v100); a thread blocked in `wait(1000)` on GPU 3, the "
                f"main thread appends an XID 79 record to the control channel; {SAMPLES} "
                "samples per implementation, each in its own process. Measures the simulator's "
                "inotify wake-up plus our wait path, not a real driver."),
        header=["implementation", "median µs", "p99 µs"],
    )
    medians = {}
    for impl in ("cython", "python"):
        with tempfile.TemporaryDirectory(prefix="gabench") as ctl:
            env = dict(os.environ, GPU_AGENT_SIM_CONTROL=ctl, GPU_AGENT_SIM_PROFILE="dgx1-v100")
            out = subprocess.run(
                [sys.executable, "-c", f"from bench.bench_events import _child; _child({impl!r})"],
                env=env, capture_output=True, text=True, timeout=300, check=True,
            ).stdout
        med, p99 = summarize(json.loads(out))
        medians[impl] = med
        section.rows.append([impl, f"{med:.0f}", f"{p99:.0f}"])
    section.notes.append(f"python/cython median ratio: {medians['python'] / medians['cython']:.2f}×")
    return section
