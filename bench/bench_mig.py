"""MIG: reading 8 GPUs x 7 MIG devices, a reconfiguration reaching kubelet, and what the MIG
check costs an idle agent.

Owns: three measurements on the simulated NVML (h100-mig, every GPU given 7x 1g.10gb with
`gpu-agent sim mig` records before anything is timed):
- discovery of the 56 MIG devices (agent/nvml/mig.py read_mig_devices, in this process) and the
  whole mixed-strategy device map (agent.rm.resources.Resources.device_map), and one read of
  the layout the periodic check compares (agent.nvml.mig.layout);
- reconfiguration to kubelet: `gpu-agent run --mig-strategy mixed` as a subprocess; GPU 7 goes
  from 7x 1g.10gb to 7g.80gb and back, and the time from appending the control record to the
  simulated kubelet receiving the device list of the new layout is taken;
- the agent's idle CPU (/proc/PID/stat utime+stime) over IDLE_S with the check at its default
  interval and with it off (`--mig-check-interval 0`).
Figures only; the tests assert behaviour, never time.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import tempfile
import time

from agent.sim import lib_path
from agent.sim import mig as sim_mig
from agent.sim.kubelet import SimKubelet, SimKubeletClient
from bench import AGENT_COMMAND, Section, cpu_seconds, percentile, sim_node_env

PROFILE = "h100-mig"
ALL_SMALL = {"1g.10gb": 7}  # every GPU's layout before anything is timed
SMALL = "nvidia.com/mig-1g.10gb"
READS = 50
RECONFIGURATIONS = 10
IDLE_S = 60.0
IDLE_SETTLE_S = 3.0


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _reads(ctl: str) -> dict[str, list[float]]:
    """In this process: the read-out of 56 MIG devices, the device map, one layout read."""
    from agent.config import load_config
    from agent.nvml import discovery, library, mig
    from agent.rm.resources import Resources

    os.environ.update({"GPU_AGENT_SIM_PROFILE": PROFILE, "GPU_AGENT_SIM_CONTROL": ctl})
    library.init(str(lib_path()))
    try:
        gpus = discovery.discover()
        found = mig.read_mig_devices(gpus)
        assert len(found) == 56, len(found)
        cfg = load_config({"mig_strategy": "mixed"}, {})
        assert len(Resources.device_map(gpus, cfg)[SMALL]) == 56
        return {"read": _timed(lambda: mig.read_mig_devices(gpus), READS),
                "map": _timed(lambda: Resources.device_map(gpus, cfg), READS),
                "layout": _timed(lambda: mig.layout(gpus), READS)}
    finally:
        library.shutdown()


def _agent(work: str, kdir: str, env: dict, *args: str) -> subprocess.Popen:
    log = open(os.path.join(work, "agent.log"), "ab")  # noqa: SIM115 - the child keeps it
    return subprocess.Popen([*AGENT_COMMAND, "run", "--kubelet-socket",
                             os.path.join(kdir, "kubelet.sock"), "--state-dir",
                             os.path.join(work, "state"), "--nvml-library", str(lib_path()),
                             "--mig-strategy", "mixed", *args],
                            env=env, stdout=log, stderr=subprocess.STDOUT)


def _reconfigurations(work: str, kdir: str, ctl: str, env: dict, interval: float
                      ) -> list[float]:
    client = SimKubeletClient(kdir)
    proc = _agent(work, kdir, env, "--mig-check-interval", f"{interval:g}s")
    out = []
    try:
        client.wait_for(lambda s: _count_in(s, SMALL) == 56, timeout=30, what="56 MIG devices")
        for i in range(RECONFIGURATIONS):
            to_big = i % 2 == 0
            # a change lands anywhere between two checks, as an operator's would
            time.sleep(random.uniform(0, interval))
            start = time.monotonic()
            sim_mig.set_layout(ctl, 7, {"7g.80gb": 1} if to_big else ALL_SMALL, PROFILE)
            want = 49 if to_big else 56
            client.wait_for(lambda s, w=want: _count_in(s, SMALL) == w, timeout=30,
                            what=f"{want} small MIG devices")
            out.append(time.monotonic() - start)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    return out


def _count_in(state, name: str) -> int:
    r = state.resource(name)
    return len(r.devices) if r is not None and r.connected else 0


def _idle(work: str, kdir: str, env: dict, *args: str) -> float:
    client = SimKubeletClient(kdir)
    proc = _agent(work, kdir, env, *args)
    try:
        client.wait_for(lambda s: _count_in(s, SMALL) >= 49, timeout=30, what="registration")
        time.sleep(IDLE_SETTLE_S)  # the start's journal load and first reconciliation
        before, start = cpu_seconds(proc.pid), time.monotonic()
        time.sleep(IDLE_S)  # a fixed window: what an idle agent spends in it is the figure
        used, span = cpu_seconds(proc.pid) - before, time.monotonic() - start
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    return used / span


def run() -> Section:
    from agent.constants import DEFAULT_MIG_CHECK_INTERVAL_S

    section = Section(
        title="MIG: 56 MIG devices read, a reconfiguration to kubelet, the check's idle cost",
        method=__doc__.split("\n\n", 1)[1].split("Figures only")[0].strip().replace("\n", " "),
        header=["measure", "median", "p99", "target"],
    )
    work = tempfile.mkdtemp(prefix="gam", dir="/tmp")
    kdir, ctl, env = sim_node_env(work, PROFILE)
    for gpu in range(8):
        sim_mig.set_layout(ctl, gpu, ALL_SMALL, PROFILE)
    reads = _reads(ctl)
    for key, what in (("read", "read 8 GPUs x 7 MIG devices (read_mig_devices)"),
                      ("map", "mixed-strategy device map of them (Resources.device_map)"),
                      ("layout", "one layout read of the periodic check (mig.layout)")):
        samples = reads[key]
        section.rows.append([what, _ms(statistics.median(samples)),
                             _ms(percentile(samples, 99)), "—"])
    kubelet = SimKubelet(kdir)
    kubelet.start()
    try:
        interval = DEFAULT_MIG_CHECK_INTERVAL_S
        samples = _reconfigurations(work, kdir, ctl, env, interval)
        section.rows.append([
            f"reconfiguration → kubelet, check every {interval:g} s (default)",
            _ms(statistics.median(samples)), _ms(percentile(samples, 99)),
            f"≤ interval + 1 s: {'met' if max(samples) <= interval + 1 else '**not met**'}"])
        fast = _reconfigurations(work, kdir, ctl, env, 0.5)
        section.rows.append(["reconfiguration → kubelet, check every 0.5 s",
                             _ms(statistics.median(fast)), _ms(percentile(fast, 99)),
                             f"≤ 1.5 s: {'met' if max(fast) <= 1.5 else '**not met**'}"])
        on = _idle(work, kdir, env)
        off = _idle(work, kdir, env, "--mig-check-interval", "0")
        section.rows.append([f"agent idle CPU, mixed, MIG check every {interval:g} s",
                             f"{on * 100:.3f}% of a core", "-", "—"])
        section.rows.append(["agent idle CPU, mixed, MIG check off", f"{off * 100:.3f}% of a core",
                             "-", "—"])
    finally:
        kubelet.stop()
    section.notes.append(
        f"Reconfiguration: {RECONFIGURATIONS} changes of GPU 7 between 7x 1g.10gb and 7g.80gb, "
        "each made at a random moment between two checks; the time is dominated by waiting "
        "for the next check (half an interval on average, a whole one at worst), "
        "then one re-read of the GPUs, the new device map, and the registrar adding or removing "
        "a resource (the resources that stay keep serving).")
    return section
