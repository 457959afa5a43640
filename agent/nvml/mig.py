"""MIG devices as NVML reports them, and their profile names as NVIDIA's tools write them.

Owns: `read_mig_devices` (every MIG device of the MIG-enabled GPUs given, in NVIDIA's visiting
order) and `profile_name`, go-nvlib's MigProfileInfo.String() ("1g.10gb", "1c.3g.20gb",
"1g.10gb+me"), the name NVIDIA's plugin matches `resources.mig` patterns against and builds
mixed-strategy resource names from. Must not decide strategies or talk gRPC.

How NVIDIA reads them (k8s-device-plugin, vendored go-nvlib pkg/nvlib/device):
- device.go VisitMigDevices: handles by index 0 .. nvmlDeviceGetMaxMigDeviceCount-1, skipping
  indexes that answer NOT_FOUND or INVALID_ARGUMENT; the index is the `j` of the device's
  `i:j` ID under deviceIDStrategy index (internal/rm/nvml_devices.go newMigDevice).
- mig_device.go GetProfile: the GPU instance profile (slices, and the +me / +me.all / +gfx /
  -me attribute its profile constant carries), the compute instance's slices, and the memory
  in GB from mig_profile.go getMigMemorySizeGB: the MIG device's share of the parent's memory
  rounded up to eighths, times the parent's memory in whole GB, rounded.
GetProfile finds the two profile constants through the GPU and compute instance objects; this
module reads the same facts from the MIG device's attributes (its GPU and compute instance
slice counts and memory) and the parent's GPU instance profile table (the constant whose
profile has those slices and that memory, the device's name deciding between look-alikes such
as 1g.10gb and 1g.10gb+me), which needs no instance handles.

Each GPU is read under agent.nvml.guard's budget. A GPU that does not answer keeps its MIG
devices as last read in this process (`_last_read`, the one state kept here), and its entry of
the last `layout` given: the devices of a GPU that hangs stay advertised (and withdrawn by the
health monitor) instead of vanishing.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import pynvml

from agent.errors import AgentError, NvmlError, NvmlNotAnswering
from agent.host import mig_minors
from agent.nvml.discovery import Gpu, _call, _text
from agent.nvml.guard import GUARD

log = logging.getLogger(__name__)

# go-nvlib mig_profile.go NewMigProfile: the attribute each GPU instance profile constant
# carries (nvmlGpuInstanceProfile*: REV1 = +me, ALL_ME = +me.all, GFX = +gfx, NO_ME = -me).
_GI_ATTRIBUTES = {7: "+me", 8: "+me", 15: "+me.all", 16: "+me.all", 10: "+gfx", 11: "+gfx",
                  12: "+gfx", 17: "+gfx", 13: "-me", 14: "-me"}
_GI_PROFILE_COUNT = 18  # NVML_GPU_INSTANCE_PROFILE_COUNT
_ONE_MIB = 1 << 20
_ONE_GIB = 1 << 30


class MigDevice(NamedTuple):
    """One MIG device (a compute instance in a GPU instance) of a MIG-enabled GPU."""

    parent: Gpu
    index: int  # its handle index on the parent: the `j` of NVIDIA's `i:j` index ID
    uuid: str  # MIG-...
    gi: int  # GPU instance ID
    ci: int  # compute instance ID
    profile: str  # go-nvlib's profile name, e.g. "1g.10gb", "1c.3g.20gb"
    memory_mb: int
    gi_slices: int
    ci_slices: int
    multiprocessors: int
    # the /dev/nvidia-caps nodes of its GPU and compute instance (NVIDIA's nvml_devices.go
    # GetPaths), () when the driver's minors file does not list them
    caps: tuple[str, ...] = ()

    @property
    def index_id(self) -> str:
        """The device's ID under deviceIDStrategy index, as NVIDIA's plugin writes it."""
        return f"{self.parent.index}:{self.index}"

    @property
    def kind(self) -> tuple:
        """What NVIDIA's single strategy compares (it requires one kind on the node: the
        devices' nvmlDeviceAttributes_t equal, internal/rm/device_map.go
        assertAllMigDevicesAreValid); these are the attributes the simulated and real NVML
        both report."""
        return (self.profile, self.memory_mb, self.gi_slices, self.ci_slices,
                self.multiprocessors)


def memory_gb(parent_total_bytes: int, mig_memory_mb: int) -> int:
    """go-nvlib getMigMemorySizeGB: the GB figure of a profile name."""
    fraction = mig_memory_mb * _ONE_MIB / parent_total_bytes
    fraction = math.ceil(fraction * 8) / 8
    total_gb = (parent_total_bytes + _ONE_GIB - 1) // _ONE_GIB
    return int(round(fraction * total_gb))  # Go's math.Round: halves away from zero


def profile_name(ci_slices: int, gi_slices: int, gb: int, suffix: str = "") -> str:
    """go-nvlib MigProfileInfo.String()."""
    if ci_slices == gi_slices:
        return f"{gi_slices}g.{gb}gb{suffix}"
    return f"{ci_slices}c.{gi_slices}g.{gb}gb{suffix}"


def _gi_profiles(handle) -> list[tuple[int, object]]:
    """(profile constant, nvmlGpuInstanceProfileInfo_t) of every profile the GPU supports."""
    out = []
    for constant in range(_GI_PROFILE_COUNT):
        try:
            out.append((constant, _call(pynvml.nvmlDeviceGetGpuInstanceProfileInfo, handle,
                                        constant)))
        except NvmlError as exc:
            if exc.is_not_supported or exc.name == "INVALID_ARGUMENT":
                continue
            raise
    return out


def _suffix(profiles: list, gi_slices: int, memory_mb: int, device_name: str) -> str:
    """The attribute suffix of the GPU instance profile with these slices and memory."""
    alike = [(c, _text(p.name)) for c, p in profiles
             if p.sliceCount == gi_slices and p.memorySizeMB == memory_mb]
    if len(alike) > 1:  # e.g. 1g.10gb and 1g.10gb+me: the device is named for its profile
        named = [(c, n) for c, n in alike if device_name.endswith(n.split("MIG ", 1)[-1])]
        alike = sorted(named or alike, key=lambda cn: -len(cn[1]))
    return _GI_ATTRIBUTES.get(alike[0][0], "") if alike else ""


def _caps(minors: dict[str, int], gpu: Gpu, gi: int, ci: int) -> tuple[str, ...]:
    names = (f"gpu{gpu.minor}/gi{gi}/access", f"gpu{gpu.minor}/gi{gi}/ci{ci}/access")
    if not all(n in minors for n in names):
        if minors:  # a MIG-capable driver that does not list this instance
            log.warning("GPU %d: no capability minors for GPU instance %d / compute instance "
                        "%d in the driver's mig-minors: passDeviceSpecs gives its MIG device "
                        "the GPU's node only", gpu.index, gi, ci)
        return ()
    return tuple(f"/dev/nvidia-caps/nvidia-cap{minors[n]}" for n in names)


def _mig_handles(handle) -> Iterator[tuple[int, object]]:
    """(handle index, MIG device handle) of a MIG-enabled GPU, skipping the indexes that answer
    NOT_FOUND or INVALID_ARGUMENT (go-nvlib device.go VisitMigDevices)."""
    for j in range(_call(pynvml.nvmlDeviceGetMaxMigDeviceCount, handle)):
        try:
            yield j, _call(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, j)
        except NvmlError as exc:
            if exc.name not in ("NOT_FOUND", "INVALID_ARGUMENT"):
                raise


# GPU UUID -> its MIG devices as last read: what a GPU that does not answer keeps.
_last_read: dict[str, list[MigDevice]] = {}


def read_mig_devices(gpus: Iterable[Gpu]) -> list[MigDevice]:
    """The MIG devices of the MIG-enabled GPUs among `gpus`, by GPU index then handle index.
    NvmlError when NVML cannot say (a lost GPU included: the caller decides); a GPU that does
    not answer within the guard's budget keeps the devices last read."""
    out = []
    minors: dict[str, int] | None = None
    for gpu in sorted(gpus, key=lambda g: g.index):
        if not gpu.mig_enabled:
            continue
        if minors is None:
            try:
                minors = mig_minors()
            except AgentError as exc:
                log.warning("%s: MIG devices get no capability nodes", exc)
                minors = {}
        try:
            found = GUARD.call(gpu.index, "MIG devices", _read_gpu_migs, gpu, minors)
        except NvmlNotAnswering as exc:
            found = _last_read.get(gpu.uuid, [])
            log.warning("GPU %d %s: %s; keeping its %d MIG devices as last read", gpu.index,
                        gpu.uuid, exc, len(found))
        _last_read[gpu.uuid] = found
        out += found
    return out


