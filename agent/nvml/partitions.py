"""MIG partitions made on demand (DRA's partitionable devices, KEP-4815): what a MIG-enabled
GPU can hold, and making and removing one GPU instance with its one full compute instance.

Owns: `possible(gpu)`: each GPU instance profile the GPU offers whose compute instance is the
whole instance (as NVIDIA's DRA driver keeps, nvlib.go:585), named as go-nvlib names it, with
each of its placements (nvmlDeviceGetGpuInstancePossiblePlacements_v2) and its counts, and the
GPU's number of memory slices; `create(gpu, profile_id, start)`: the GPU instance at that
placement (nvmlDeviceCreateGpuInstanceWithPlacement) and its full compute instance, answered
as the MIG device it makes (UUID, IDs, capability nodes), nothing left when that fails;
`destroy(gpu, gi, ci, uuid)`: the compute instance, then the GPU instance, when they are
still that MIG device's. NvmlError when NVML refuses (INSUFFICIENT_RESOURCES: the placement
is taken). Must not decide what is published or prepared (agent.dra).
"""

from __future__ import annotations

import ctypes
import logging
from typing import NamedTuple

import pynvml

from agent.errors import AgentError, NvmlError
from agent.host import mig_minors
from agent.nvml.discovery import Gpu, _call, _text
from agent.nvml.identity import MigPlacement
from agent.nvml.mig import (
    _GI_ATTRIBUTES,
    _caps,
    _gi_profiles,
    _mig_handles,
    memory_gb,
    profile_name,
)

log = logging.getLogger(__name__)

# NVML_COMPUTE_INSTANCE_PROFILE_* by its slice count: the full compute instance of a GPU
# instance of that many slices
_CI_PROFILE_BY_SLICES = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}


class Partition(NamedTuple):
    """A MIG device a GPU can hold: its profile's name and placement with its counts."""

    profile: str  # go-nvlib's name: 1g.10gb, 1g.10gb+me, ...
    placement: MigPlacement
    slices: int  # its compute slices (the profile's slice count)


class Made(NamedTuple):
    """A MIG device made by `create`."""

    uuid: str
    gi: int
    ci: int
    caps: tuple[str, ...]  # its capability device nodes (/dev/nvidia-caps/nvidia-cap<N>)


def possible(gpu: Gpu) -> tuple[list[Partition], int]:
    """(every partition GPU `gpu` can hold, its memory slices)."""
    handle = _call(pynvml.nvmlDeviceGetHandleByIndex, gpu.index)
    out, slices = [], 0
    for constant, p in _gi_profiles(handle):
        count = ctypes.c_uint(0)
        _call(pynvml.nvmlDeviceGetGpuInstancePossiblePlacements, handle, p.id, None,
              ctypes.byref(count))
        if not count.value:
            continue
        placements = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
        _call(pynvml.nvmlDeviceGetGpuInstancePossiblePlacements, handle, p.id, placements,
              ctypes.byref(count))
        name = profile_name(p.sliceCount, p.sliceCount,
                            memory_gb(gpu.memory_total, p.memorySizeMB),
                            _GI_ATTRIBUTES.get(constant, ""))
        for placement in placements[:count.value]:
            slices = max(slices, placement.start + placement.size)
            out.append(Partition(name, MigPlacement(
                profile_id=int(p.id), start=int(placement.start), size=int(placement.size),
                multiprocessors=int(p.multiprocessorCount), copy_engines=int(p.copyEngineCount),
                decoders=int(p.decoderCount), encoders=int(p.encoderCount),
                jpegs=int(p.jpegCount), ofas=int(p.ofaCount), memory_mb=int(p.memorySizeMB)),
                int(p.sliceCount)))
    return out, slices


def create(gpu: Gpu, profile_id: int, start: int, size: int) -> Made:
    """The GPU instance of profile `profile_id` at memory slices start .. start + size - 1 and
    its full compute instance; on any failure after the GPU instance is made, what was made
    is destroyed before the error is raised (AgentError)."""
    handle = _call(pynvml.nvmlDeviceGetHandleByIndex, gpu.index)
    placement = pynvml.c_nvmlGpuInstancePlacement_t(start, size)
    gi = _call(pynvml.nvmlDeviceCreateGpuInstanceWithPlacement, handle, profile_id,
               ctypes.byref(placement))
    ci = None
    try:
        gi_id = int(_call(pynvml.nvmlGpuInstanceGetInfo, gi).id)
        slices = next((p.sliceCount for _, p in _gi_profiles(handle) if p.id == profile_id), 0)
        if slices not in _CI_PROFILE_BY_SLICES:
            raise AgentError(f"GPU {gpu.index}: GPU instance profile {profile_id} has "
                             f"{slices} slices, no full compute instance profile")
        ci_profile = _call(pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo, gi,
                           _CI_PROFILE_BY_SLICES[slices], 0)
        ci = _call(pynvml.nvmlGpuInstanceCreateComputeInstance, gi, ci_profile.id)
        ci_id = int(_call(pynvml.nvmlComputeInstanceGetInfo_v2, ci).id)
        uuid = _uuid(handle, gi_id, ci_id)
        if uuid is None:  # NVML made it and does not list it
            raise NvmlError(pynvml.NVML_ERROR_NOT_FOUND, "nvmlDeviceGetMigDeviceHandleByIndex")
        minors = mig_minors()  # AgentError when the driver's list cannot be read
    except Exception:
        if ci is not None:
            _call(pynvml.nvmlComputeInstanceDestroy, ci)
        _call(pynvml.nvmlGpuInstanceDestroy, gi)  # no half-made partition is left
        raise
    log.info("GPU %d: MIG device %s made (GPU instance %d at %d+%d, compute instance %d)",
             gpu.index, uuid, gi_id, start, size, ci_id)
    return Made(uuid, gi_id, ci_id, _caps(minors, gpu, gi_id, ci_id))


def _uuid(handle, gi: int, ci: int) -> str | None:
    """The UUID of the MIG device of GPU instance `gi`, compute instance `ci`; None if none."""
    for _, mig in _mig_handles(handle):
        if (_call(pynvml.nvmlDeviceGetGpuInstanceId, mig),
                _call(pynvml.nvmlDeviceGetComputeInstanceId, mig)) == (gi, ci):
            return _text(_call(pynvml.nvmlDeviceGetUUID, mig))
    return None


def destroy(gpu: Gpu, gi: int, ci: int, uuid: str) -> None:
    """MIG device `uuid` (GPU instance `gi`, compute instance `ci`) destroyed: the compute
    instance, then the GPU instance. Gone already, or those IDs now another MIG device's
    (NVML hands a freed ID to the next instance made): nothing is done."""
    handle = _call(pynvml.nvmlDeviceGetHandleByIndex, gpu.index)
    if _uuid(handle, gi, ci) != uuid:
        return
    instance = _call(pynvml.nvmlDeviceGetGpuInstanceById, handle, gi)
    _call(pynvml.nvmlComputeInstanceDestroy,
          _call(pynvml.nvmlGpuInstanceGetComputeInstanceById, instance, ci))
    _call(pynvml.nvmlGpuInstanceDestroy, instance)
    log.info("GPU %d: MIG device %s destroyed (GPU instance %d)", gpu.index, uuid, gi)
