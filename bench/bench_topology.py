"""The set search (agent._fast topology: `PairScores`), compiled vs pure-Python twin, at 8 and
64 GPUs.

Owns: which score matrices the search is timed on and how: each node's pair scores as the
agent computes them (`TopologyModel`, read back through the simulated NVML by
bench_preferred's `read_model`): at 8 GPUs the DGX-1V hybrid cube mesh (not tree-shaped: branch
and bound) and the HGX H100 NVSwitch box and a PCIe server (tree-shaped: the tree DP); at 64
GPUs eight NV2 islands on a PCIe tree and a PCIe tree with one GPU of unknown NUMA node (tree
DP, with an odd GPU), and a ring of 64 GPUs joined NV2 to their neighbours (branch and bound).
The table: building `PairScores` (once per device set), then `search` per size k, best-effort
and packed. The end-to-end GetPreferredAllocation policy is bench_preferred's.
"""

from __future__ import annotations

import random

from agent._fast import _topology_py, topology
from agent.constants import ALLOCATION_POLICIES
from bench import Section, summarize, time_calls
from bench.bench_preferred import TOPOLOGIES, islands, pcie_tree, read_model, topo_text

IMPLS = {"cython": topology, "python": _topology_py}

BUILD_NOTE = ("A build is mostly `tree_split` (plain Python in `_topology_checks`, shared by both "
              "implementations), so the two build at about the same cost; on scores that are not "
              "tree-shaped it sets aside up to 6 GPUs (3 up to 16) before giving up, the most "
              "expensive build. It runs once per device set, never per request.")


def ring(n: int) -> str:
    """n GPUs in a ring, each NV2 to its two neighbours, PCIe SYS/NODE otherwise."""
    half = max(n // 2, 1)
    return topo_text(n, lambda i, j: "NV2" if (i - j) % n in (1, n - 1)
                     else "NODE" if i // half == j // half else "SYS")


def nodes() -> list[tuple[str, str]]:
    """(label, topo text) of the nodes the search is timed on."""
    shipped = {p.stem: p for p in TOPOLOGIES}
    out = [(stem, shipped[stem].read_text()) for stem in
           ("dgx1v-8x-v100-sxm2", "hgx-h100-8gpu", "pcie-8x-pix-phb-sys")]
    out += [("synthetic 64: 8 islands of 8 (NV2), PCIe tree", islands(64)),
            ("synthetic 64: PCIe tree, GPU5's NUMA node unknown", pcie_tree(64, (5,))),
            ("synthetic 64: NV2 ring", ring(64))]
    return out


def masks(n: int, k: int, count: int, seed: int) -> list[int]:
    """`count` available masks for a request of k: every GPU first, then random subsets."""
    rnd = random.Random(seed)
    out = [(1 << n) - 1]
    while len(out) < count:
        out.append(sum(1 << i for i in rnd.sample(range(n), rnd.randint(k, n))))
    return out


def timed(fn, calls: int) -> tuple[float, float]:
    return summarize(time_calls(fn, calls, warmup=1))


def row(label: str, n: int, what: str, path: str, fast: tuple[float, float],
        slow: tuple[float, float] | None) -> list[str]:
    twin = ["not run", "not run", "—"] if slow is None else \
        [f"{slow[0]:.1f}", f"{slow[1]:.1f}", f"{slow[0] / fast[0]:.0f}×"]
    return [label, str(n), what, path, f"{fast[0]:.1f}", f"{fast[1]:.1f}", *twin]


def search_rows(label: str, scores, unknown, ks) -> list[list[str]]:
    n = len(scores)
    built = {name: impl.PairScores(scores, unknown) for name, impl in IMPLS.items()}
    fast, slow = built["cython"], built["python"]
    rows = [row(label, n, "build", "tree DP" if fast.tree_shaped else "B&B",
                timed(lambda: topology.PairScores(scores, unknown), 50),
                timed(lambda: _topology_py.PairScores(scores, unknown), 10))]
    for k in ks:
        requests = [(avail, policy) for avail in masks(n, k, 10, seed=k)
                    for policy in ALLOCATION_POLICIES]
        most = 0
        for avail, policy in requests:  # the same answers, and how hard the search worked
            got = fast.search(avail, 0, k, policy)
            assert got == slow.search(avail, 0, k, policy), (label, k, policy, hex(avail))
            most = max(most, got[1])
        path = "tree DP" if fast.tree_shaped else f"B&B, ≤ {most} nodes"
        calls = {"cython": 20, "python": 2}
        samples = {}
        for name, ps in built.items():
            runs = []
            for avail, policy in requests:
                runs += time_calls(lambda ps=ps, a=avail, p=policy, k=k: ps.search(a, 0, k, p),
                                   calls[name], warmup=1)
            samples[name] = summarize(runs)
        rows.append(row(label, n, f"search k={k}", path, samples["cython"], samples["python"]))
    return rows


def run() -> Section:
    section = Section(
        title="Set search: PairScores (compiled vs twin, 8 and 64 GPUs)",
        method=("`PairScores(scores, unknown)` (built once per device set; 50 compiled, 10 twin "
                "builds) and `search(available, 0, k, policy)` on each node's pair scores as "
                "`TopologyModel` computes them (read through the simulated NVML), µs. Per k: "
                "every GPU free plus 9 random free subsets of at least k GPUs, best-effort and "
                "packed each (compiled: 20 calls each; twin: 2). Both answer the same mask and "
                "node count on every request. `search`: the exact tree DP (tree-shaped scores, "
                "up to a few odd GPUs), or branch and bound with the most nodes one request "
                "took (budget 2^17)."),
        header=["node", "GPUs", "call", "search", "cython median µs", "cython p99 µs",
                "python median µs", "python p99 µs", "python/cython"],
    )
    for label, text in nodes():
        model, gpus = read_model(text, label.split(":")[0].replace(" ", "-"))
        unknown = [g.numa_node is None for g in model.gpus]
        n = len(gpus)
        ks = (1, 2, 4, 8) if n <= 8 else (2, 8, 32)
        if not model.search.tree_shaped and n > 16:
            ks = (2, 4)  # branch and bound at 64 GPUs: the twin takes seconds for large k
        section.rows += search_rows(label, model.scores, unknown, ks)
    section.notes.append(BUILD_NOTE)
    return section

