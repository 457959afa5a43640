"""Picks the live implementation of the hot paths: compiled Cython, or the pure-Python twins.

Owns: the choice, made once at import. `events_impl`, `topology_impl` and `entries_impl` (the
allocation journal's entries: replayed at load, packed per Allocate) are the live modules,
`IMPLEMENTATION` says which kind ("cython" or "python"). GPU_AGENT_PURE_PYTHON=1 forces the
twins. Must not import anything of `agent` but `errors` and `constants` (the twins and the
.pyx files alike; tests/test_boundaries.py checks both). Tests hand either implementation's
modules to the code that takes them (HealthMonitor's `events_module`, TopologyModel's
`topology_module`, agent.state.frames.scan's `entries_module`) and run under both.
"""

import importlib
import importlib.util
import logging
import os

log = logging.getLogger(__name__)

# entries_impl's module per implementation, imported on first use (module __getattr__ below)
_ENTRIES = {"cython": "agent._fast.entries", "python": "agent._fast._entries_py"}

if os.environ.get("GPU_AGENT_PURE_PYTHON", "") == "1":
    from agent._fast import _events_py as events_impl
    from agent._fast import _topology_py as topology_impl
    IMPLEMENTATION = "python"
else:
    try:
        from agent._fast import events as events_impl
        from agent._fast import topology as topology_impl
        if importlib.util.find_spec(_ENTRIES["cython"]) is None:
            raise ImportError(f"no module named {_ENTRIES['cython']}")
        IMPLEMENTATION = "cython"
    except ImportError as exc:  # an unbuilt tree still runs, slower, and says so
        log.warning("compiled agent._fast not importable (%s); using the pure-Python twins", exc)
        from agent._fast import _events_py as events_impl
        from agent._fast import _topology_py as topology_impl
        IMPLEMENTATION = "python"

log.debug("hot paths: %s (%s, %s, %s)", IMPLEMENTATION, events_impl.__name__,
          topology_impl.__name__, _ENTRIES[IMPLEMENTATION])


def __getattr__(name: str):
    """`entries_impl` is imported when first asked for: it brings msgpack, and the journal it
    serves loads after the first registration, so the start path does not pay for either."""
    if name == "entries_impl":
        module = importlib.import_module(_ENTRIES[IMPLEMENTATION])
        globals()["entries_impl"] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["IMPLEMENTATION", "events_impl", "entries_impl", "topology_impl"]