def _read_gpu_migs(gpu: Gpu, minors: dict[str, int]) -> list[MigDevice]:
    out = []
    handle = _call(pynvml.nvmlDeviceGetHandleByIndex, gpu.index)
    profiles = _gi_profiles(handle)
    for j, mig in _mig_handles(handle):
        attrs = _call(pynvml.nvmlDeviceGetAttributes_v2, mig)
        name = _text(_call(pynvml.nvmlDeviceGetName, mig))
        gi_slices, ci_slices = attrs.gpuInstanceSliceCount, attrs.computeInstanceSliceCount
        suffix = _suffix(profiles, gi_slices, attrs.memorySizeMB, name)
        gi = _call(pynvml.nvmlDeviceGetGpuInstanceId, mig)
        ci = _call(pynvml.nvmlDeviceGetComputeInstanceId, mig)
        out.append(MigDevice(
            parent=gpu, index=j, uuid=_text(_call(pynvml.nvmlDeviceGetUUID, mig)),
            gi=gi, ci=ci, caps=_caps(minors, gpu, gi, ci),
            profile=profile_name(ci_slices, gi_slices,
                                 memory_gb(gpu.memory_total, attrs.memorySizeMB), suffix),
            memory_mb=int(attrs.memorySizeMB), gi_slices=int(gi_slices),
            ci_slices=int(ci_slices), multiprocessors=int(attrs.multiprocessorCount)))
    return out


