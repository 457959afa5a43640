# Declarations of agent._fast.topology's C level: the GPU limit of its uint64_t masks and the
# compiler builtins its bitmask loops use.
#
# Owns: declarations only (one uint64_t per GPU set, bit i = GPU i); the logic lives in
# topology.pyx.

cdef enum:
    TOPOLOGY_MAX_GPUS = 64

cdef extern from *:
    # Count of trailing zero bits; undefined for 0, which the callers never pass.
    int __builtin_ctzll(unsigned long long x) noexcept nogil
    # Count of set bits.
    int __builtin_popcountll(unsigned long long x) noexcept nogil
