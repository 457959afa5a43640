"""Keeps modules that `gpu-agent run` never uses off its start path until something uses them.

grpc's import pulls in asyncio and grpc.aio: its C core reads `asyncio.AbstractEventLoop` when
it loads, and `grpc/__init__.py` imports `grpc.aio`, whose class bodies read `asyncio.Task` and
friends. The agent runs no event loop, yet that costs every start 20 to 35 ms on a 2-vCPU VM
(asyncio brings ssl, and ssl libcrypto) and about 7 MB of resident memory. Likewise protobuf's
descriptor_pool imports python_message (with text_format, the pure-Python decoder and pickle),
which only the pure-Python protobuf backend uses (the agent runs on upb), and pynvml imports
`ctypes.util.find_library` (with shutil, subprocess and tempfile), which it never calls. And
grpc's server module imports `typing_extensions.override`, a decorator for type checkers,
which brings typing_extensions and inspect (with ast, dis and tokenize): about 10 ms of the
start and 2.4 MB that nothing else in `run` needs (prometheus_client loads inspect at the
first scrape).

`defer_unused_modules()` puts a stand-in in `sys.modules` for each of them. A stand-in turns
into the real module, in place, on the first use of any name, so a caller gets what the real
import would give, only later. Three kinds of names are answered without that: cheap ones that
a small module defines (`asyncio.AbstractEventLoop`, from `asyncio.events`; on Python 3.12
and later `typing_extensions.override` is `typing.override`), forwarded functions
(`ctypes.util.find_library`: a function that loads the module and calls the real one, so
pynvml's imported name is that forwarder), and, before 3.12, `typing_extensions.override`
answered with a function that does what the real one does (PEP 698: set `__override__` on
its argument and return it), since grpc applies it while its classes are made. Nothing is
deferred when the module is already imported or cannot be found. bench/bench_plugin.py
measures the start.

Owns: those stand-ins. Must not: change what a deferred module's attributes are once loaded,
or import anything of the agent.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import threading
import types
import typing


def _override(arg):
    """typing_extensions.override before Python 3.12, line for line in what it does."""
    try:
        arg.__override__ = True
    except (AttributeError, TypeError):  # a read-only attribute, or a builtin
        pass
    return arg


# What a stand-in answers before it loads: name -> the module that defines it (cheap),
# functions answered with a forwarder (called at import, the function itself never), and
# names answered with an equal stand-in of their own.
_CHEAP = {"asyncio": {"AbstractEventLoop": "asyncio.events"}}
_FORWARDED = {"ctypes.util": ("find_library",)}
_EQUAL: dict[str, dict] = {}
if hasattr(typing, "override"):  # 3.12+: typing_extensions exports this very function
    _CHEAP["typing_extensions"] = {"override": "typing"}
else:
    _EQUAL["typing_extensions"] = {"override": _override}
_STATE = "__deferred__"  # the stand-in's bookkeeping, in its __dict__ until it is loaded


class _Deferred:
    __slots__ = ("cheap", "equal", "forwarded", "lock", "loading_thread")

    def __init__(self, name: str):
        self.cheap = _CHEAP.get(name, {})
        self.forwarded = _FORWARDED.get(name, ())
        self.equal = _EQUAL.get(name, {})
        self.lock = threading.RLock()
        self.loading_thread: int | None = None


class DeferredModule(types.ModuleType):
    """A module in sys.modules whose code has not run yet; see the module docstring."""

    def __getattr__(self, name: str):
        # Only called for names not in __dict__: before the load, or names the module lacks.
        state = self.__dict__.get(_STATE)
        if state is None:  # loaded, perhaps by another thread since this lookup missed
            return self._loaded(name)
        if name.startswith("__") and name != "__all__":
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        if name in state.forwarded:
            return _forwarder(self, name)
        if name in state.equal:
            return state.equal[name]
        with state.lock:
            if state.loading_thread == threading.get_ident():
                # The import system asking, while this thread runs the module's own imports,
                # whether a submodule is already an attribute: it is not, so it gets imported.
                raise AttributeError(name)
            if name in state.cheap:
                state.loading_thread = threading.get_ident()
                try:
                    return getattr(importlib.import_module(state.cheap[name]), name)
                finally:
                    state.loading_thread = None
            self._load(state)
        return self._loaded(name)

    def _loaded(self, name: str):
        """`name` of the loaded module (AttributeError if it has none)."""
        try:
            return self.__dict__[name]
        except KeyError:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}") from None

    def _load(self, state: _Deferred) -> None:
        """Run the module's code in this very object (with state.lock held)."""
        if self.__dict__.get(_STATE) is None:
            return  # another thread loaded it while this one waited for the lock
        state.loading_thread = threading.get_ident()
        try:
            self.__spec__.loader.exec_module(self)
            del self.__dict__[_STATE]
        finally:
            state.loading_thread = None


def _forwarder(module: DeferredModule, name: str):
    """A function that loads `module` and calls its `name` with the same arguments."""
    def forward(*args, **kwargs):
        state = module.__dict__.get(_STATE)
        if state is not None:
            with state.lock:
                module._load(state)
        return module.__dict__[name](*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    forward.__module__ = module.__name__
    return forward


def _defer(name: str, path: list[str] | None) -> None:
    if name in sys.modules:
        return
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None or spec.origin is None:
        return
    module = DeferredModule(name)
    module.__spec__ = spec
    module.__loader__ = spec.loader
    module.__file__ = spec.origin
    if spec.submodule_search_locations is not None:
        module.__path__ = list(spec.submodule_search_locations)
    module.__package__ = spec.parent
    module.__dict__[_STATE] = _Deferred(name)
    sys.modules[name] = module
    parent_name, _, child = name.rpartition(".")
    parent = sys.modules.get(parent_name) if parent_name else None
    if parent is not None:  # as the import system does when it loads a submodule
        setattr(parent, child, module)


def _package_path(name: str) -> list[str] | None:
    """Where the submodules of top-level package `name` are, without running its code."""
    spec = importlib.machinery.PathFinder.find_spec(name)
    return None if spec is None or not spec.submodule_search_locations \
        else list(spec.submodule_search_locations)


def defer_unused_modules() -> None:
    """Install the stand-ins (before grpc, protobuf and pynvml are first imported). Packages
    whose code runs anyway are imported here so their submodule's stand-in is their
    attribute too; grpc, whose import is the point, binds `grpc.aio` itself."""
    _defer("asyncio", None)
    _defer("typing_extensions", None)  # for grpc._server's `override`
    _defer("inspect", None)  # typing_extensions' (and dataclasses' for classes with no doc)
    if "grpc" not in sys.modules:
        path = _package_path("grpc")
        if path:
            _defer("grpc.aio", path)
    import ctypes  # pynvml's first import

    _defer("ctypes.util", list(ctypes.__path__))
    try:
        import google.protobuf.internal as internal  # two tiny package files
    except ImportError:
        return
    _defer("google.protobuf.internal.python_message", list(internal.__path__))


def is_loaded(name: str) -> bool:
    """Whether `name` has run its code in this process (False while a stand-in waits)."""
    module = sys.modules.get(name)
    return module is not None and _STATE not in vars(module)
