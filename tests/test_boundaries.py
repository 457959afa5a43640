"""The module boundaries of ../shared/STYLE.md, checked on the source: imports run one way
(`__main__ → daemon → kubelet → rm → nvml → _fast`), kubelet never touches NVML, only the gRPC
layers import grpc, and every module says in its docstring what it owns.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

AGENT = Path(__file__).resolve().parent.parent / "agent"

# Rank of each top-level part of the package: a module may import parts of its own rank or
# of a higher rank number (further down the chain), never a lower one.
RANK = {
    "__main__": 0, "demo": 0,
    "daemon": 1,
    "kubelet": 2,
    "rm": 3, "health": 3, "state": 3,
    "nvml": 4,
    "_fast": 5,
    "config": 6, "_proto": 6, "host": 6, "errors": 7,
}
# Extra rules, part -> parts of agent it must never import.
FORBIDDEN = {
    "kubelet": {"nvml", "_fast"},
    "_fast": set(RANK) - {"_fast", "errors"},
    "errors": set(RANK) - {"errors"},
    "_proto": set(RANK) - {"_proto"},
    "config": set(RANK) - {"config", "errors"},
    "host": set(RANK) - {"host", "errors"},
}
# Only these parts may import grpc.
GRPC_PARTS = {"kubelet", "daemon", "sim", "_proto", "demo", "__main__"}


def _part(module_path: Path) -> str:
    rel = module_path.relative_to(AGENT)
    head = rel.parts[0]
    head = head[:-3] if head.endswith(".py") else head
    return "config" if head.startswith("_config_") else head


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


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(AGENT)))
def test_imports_follow_the_layering(path: Path):
    part = _part(path)
    tree = ast.parse(path.read_text(), str(path))
    problems = []
    for name, line in _agent_imports(tree):
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
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(AGENT)))
def test_every_module_opens_with_a_docstring(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    doc = ast.get_docstring(tree)
    assert doc and len(doc.split()) >= 5, f"{path} needs a docstring saying what it owns"
