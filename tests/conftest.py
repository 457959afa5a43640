"""Shared fixtures: the simulated GPU node's environment, a way to run `gpu-agent`, and the two
implementations of agent._fast's hot paths.

Tests talk to the simulated libnvidia-ml.so.1 (loaded in-process through pynvml, or by a child
process) and to real processes over real unix sockets. Nothing here patches pynvml. A test that
takes `fast_impl` runs twice, as msgpack runs its suite: on the compiled modules ("cython") and
on their pure-Python twins ("python").
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pynvml
import pytest

# Imported first: agent/__init__.py turns gRPC's fork support off before a test module imports
# grpc. This process forks too (mount, the agents, the simulated kubelet) while its gRPC
# channels and servers run; on Python 3.9, whose subprocess forks rather than vforks, grpcio
# 1.80's fork handlers then aborted about 1 child in 2 before its exec (grpc/grpc#43055).
import agent  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
# The modules of each implementation of agent._fast: (events, topology).
FAST_MODULES = {
    "cython": ("agent._fast.events", "agent._fast.topology"),
    "python": ("agent._fast._events_py", "agent._fast._topology_py"),
}


@dataclass(frozen=True)
class FastImpl:
    """One implementation of agent._fast's hot paths: its modules, imported directly (not through
    the selector, so a compiled module that fails to import fails the test), for in-process
    code that takes them (HealthMonitor's `events_module`, TopologyModel's `topology_module`),
    and `pure_python` for a child `gpu-agent`: daemon_harness.Node(pure_python=True) gives it
    GPU_AGENT_PURE_PYTHON=1, and its selector then picks the twins."""

    name: str  # "cython" or "python"
    events: ModuleType
    topology: ModuleType

    @property
    def pure_python(self) -> bool:
        return self.name == "python"


@pytest.fixture(scope="module", params=list(FAST_MODULES))
def fast_impl(request) -> FastImpl:
    """The test runs on the compiled modules, then on the twins (ids `cython`, `python`)."""
    return FastImpl(request.param, *(importlib.import_module(m)
                                      for m in FAST_MODULES[request.param]))


def wants_twins(request) -> bool:
    """Whether the test asking for a fixture (a simulated node) runs on the twins: it takes
    `fast_impl` and this is the "python" run. For fixtures that start `gpu-agent` children."""
    return "fast_impl" in request.fixturenames and request.getfixturevalue("fast_impl").pure_python


def gpu_agent_cmd(*args: str) -> list[str]:
    """The argv that runs `gpu-agent ARGS` with this interpreter (no reliance on PATH)."""
    return [sys.executable, "-m", "agent", *args]


def run_gpu_agent(*args: str, env: dict | None = None, timeout: float = 60,
                  check: bool = True) -> subprocess.CompletedProcess:
    """Run `gpu-agent ARGS` to completion; raise with its output if it fails and check is set."""
    proc = subprocess.run(
        gpu_agent_cmd(*args), env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"gpu-agent {' '.join(args)} exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc


@pytest.fixture
def sim_control(tmp_path: Path) -> Path:
    """A fresh control directory for the simulated NVML (GPU_AGENT_SIM_CONTROL)."""
    path = tmp_path / "simctl"
    path.mkdir()
    return path


@pytest.fixture
def sim_env(sim_control: Path, monkeypatch: pytest.MonkeyPatch):
    """Point this process (and children started with os.environ) at a simulated node.

    Returns a function `use(profile)` that selects the profile; the control directory is the
    `sim_control` fixture's. The simulated library reads these variables at each nvmlInit that
    takes its init count from 0 to 1.
    """
    monkeypatch.setenv("GPU_AGENT_SIM_CONTROL", str(sim_control))
    monkeypatch.delenv("GPU_AGENT_SIM_FAULTS", raising=False)

    def use(profile: str = "dgx1-v100") -> dict:
        monkeypatch.setenv("GPU_AGENT_SIM_PROFILE", profile)
        return dict(os.environ)

    return use


def drain_nvml() -> None:
    """Release every outstanding nvmlInit in this process, so the next init (re)reads the
    simulator's environment (profile, faults)."""
    for _ in range(1000):
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError_Uninitialized:
            return


@pytest.fixture
def node(sim_env, monkeypatch: pytest.MonkeyPatch):
    """start(profile, faults=None) -> env: (re)initialise the in-process simulated NVML.

    Initialises through pynvml itself, so tests can name the pynvml error they expect.
    """
    from agent.nvml import library
    from agent.sim import lib_path

    def start(profile: str = "dgx1-v100", faults: str | None = None) -> dict:
        env = sim_env(profile)
        if faults is None:
            monkeypatch.delenv("GPU_AGENT_SIM_FAULTS", raising=False)
        else:
            monkeypatch.setenv("GPU_AGENT_SIM_FAULTS", faults)
            env["GPU_AGENT_SIM_FAULTS"] = faults
        drain_nvml()
        library.load(str(lib_path()))
        pynvml.nvmlInit()
        return env

    yield start
    drain_nvml()
