"""Benchmarks for gpu-agent, run by `make bench` (`python -m bench`).

Owns: timing helpers and the writer of docs/benchmarks.md. Each benchmark module exposes
`run() -> Section`; figures are measured here, never asserted in tests.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field

# Before any bench module imports grpc: agent/__init__.py turns gRPC's fork support off, which
# a bench process needs as the tests' does (tests/conftest.py): it forks agents and kubelets
# while its own gRPC channels run.
import agent  # noqa: F401


@dataclass
class Section:
    """One benchmark's findings: a title, what was measured and how, and a table."""

    title: str
    method: str
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# `gpu-agent` as the installed service starts it: /usr/bin/gpu-agent is pip's console script for
# agent.__main__:main (pyproject.toml), which imports and calls it; `python -m agent` would add
# runpy's imports (about 3 ms) that the service never pays.
AGENT_COMMAND = [sys.executable, "-c", "import sys; from agent.__main__ import main; "
                                       "sys.exit(main())"]


def sim_node_env(work: str, profile: str = "dgx1-v100") -> tuple[str, str, dict]:
    """(kubelet dir, simulated NVML control dir, environment) of a simulated node under
    `work`: this environment without anything that configures the agent or systemd."""
    kdir, ctl_dir = os.path.join(work, "kd"), os.path.join(work, "ctl")
    os.makedirs(ctl_dir)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GPU_AGENT_") and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
    env.update(GPU_AGENT_SIM_PROFILE=profile, GPU_AGENT_SIM_CONTROL=ctl_dir)
    return kdir, ctl_dir, env


def wait_until(predicate, what: str, timeout: float = 30.0) -> None:
    """Until predicate() is true; RuntimeError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout:g} s")
        time.sleep(0.02)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process `pid` has used (/proc/PID/stat utime + stime)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    """Resident memory of process `pid` in MB (10^6 bytes; VmRSS is in KiB)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError(f"no VmRSS for pid {pid}")


def stop_agent(proc, timeout: float = 30.0) -> None:
    """SIGTERM an agent process; raise if it does not exit 0 (a bench never hides a failure)."""
    import signal

    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout)
    if code != 0:
        raise RuntimeError(f"the agent exited {code}")


def percentile(samples: list[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank, of a non-empty sample list."""
    ordered = sorted(samples)
    rank = max(0, min(len(ordered) - 1, int(round(q / 100 * len(ordered) + 0.5)) - 1))
    return ordered[rank]


def ratio_row(what: str, samples_s: list[float], base_s: float, decimals: int = 0) -> list[str]:
    """A table row: `what`, the sample count, median and p99 in ms with `decimals`, and the
    median's ratio to `base_s` (a reference measured in the same run)."""
    med = percentile(samples_s, 50)
    return [what, str(len(samples_s)), f"{med * 1e3:.{decimals}f} ms",
            f"{percentile(samples_s, 99) * 1e3:.{decimals}f} ms", f"{med / base_s:.2f}×"]


def summarize(samples_s: list[float]) -> tuple[float, float]:
    """(median, p99) of samples given in seconds, returned in microseconds."""
    return statistics.median(samples_s) * 1e6, percentile(samples_s, 99) * 1e6


def time_calls(fn, repeat: int, warmup: int = 10) -> list[float]:
    """Wall time in seconds of each of `repeat` calls of fn(), after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    clock = time.perf_counter
    for _ in range(repeat):
        start = clock()
        fn()
        out.append(clock() - start)
    return out


def machine() -> str:
    """A one-line description of the machine the figures come from."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} CPUs, Linux {platform.release()}, "
            f"Python {platform.python_version()}")


def allocate_timed(stub, request, calls: int) -> list[float]:
    """Seconds of each of `calls` blocking Allocate calls of `request` on `stub`."""
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        stub.Allocate(request, timeout=10)
        out.append(time.perf_counter() - start)
    return out


def allocate_concurrently(socket: str, request, callers: int, calls_per_caller: int,
                          warmup: int = 50) -> tuple[list[float], float]:
    """Allocate `request` on the plugin socket from `callers` concurrent grpc.aio callers on
    one channel, each making `calls_per_caller` calls after `warmup` calls; (per-call seconds,
    wall seconds of the concurrent part)."""
    import asyncio

    import grpc

    from agent._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc

    async def main() -> tuple[list[float], float]:
        async with grpc.aio.insecure_channel(f"unix:{socket}",
                                             options=[("grpc.enable_http_proxy", 0)]) as ch:
            stub = dp_grpc.DevicePluginStub(ch)
            for _ in range(warmup):
                await stub.Allocate(request, timeout=10)
            samples: list[float] = []

            async def caller() -> None:
                for _ in range(calls_per_caller):
                    start = time.perf_counter()
                    await stub.Allocate(request, timeout=30)
                    samples.append(time.perf_counter() - start)

            start = time.perf_counter()
            await asyncio.gather(*(caller() for _ in range(callers)))
            return samples, time.perf_counter() - start

    return asyncio.run(main())
