"""Our exact search against NVIDIA's best-effort algorithm (bench/baseline_nvidia.py).

Owns: the comparison at n = 8, 12, 14, 16 GPUs: time of one answer and the score of the set
each returns, with the same pair scores (agent.rm.topology), on nodes read back through the
simulated NVML (the DGX-1V matrix at 8; NVLink bridge pairs on a two-socket PCIe tree above).
The baseline gets a time cap per case; where it does not finish, the table says so.
"""

from __future__ import annotations

import time

from bench import Section
from bench.baseline_nvidia import TimeUp, best_effort
from bench.bench_preferred import TOPOLOGIES, bridge_pairs, read_model

CAP_S = 8.0


def run() -> Section:
    section = Section(
        title="Preferred allocation against NVIDIA's best-effort (all partitions into sets of k)",
        method=(f"One request with every GPU free, k = 2 and 4 (and 3 at 8 GPUs), must-include "
                f"none; ours is `PairScores.search` (compiled, median of 20), the baseline is "
                f"go-gpuallocator's algorithm in Python with the same pair scores, capped at "
                f"{CAP_S:g} s a case. Score = sum of pair scores of the returned set."),
        header=["GPUs", "k", "ours µs", "baseline", "baseline/ours", "our score",
                "baseline score", "ours ≥ baseline"],
    )
    dgx = next(p for p in TOPOLOGIES if p.stem.startswith("dgx1v"))
    cases = [(8, read_model(dgx.read_text(), "dgx1v")[0], (2, 3, 4))]
    for n in (12, 14, 16):
        cases.append((n, read_model(bridge_pairs(n), f"bridges-{n}")[0], (2, 4)))
    for n, model, sizes in cases:
        scores = [list(row) for row in model.scores]
        everything = (1 << n) - 1
        for k in sizes:
            samples = []
            for _ in range(20):
                start = time.perf_counter()
                mask = model.search.best_set(everything, 0, k)
                samples.append(time.perf_counter() - start)
            ours_us = sorted(samples)[len(samples) // 2] * 1e6
            ours_score = model.search.set_score(mask)
            start = time.perf_counter()
            try:
                picked = best_effort(scores, list(range(n)), [], k,
                                     deadline=time.monotonic() + CAP_S)
                took = time.perf_counter() - start
                theirs = model.search.set_score(sum(1 << g for g in picked))
                section.rows.append([str(n), str(k), f"{ours_us:.0f}", f"{took:.3f} s",
                                     f"{took * 1e6 / ours_us:,.0f}×", str(ours_score),
                                     str(theirs), "yes" if ours_score >= theirs else "NO"])
            except TimeUp as up:
                so_far = ("-" if up.best is None
                          else f"{model.search.set_score(sum(1 << g for g in up.best))} "
                               f"(best so far)")
                ok = up.best is None or ours_score >= model.search.set_score(
                    sum(1 << g for g in up.best))
                section.rows.append([str(n), str(k), f"{ours_us:.0f}",
                                     f"> {CAP_S:g} s ({up.partitions:,} partitions)",
                                     f"> {CAP_S * 1e6 / ours_us:,.0f}×", str(ours_score),
                                     so_far, "yes" if ok else "NO"])
    section.notes.append("Our set is the highest-scoring one of all C(n, k) sets, so its score "
                         "can never be lower; the baseline maximises the whole partition and "
                         "can return a lower-scoring set.")
    return section
