"""glibc's malloc held to one arena in the agent's process, unless the operator chose a number.

glibc gives each thread that allocates while another holds the lock an arena of its own (up to
8 per core): gRPC's threads, the Allocate workers, the health and journal threads. Memory
freed in one arena serves only that arena, so each keeps its own high-water mark: after
10,000 Allocates that kept their records, the agent held 0.5 MB more with them than with one
(docs/benchmarks.md, the gRPC-floor section's "without" row). Python's own allocator serves
small objects from its arenas under the GIL either way; the threads that allocate outside it
are gRPC's, and a node agent's gRPC traffic is a few calls per container start.

Owns: `limit()`. An operator's MALLOC_ARENA_MAX (glibc reads it itself) is left as it is, and
so is a libc without mallopt (musl). Must not import anything of `agent`.
"""

from __future__ import annotations

import ctypes
import os

M_ARENA_MAX = -8  # malloc.h


def limit() -> None:
    """One malloc arena, before the process starts its threads (it binds each to an arena as
    the thread first allocates)."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return
    try:
        ctypes.CDLL(None).mallopt(M_ARENA_MAX, 1)
    except (OSError, AttributeError):  # no mallopt: not glibc
        pass
