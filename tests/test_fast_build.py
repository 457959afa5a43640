"""The compiled hot paths exist and are live: agent._fast.events and .topology import as extension
modules built from the current sources (so this suite fails on an unbuilt tree rather than
quietly testing the twins twice), the selector picks them by default and the twins under
GPU_AGENT_PURE_PYTHON=1, both implementations offer the same API, and `gpu-agent status` says
which one is live.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_gpu_agent

FAST = ROOT / "agent" / "_fast"
PAIRS = [
    pytest.param("events", "_events_py", id="events"),
    pytest.param("topology", "_topology_py", id="topology"),
]
# events.pyx cimports nvml.pxd; topology has its .pxd
SOURCES = {"events": 2, "topology": 2}


@pytest.mark.parametrize(("compiled", "twin"), PAIRS)
def test_compiled_module_imports_as_an_extension(compiled, twin):
    module = importlib.import_module(f"agent._fast.{compiled}")
    assert isinstance(module.__loader__, importlib.machinery.ExtensionFileLoader), module.__file__
    assert module.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
    assert Path(module.__file__).parent == FAST


def _sources(compiled: str) -> list[Path]:
    """The .pyx, its own .pxd and the agent._fast .pxd files it cimports."""
    pyx = FAST / f"{compiled}.pyx"
    names = {compiled, *re.findall(r"^\s*from\s+agent\._fast\.(\w+)\s+cimport\b",
                                   pyx.read_text(), re.MULTILINE)}
    return [pyx, *(p for p in (FAST / f"{name}.pxd" for name in sorted(names)) if p.exists())]


@pytest.mark.parametrize(("compiled", "twin"), PAIRS)
def test_compiled_module_is_built_from_current_sources(compiled, twin):
    built = Path(importlib.import_module(f"agent._fast.{compiled}").__file__).stat().st_mtime
    sources = _sources(compiled)
    assert len(sources) == SOURCES[compiled], sources
    stale = [s.name for s in sources if s.stat().st_mtime > built]
    assert not stale, f"agent._fast.{compiled} is older than {stale}: run setup.py build_ext --inplace"


@pytest.mark.parametrize(("compiled", "twin"), PAIRS)
def test_twin_offers_the_same_api(compiled, twin):
    c = importlib.import_module(f"agent._fast.{compiled}")
    p = importlib.import_module(f"agent._fast.{twin}")
    assert sorted(c.__all__) == sorted(p.__all__)
    for name in c.__all__:
        c_obj, p_obj = getattr(c, name), getattr(p, name)
        if isinstance(c_obj, type) and c_obj is not p_obj:
            public = {a for a in dir(c_obj) if not a.startswith("_")}
            assert public == {a for a in dir(p_obj) if not a.startswith("_")}, name


def test_both_event_loops_return_one_event_type():
    from agent._fast import _events_py, _types, events

    assert events.Event is _events_py.Event is _types.Event


def _selector(pure: str | None) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GPU_AGENT_PURE_PYTHON"}
    if pure is not None:
        env["GPU_AGENT_PURE_PYTHON"] = pure
    code = ("from agent import _fast; "
            "print(_fast.IMPLEMENTATION, _fast.events_impl.__name__, _fast.topology_impl.__name__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    return proc.stdout.strip(), proc.stderr


@pytest.mark.parametrize(("pure", "expected"), [
    pytest.param(None, "cython agent._fast.events agent._fast.topology", id="default"),
    pytest.param("0", "cython agent._fast.events agent._fast.topology", id="pure-0"),
    pytest.param("1", "python agent._fast._events_py agent._fast._topology_py", id="pure-1"),
])
def test_selector_picks_the_implementation(pure, expected):
    out, err = _selector(pure)
    assert out == expected
    assert "not importable" not in err


@pytest.mark.parametrize(("pure", "expected"), [
    pytest.param(None, "hot paths: cython (events: agent._fast.events, "
                       "topology: agent._fast.topology)", id="cython"),
    pytest.param("1", "hot paths: python (events: agent._fast._events_py, "
                      "topology: agent._fast._topology_py)", id="python"),
])
def test_status_names_the_live_implementation(pure, expected):
    env = {k: v for k, v in os.environ.items() if k != "GPU_AGENT_PURE_PYTHON"}
    if pure is not None:
        env["GPU_AGENT_PURE_PYTHON"] = pure
    assert expected in run_gpu_agent("status", env=env, check=False).stdout.splitlines()


def test_the_start_path_imports_neither_the_journal_nor_msgpack():
    """The journal loads after the first registration: what `gpu-agent run` imports to start
    (the selector of the event loop's implementation included) brings neither the journal's
    codec nor msgpack."""
    code = ("import sys; import agent._fast, agent.__main__, agent.daemon; "
            "print([m for m in ('agent.state.journal', 'agent.state.frames', 'msgpack') "
            "if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=True)
    assert proc.stdout.split() == ["[]"]
