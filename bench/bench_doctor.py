"""`gpu-agent doctor` on the simulated node: how long an operator waits for the whole report.

Owns: measuring the command end to end (a fresh `gpu-agent doctor --json` process each time,
as an operator or a monitoring script runs it) against a simulated node with everything the
checks talk to: the simulated NVML (dgx1-v100, 8 GPUs), a simulated kubelet in the bench
process over real unix sockets (registration and podresources), `gpu-agent run` registered
with it, and a simulated driver tree (agent.sim.driver_tree: device nodes, /dev/char links,
containerd config, toolkit stubs that answer --version); and the checks alone (`run_checks` in
a fresh process, the interpreter's start and the command line left out). Figures only; the
tests assert behaviour.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from agent._proto.simkubelet.v1 import control_pb2 as ctl
from agent.sim import driver_tree, lib_path
from agent.sim.kubelet import SimKubelet, SimKubeletClient
from agent.status import read_status
from bench import Section, percentile, sim_node_env

RUNS = 30
RESOURCE = "nvidia.com/gpu"
TARGET_S = 1.0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Times run_checks alone in a fresh process: the modules the checks load on use (grpc, pynvml,
# PyYAML, the podresources stubs) are in it, the interpreter and the parser are not.
_CHECKS_ONLY = """
import os, sys, time
from agent.doctor.context import make_context
from agent.doctor.runner import run_checks
from agent.doctor.model import exit_code
args = dict(zip(sys.argv[2::2], sys.argv[3::2]))
t = time.perf_counter()
checks = run_checks(make_context(args, os.environ, root=sys.argv[1]))
print(time.perf_counter() - t, exit_code(checks))
"""


def _timed(argv: list[str], env: dict) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - start
    if proc.returncode not in (0, 1, 2):
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr}")
    return elapsed, proc.stdout


def _wait_status(state_dir: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        doc = read_status(state_dir)
        if doc and doc.get("resources") and doc["resources"][0]["registered"] \
                and doc.get("state") is not None:
            return doc
        if time.monotonic() > deadline:
            raise RuntimeError(f"the agent's status.json never showed it registered: {doc}")
        time.sleep(0.05)


def run() -> Section:
    section = Section(
        title="gpu-agent doctor: the whole report on the simulated node",
        method=(f"`gpu-agent doctor --json` as a fresh process, {RUNS} runs, on a simulated "
                "node: NVML (dgx1-v100, 8 GPUs, loaded by the doctor itself), a simulated "
                "kubelet in the bench process (its socket connected to, podresources "
                "GetAllocatableResources asked), `gpu-agent run` registered with it "
                "(status.json read, the journal read), and a simulated driver tree (13 device "
                "nodes and their /dev/char links, containerd config.toml parsed, nvidia-ctk and "
                "nvidia-container-runtime stubs run with --version). All 20 checks run; the "
                "node is healthy (exit 0). 'checks alone' times `run_checks` in a fresh "
                "process, with the modules the checks load on use (grpc, pynvml, PyYAML) but "
                "not the interpreter's start or the command line."),
        header=["measure", "median", "p99", "target", "met"],
    )
    work = tempfile.mkdtemp(prefix="gabd", dir="/tmp")
    kdir, _, env = sim_node_env(work)
    state = os.path.join(work, "state")
    tree = driver_tree.build(os.path.join(work, "root"), "dgx1-v100")
    config = {"--kubelet-socket": os.path.join(kdir, "kubelet.sock"),
              "--pod-resources-socket": os.path.join(kdir, "pod-resources", "kubelet.sock"),
              "--state-dir": state, "--nvml-library": str(lib_path()),
              "--device-list-strategy": "envvar,cdi-cri",
              "--cdi-spec-dirs": tree.path("/etc/cdi")}
    flags = [x for pair in config.items() for x in pair]
    kubelet = SimKubelet(kdir)
    kubelet.start()
    client = SimKubeletClient(kdir)
    log = open(os.path.join(work, "agent.log"), "wb")  # closed below
    agent = subprocess.Popen([sys.executable, "-m", "agent", "run", *flags], env=env,
                             cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        client.wait_for_event(lambda e: e.kind == ctl.Event.Kind.SNAPSHOT
                              and e.resource_name == RESOURCE, timeout=30,
                              what="the agent's first device list")
        _wait_status(state)
        command = [sys.executable, "-m", "agent", "doctor", "--json", "--root", tree.root,
                   *flags]
        codes, whole = set(), []
        for _ in range(RUNS + 2):
            elapsed, out = _timed(command, env)
            codes.add(json.loads(out)["exitCode"])
            whole.append(elapsed)
        whole = whole[2:]  # the first runs warm the page cache
        alone = []
        checks_only = [sys.executable, "-c", _CHECKS_ONLY, tree.root,
                       *[x for name, value in config.items()
                         for x in (name[2:].replace("-", "_"), value)]]
        for _ in range(RUNS):
            _elapsed, out = _timed(checks_only, env)
            seconds, code = out.split()
            alone.append(float(seconds))
            codes.add(int(code))
        spawn = [_timed([sys.executable, "-c", "pass"], env)[0] for _ in range(RUNS)]
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(10)
        log.close()
        client.close()
        kubelet.stop()
        shutil.rmtree(work, ignore_errors=True)

    def row(name: str, samples: list[float], target: str, limit: float | None) -> None:
        med, p99 = statistics.median(samples), percentile(samples, 99)
        met = "" if limit is None else ("yes" if p99 < limit else "**no**")
        section.rows.append([name, f"{med * 1000:.0f} ms", f"{p99 * 1000:.0f} ms", target, met])

    row("`gpu-agent doctor --json` (process start to exit)", whole, "under 1 s", TARGET_S)
    row("the checks alone (run_checks, their lazy imports included)", alone, "—", None)
    row("reference: spawn `python -c pass` to its exit", spawn, "—", None)
    section.notes.append(
        f"Exit codes seen: {sorted(codes)} (0: every check ok or skipped). The checks' own "
        "bounds are 2 s per subprocess and kubelet RPC and 10 s for NVML "
        "(agent/doctor/context.py); on a real node without persistence mode, nvmlInit alone "
        "can take seconds (the driver.persistence check says so).")
    return section
