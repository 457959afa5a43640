"""NVML probes the health monitor uses to tell whether a GPU is back: is its handle valid, is
it still the same GPU, do basic queries answer.

Owns: `probe(uuid, pci_bus_id)` (None when the GPU answers as itself, else what failed) and
`lost(uuids)` (which GPUs NVML reports lost, to name the GPU behind a wait that failed with
GPU_IS_LOST, which NVML does not). Reads only; NVML must be initialised. Must not decide what
a failure means (agent.health does) nor keep state.
"""

from __future__ import annotations

import pynvml

from agent.errors import NvmlError
from agent.nvml.discovery import _call, _text


def probe(uuid: str, pci_bus_id: str | None = None) -> str | None:
    """None when the GPU `uuid` answers NVML as itself: its handle by UUID is valid, reads
    back the same UUID (and PCI bus id, when given), and its name, memory and index queries
    succeed. Otherwise a short description of the first thing that failed."""
    try:
        handle = _call(pynvml.nvmlDeviceGetHandleByUUID, uuid)
        got = _text(_call(pynvml.nvmlDeviceGetUUID, handle))
        if got != uuid:
            return f"the handle for {uuid} now reads UUID {got}"
        if pci_bus_id is not None:
            bus = _text(_call(pynvml.nvmlDeviceGetPciInfo, handle).busId)
            if bus.lower() != pci_bus_id.lower():
                return f"{uuid} moved from PCI {pci_bus_id} to {bus}"
        _call(pynvml.nvmlDeviceGetName, handle)
        _call(pynvml.nvmlDeviceGetMemoryInfo, handle)
        _call(pynvml.nvmlDeviceGetIndex, handle)
    except NvmlError as exc:
        return str(exc)
    return None


def lost(uuids: list[str]) -> list[str]:
    """The GPUs among `uuids` whose handle lookup or UUID query says GPU_IS_LOST."""
    out = []
    for uuid in uuids:
        try:
            handle = _call(pynvml.nvmlDeviceGetHandleByUUID, uuid)
            _call(pynvml.nvmlDeviceGetUUID, handle)
        except NvmlError as exc:
            if exc.is_gpu_lost:
                out.append(uuid)
    return out
