"""Picks the live implementation of the hot paths: compiled Cython, or the pure-Python twins.

Owns: the choice, made once at import. `events_impl` and `topology_impl` are the live modules,
`IMPLEMENTATION` says which kind ("cython" or "python"). GPU_AGENT_PURE_PYTHON=1 forces the
twins. Must not import anything of `agent` but `errors` and `constants` (the twins and the
.pyx files alike; tests/test_boundaries.py checks both). Tests hand either implementation's
modules to the code that takes them (HealthMonitor's `events_module`, TopologyModel's
`topology_module`) and run under both.
"""

import logging
import os

log = logging.getLogger(__name__)

if os.environ.get("GPU_AGENT_PURE_PYTHON", "") == "1":
    from agent._fast import _events_py as events_impl
    from agent._fast import _topology_py as topology_impl
    IMPLEMENTATION = "python"
else:
    try:
        from agent._fast import events as events_impl
        from agent._fast import topology as topology_impl
        IMPLEMENTATION = "cython"
    except ImportError as exc:  # an unbuilt tree still runs, slower, and says so
        log.warning("compiled agent._fast not importable (%s); using the pure-Python twins", exc)
        from agent._fast import _events_py as events_impl
        from agent._fast import _topology_py as topology_impl
        IMPLEMENTATION = "python"

log.debug("hot paths: %s (%s, %s)", IMPLEMENTATION, events_impl.__name__, topology_impl.__name__)

__all__ = ["IMPLEMENTATION", "events_impl", "topology_impl"]