def layout(gpus: Iterable[Gpu], known: tuple = ()) -> tuple:
    """What a MIG reconfiguration changes, cheaply read: per MIG-capable GPU its current and
    pending MIG mode and its MIG devices' UUIDs (a few NVML calls per GPU, no profile tables).
    Two reads are equal exactly when no instance was created or destroyed and no mode
    changed. NvmlError when NVML cannot say; a GPU that does not answer within the guard's
    budget keeps its entry in `known` (the layout read before)."""
    before = {entry[0]: entry for entry in known}
    out = []
    for gpu in sorted(gpus, key=lambda g: g.index):
        try:
            entry = GUARD.call(gpu.index, "MIG layout", _gpu_layout, gpu)
        except NvmlNotAnswering:
            entry = before.get(gpu.uuid)
        if entry is not None:
            out.append(entry)
    return tuple(out)


def _gpu_layout(gpu: Gpu) -> tuple | None:
    handle = _call(pynvml.nvmlDeviceGetHandleByIndex, gpu.index)
    try:
        current, pending = _call(pynvml.nvmlDeviceGetMigMode, handle)
    except NvmlError as exc:
        if exc.is_not_supported:
            return None
        raise
    uuids = [_text(_call(pynvml.nvmlDeviceGetUUID, mig))
             for _, mig in (_mig_handles(handle) if current else ())]
    return (gpu.uuid, int(current), int(pending), tuple(uuids))
