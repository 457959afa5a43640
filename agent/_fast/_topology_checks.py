"""Argument checks and constants of the set search, shared by topology.pyx and its twin.

Owns: the limits of `PairScores` (pair scores, GPU count, the search's node budget, the weight
that ranks GPUs of unknown NUMA node last) and the errors whose wording must be identical in
the compiled module and `_topology_py`. Must not import anything of `agent` but `errors` and
its sibling `_types`, nor do any NVML calls.
"""

from __future__ import annotations

import operator

from agent._fast._types import MAX_GPUS

# A pair score is an int in [0, MAX_PAIR_SCORE]; set scores and weights then fit in int64.
MAX_PAIR_SCORE = (1 << 24) - 1
# Added to a GPU's tie-break weight when its NUMA node is unknown: larger than any sum of
# link degrees (64 * 63 * MAX_PAIR_SCORE < 2**36), so such GPUs are ranked last.
UNKNOWN_NUMA_WEIGHT = 1 << 40
# Search nodes visited before the search stops and returns the best set found so far: a
# search over <= 16 candidates (< 2**16 nodes) is always exact. Real
# topologies (classes of interchangeable GPUs, tight bounds) stay far below it.
NODE_BUDGET = 1 << 17
BEST_EFFORT = "best-effort"
PACKED = "packed"
POLICIES = (BEST_EFFORT, PACKED)


def check_scores(scores, unknown) -> tuple[list[list[int]], list[bool]]:
    """`scores` (n x n, symmetric, ints in [0, MAX_PAIR_SCORE] off the diagonal, which is
    ignored) and `unknown` (n truthy/falsy flags, or None for all False) as plain lists."""
    n = len(scores)
    if n > MAX_GPUS:
        raise ValueError(f"pair scores of {n} GPUs: at most {MAX_GPUS} are supported "
                         f"(uint64_t masks)")
    matrix = []
    for i in range(n):
        row = scores[i]
        if len(row) != n:
            raise ValueError(f"scores must be square: row {i} has {len(row)} entries, "
                             f"expected {n}")
        out = []
        for j in range(n):
            if i == j:
                out.append(0)
                continue
            try:
                value = operator.index(row[j])
            except TypeError:
                raise TypeError(f"scores[{i}][{j}] must be an integer pair score, got "
                                f"{type(row[j]).__name__}") from None
            if not 0 <= value <= MAX_PAIR_SCORE:
                raise ValueError(f"scores[{i}][{j}] = {value} is not a pair score "
                                 f"(0..{MAX_PAIR_SCORE})")
            out.append(value)
        matrix.append(out)
    for i in range(n):
        for j in range(i + 1, n):
            if matrix[i][j] != matrix[j][i]:
                raise ValueError(f"scores must be symmetric: scores[{i}][{j}] = {matrix[i][j]} "
                                 f"but scores[{j}][{i}] = {matrix[j][i]}")
    if unknown is None:
        flags = [False] * n
    else:
        if len(unknown) != n:
            raise ValueError(f"unknown has {len(unknown)} entries, expected one per GPU ({n})")
        flags = [bool(u) for u in unknown]
    return matrix, flags


def check_request(n: int, available: object, must: object, k: object,
                  policy: object) -> tuple[int, int, int, bool]:
    """(available, must, k, packed) checked against n GPUs; ValueError / TypeError otherwise."""
    avail = operator.index(available)
    required = operator.index(must)
    size = operator.index(k)
    full = (1 << n) - 1
    if avail < 0 or avail & ~full:
        raise ValueError(f"available mask {avail:#x} names GPUs outside 0..{n - 1}")
    if required < 0 or required & ~avail:
        raise ValueError(f"must-include mask {required:#x} is not within the available mask "
                         f"{avail:#x}")
    have = bin(avail).count("1")
    if not bin(required).count("1") <= size <= have:
        raise ValueError(f"set size {size} must be between the {bin(required).count('1')} "
                         f"must-include and the {have} available GPUs")
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: expected one of {', '.join(POLICIES)}")
    return avail, required, size, policy == PACKED


def check_mask(n: int, mask: object) -> int:
    value = operator.index(mask)
    if value < 0 or value & ~((1 << n) - 1):
        raise ValueError(f"mask {value:#x} names GPUs outside 0..{n - 1}")
    return value
