"""Pure-Python twin of agent._fast.events: the NVML event set, through unmodified pynvml.

Owns: the same API and the same answers as events.pyx for hosts without the compiled
extension, the ignored-XID / single-bit-ECC filter and its counters included (here in Python,
between pynvml waits, with the same timeout accounting). The library at `library_path` is loaded with ctypes (RTLD_GLOBAL) before pynvml
initialises, so pynvml's CDLL("libnvidia-ml.so.1") binds to that copy by SONAME; ctypes
releases the GIL during every foreign call, nvmlEventSetWait_v2 included. Every NVML error
becomes an exception in `_call`, through agent.errors.nvml_error.
Must not: decide what an event means, loop forever, patch pynvml, import anything of `agent`
but `errors` and the sibling `_types`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time

import pynvml

from agent._fast._types import (
    COUNTERS,
    EVENT_SINGLE_BIT_ECC,
    EVENT_XID_CRITICAL,
    MAX_WAIT_MS,
    Event,
    cannot_open,
    check_event_mask,
    check_gpu_index,
    check_ignored_xids,
    check_timeout,
    closed_set,
    missing_symbol,
    wait_in_progress,
)
from agent.errors import NvmlError, nvml_error

__all__ = ["MAX_WAIT_MS", "Event", "EventSet"]

log = logging.getLogger(__name__)

# The C symbols the pynvml functions below call; checked up front, as the compiled module does.
_SYMBOLS = (
    "nvmlInitWithFlags",
    "nvmlShutdown",
    "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetIndex",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetSupportedEventTypes",
    "nvmlDeviceRegisterEvents",
    "nvmlEventSetCreate",
    "nvmlEventSetWait_v2",
    "nvmlEventSetFree",
)


def _call(function: str, fn, *args):
    """The one place this module turns an NVML error (pynvml.NVMLError) into NvmlError."""
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        raise nvml_error(exc.value, function) from exc


def _resolved(fn, *args):
    """fn(*args), or None where NVML cannot answer (for the Event fields documented so)."""
    try:
        return fn(*args)
    except pynvml.NVMLError:
        return None


class EventSet:
    """EventSet(library_path: str)

    One NVML event set on the library at `library_path`, loaded with ctypes (RTLD_GLOBAL) and
    every symbol checked up front (NvmlLibraryError naming a missing one); pynvml.nvmlInit
    (NVML counts inits); nvmlEventSetCreate. `close()` (or leaving a `with` block) frees the
    set and calls nvmlShutdown once. One thread may wait at a time; register() may run beside it.
    """

    def __init__(self, library_path: str | os.PathLike):
        self._guard = threading.Lock()  # makes the check-and-set of _waiting/_closed atomic
        self._set = None
        self._initialised = False
        self._closed = False
        self._waiting = False
        self._ignored: frozenset[int] = frozenset()
        self._counts = dict.fromkeys(COUNTERS, 0)
        path = os.fspath(library_path)
        self._library_path = os.fsdecode(path) if isinstance(path, bytes) else path
        try:
            lib = ctypes.CDLL(self._library_path, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            self._closed = True
            raise cannot_open(self._library_path, str(exc)) from exc
        for name in _SYMBOLS:
            if not hasattr(lib, name):
                self._closed = True
                raise missing_symbol(self._library_path, name)
        try:
            _call("nvmlInitWithFlags", pynvml.nvmlInit)
            self._initialised = True
            self._set = _call("nvmlEventSetCreate", pynvml.nvmlEventSetCreate)
        except BaseException:
            self._closed = True
            error = self._release()
            if error is not None:  # already raising the first error; this one is only logged
                log.warning("cleaning up a failed EventSet(%s): %s", self._library_path, error)
            raise

    def __del__(self):
        # Not closed by the owner: free what we hold. A failure has nowhere to go from here;
        # close() is the way to see it.
        if not getattr(self, "_closed", True) and not self._waiting:
            self._closed = True
            self._release()

    def _release(self) -> NvmlError | None:
        """Free the set and shut NVML down once; the first error, if any (not raised)."""
        first = None
        if self._set is not None:
            event_set, self._set = self._set, None
            try:
                _call("nvmlEventSetFree", pynvml.nvmlEventSetFree, event_set)
            except NvmlError as exc:
                first = first or exc
        if self._initialised:
            self._initialised = False
            try:
                _call("nvmlShutdown", pynvml.nvmlShutdown)
            except NvmlError as exc:
                first = first or exc
        return first

    @property
    def library_path(self) -> str:
        """The path this set's NVML library was opened from."""
        return self._library_path

    @property
    def closed(self) -> bool:
        """True once close() ran (or the constructor failed)."""
        return self._closed

    @property
    def waiting(self) -> bool:
        """True while a thread is inside wait() (close() must wait for it to come back)."""
        return self._waiting

    def register(self, index: int, event_types: int) -> int:
        """Register GPU `index` for `event_types` masked with what it supports; the mask registered.

        0 means none of the requested types is supported there: nothing is registered, and it
        is no error. NvmlError from NVML (NOT_SUPPORTED where the GPU has no events at all,
        INVALID_ARGUMENT for an index beyond the GPUs, GPU_IS_LOST, ...).
        """
        c_index = check_gpu_index(index)
        wanted = check_event_mask(event_types)
        if self._closed:
            raise closed_set()
        device = _call("nvmlDeviceGetHandleByIndex_v2", pynvml.nvmlDeviceGetHandleByIndex, c_index)
        supported = _call("nvmlDeviceGetSupportedEventTypes",
                          pynvml.nvmlDeviceGetSupportedEventTypes, device)
        wanted &= supported
        if wanted:
            _call("nvmlDeviceRegisterEvents", pynvml.nvmlDeviceRegisterEvents,
                  device, wanted, self._set)
        return wanted

    def set_ignored_xids(self, xids) -> None:
        """Drop XidCriticalError events with these XIDs (each in 0..1023) from now on,
        counting them in counters["ignored"]; replaces the previous set (empty: drop none)."""
        self._ignored = frozenset(check_ignored_xids(xids))

    @property
    def ignored_xids(self) -> tuple[int, ...]:
        """The XIDs dropped by the filter, sorted."""
        return tuple(sorted(self._ignored))

    @property
    def counters(self) -> dict[str, int]:
        """Events seen by wait() since the set was opened: {"ignored": XIDs dropped by the
        filter, "sbe": single-bit ECC events counted and dropped, "delivered": returned}."""
        return dict(self._counts)

    def _filtered_wait(self, timeout: int):
        """pynvml waits until an event passes the filter (its data), or `timeout` ms have gone
        by in all (NvmlError TIMEOUT); the same accounting as the compiled _filtered_wait."""
        start = time.monotonic_ns() // 1_000_000
        left = timeout
        counts = self._counts
        while True:
            data = _call("nvmlEventSetWait_v2", pynvml.nvmlEventSetWait_v2, self._set, left)
            if data.eventType == EVENT_SINGLE_BIT_ECC:
                counts["sbe"] += 1
            elif data.eventType == EVENT_XID_CRITICAL and data.eventData in self._ignored:
                counts["ignored"] += 1
            else:
                counts["delivered"] += 1
                return data
            elapsed = time.monotonic_ns() // 1_000_000 - start
            left = timeout - elapsed if elapsed < timeout else 0

    def wait(self, timeout_ms: int) -> Event | None:
        """Wait up to min(timeout_ms, MAX_WAIT_MS) for the next event that passes the filter,
        with the GIL released during each NVML wait.

        None on NVML_ERROR_TIMEOUT; NvmlError on any other failure (GPU_IS_LOST, ...).
        The caller loops, checking its stop flag between waits.
        """
        c_timeout = check_timeout(timeout_ms)
        with self._guard:
            if self._closed:
                raise closed_set()
            if self._waiting:
                raise wait_in_progress("wait()")
            self._waiting = True
        try:  # still "waiting" while the handle is resolved: close() must not shut NVML yet
            try:
                data = self._filtered_wait(c_timeout)
            except NvmlError as exc:
                if exc.is_timeout:
                    return None
                raise
            return self._event(data)
        finally:
            self._waiting = False

    @staticmethod
    def _event(data: pynvml.c_nvmlEventData_t) -> Event:
        """The Event for `data`: index and UUID resolved from its device handle, else None."""
        index = uuid = None
        if data.device:  # a NULL handle is a false ctypes pointer
            index = _resolved(pynvml.nvmlDeviceGetIndex, data.device)
            uuid = _resolved(pynvml.nvmlDeviceGetUUID, data.device)
        return Event(index, uuid, data.eventType, data.eventData,
                     data.gpuInstanceId, data.computeInstanceId)

    def close(self) -> None:
        """Free the event set and call nvmlShutdown once; later calls do nothing.

        RuntimeError while another thread is inside wait() (stop it first: it returns within
        MAX_WAIT_MS). NvmlError if freeing or shutting down failed (after doing both).
        """
        with self._guard:
            if self._closed:
                return
            if self._waiting:
                raise wait_in_progress("close()")
            self._closed = True
        error = self._release()
        if error is not None:
            raise error

    def __enter__(self) -> EventSet:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<EventSet {self._library_path!r} {state}>"
