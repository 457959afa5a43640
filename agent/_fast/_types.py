"""Plain-Python types and input checks shared by the compiled hot paths and their twins.

Owns: the `Event` record both event loops return, the NVML constants both use (event types,
the wait cap), the GPU limit of the topology masks, and the argument checks whose wording must
be identical in both implementations. Must not import anything of `agent` but `errors`, nor do
any NVML calls.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

from agent.errors import NvmlLibraryError

# NVML event types (nvmlEventType*), bits of an event mask.
EVENT_SINGLE_BIT_ECC = 0x1
EVENT_DOUBLE_BIT_ECC = 0x2
EVENT_PSTATE = 0x4
EVENT_XID_CRITICAL = 0x8
EVENT_CLOCK = 0x10
EVENT_POWER_SOURCE = 0x80
EVENT_MIG_CONFIG_CHANGE = 0x100

# No single wait blocks longer than this: the caller gets control back to check its stop flag.
MAX_WAIT_MS = 5000
# GPU sets of the topology search are uint64_t bitmasks, one bit per GPU index.
MAX_GPUS = 64
# Buffer for nvmlDeviceGetUUID (NVML_DEVICE_UUID_V2_BUFFER_SIZE).
UUID_BUFFER_SIZE = 96
# gpuInstanceId / computeInstanceId of an event on a GPU that is not a MIG instance.
NO_INSTANCE = 0xFFFFFFFF
# The ignored-XID filter is a bitmap of this many bits (XIDs 0..1023); an XID beyond it always
# reaches the caller, whose policy decides (NVIDIA's catalog stops well below it).
XID_FILTER_SIZE = 1024
# The names of EventSet.counters, in order.
COUNTERS = ("ignored", "sbe", "delivered")


class Event(NamedTuple):
    """One NVML event, as `EventSet.wait()` returns it (the same type from both implementations).

    `index` and `uuid` are the GPU the event's device handle names, resolved at wait time with
    nvmlDeviceGetIndex / nvmlDeviceGetUUID. Each is None when it cannot be known: the event
    carries no device handle, or NVML cannot resolve it. A caller must then treat the event as
    concerning every GPU it watches (as NVIDIA's device plugin does), never as concerning none.
    `xid` is the event's eventData: the XID for XidCriticalError events, raw data otherwise.
    `gpu_instance_id` / `compute_instance_id` are passed through as NVML gives them
    (NO_INSTANCE, 0xFFFFFFFF, when the event is not about a MIG instance).
    """

    index: int | None
    uuid: str | None
    event_type: int
    xid: int
    gpu_instance_id: int
    compute_instance_id: int


def check_gpu_index(index: object) -> int:
    """`index` as an int in [0, 2**32); TypeError / ValueError otherwise."""
    value = operator.index(index)
    if not 0 <= value < 2**32:
        raise ValueError(f"GPU index must be in [0, 2**32), got {value}")
    return value


def check_event_mask(event_types: object) -> int:
    """`event_types` as an int in [0, 2**64); TypeError / ValueError otherwise."""
    value = operator.index(event_types)
    if not 0 <= value < 2**64:
        raise ValueError(f"event type mask must be in [0, 2**64), got {value:#x}")
    return value


def check_timeout(timeout_ms: object) -> int:
    """`timeout_ms` capped to MAX_WAIT_MS; TypeError / ValueError when not a non-negative int."""
    value = operator.index(timeout_ms)
    if value < 0:
        raise ValueError(f"timeout_ms must be >= 0, got {value}")
    return min(value, MAX_WAIT_MS)


def check_ignored_xids(xids: object) -> tuple[int, ...]:
    """`xids` (an iterable of ints) as a sorted tuple of distinct XIDs in [0, XID_FILTER_SIZE);
    TypeError / ValueError otherwise."""
    out = set()
    for xid in xids:  # TypeError for a non-iterable, as both implementations word it
        value = operator.index(xid)
        if not 0 <= value < XID_FILTER_SIZE:
            raise ValueError(f"ignored XID {value} is outside the filter's 0..{XID_FILTER_SIZE - 1}; "
                             f"the caller's policy must handle it")
        out.add(value)
    return tuple(sorted(out))


def cannot_open(path: str, reason: str) -> NvmlLibraryError:
    return NvmlLibraryError(
        f"cannot open NVML library {path}: {reason}; is the NVIDIA driver installed and is the "
        f"library path right?"
    )


def missing_symbol(path: str, name: str) -> NvmlLibraryError:
    return NvmlLibraryError(
        f"NVML library {path} lacks {name}; the driver is too old or this is not libnvidia-ml"
    )


def wait_in_progress(action: str) -> RuntimeError:
    return RuntimeError(
        f"{action} while another thread waits on this EventSet; stop the waiter first "
        f"(each wait returns within {MAX_WAIT_MS} ms)"
    )


def closed_set() -> ValueError:
    return ValueError("operation on a closed EventSet")
