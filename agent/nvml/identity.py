"""What a DRA driver publishes of each GPU and MIG device beyond discovery, read through NVML.

Owns: `gpu_identity` (a GPU's architecture and brand, named as go-nvlib's
GetArchitectureAsString and GetBrandAsString name them, which NVIDIA's DRA driver publishes)
and `mig_placement` (a MIG device's GPU instance: its profile ID, placement and the engine
counts of its profile, from which NVIDIA's DRA driver names the device and sets its capacity).
These reads are not on the device plugin's start path: discovery (agent.nvml.discovery) does
without them. NVML must be initialised. Must not decide what a value means for a ResourceSlice
(agent.dra.slices does) or keep state.
"""

from __future__ import annotations

from typing import NamedTuple

import pynvml

from agent.errors import NvmlError
from agent.nvml.discovery import Gpu, _call
from agent.nvml.mig import MigDevice, _gi_profiles

# go-nvlib pkg/nvlib/device/device.go GetArchitectureAsString and GetBrandAsString (as
# vendored by kubernetes-sigs/dra-driver-nvidia-gpu v0.4.1): NVML's enum -> the name. A value
# go-nvlib does not know fails its discovery; here it reads "Unknown".
ARCHITECTURES = {
    pynvml.NVML_DEVICE_ARCH_KEPLER: "Kepler",
    pynvml.NVML_DEVICE_ARCH_MAXWELL: "Maxwell",
    pynvml.NVML_DEVICE_ARCH_PASCAL: "Pascal",
    pynvml.NVML_DEVICE_ARCH_VOLTA: "Volta",
    pynvml.NVML_DEVICE_ARCH_TURING: "Turing",
    pynvml.NVML_DEVICE_ARCH_AMPERE: "Ampere",
    pynvml.NVML_DEVICE_ARCH_ADA: "Ada Lovelace",
    pynvml.NVML_DEVICE_ARCH_HOPPER: "Hopper",
    pynvml.NVML_DEVICE_ARCH_BLACKWELL: "Blackwell",
    pynvml.NVML_DEVICE_ARCH_UNKNOWN: "Unknown",
}
BRANDS = {
    pynvml.NVML_BRAND_UNKNOWN: "Unknown",
    pynvml.NVML_BRAND_QUADRO: "Quadro",
    pynvml.NVML_BRAND_TESLA: "Tesla",
    pynvml.NVML_BRAND_NVS: "NVS",
    pynvml.NVML_BRAND_GRID: "Grid",
    pynvml.NVML_BRAND_GEFORCE: "GeForce",
    pynvml.NVML_BRAND_TITAN: "Titan",
    pynvml.NVML_BRAND_NVIDIA_VAPPS: "NvidiaVApps",
    pynvml.NVML_BRAND_NVIDIA_VPC: "NvidiaVPC",
    pynvml.NVML_BRAND_NVIDIA_VCS: "NvidiaVCS",
    pynvml.NVML_BRAND_NVIDIA_VWS: "NvidiaVWS",
    pynvml.NVML_BRAND_NVIDIA_CLOUD_GAMING: "NvidiaCloudGaming",
    pynvml.NVML_BRAND_QUADRO_RTX: "QuadroRTX",
    pynvml.NVML_BRAND_NVIDIA_RTX: "NvidiaRTX",
    pynvml.NVML_BRAND_NVIDIA: "Nvidia",
    pynvml.NVML_BRAND_GEFORCE_RTX: "GeForceRTX",
    pynvml.NVML_BRAND_TITAN_RTX: "TitanRTX",
}


class GpuIdentity(NamedTuple):
    architecture: str  # "Hopper"
    brand: str  # "Nvidia"


class MigPlacement(NamedTuple):
    """A MIG device's GPU instance: its profile's ID (nvidia-smi mig -lgip's ID column), its
    placement (memory slices start .. start + size - 1) and its profile's counts."""

    profile_id: int
    start: int
    size: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpegs: int
    ofas: int
    memory_mb: int


def gpu_identity(gpu: Gpu) -> GpuIdentity:
    """GPU `gpu`'s architecture and brand; NvmlError when NVML cannot say."""
    handle = _call(pynvml.nvmlDeviceGetHandleByIndex, gpu.index)
    arch = _call(pynvml.nvmlDeviceGetArchitecture, handle)
    brand = _call(pynvml.nvmlDeviceGetBrand, handle)
    return GpuIdentity(ARCHITECTURES.get(arch, "Unknown"), BRANDS.get(brand, "Unknown"))


def mig_placement(mig: MigDevice) -> MigPlacement:
    """The GPU instance of MIG device `mig`; NvmlError when NVML cannot say."""
    handle = _call(pynvml.nvmlDeviceGetHandleByIndex, mig.parent.index)
    info = _call(pynvml.nvmlGpuInstanceGetInfo,
                 _call(pynvml.nvmlDeviceGetGpuInstanceById, handle, mig.gi))
    for _, p in _gi_profiles(handle):
        if p.id == info.profileId:
            return MigPlacement(
                profile_id=int(p.id), start=int(info.placement.start),
                size=int(info.placement.size), multiprocessors=int(p.multiprocessorCount),
                copy_engines=int(p.copyEngineCount), decoders=int(p.decoderCount),
                encoders=int(p.encoderCount), jpegs=int(p.jpegCount), ofas=int(p.ofaCount),
                memory_mb=int(p.memorySizeMB))
    # a profile the GPU does not list: NVML contradicts itself
    raise NvmlError(pynvml.NVML_ERROR_NOT_FOUND, "nvmlDeviceGetGpuInstanceProfileInfo")
