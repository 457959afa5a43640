"""NVML probes the health monitor uses to tell whether a GPU is back: is its handle valid, is
it still the same GPU, do basic queries answer, and does the driver still ask for a repair
first (its recovery action, a row remap pending or failed, pages pending retirement).

Owns: `probe(uuid, pci_bus_id)` (None when the GPU answers as itself, else what failed),
`repair_pending(handle)` (what the driver still asks for), `recovery_probe` (both: what the
health monitor asks before a withdrawn GPU returns), `recovery_action(uuid)` (read on XID 154)
and
`lost(uuids)` (which GPUs NVML reports lost, to name the GPU behind a wait that failed with
GPU_IS_LOST, which NVML does not). Reads only; NVML must be initialised. Must not decide what
a failure means (agent.health does) nor keep state.
"""

from __future__ import annotations

import pynvml

from agent.errors import NVML_CODES, NvmlError
from agent.nvml.discovery import _call, _text

# NVML_GPU_RECOVERY_ACTION_* other than NONE (0): what the driver says must happen before the
# GPU serves work again (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, R550 drivers and later).
RECOVERY_ACTIONS = {1: "a GPU reset", 2: "a node reboot", 3: "draining P2P",
                    4: "draining and a GPU reset", 5: "recovering the IMEX domain",
                    6: "a PCI bus reset", 7: "a system reboot"}
FI_GPU_RECOVERY_ACTION = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
# A query the driver or GPU does not offer: that check is skipped.
_NOT_OFFERED = frozenset((NVML_CODES["NOT_SUPPORTED"], NVML_CODES["FUNCTION_NOT_FOUND"]))


def probe(uuid: str, pci_bus_id: str | None = None) -> str | None:
    """None when the GPU `uuid` answers NVML as itself: its handle by UUID is valid, reads
    back the same UUID (and PCI bus id, when given), and its name, memory and index queries
    succeed. Otherwise a short description of the first thing that failed."""
    return _checked(uuid, pci_bus_id, repair=False)


def recovery_probe(uuid: str, pci_bus_id: str | None = None) -> str | None:
    """`probe`, then `repair_pending` on the same handle: None when the GPU answers as itself
    and the driver asks for nothing more before it serves again."""
    return _checked(uuid, pci_bus_id, repair=True)


def _checked(uuid: str, pci_bus_id: str | None, repair: bool) -> str | None:
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
        return repair_pending(handle) if repair else None
    except NvmlError as exc:
        return str(exc)


def repair_pending(handle) -> str | None:
    """What the driver still asks for before GPU `handle` serves again, or None: a recovery
    action other than none, a failed or pending row remap (Ampere and later), pages pending
    retirement (before Ampere). A query the driver does not offer is skipped; any other
    error propagates (NvmlError)."""
    action = _offered(_recovery_action, handle)
    if action:
        return (f"the driver asks for {RECOVERY_ACTIONS.get(action, f'recovery action {action}')}"
                f" (GPU recovery action {action})")
    rows = _offered(_call, pynvml.nvmlDeviceGetRemappedRows, handle)
    if rows is not None:
        _, _, pending, failed = rows
        if failed:
            return "a row remapping failed: the GPU needs service"
        if pending:
            return "a row remapping is pending: a GPU reset applies it"
    pages = _offered(_call, pynvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    if pages == pynvml.NVML_FEATURE_ENABLED:
        return "pages are pending retirement: a GPU reset or a reboot retires them"
    return None


def recovery_action(uuid: str) -> int | None:
    """The driver's recovery action for GPU `uuid` now (NVML_GPU_RECOVERY_ACTION_*), or None
    when the driver does not offer it or the GPU does not answer."""
    try:
        return _recovery_action(_call(pynvml.nvmlDeviceGetHandleByUUID, uuid))
    except NvmlError:
        return None


def _recovery_action(handle) -> int | None:
    value, = _call(pynvml.nvmlDeviceGetFieldValues, handle, [FI_GPU_RECOVERY_ACTION])
    if value.nvmlReturn in _NOT_OFFERED:
        return None
    if value.nvmlReturn != pynvml.NVML_SUCCESS:
        raise NvmlError(value.nvmlReturn, "nvmlDeviceGetFieldValues(GPU_RECOVERY_ACTION)")
    return value.value.uiVal


def _offered(fn, *args):
    """fn(*args), or None when the query is not offered here."""
    try:
        return fn(*args)
    except NvmlError as exc:
        if exc.code in _NOT_OFFERED:
            return None
        raise


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
