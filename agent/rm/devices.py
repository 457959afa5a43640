"""The device model: what the agent advertises to kubelet, and how each device maps to GPUs.

Owns: `Device` (one advertised device) and building the full-GPU device list from discovered
GPUs. Later: MIG devices and shared replicas map onto the same record. Must not call NVML (it
gets `agent.nvml.discovery.Gpu` records) nor import grpc.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from agent.nvml.discovery import Gpu

RESOURCE_GPU = "nvidia.com/gpu"


@dataclass(frozen=True)
class Device:
    """One device advertised to kubelet under a resource name."""

    id: str  # the ID kubelet sees: the GPU UUID for a full GPU
    index: str  # the ID under DEVICE_ID_STRATEGY=index: "3" for GPU 3
    gpu_uuid: str  # the physical GPU behind it
    gpu_index: int
    numa_node: int | None
    paths: tuple[str, ...]  # device nodes the container needs, e.g. ("/dev/nvidia3",)
    name: str = ""  # product name, for status and logs


def full_gpu_devices(gpus: Iterable[Gpu]) -> list[Device]:
    """One `nvidia.com/gpu` device per GPU without MIG, in index order."""
    return [
        Device(
            id=gpu.uuid,
            index=str(gpu.index),
            gpu_uuid=gpu.uuid,
            gpu_index=gpu.index,
            numa_node=gpu.numa_node,
            paths=(f"/dev/nvidia{gpu.minor}",),
            name=gpu.name,
        )
        for gpu in sorted(gpus, key=lambda g: g.index)
        if not gpu.mig_enabled
    ]
