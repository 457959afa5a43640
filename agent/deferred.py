"""Keeps asyncio and grpc.aio off `gpu-agent run`'s start path until something uses them.

grpc's import pulls both in: its C core reads `asyncio.AbstractEventLoop` when it loads, and
`grpc/__init__.py` imports `grpc.aio`, whose class bodies read `asyncio.Task` and friends. The
agent runs no event loop, yet that costs every start 20 to 35 ms on a 2-vCPU VM (asyncio brings
ssl, and ssl libcrypto) and about 7 MB of resident memory (bench/bench_plugin.py).

`defer_event_loop_modules()` puts a stand-in in `sys.modules` for each of the two packages. A
stand-in answers the names listed as cheap (`asyncio.AbstractEventLoop`, from the small
`asyncio.events`) and turns into the real package, in place, on the first use of any other
name, so a caller always gets what the real import would give, only later. Nothing is deferred
when the package is already imported or cannot be found.

Owns: those stand-ins. Must not: change what any attribute of a deferred package is, or import
anything of the agent.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import threading
import types

# What each deferred package may answer without loading: name -> the submodule that defines it.
_CHEAP = {"asyncio": {"AbstractEventLoop": "asyncio.events"}, "grpc.aio": {}}
_STATE = "__deferred__"  # the stand-in's bookkeeping, in its __dict__ until it is loaded


class _Deferred:
    __slots__ = ("cheap", "lock", "loading_thread")

    def __init__(self, cheap: dict[str, str]):
        self.cheap = cheap
        self.lock = threading.RLock()
        self.loading_thread: int | None = None


class DeferredPackage(types.ModuleType):
    """A package in sys.modules whose code has not run yet; see the module docstring."""

    def __getattr__(self, name: str):
        # Only called for names not in __dict__: before the load, or names the package lacks.
        state = self.__dict__.get(_STATE)
        if state is None or (name.startswith("__") and name != "__all__"):
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        with state.lock:
            if state.loading_thread == threading.get_ident():
                # The import system asking, while this thread runs the package's own imports,
                # whether a submodule is already an attribute: it is not, so it gets imported.
                raise AttributeError(name)
            if self.__dict__.get(_STATE) is not None:
                state.loading_thread = threading.get_ident()
                try:
                    if name in state.cheap:
                        return getattr(importlib.import_module(state.cheap[name]), name)
                    self.__spec__.loader.exec_module(self)
                    del self.__dict__[_STATE]
                finally:
                    state.loading_thread = None
        try:
            return self.__dict__[name]
        except KeyError:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}") from None


def _defer(name: str, path: list[str] | None) -> None:
    if name in sys.modules:
        return
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return
    module = DeferredPackage(name)
    module.__spec__ = spec
    module.__loader__ = spec.loader
    module.__file__ = spec.origin
    module.__path__ = list(spec.submodule_search_locations)
    module.__package__ = name
    module.__dict__[_STATE] = _Deferred(_CHEAP[name])
    sys.modules[name] = module


def defer_event_loop_modules() -> None:
    """Install the stand-ins for asyncio and grpc.aio (before grpc is first imported)."""
    _defer("asyncio", None)
    if "grpc" not in sys.modules:
        grpc = importlib.machinery.PathFinder.find_spec("grpc")
        if grpc is not None and grpc.submodule_search_locations:
            _defer("grpc.aio", list(grpc.submodule_search_locations))


def is_loaded(name: str) -> bool:
    """Whether `name` has run its code in this process (False while a stand-in waits)."""
    module = sys.modules.get(name)
    return module is not None and _STATE not in vars(module)

