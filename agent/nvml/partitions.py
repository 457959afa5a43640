"""MIG partitions made on demand (DRA's partitionable devices, KEP-4815): what a MIG-enabled
GPU can hold, and making and removing one GPU instance with its one full compute instance.

Owns: `possible(gpu)`: each GPU instance profile the GPU offers whose compute instance is the
whole instance (as NVIDIA's DRA driver keeps, nvlib.go:585), named as go-nvlib names it, with
each of its placements (nvmlDeviceGetGpuInstancePossiblePlacements_v2) and its counts, and the
GPU's number of memory slices; `create(gpu, profile_id, start)`: the GPU instance at that
placement (nvmlDeviceCreateGpuInstanceWithPlacement) and its full compute instance, answered
as the MIG device it makes (UUID, IDs, capability nodes); `destroy(gpu, gi, ci)`: the compute
instance, then the GPU instance (already gone: nothing to do). NvmlError when NVML refuses
(INSUFFICIENT_RESOURCES: the placement is taken). Must not decide what is published or
prepared (agent.dra).
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
    its full compute instance."""
    handle = _call(pynvml.nvmlDeviceGetHandleByIndex, gpu.index)
    placement = pynvml.c_nvmlGpuInstancePlacement_t(start, size)
    gi = _call(pynvml.nvmlDeviceCreateGpuInstanceWithPlacement, handle, profile_id,
               ctypes.byref(placement))
    try:
        info = _call(pynvml.nvmlGpuInstanceGetInfo, gi)
        slices = next(p.sliceCount for _, p in _gi_profiles(handle) if p.id == profile_id)
        ci_profile = _call(pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo, gi,
                           _CI_PROFILE_BY_SLICES[slices], 0)
        ci = _call(pynvml.nvmlGpuInstanceCreateComputeInstance, gi, ci_profile.id)
        ci_id = int(_call(pynvml.nvmlComputeInstanceGetInfo_v2, ci).id)
    except NvmlError:
        _call(pynvml.nvmlGpuInstanceDestroy, gi)  # no half-made partition is left
        raise
    gi_id = int(info.id)
    for _, mig in _mig_handles(handle):
        if (_call(pynvml.nvmlDeviceGetGpuInstanceId, mig),
                _call(pynvml.nvmlDeviceGetComputeInstanceId, mig)) == (gi_id, ci_id):
            uuid = _text(_call(pynvml.nvmlDeviceGetUUID, mig))
            break
    else:  # NVML made it and does not list it
        raise NvmlError(pynvml.NVML_ERROR_NOT_FOUND, "nvmlDeviceGetMigDeviceHandleByIndex")
    try:
        minors = mig_minors()
    except AgentError as exc:
        log.warning("%s: the MIG device gets no capability nodes", exc)
        minors = {}
    log.info("GPU %d: MIG device %s made (GPU instance %d at %d+%d, compute instance %d)",
             gpu.index, uuid, gi_id, start, size, ci_id)
    return Made(uuid, gi_id, ci_id, _caps(minors, gpu, gi_id, ci_id))


def destroy(gpu: Gpu, gi: int, ci: int) -> None:
    """The compute instance, then the GPU instance; what is already gone is skipped."""
    handle = _call(pynvml.nvmlDeviceGetHandleByIndex, gpu.index)
    try:
        instance = _call(pynvml.nvmlDeviceGetGpuInstanceById, handle, gi)
    except NvmlError as exc:
        if exc.name in ("NOT_FOUND", "INVALID_ARGUMENT"):
            return
        raise
    try:
        _call(pynvml.nvmlComputeInstanceDestroy,
              _call(pynvml.nvmlGpuInstanceGetComputeInstanceById, instance, ci))
    except NvmlError as exc:
        if exc.name not in ("NOT_FOUND", "INVALID_ARGUMENT"):
            raise
    _call(pynvml.nvmlGpuInstanceDestroy, instance)
    log.info("GPU %d: MIG device of GPU instance %d destroyed", gpu.index, gi)
