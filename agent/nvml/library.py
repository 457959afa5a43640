"""Opening the NVML shared library so that pynvml and agent._fast share one loaded copy.

Owns: the path decision (explicit path, else libnvidia-ml.so.1 under the driver root) and the
preload. pynvml always does `CDLL("libnvidia-ml.so.1")`; the dynamic loader answers a bare
name with an object already loaded under that SONAME, so loading our chosen path first (with
RTLD_GLOBAL) makes pynvml, and the Cython event loop's dlopen of the same path, use that one
copy: the real driver's library on a host, the simulated one in tests.
"""

from __future__ import annotations

import ctypes
import os
import threading

import pynvml

from agent.errors import NvmlLibraryError, nvml_error

LIB_NAME = "libnvidia-ml.so.1"
# Where distributions put the driver's NVML library, relative to the driver root.
_SEARCH_DIRS = (
    "usr/lib64",
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib",
    "lib64",
    "lib",
)

_lock = threading.Lock()
_loaded: str | None = None


def resolve_library_path(driver_root: str = "/", explicit: str | None = None) -> str:
    """The NVML library path to open: `explicit` if given, else the first one under driver_root.

    With driver_root "/" and nothing found, the bare SONAME is returned so the dynamic loader
    searches its usual paths (ld.so.cache), as nvidia-container-toolkit does.
    """
    if explicit:
        return explicit
    root = os.path.normpath(driver_root or "/")  # os.path, not pathlib: the start path
    for sub in _SEARCH_DIRS:
        candidate = os.path.join(root, sub, LIB_NAME)
        if os.path.exists(candidate):
            return candidate
    if root == "/":
        return LIB_NAME
    raise NvmlLibraryError(
        f"{LIB_NAME} not found under driver root {root} "
        f"(looked in {', '.join(_SEARCH_DIRS)}); is the NVIDIA driver installed there?"
    )


def load(path: str) -> str:
    """Load the NVML library at `path` into this process (once) and return the path in use.

    A second call with another path fails: a process can hold only one libnvidia-ml.so.1.
    """
    global _loaded
    with _lock:
        if _loaded is not None:
            if os.path.realpath(_loaded) != os.path.realpath(path) and path != _loaded:
                raise NvmlLibraryError(
                    f"NVML library {_loaded} is already loaded; cannot also load {path}"
                )
            return _loaded
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise NvmlLibraryError(
                f"cannot open NVML library {path}: {exc}; is the NVIDIA driver installed and "
                f"is --nvml-library / --driver-root right?"
            ) from exc
        _loaded = path
        return path


def init(path: str) -> None:
    """Load `path` (see load) and initialise NVML through pynvml; NvmlError on failure."""
    load(path)
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise nvml_error(exc.value, "nvmlInit") from exc


def shutdown() -> None:
    """Release one pynvml initialisation (NVML counts them)."""
    try:
        pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:
        raise nvml_error(exc.value, "nvmlShutdown") from exc
