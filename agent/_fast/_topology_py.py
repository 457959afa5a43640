"""Pure-Python twin of agent._fast.topology: GPU groups by common-ancestor level, as bitmasks.

Owns: the same API and the same answers as topology.pyx, for hosts without the compiled
extension (and as the reference the tests compare the compiled module against). Groups are
ints used as bitmasks, bit i = GPU index i, at most MAX_GPUS GPUs. Must not import anything of
`agent` but `errors` and its sibling `_types`; no NVML calls (the caller passes the levels).
"""

from __future__ import annotations

from collections.abc import Sequence

from agent._fast._types import (
    MAX_GPUS,
    check_level,
    check_threshold,
    not_square,
    not_symmetric,
    too_many_gpus,
)

__all__ = ["build_tree", "groups_at_level"]


def _convert(levels: Sequence[Sequence[int]]) -> list[list[int]]:
    """The one conversion in: validate `levels` (square, symmetric, <= MAX_GPUS) into lists."""
    n = len(levels)
    if n > MAX_GPUS:
        raise too_many_gpus(n)
    matrix = []
    for i in range(n):
        row = levels[i]
        if len(row) != n:
            raise not_square(i, len(row), n)
        matrix.append([check_level(row[j], i, j) for j in range(n)])
    for i in range(n):
        for j in range(i + 1, n):
            if matrix[i][j] != matrix[j][i]:
                raise not_symmetric(i, j, matrix[i][j], matrix[j][i])
    return matrix


def _groups(matrix: list[list[int]], threshold: int) -> list[int]:
    """Connected components of "level <= threshold", lowest-bit order (mirrors the C loop)."""
    n = len(matrix)
    adjacency = []
    for i in range(n):
        mask = 0
        for j in range(n):
            if matrix[i][j] <= threshold:
                mask |= 1 << j
        adjacency.append(mask)
    groups = []
    remaining = (1 << n) - 1
    while remaining:
        seed = remaining & -remaining
        group = frontier = seed
        while frontier:
            low = frontier & -frontier
            frontier ^= low
            new = adjacency[low.bit_length() - 1] & ~group
            group |= new
            frontier |= new
        groups.append(group)
        remaining &= ~group
    return groups


def groups_at_level(levels: Sequence[Sequence[int]], threshold: int) -> list[int]:
    """GPUs joined when levels[i][j] <= threshold, transitively; masks sorted by lowest bit.

    `levels` is an n x n matrix of NVML topology levels (n <= 64), square and symmetric; the
    diagonal is not used for joining (a GPU is always in its own group). ValueError for a
    malformed matrix, TypeError for a non-integer entry.
    """
    matrix = _convert(levels)
    return _groups(matrix, check_threshold(threshold))


def build_tree(levels: Sequence[Sequence[int]]) -> list[tuple[int, list[int]]]:
    """[(level, groups_at_level(levels, level)) for each distinct level in `levels`, ascending].

    Each level's groups are unions of the previous level's: the tree of GPUs by closest common
    ancestor (gpu-manager style), leaves first. Empty for an empty matrix.
    """
    matrix = _convert(levels)
    distinct = sorted({value for row in matrix for value in row})
    return [(level, _groups(matrix, level)) for level in distinct]
