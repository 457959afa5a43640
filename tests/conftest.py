"""Shared fixtures: the simulated GPU node's environment and a way to run `gpu-agent`.

Tests talk to the simulated libnvidia-ml.so.1 (loaded in-process through pynvml, or by a child
process) and to real processes over real unix sockets. Nothing here patches pynvml.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"


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
