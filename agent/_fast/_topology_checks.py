"""Argument checks and constants of the set search, shared by topology.pyx and its twin.

Owns: the limits of `PairScores` (pair scores, GPU count, the search's node budget, the weight
that ranks GPUs of unknown NUMA node last) and the errors whose wording must be identical in
the compiled module and `_topology_py`; and `tree_split` / `score_tree`, which recognise
tree-shaped score matrices (up to a few odd GPUs) once, at construction, for the exact tree DP
of both implementations (one builder, so the two work on the same tree). Must not import
anything of `agent` but `errors`, `constants` and its sibling `_types`, nor do any NVML calls.
"""

from __future__ import annotations

import operator

from agent._fast._types import MAX_GPUS
from agent.constants import ALLOCATION_POLICIES, PACKED

# A pair score is an int in [0, MAX_PAIR_SCORE]; set scores and weights then fit in int64.
MAX_PAIR_SCORE = (1 << 24) - 1
# Added to a GPU's tie-break weight when its NUMA node is unknown: larger than any sum of
# link degrees (64 * 63 * MAX_PAIR_SCORE < 2**36), so such GPUs are ranked last.
UNKNOWN_NUMA_WEIGHT = 1 << 40
# Search nodes visited before the search stops and returns the best set found so far: a
# search over <= 16 candidates (< 2**16 nodes) is always exact. Real
# topologies (classes of interchangeable GPUs, tight bounds) stay far below it.
NODE_BUDGET = 1 << 17


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


# At most this many GPUs are set aside to make the rest of a score matrix tree-shaped: the tree
# DP then runs once per subset of them (2 ** MAX_ODD runs at most, each some 10-40 µs at 64
# GPUs). Up to 16 GPUs, where branch and bound is always exact and takes microseconds, fewer.
MAX_ODD = 6
MAX_ODD_UP_TO_16 = 3

def score_tree(matrix: list[list[int]], group: int | None = None
               ) -> tuple[int, list[int], list[int], list[list[int]]] | None:
    """The group tree of the GPUs in `group` (default: all) when their scores are tree-shaped
    (ultrametric), else None.

    Tree-shaped: every pair's score is that of the smallest group holding both, a group's
    children scoring strictly more inside than across (equivalently, of any three GPUs' pair
    scores the lowest occurs at least twice). The PCIe tree is, so is an NVLink/NVSwitch island
    layout that follows it; a hybrid cube mesh (DGX-1) is not, nor is a tree where one GPU's
    NUMA node or one pair's link is unknown. Returns (root, masks, cross, kids): node i < n is
    GPU i (mask 1 << i, no kids); nodes n.. are groups (root first, then breadth-first),
    `cross[g]` the score of every pair across two of g's children, `kids[g]` its children,
    lowest GPU first. Built top-down: a group's children are its classes of "scores more than
    the group's lowest pair score". A group of one GPU is that GPU's node.
    """
    n = len(matrix)
    full = (1 << n) - 1 if group is None else group
    if full == 0:
        return None
    masks = [1 << i for i in range(n)]
    cross = [0] * n
    kids: list[list[int]] = [[] for _ in range(n)]
    if full & (full - 1) == 0:
        return full.bit_length() - 1, masks, cross, kids
    masks.append(full)
    cross.append(0)
    kids.append([])
    floor = [-1] * (n + 1)  # per node, its parent's cross score (-1 at the root)
    node = n
    while node < len(masks):
        group = masks[node]
        members = [i for i in range(n) if group >> i & 1]
        low = min(matrix[a][b] for x, a in enumerate(members) for b in members[x + 1:])
        if low <= floor[node]:
            return None  # a pair inside the group scores no more than across it
        cross[node] = low
        rest = group
        while rest:
            seed = (rest & -rest).bit_length() - 1
            part = 1 << seed
            for y in members:
                if rest >> y & 1 and matrix[seed][y] > low:
                    part |= 1 << y
            rest &= ~part
            for a in members:
                if part >> a & 1:
                    for b in members:
                        if rest >> b & 1 and matrix[a][b] != low:
                            return None  # across two children the score must be the lowest
            if part & (part - 1):
                kids[node].append(len(masks))
                masks.append(part)
                cross.append(0)
                kids.append([])
                floor.append(low)
            else:
                kids[node].append(seed)
        node += 1
    return n, masks, cross, kids


def tree_split(matrix: list[list[int]]
               ) -> tuple[list[int], tuple[int, list[int], list[int], list[list[int]]]] | None:
    """(odd, tree): at most MAX_ODD GPUs `odd` (MAX_ODD_UP_TO_16 up to 16 GPUs) whose removal
    leaves the other GPUs' scores tree-shaped, and that tree (`score_tree`); None when no such
    few GPUs are found, and for no GPUs. Greedy: while the rest is not tree-shaped, set aside the GPU in the most triples
    breaking the tree rule (ties: the lowest index). One odd GPU is typical: a GPU of unknown
    NUMA node, or one side of a pair NVML could not read."""
    n = len(matrix)
    if n == 0:
        return None
    odd: list[int] = []
    rest = (1 << n) - 1
    limit = MAX_ODD_UP_TO_16 if n <= 16 else MAX_ODD
    while True:
        tree = score_tree(matrix, rest)
        if tree is not None:
            return odd, tree
        if len(odd) == limit:
            return None
        members = [i for i in range(n) if rest >> i & 1]
        bad = [0] * n
        for x, i in enumerate(members):
            row_i = matrix[i]
            for y in range(x + 1, len(members)):
                j = members[y]
                a = row_i[j]
                row_j = matrix[j]
                for third in members[y + 1:]:
                    b, c = row_i[third], row_j[third]
                    # the lowest of the three must occur twice
                    if (a < b and a < c) or (b < a and b < c) or (c < a and c < b):
                        bad[i] += 1
                        bad[j] += 1
                        bad[third] += 1
        worst = max(members, key=lambda g: (bad[g], -g))
        odd.append(worst)
        rest &= ~(1 << worst)


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
    if policy not in ALLOCATION_POLICIES:
        raise ValueError(f"unknown policy {policy!r}: expected one of "
                         f"{', '.join(ALLOCATION_POLICIES)}")
    return avail, required, size, policy == PACKED


def check_mask(n: int, mask: object) -> int:
    value = operator.index(mask)
    if value < 0 or value & ~((1 << n) - 1):
        raise ValueError(f"mask {value:#x} names GPUs outside 0..{n - 1}")
    return value
