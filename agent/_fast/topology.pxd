# Declarations of agent._fast.topology's C level, for other Cython modules to cimport.
#
# Owns: the signatures of the nogil bitmask core (one uint64_t per GPU set, bit i = GPU i) and
# the compiler builtin it uses. Declarations only: the logic lives in topology.pyx.

from libc.stdint cimport uint64_t

cdef extern from *:
    # Count of trailing zero bits; undefined for 0, which the callers never pass.
    int __builtin_ctzll(unsigned long long x) noexcept nogil

cdef enum:
    TOPOLOGY_MAX_GPUS = 64

# adjacency[i] = the GPUs j != i with levels[i * n + j] <= threshold (row-major n x n levels).
cdef void adjacency_at(const int* levels, int n, long long threshold,
                       uint64_t* adjacency) noexcept nogil

# Connected components of `adjacency` over GPUs 0..n-1 into groups[], in order of lowest set
# bit; returns how many (at most n). groups must hold n entries.
cdef int join_groups(const uint64_t* adjacency, int n, uint64_t* groups) noexcept nogil

# Count of set bits.
cdef extern from *:
    int __builtin_popcountll(unsigned long long x) noexcept nogil
