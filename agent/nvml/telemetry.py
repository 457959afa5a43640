"""GPU telemetry read from NVML when Prometheus scrapes: one GPU's current values.

Owns: which NVML queries a reading makes and the units they come back in (converted to base
units: bytes, degrees Celsius, watts, hertz, ratios 0-1), and remembering per GPU which
queries NVML does not support there (asked once, then left out: a V100 has retired pages and
no row remapping, an A100 the other way round). Must not decide how long a scrape waits or
what a failure means for the GPU's health (agent.metrics, agent.health), nor keep a polling
loop: nothing here runs unless something asks.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, Callable

import pynvml

from agent.errors import NvmlError, nvml_error

# nvmlClocksEventReasons bits (nvml.h, "Clocks Event Reasons"; pynvml's
# nvmlClocksThrottleReason* constants), by the label value the exporter gives each.
THROTTLE_REASONS = (
    ("gpu_idle", 0x1),
    ("applications_clocks_setting", 0x2),
    ("sw_power_cap", 0x4),
    ("hw_slowdown", 0x8),
    ("sync_boost", 0x10),
    ("sw_thermal_slowdown", 0x20),
    ("hw_thermal_slowdown", 0x40),
    ("hw_power_brake_slowdown", 0x80),
    ("display_clock_setting", 0x100),
)


def _throttle(handle: Any) -> int:
    get = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
    return get(handle)


# The v2 memory call (drivers from R510 on) counts the memory the driver and firmware reserve
# apart, as nvidia-smi shows it; the v1 struct counts it as used (480 MiB on an idle H100:
# docs/hardware/). False once this driver lacks v2: v1 from then on.
_MEMORY_V2 = [getattr(pynvml, "nvmlMemory_v2", None) is not None]
_NO_V2 = (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_NOT_SUPPORTED,
          getattr(pynvml, "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", -1))


def _memory(handle: Any) -> Iterator[tuple[str, float]]:
    info = None
    if _MEMORY_V2[0]:
        try:
            info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        except pynvml.NVMLError as exc:
            if exc.value not in _NO_V2:
                raise
            _MEMORY_V2[0] = False
    if info is None:
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
    yield "memory_used_bytes", info.used
    yield "memory_total_bytes", info.total


def _utilization(handle: Any) -> Iterator[tuple[str, float]]:
    rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
    yield "utilization_ratio", rates.gpu / 100.0
    yield "memory_utilization_ratio", rates.memory / 100.0


def _ecc(handle: Any) -> Iterator[tuple[str, float]]:
    for name, kind in (("corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                       ("uncorrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)):
        yield f"ecc_{name}", pynvml.nvmlDeviceGetTotalEccErrors(handle, kind,
                                                                 pynvml.NVML_VOLATILE_ECC)


def _remapped(handle: Any) -> Iterator[tuple[str, float]]:
    corrected, uncorrected, pending, failed = pynvml.nvmlDeviceGetRemappedRows(handle)
    yield "remapped_rows_correctable", corrected
    yield "remapped_rows_uncorrectable", uncorrected
    yield "remapped_rows_pending", 1.0 if pending else 0.0
    yield "remapped_rows_failed", 1.0 if failed else 0.0


def _throttle_bits(handle: Any) -> Iterator[tuple[str, float]]:
    mask = _throttle(handle)
    for name, bit in THROTTLE_REASONS:
        yield f"throttle_{name}", 1.0 if mask & bit else 0.0


def _one(name: str, get: Callable[[Any], float], scale: float = 1.0):
    def query(handle: Any) -> Iterator[tuple[str, float]]:
        yield name, get(handle) * scale
    return query


# Each query: a name (what the unsupported set remembers) and what it yields. Order: the
# cheapest and most asked for first, so that a GPU that hangs mid-way has given those.
QUERIES: tuple[tuple[str, Callable[[Any], Iterator[tuple[str, float]]]], ...] = (
    ("memory", _memory),
    ("utilization", _utilization),
    ("temperature", _one("temperature_celsius", lambda h: pynvml.nvmlDeviceGetTemperature(
        h, pynvml.NVML_TEMPERATURE_GPU))),
    ("power", _one("power_watts", pynvml.nvmlDeviceGetPowerUsage, 1e-3)),
    ("power_limit", _one("power_limit_watts", pynvml.nvmlDeviceGetEnforcedPowerLimit, 1e-3)),
    ("sm_clock", _one("sm_clock_hertz", lambda h: pynvml.nvmlDeviceGetClockInfo(
        h, pynvml.NVML_CLOCK_SM), 1e6)),
    ("ecc", _ecc),
    ("retired_pages", _one("retired_pages_pending", lambda h: float(
        pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h) == pynvml.NVML_FEATURE_ENABLED))),
    ("remapped_rows", _remapped),
    ("throttle", _throttle_bits),
)


class Reading(dict):
    """One GPU's values by name (base units) plus `errors`: the queries that failed."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[NvmlError] = []


class TelemetryReader:
    """Reads GPUs by UUID; thread-safe (one reading per GPU at a time is the caller's rule)."""

    def __init__(self) -> None:
        self._handles: dict[str, Any] = {}
        self._unsupported: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def unsupported(self, uuid: str) -> frozenset[str]:
        with self._lock:
            return frozenset(self._unsupported.get(uuid, ()))

    def read(self, uuid: str) -> Reading:
        """The GPU's values now; a query NVML does not support there is remembered and not
        asked again, one that fails otherwise is in `errors` (and its values left out)."""
        reading = Reading()
        try:
            handle = self._handle(uuid)
        except NvmlError as exc:
            reading.errors.append(exc)
            return reading
        skip = self.unsupported(uuid)
        for name, query in QUERIES:
            if name in skip:
                continue
            try:
                reading.update(query(handle))
            except pynvml.NVMLError as exc:
                error = nvml_error(exc.value, f"telemetry {name}")
                if error.is_not_supported:
                    with self._lock:
                        self._unsupported.setdefault(uuid, set()).add(name)
                else:
                    reading.errors.append(error)
        return reading

    def _handle(self, uuid: str) -> Any:
        handle = self._handles.get(uuid)
        if handle is None:
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            except pynvml.NVMLError as exc:
                raise nvml_error(exc.value, "nvmlDeviceGetHandleByUUID") from exc
            self._handles[uuid] = handle
        return handle
