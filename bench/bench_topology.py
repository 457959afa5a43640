"""Topology grouping (agent._fast topology: `build_tree`), compiled vs pure-Python twin.

Owns: the synthetic but realistically shaped PCIe trees the benchmark runs on (pairs behind
one switch, quads behind a switch tree, host bridges, NUMA nodes, sockets) at 8, 16 and 64 GPUs.
"""

from __future__ import annotations

from agent._fast import _topology_py, topology
from bench import Section, summarize, time_calls

IMPLS = {"cython": topology, "python": _topology_py}


def tree_levels(n: int) -> list[list[int]]:
    """Levels of an n-GPU PCIe tree: PIX within 2, PXB within 4, PHB within 8, NODE within
    n/2, SYS across the halves."""
    levels = [[0] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            if i // 2 == j // 2:
                levels[i][j] = 10
            elif i // 4 == j // 4:
                levels[i][j] = 20
            elif i // 8 == j // 8:
                levels[i][j] = 30
            elif i // max(n // 2, 1) == j // max(n // 2, 1):
                levels[i][j] = 40
            else:
                levels[i][j] = 50
    return levels


def run() -> Section:
    section = Section(
        title="Topology tree: build_tree (group GPUs by common-ancestor level)",
        method=("`build_tree(levels)` on synthetic PCIe trees (PIX pairs, PXB quads, PHB "
                "eights, NODE halves, SYS across); 2,000 timed calls each after warm-up."),
        header=["GPUs", "cython median µs", "cython p99 µs", "python median µs",
                "python p99 µs", "python/cython (median)"],
    )
    for n in (8, 16, 64):
        levels = tree_levels(n)
        results = {}
        for name, impl in IMPLS.items():
            assert impl.build_tree(levels) == IMPLS["python"].build_tree(levels)
            results[name] = summarize(time_calls(lambda impl=impl, levels=levels: impl.build_tree(levels), 2000))
        (cm, cp), (pm, pp) = results["cython"], results["python"]
        section.rows.append([str(n), f"{cm:.1f}", f"{cp:.1f}", f"{pm:.1f}", f"{pp:.1f}",
                             f"{pm / cm:.1f}×"])
    return section
