"""The baseline: what NVIDIA's best-effort policy does (go-gpuallocator besteffort_policy.go).

Owns: a faithful Python rendering of that algorithm for the benchmark to time and to compare
scores with: pad the available GPUs to a multiple of the request size, enumerate every
partition of them into sets of that size (first members in increasing order; sets with part of
the padding skipped), keep the partition with the highest sum of set scores among those with a
set holding every required GPU, and return that partition's highest-scoring set holding them.
Set score = sum of pair scores, as NVIDIA's; the pair scores are ours (agent.rm.topology), so
the two answers are comparable. A deadline stops the enumeration (`TimeUp`), as a benchmark
cannot wait minutes. Must not be used by the agent.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence


class TimeUp(Exception):
    """The enumeration ran past its deadline; `best` is the best set found so far (or None)."""

    def __init__(self, best: tuple[int, ...] | None, partitions: int):
        super().__init__(f"stopped after {partitions} partitions")
        self.best = best
        self.partitions = partitions


def best_effort(scores: Sequence[Sequence[int]], available: Sequence[int],
                required: Sequence[int], size: int, deadline: float | None = None
                ) -> tuple[int, ...]:
    """NVIDIA's best-effort answer: `size` of `available` GPUs (indices into scores)."""
    pad = -1

    def set_score(gpus) -> int:
        return sum(scores[a][b] for a, b in itertools.combinations(gpus, 2) if a >= 0 and b >= 0)

    if size == 1:  # NVIDIA's shortcut: every single GPU is a partition of its own
        return (required[0],) if required else (available[0],)
    devices = list(available)
    while len(devices) % size:
        devices.append(pad)
    padding = devices.count(pad)
    need = set(required)
    best_partition: list[tuple[int, ...]] | None = None
    best_score = 0
    count = 0

    def has_full_set(partition) -> bool:
        return any(need <= set(s) and pad not in s for s in partition)

    def iterate(devs: list[int], accum: list[tuple[int, ...]]) -> None:
        nonlocal best_partition, best_score, count
        if len(devs) == size:
            partition = accum + [tuple(devs)]
            count += 1
            if deadline is not None and count % 256 == 0 and time.monotonic() > deadline:
                raise TimeUp(_pick(best_partition), count)
            if not has_full_set(partition):
                return
            score = sum(set_score(s) for s in partition)
            if score > best_score or best_partition is None:
                best_partition, best_score = partition, score
            return
        first = devs[0]
        for rest in itertools.combinations(devs[1:], size - 1):
            chosen = (first, *rest)
            p = chosen.count(pad)
            if not (p == 0 or p == padding):
                continue
            remaining = [d for d in devs if d not in chosen or d == pad]
            # drop as many pads as the set took
            for _ in range(p):
                remaining.remove(pad)
            iterate(remaining, accum + [chosen])

    def _pick(partition) -> tuple[int, ...] | None:
        if partition is None:
            return None
        sets = [s for s in partition if need <= set(s) and pad not in s]
        return max(sets, key=set_score) if sets else None

    iterate(devices, [])
    return _pick(best_partition)
