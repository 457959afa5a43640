"""The module boundaries of ../shared/STYLE.md, checked on the source: imports run one way
(`__main__ → daemon → kubelet → rm → nvml → _fast`), kubelet never touches NVML, only the gRPC
layers import grpc, and every module says in its docstring what it owns. The Cython sources of
agent/_fast (.pyx, .pxd) are held to the same rules as its Python modules: their import and
cimport lines may name, of agent, only agent._fast itself, errors and constants.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

AGENT = Path(__file__).resolve().parent.parent / "agent"

# Rank of each top-level part of the package: a module may import parts of its own rank or
# of a higher rank number (further down the chain), never a lower one.
RANK = {
    "__main__": 0, "demo": 0,
    "daemon": 1, "status": 1, "doctor": 1, "services": 1, "metrics": 1, "dramode": 1,
    "kubelet": 2, "kubeapi": 2, "dra": 2,
    "rm": 3, "health": 3, "state": 3, "mps": 3,
    "nvml": 4,
    "_fast": 5,
    "config": 6, "_proto": 6, "host": 6, "systemd": 6, "errors": 7, "constants": 7, "fileio": 7, "dirwatch": 7, "signals": 7,
    "devchar": 7, "logs": 7, "deferred": 7, "latency": 7, "gcpause": 7,
    "threadnames": 7, "arenas": 7,
}
# Extra rules, part -> parts of agent it must never import.
FORBIDDEN = {
    "kubelet": {"nvml", "_fast"},
    # told what the devices are, never asks NVML itself (as kubelet/)
    "dra": {"nvml", "_fast"},
    # the API server's client and the fault reports: told what to say, never asks NVML or rm
    # (dirwatch: the kubeconfig not there yet is waited for with inotify)
    "kubeapi": set(RANK) - {"kubeapi", "errors", "constants", "dirwatch"},
    "_fast": set(RANK) - {"_fast", "errors", "constants"},
    "errors": set(RANK) - {"errors"},
    "constants": set(RANK) - {"constants"},
    "fileio": set(RANK) - {"fileio", "errors", "constants"},
    "dirwatch": set(RANK) - {"dirwatch"},
    "devchar": set(RANK) - {"devchar", "errors", "constants", "dirwatch"},
    "signals": set(RANK) - {"signals"},
    "logs": set(RANK) - {"logs"},
    "deferred": set(RANK) - {"deferred"},
    "latency": set(RANK) - {"latency"},
    "gcpause": set(RANK) - {"gcpause"},
    "threadnames": set(RANK) - {"threadnames"},
    "arenas": set(RANK) - {"arenas"},
    "_proto": set(RANK) - {"_proto"},
    "config": set(RANK) - {"config", "errors", "constants"},
    "host": set(RANK) - {"host", "errors"},
    # the daemon's sd_notify client: a protocol that knows nothing of the agent
    "systemd": set(RANK) - {"systemd", "errors", "constants"},
}
# Only these parts may import grpc.
GRPC_PARTS = {"kubelet", "dra", "daemon", "sim", "_proto", "demo", "__main__"}


def _part(module_path: Path) -> str:
    rel = module_path.relative_to(AGENT)
    head = rel.parts[0]
    return head[:-3] if head.endswith(".py") else head


def _agent_imports(tree: ast.AST) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, node.lineno))
            found += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
    return found


def _python_modules():
    return sorted(p for p in AGENT.rglob("*.py") if "_proto" not in p.relative_to(AGENT).parts)


MODULES = _python_modules()


# `from M import|cimport names` (names possibly in parentheses over several lines) and
# `import|cimport M [as x], N`, each at the start of a line.
_CYTHON_FROM = re.compile(r"^[ \t]*from[ \t]+([\w.]+)[ \t]+c?import[ \t]+(\([^)]*\)|[^\n#]*)",
                          re.MULTILINE)
_CYTHON_IMPORT = re.compile(r"^[ \t]*c?import[ \t]+([\w.]+(?:[ \t]+as[ \t]+\w+)?"
                            r"(?:[ \t]*,[ \t]*[\w.]+(?:[ \t]+as[ \t]+\w+)?)*)[ \t]*(?:#.*)?$",
                            re.MULTILINE)
CYTHON_SOURCES = sorted([*(AGENT / "_fast").glob("*.pyx"), *(AGENT / "_fast").glob("*.pxd")])


def _cython_imports(text: str) -> list[tuple[str, int]]:
    """(module, line) of each import / cimport of a .pyx or .pxd, as `_agent_imports` gives
    them: `from M import|cimport a, b` as M, M.a and M.b; `import|cimport M, N` as M, N."""
    found = []
    for m in _CYTHON_FROM.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        names = re.sub(r"#[^\n]*", "", m.group(2)).strip("() \t\n\\").split(",")
        found.append((m.start(), m.group(1), line))
        found += [(m.start(), f"{m.group(1)}.{n.split()[0]}", line) for n in names
                  if n.strip() and re.fullmatch(r"\w+", n.split()[0])]
    for m in _CYTHON_IMPORT.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        found += [(m.start(), n.split()[0], line) for n in m.group(1).split(",")]
    return [(name, line) for _, name, line in sorted(found, key=lambda f: f[0])]


def _layering_problems(part: str, imports: list[tuple[str, int]]) -> list[str]:
    problems = []
    for name, line in imports:
        bits = name.split(".")
        if bits[0] == "grpc" and part not in GRPC_PARTS:
            problems.append(f"line {line}: {part} imports grpc")
        if bits[0] != "agent" or len(bits) < 2:
            continue
        target = bits[1]
        if target not in RANK and target != "sim":
            continue  # a name imported from the package itself (e.g. __version__)
        if target == "sim" and part not in {"sim", "__main__", "demo"}:
            problems.append(f"line {line}: {part} imports the simulator ({name})")
        if part == "sim" or target == "sim":
            continue
        if target in FORBIDDEN.get(part, set()):
            problems.append(f"line {line}: {part} must not import {name}")
        elif part in RANK and RANK[target] < RANK[part]:
            problems.append(f"line {line}: {part} imports {name}, which is above it")
    return problems


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(AGENT)))
def test_imports_follow_the_layering(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    problems = _layering_problems(_part(path), _agent_imports(tree))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", CYTHON_SOURCES, ids=lambda p: str(p.relative_to(AGENT)))
def test_cython_sources_follow_the_layering(path: Path):
    imports = _cython_imports(path.read_text())
    if path.suffix == ".pyx":
        assert imports, f"no import or cimport line read in {path}"
    problems = _layering_problems("_fast", imports)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("text", "found"), [
    pytest.param("from agent.errors import NvmlError", ["agent.errors", "agent.errors.NvmlError"],
                 id="from-import"),
    pytest.param("from agent import daemon, rm as r", ["agent", "agent.daemon", "agent.rm"],
                 id="from-package"),
    pytest.param("from agent._fast.nvml cimport *", ["agent._fast.nvml"], id="cimport-star"),
    pytest.param("    cimport agent.rm.topology as t, grpc", ["agent.rm.topology", "grpc"],
                 id="cimport-list"),
    pytest.param("from agent import (\n    errors,  # the errors\n    rm,\n)",
                 ["agent", "agent.errors", "agent.rm"], id="parenthesized"),
    pytest.param("# import agent.daemon\nx = 1  # from agent import rm", [], id="comments"),
])
def test_cython_import_lines_are_read(text, found):
    assert [name for name, _ in _cython_imports(text)] == found


def test_a_forbidden_cimport_in_fast_is_caught():
    problems = _layering_problems("_fast", _cython_imports("from agent.rm.topology cimport x\n"
                                                           "import grpc\n"))
    assert "line 1: _fast must not import agent.rm.topology" in problems
    assert "line 2: _fast imports grpc" in problems


def test_every_part_of_agent_has_a_rank():
    parts = {_part(p) for p in MODULES} - {"__init__", "sim"}
    assert parts <= set(RANK), f"give {sorted(parts - set(RANK))} a RANK in this file"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(AGENT)))
def test_every_module_opens_with_a_docstring(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    doc = ast.get_docstring(tree)
    assert doc and len(doc.split()) >= 5, f"{path} needs a docstring saying what it owns"
