"""GPU groups by common-ancestor level, on uint64_t bitmasks (compiled; twin: _topology_py.py).

Owns: joining GPUs whose NVML topology level is <= a threshold into groups, transitively, and
the tree of those groups over every level. One conversion in (the Python matrix, validated into
a C array), the search fully nogil on bitmasks (bit i = GPU index i, at most 64 GPUs), one
conversion out (ints). Must not call NVML (the caller passes the levels) nor import anything of
`agent` but `errors` and the sibling `_types`; answers must equal the twin's.
"""

from cpython.long cimport PyLong_AsLongLongAndOverflow
from libc.stdint cimport uint64_t
from libc.stdlib cimport free, malloc, qsort

from agent._fast._types import (
    check_level,
    check_threshold,
    not_square,
    not_symmetric,
    too_many_gpus,
)

__all__ = ["build_tree", "groups_at_level"]


cdef enum:
    MAX_LEVEL = 2147483647  # _types.MAX_LEVEL, the largest C int


cdef struct Matrix:
    int n
    int levels[TOPOLOGY_MAX_GPUS * TOPOLOGY_MAX_GPUS]


cdef void adjacency_at(const int* levels, int n, long long threshold,
                       uint64_t* adjacency) noexcept nogil:
    cdef int i, j
    cdef uint64_t mask
    for i in range(n):
        mask = 0
        for j in range(n):
            if j != i and levels[i * n + j] <= threshold:
                mask |= (<uint64_t>1) << j
        adjacency[i] = mask


cdef int join_groups(const uint64_t* adjacency, int n, uint64_t* groups) noexcept nogil:
    cdef uint64_t remaining, group, frontier, low, new
    cdef int count = 0
    if n <= 0:
        return 0
    remaining = ~(<uint64_t>0) if n == TOPOLOGY_MAX_GPUS else ((<uint64_t>1) << n) - 1
    while remaining:
        group = remaining & (~remaining + 1)  # the lowest GPU not yet grouped seeds a group
        frontier = group
        while frontier:
            low = frontier & (~frontier + 1)
            frontier ^= low
            new = adjacency[__builtin_ctzll(low)] & ~group
            group |= new
            frontier |= new
        groups[count] = group
        count += 1
        remaining &= ~group
    return count


cdef int _compare_int(const void* a, const void* b) noexcept nogil:
    # qsort's callback: plain C, nothing that can raise.
    cdef int x = (<const int*>a)[0]
    cdef int y = (<const int*>b)[0]
    return (x > y) - (x < y)


cdef int _distinct_levels(const Matrix* m, int* out) noexcept nogil:
    """Sorted distinct values of m's n x n levels into out (room for n * n); returns how many."""
    cdef int total = m.n * m.n
    cdef int i, count = 0
    for i in range(total):
        out[i] = m.levels[i]
    qsort(out, total, sizeof(int), _compare_int)
    for i in range(total):
        if count == 0 or out[count - 1] != out[i]:
            out[count] = out[i]
            count += 1
    return count


cdef int _first_asymmetry(const Matrix* m) noexcept nogil:
    """i * n + j of the first (i < j) entry differing from its mirror, or -1."""
    cdef int i, j, n = m.n
    for i in range(n):
        for j in range(i + 1, n):
            if m.levels[i * n + j] != m.levels[j * n + i]:
                return i * n + j
    return -1


cdef int _convert(object levels, Matrix* m) except -1:
    """The one conversion in: validate `levels` (square, symmetric, <= 64 GPUs) into m."""
    cdef Py_ssize_t n = len(levels)
    cdef Py_ssize_t i, j, length
    cdef int bad, overflow
    cdef long long value = 0
    if n > TOPOLOGY_MAX_GPUS:
        raise too_many_gpus(n)
    m.n = <int>n
    for i in range(n):
        row = levels[i]
        length = len(row)
        if length != n:
            raise not_square(i, length, n)
        for j in range(n):
            item = row[j]
            overflow = 1
            if type(item) is int:  # the common case, checked in C; the rest as the twin does
                value = PyLong_AsLongLongAndOverflow(item, &overflow)
            if overflow == 0 and 0 <= value <= MAX_LEVEL:
                m.levels[i * n + j] = <int>value
            else:
                m.levels[i * n + j] = check_level(item, i, j)
    with nogil:
        bad = _first_asymmetry(m)
    if bad >= 0:
        i = bad // n
        j = bad % n
        raise not_symmetric(i, j, m.levels[i * n + j], m.levels[j * n + i])
    return 0


cdef list _masks(const uint64_t* groups, int count):
    return [groups[k] for k in range(count)]


def groups_at_level(levels, threshold):
    """GPUs joined when levels[i][j] <= threshold, transitively; masks sorted by lowest bit.

    `levels` is an n x n matrix of NVML topology levels (n <= 64), square and symmetric; the
    diagonal is not used for joining (a GPU is always in its own group). ValueError for a
    malformed matrix, TypeError for a non-integer entry.
    """
    cdef Matrix m
    cdef uint64_t adjacency[TOPOLOGY_MAX_GPUS]
    cdef uint64_t groups[TOPOLOGY_MAX_GPUS]
    cdef long long limit = check_threshold(threshold)
    cdef int count
    _convert(levels, &m)
    with nogil:
        adjacency_at(m.levels, m.n, limit, adjacency)
        count = join_groups(adjacency, m.n, groups)
    return _masks(groups, count)


def build_tree(levels):
    """[(level, groups_at_level(levels, level)) for each distinct level in `levels`, ascending].

    Each level's groups are unions of the previous level's: the tree of GPUs by closest common
    ancestor (gpu-manager style), leaves first. Empty for an empty matrix.
    """
    cdef Matrix m
    cdef uint64_t adjacency[TOPOLOGY_MAX_GPUS]
    cdef int* distinct = NULL
    cdef int* counts = NULL
    cdef uint64_t* groups = NULL
    cdef int n, d = 0, k
    _convert(levels, &m)
    n = m.n
    if n == 0:
        return []
    try:
        distinct = <int*>malloc(n * n * sizeof(int))
        counts = <int*>malloc(n * n * sizeof(int))
        groups = <uint64_t*>malloc(n * n * n * sizeof(uint64_t))
        if distinct == NULL or counts == NULL or groups == NULL:
            raise MemoryError()
        with nogil:
            d = _distinct_levels(&m, distinct)
            for k in range(d):
                adjacency_at(m.levels, n, distinct[k], adjacency)
                counts[k] = join_groups(adjacency, n, groups + k * n)
        return [(distinct[k], _masks(groups + k * n, counts[k])) for k in range(d)]
    finally:
        free(distinct)
        free(counts)
        free(groups)
