"""NVML event loop primitive: an event set waited on with the GIL released (twin: _events_py.py).

Owns: opening the NVML library with dlopen (no link-time dependency on the driver), one
nvmlInit_v2 / nvmlShutdown pair and one NVML event set per `EventSet`, registering GPUs on it,
and bounded waits (<= MAX_WAIT_MS) that release the GIL around nvmlEventSetWait_v2 only. The
filter runs in C inside that same GIL-free stretch: XidCriticalError events whose XID is in
the ignored bitmap (`set_ignored_xids`, XIDs 0..1023) and every SingleBitEccError are counted
and dropped, and the wait goes on for what is left of its timeout; only the other events come
back to Python (`counters` says how many went each way). Every NVML return code becomes an
exception in `_check`, through agent.errors.nvml_error.
Must not: decide what an event means (the health code does), loop forever, import anything of
`agent` but `errors` and the sibling `_types`. Answers must equal the twin's.

Open the same path that agent.nvml.library loaded, so this module, pynvml and the rest of the
process share one copy of the library (dlopen answers an already loaded path with that copy).
"""

import logging
import os

from libc.stdint cimport uint64_t
from libc.string cimport memset
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec
from posix.dlfcn cimport RTLD_GLOBAL, RTLD_NOW, dlclose, dlerror, dlopen, dlsym

from agent._fast.nvml cimport *

