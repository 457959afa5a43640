"""The simulated GPU node: a C library with NVML's ABI, its node profiles, and a simulated kubelet.

Owns: where the built library and the shipped profiles are. Used by tests, `gpu-agent demo`
and `gpu-agent sim`; never by the daemon itself, which only ever sees "an NVML library path".
"""

from __future__ import annotations

from pathlib import Path

from agent.errors import SimError

SIM_DIR = Path(__file__).resolve().parent
PROFILES_DIR = SIM_DIR / "profiles"
LIB_NAME = "libnvidia-ml.so.1"

# Environment variables read by the simulated library and by `gpu-agent sim` alike.
ENV_PROFILE = "GPU_AGENT_SIM_PROFILE"
ENV_CONTROL = "GPU_AGENT_SIM_CONTROL"
ENV_FAULTS = "GPU_AGENT_SIM_FAULTS"


def lib_path() -> Path:
    """Path of the built simulated libnvidia-ml.so.1; SimError if the build did not make it."""
    path = SIM_DIR / "lib" / LIB_NAME
    if not path.is_file():
        raise SimError(f"simulated NVML library not built: {path} is missing (run `make build`)")
    return path


def profile_names() -> list[str]:
    """Names of the shipped profiles (file stems under agent/sim/profiles/)."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
