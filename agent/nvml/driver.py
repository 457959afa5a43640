"""What the driver says about itself and each GPU's settings, read through pynvml for
`gpu-agent doctor`: the driver and CUDA driver versions, how many GPUs NVML counts, and per GPU
its persistence mode and MIG mode (current and pending).

Owns: those reads, as plain records (`DriverInfo`, `GpuSettings`); a setting the GPU or driver
does not support (NVML_ERROR_NOT_SUPPORTED) reads as None. NVML must be initialised
(agent.nvml.library). Must not decide what a value means for the node (agent.doctor does),
keep state, or change any setting.
"""

from __future__ import annotations

from dataclasses import dataclass

import pynvml

from agent.errors import NvmlError
from agent.nvml.discovery import _call, _text


@dataclass(frozen=True)
class DriverInfo:
    """The driver as NVML reports it."""

    driver_version: str  # e.g. "550.54.15"
    cuda_driver_version: int  # e.g. 12040 for CUDA 12.4
    gpu_count: int  # nvmlDeviceGetCount: every GPU the driver knows, lost ones included

    @property
    def cuda_text(self) -> str:
        """The CUDA driver version as nvidia-smi prints it: 12040 -> "12.4"."""
        v = self.cuda_driver_version
        return f"{v // 1000}.{v % 1000 // 10}"


@dataclass(frozen=True)
class GpuSettings:
    """One GPU's settings; None where NVML answers NOT_SUPPORTED."""

    index: int
    persistence: bool | None
    mig_current: bool | None
    mig_pending: bool | None


def driver_info() -> DriverInfo:
    """The driver's versions and GPU count; NvmlError when NVML cannot say."""
    return DriverInfo(
        driver_version=_text(_call(pynvml.nvmlSystemGetDriverVersion)),
        cuda_driver_version=int(_call(pynvml.nvmlSystemGetCudaDriverVersion)),
        gpu_count=int(_call(pynvml.nvmlDeviceGetCount)),
    )


def _optional(fn, *args):
    try:
        return _call(fn, *args)
    except NvmlError as exc:
        if exc.is_not_supported:
            return None
        raise


def gpu_settings(index: int) -> GpuSettings:
    """Persistence and MIG modes of GPU `index`; NvmlError (e.g. GPU_IS_LOST) when it does
    not answer."""
    handle = _call(pynvml.nvmlDeviceGetHandleByIndex, index)
    persistence = _optional(pynvml.nvmlDeviceGetPersistenceMode, handle)
    mig = _optional(pynvml.nvmlDeviceGetMigMode, handle)
    enabled = pynvml.NVML_DEVICE_MIG_ENABLE
    return GpuSettings(
        index=index,
        persistence=None if persistence is None else persistence == pynvml.NVML_FEATURE_ENABLED,
        mig_current=None if mig is None else mig[0] == enabled,
        mig_pending=None if mig is None else mig[1] == enabled,
    )