from agent._fast._types import (
    COUNTERS,
    EVENT_SINGLE_BIT_ECC,
    EVENT_XID_CRITICAL,
    MAX_WAIT_MS,
    XID_FILTER_SIZE,
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
from agent.errors import nvml_error

__all__ = ["MAX_WAIT_MS", "Event", "EventSet"]

log = logging.getLogger(__name__)

# The bitmap's shape: 64-bit words covering XIDs 0..XID_FILTER_SIZE-1.
cdef enum:
    _XID_WORDS = 16
    _XID_BITS = _XID_WORDS * 64
assert _XID_BITS == XID_FILTER_SIZE
cdef unsigned long long _SBE = EVENT_SINGLE_BIT_ECC
cdef unsigned long long _XID = EVENT_XID_CRITICAL


cdef inline long long _now_ms() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <long long>ts.tv_sec * 1000 + ts.tv_nsec // 1000000


cdef int _check(nvmlReturn_t ret, str function) except -1:
    """The one place this module turns an NVML return code into an exception."""
    if ret != NVML_SUCCESS:
        raise nvml_error(ret, function)
    return 0


cdef struct Api:
    # The NVML functions we call, resolved with dlsym from the one dlopen handle.
    nvmlInit_v2_fn init
    nvmlShutdown_fn shutdown
    nvmlDeviceGetHandleByIndex_v2_fn get_handle_by_index
    nvmlDeviceGetIndex_fn get_index
    nvmlDeviceGetUUID_fn get_uuid
    nvmlDeviceGetSupportedEventTypes_fn get_supported_event_types
    nvmlDeviceRegisterEvents_fn register_events
    nvmlEventSetCreate_fn event_set_create
    nvmlEventSetWait_v2_fn event_set_wait
    nvmlEventSetFree_fn event_set_free


cdef void* _symbol(void* lib, str name, str path) except NULL:
    cdef bytes cname = name.encode("ascii")
    cdef void* address = dlsym(lib, cname)
    if address == NULL:
        raise missing_symbol(path, name)
    return address


cdef int _resolve(void* lib, Api* api, str path) except -1:
    api.init = <nvmlInit_v2_fn>_symbol(lib, "nvmlInit_v2", path)
    api.shutdown = <nvmlShutdown_fn>_symbol(lib, "nvmlShutdown", path)
    api.get_handle_by_index = <nvmlDeviceGetHandleByIndex_v2_fn>_symbol(
        lib, "nvmlDeviceGetHandleByIndex_v2", path)
    api.get_index = <nvmlDeviceGetIndex_fn>_symbol(lib, "nvmlDeviceGetIndex", path)
    api.get_uuid = <nvmlDeviceGetUUID_fn>_symbol(lib, "nvmlDeviceGetUUID", path)
    api.get_supported_event_types = <nvmlDeviceGetSupportedEventTypes_fn>_symbol(
        lib, "nvmlDeviceGetSupportedEventTypes", path)
    api.register_events = <nvmlDeviceRegisterEvents_fn>_symbol(
        lib, "nvmlDeviceRegisterEvents", path)
    api.event_set_create = <nvmlEventSetCreate_fn>_symbol(lib, "nvmlEventSetCreate", path)
    api.event_set_wait = <nvmlEventSetWait_v2_fn>_symbol(lib, "nvmlEventSetWait_v2", path)
    api.event_set_free = <nvmlEventSetFree_fn>_symbol(lib, "nvmlEventSetFree", path)
    return 0


cdef class EventSet:
    """One NVML event set on the library at `library_path`: dlopen(RTLD_NOW | RTLD_GLOBAL), every
    symbol resolved up front (NvmlLibraryError naming a missing one), nvmlInit_v2 (NVML counts
    inits), nvmlEventSetCreate. `close()` (or leaving a `with` block) frees the set and calls
    nvmlShutdown once. One thread may wait at a time; register() may run beside it.
    """

    cdef void* _lib
    cdef Api _api
    cdef nvmlEventSet_t _set
    cdef bint _initialised
    cdef bint _closed
    cdef bint _waiting
    cdef uint64_t _ignored[_XID_WORDS]
    cdef unsigned long long _n_ignored
    cdef unsigned long long _n_sbe
    cdef unsigned long long _n_delivered
    cdef readonly str library_path

    def __cinit__(self, *args, **kwargs):
        memset(self._ignored, 0, sizeof(self._ignored))
        self._n_ignored = self._n_sbe = self._n_delivered = 0
        self._lib = NULL
        self._set = NULL
        self._initialised = False
        self._closed = False
        self._waiting = False

    def __init__(self, library_path):
        cdef const char* reason
        cdef const char* failed
        cdef nvmlReturn_t ret
        if self._lib != NULL or self._closed:
            raise RuntimeError("EventSet.__init__ called twice")
        path = os.fspath(library_path)
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        self.library_path = path
        cdef bytes cpath = os.fsencode(path)
        self._lib = dlopen(cpath, RTLD_NOW | RTLD_GLOBAL)
        if self._lib == NULL:
            reason = dlerror()
            self._closed = True
            raise cannot_open(path, (<bytes>reason).decode("utf-8", "replace")
                              if reason != NULL else "dlopen failed")
        try:
            _resolve(self._lib, &self._api, path)
            _check(self._api.init(), "nvmlInit_v2")
            self._initialised = True
            _check(self._api.event_set_create(&self._set), "nvmlEventSetCreate")
        except BaseException:
            self._closed = True
            ret = self._release(&failed)
            if ret != NVML_SUCCESS:  # already raising the first error; this one is only logged
                log.warning("cleaning up a failed EventSet(%s): %s", path,
                            nvml_error(ret, (<bytes>failed).decode("ascii")))
            raise

    def __dealloc__(self):
        # Not closed by the owner: free what we hold. Nothing may raise here, so a failing
        # nvmlEventSetFree / nvmlShutdown has nowhere to go; close() is the way to see it.
        cdef const char* failed
        self._release(&failed)

    cdef nvmlReturn_t _release(self, const char** failed) noexcept:
        """Free the set, shut NVML down once, dlclose; the first failing code (and its function)."""
        cdef nvmlReturn_t ret, first = NVML_SUCCESS
        failed[0] = NULL
        if self._set != NULL:
            ret = self._api.event_set_free(self._set)
            self._set = NULL
            if ret != NVML_SUCCESS and first == NVML_SUCCESS:
                first, failed[0] = ret, "nvmlEventSetFree"
        if self._initialised:
            ret = self._api.shutdown()
            self._initialised = False
            if ret != NVML_SUCCESS and first == NVML_SUCCESS:
                first, failed[0] = ret, "nvmlShutdown"
        if self._lib != NULL:
            dlclose(self._lib)
            self._lib = NULL
        return first

    @property
    def closed(self):
        """True once close() ran (or the constructor failed)."""
        return self._closed

    @property
    def waiting(self):
        """True while a thread is inside wait() (close() must wait for it to come back)."""
        return self._waiting

    def register(self, index, event_types):
        """Register GPU `index` for `event_types` masked with what it supports
        (nvmlDeviceGetSupportedEventTypes); returns the mask registered. 0 means none of the
        requested types is supported there: nothing is registered, and it is no error.
        NvmlError from NVML (NOT_SUPPORTED where the GPU has no events at all, INVALID_ARGUMENT
        for an index beyond the GPUs, GPU_IS_LOST, ...).
        """
        cdef unsigned int c_index = check_gpu_index(index)
        cdef unsigned long long wanted = check_event_mask(event_types)
        cdef unsigned long long supported = 0
        cdef nvmlDevice_t device = NULL
        cdef nvmlReturn_t rc
        if self._closed:
            raise closed_set()
        # Without the GIL: on a GPU whose calls hang only this thread waits (the caller
        # abandons it after agent.nvml.guard's budget), never the whole process.
        with nogil:
            rc = self._api.get_handle_by_index(c_index, &device)
        _check(rc, "nvmlDeviceGetHandleByIndex_v2")
        with nogil:
            rc = self._api.get_supported_event_types(device, &supported)
        _check(rc, "nvmlDeviceGetSupportedEventTypes")
        wanted &= supported
        if wanted:
            with nogil:
                rc = self._api.register_events(device, wanted, self._set)
            _check(rc, "nvmlDeviceRegisterEvents")
        return wanted

    def set_ignored_xids(self, xids):
        """Drop XidCriticalError events with these XIDs (each in 0..1023) in C from now on,
        counting them in counters["ignored"]; replaces the previous set (empty: drop none)."""
        cdef uint64_t words[_XID_WORDS]
        cdef int i
        memset(words, 0, sizeof(words))
        for xid in check_ignored_xids(xids):
            words[xid >> 6] |= (<uint64_t>1) << (xid & 63)
        for i in range(_XID_WORDS):  # word by word: a waiter sees each word old or new
            self._ignored[i] = words[i]

    @property
    def ignored_xids(self):
        """The XIDs dropped in C, sorted."""
        return tuple(x for x in range(XID_FILTER_SIZE)
                     if self._ignored[x >> 6] & ((<uint64_t>1) << (x & 63)))

    @property
    def counters(self):
        """Events seen by wait() since the set was opened: {"ignored": XIDs dropped by the
        filter, "sbe": single-bit ECC events counted and dropped, "delivered": returned}."""
        return dict(zip(COUNTERS, (self._n_ignored, self._n_sbe, self._n_delivered)))

    cdef nvmlReturn_t _filtered_wait(self, nvmlEventData_t* data,
                                     unsigned int timeout) noexcept nogil:
        """nvmlEventSetWait_v2 until an event passes the filter, an error, or `timeout` ms
        have gone by in all (then TIMEOUT). Runs without the GIL."""
        cdef long long start = _now_ms()
        cdef long long elapsed
        cdef unsigned int left = timeout
        cdef nvmlReturn_t ret
        cdef unsigned long long xid
        while True:
            memset(data, 0, sizeof(nvmlEventData_t))
            ret = self._api.event_set_wait(self._set, data, left)
            if ret != NVML_SUCCESS:
                return ret
            xid = data.eventData
            if data.eventType == _SBE:
                self._n_sbe += 1
            elif (data.eventType == _XID and xid < _XID_BITS
                  and self._ignored[xid >> 6] & ((<uint64_t>1) << (xid & 63))):
                self._n_ignored += 1
            else:
                self._n_delivered += 1
                return NVML_SUCCESS
            elapsed = _now_ms() - start
            left = <unsigned int>(timeout - elapsed) if elapsed < timeout else 0

    def wait(self, timeout_ms):
        """Wait up to min(timeout_ms, MAX_WAIT_MS) for the next event that passes the filter,
        with the GIL released. None on NVML_ERROR_TIMEOUT; NvmlError on any other failure
        (GPU_IS_LOST, ...). The caller loops, checking its stop flag between waits.
        """
        cdef unsigned int c_timeout = check_timeout(timeout_ms)
        cdef nvmlEventData_t data
        cdef nvmlReturn_t ret
        # No Python calls from here to `_waiting = True`: the GIL is not given up in between,
        # so close() on another thread sees either a closed set here or a wait in progress.
        if self._closed:
            raise closed_set()
        if self._waiting:
            raise wait_in_progress("wait()")
        self._waiting = True
        try:  # still "waiting" while the handle is resolved: close() must not unload NVML yet
            with nogil:
                ret = self._filtered_wait(&data, c_timeout)
            if ret == NVML_ERROR_TIMEOUT:
                return None
            _check(ret, "nvmlEventSetWait_v2")
            return self._event(&data)
        finally:
            self._waiting = False

    cdef object _event(self, const nvmlEventData_t* data):
        """The Event for `data`: index and UUID resolved from its device handle, else None."""
        cdef unsigned int c_index = 0
        cdef char uuid_buf[NVML_DEVICE_UUID_V2_BUFFER_SIZE]
        index = None
        uuid = None
        if data.device != NULL:
            # A handle NVML cannot resolve leaves the field None (see Event): the event itself
            # is still delivered, so an XID on a GPU that is going away is never dropped here.
            if self._api.get_index(data.device, &c_index) == NVML_SUCCESS:
                index = c_index
            memset(uuid_buf, 0, sizeof(uuid_buf))
            if self._api.get_uuid(data.device, uuid_buf, sizeof(uuid_buf)) == NVML_SUCCESS:
                uuid_buf[sizeof(uuid_buf) - 1] = 0
                uuid = (<bytes>uuid_buf).decode("utf-8", "replace")
        return Event(index, uuid, data.eventType, data.eventData,
                     data.gpuInstanceId, data.computeInstanceId)

    def close(self):
        """Free the event set and call nvmlShutdown once; later calls do nothing.

        RuntimeError while another thread is inside wait() (stop it first: it returns within
        MAX_WAIT_MS). NvmlError if freeing or shutting down failed (after doing both).
        """
        cdef const char* failed
        cdef nvmlReturn_t ret
        if self._closed:
            return
        if self._waiting:
            raise wait_in_progress("close()")
        self._closed = True
        ret = self._release(&failed)
        if ret != NVML_SUCCESS:
            _check(ret, (<bytes>failed).decode("ascii"))

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()
        return False

    def __repr__(self):
        state = "closed" if self._closed else "open"
        return f"<EventSet {self.library_path!r} {state}>"
