"""agent._fast topology (the exact set search, `PairScores`), run against the compiled module and
its pure-Python twin: hand-made layouts with known answers (NVSwitch islands, 64 GPUs, a PCIe
tree searched by the tree DP, a ring searched by branch and bound), input validation, and
Hypothesis properties (both implementations give the same mask and node count, and the
brute-force optimum; the tree DP is optimal on tree-shaped scores with a few odd GPUs).
"""

from __future__ import annotations

import importlib
import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent._fast._topology_checks import UNKNOWN_NUMA_WEIGHT

ALL64 = (1 << 64) - 1


@pytest.fixture(scope="module")
def impl(fast_impl):
    """The module under test: agent._fast.topology, then its twin (conftest's `fast_impl`)."""
    return fast_impl.topology


def compiled():
    return importlib.import_module("agent._fast.topology")


def twin():
    return importlib.import_module("agent._fast._topology_py")


def matrix(n: int, score_of) -> list[list[int]]:
    """n x n scores with 0 on the diagonal and score_of(i, j) elsewhere."""
    return [[0 if i == j else score_of(i, j) for j in range(n)] for i in range(n)]


def bits(*indices: int) -> int:
    return sum(1 << i for i in indices)


def brute_force(scores, unknown, available, must, k):
    """The documented answer by enumeration: highest set score, then the fewest GPUs of unknown
    NUMA node plus the smallest sum of link degrees within `available`, then lowest indices."""
    n = len(scores)
    members = [i for i in range(n) if available >> i & 1]
    best = None
    for combo in itertools.combinations(members, k):
        mask = sum(1 << i for i in combo)
        if mask & must != must:
            continue
        score = sum(scores[a][b] for a, b in itertools.combinations(combo, 2))
        weight = sum((UNKNOWN_NUMA_WEIGHT if unknown[c] else 0)
                     + sum(scores[c][y] for y in members if y != c) for c in combo)
        key = (-score, weight, combo)
        if best is None or key < best[0]:
            best = (key, mask, score)
    return best[1], best[2]


@st.composite
def scored_topologies(draw, max_gpus=12):
    n = draw(st.integers(1, max_gpus))
    palette = draw(st.sampled_from([(10, 20, 30, 40, 50), (10, 110, 210, 1210), (0, 1, 2),
                                    (10, 1815)]))
    scores = [[0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            scores[i][j] = scores[j][i] = draw(st.sampled_from(palette))
    unknown = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    available = draw(st.integers(1, (1 << n) - 1))
    members = [i for i in range(n) if available >> i & 1]
    must = sum(1 << i for i in draw(st.lists(st.sampled_from(members), unique=True,
                                             max_size=len(members))))
    return scores, unknown, available, must


@settings(max_examples=60, deadline=None)
@given(scored_topologies())
def test_property_search_is_optimal_and_both_implementations_agree(case):
    scores, unknown, available, must = case
    fast, slow = compiled().PairScores(scores, unknown), twin().PairScores(scores, unknown)
    lowest = bin(must).count("1")
    for k in range(max(lowest, 1), bin(available).count("1") + 1):
        want_mask, want_score = brute_force(scores, unknown, available, must, k)
        for policy in ("best-effort", "packed"):
            got = fast.search(available, must, k, policy)
            assert got == slow.search(available, must, k, policy)  # mask and node count
            mask = got[0]
            assert bin(mask).count("1") == k and mask & must == must and mask & ~available == 0
        assert fast.best_set(available, must, k) == want_mask
        assert fast.set_score(want_mask) == slow.set_score(want_mask) == want_score


def test_search_on_an_nvswitch_pair_of_islands(impl):
    """Two islands of 4 (NV12 and NV18 over NVSwitch), SYS across: best-effort takes the NV18
    pair, packed the broken NV12 island's last two GPUs."""
    island = [0, 0, 0, 0, 1, 1, 1, 1]
    scores = [[0 if a == b else (1210 if island[a] == island[b] == 0 else
                                 1810 if island[a] == island[b] == 1 else 10)
               for b in range(8)] for a in range(8)]
    ps = impl.PairScores(scores)
    free = bits(0, 1, 4, 5, 6, 7)
    assert ps.best_set(free, 0, 2) == bits(4, 5)
    assert ps.best_set(free, 0, 2, "packed") == bits(0, 1)
    assert ps.best_set(free, 0, 4, "packed") == bits(4, 5, 6, 7)
    assert ps.best_set(free, bits(0), 2) == bits(0, 1)
    assert ps.set_score(bits(4, 5, 6)) == 3 * 1810


def test_search_of_64_gpus_uses_bit_63(impl):
    scores = [[0 if a == b else (50 if a // 2 == b // 2 else 10) for b in range(64)]
              for a in range(64)]
    ps = impl.PairScores(scores)
    assert ps.best_set(ALL64, 0, 2) == bits(0, 1)
    assert ps.best_set(bits(62, 63, 5), 0, 2) == bits(62, 63)
    assert ps.best_set(ALL64, 1 << 63, 2) == bits(62, 63)
    assert ps.set_score(ALL64) == 32 * 50 + (64 * 63 // 2 - 32) * 10
    assert ps.set_score(bits(0, 1, 63)) == 50 + 10 + 10


@pytest.mark.parametrize("args, error, message", [
    pytest.param(([[0, 1], [2, 0]],), ValueError, r"scores must be symmetric: scores\[0\]\[1\]",
                 id="asymmetric"),
    pytest.param(([[0, 1]],), ValueError, "scores must be square", id="not-square"),
    pytest.param(([[0, -1], [-1, 0]],), ValueError, r"scores\[0\]\[1\] = -1 is not a pair score",
                 id="negative"),
    pytest.param(([[0, "a"], ["a", 0]],), TypeError, "must be an integer pair score",
                 id="not-int"),
    pytest.param(([[0] * 65] * 65,), ValueError, "at most 64", id="too-many"),
    pytest.param(([[0, 1], [1, 0]], [True]), ValueError, "unknown has 1 entries", id="flags"),
])
def test_pair_scores_reject_bad_matrices_alike(impl, args, error, message):
    with pytest.raises(error, match=message):
        impl.PairScores(*args)


@pytest.mark.parametrize("request_args, message", [
    pytest.param((bits(0, 5), 0, 1), "outside 0..3", id="gpu-outside"),
    pytest.param((bits(0, 1), bits(2), 1), "must-include mask 0x4 is not within", id="must-out"),
    pytest.param((bits(0, 1), 0, 3), "set size 3 must be between the 0 must-include and the 2",
                 id="too-big"),
    pytest.param((bits(0, 1), bits(0, 1), 1), "set size 1 must be between the 2", id="too-small"),
    pytest.param((bits(0, 1), 0, 1, "spread"), "unknown policy 'spread'", id="policy"),
])
def test_search_rejects_bad_requests_alike(impl, request_args, message):
    ps = impl.PairScores(matrix(4, lambda i, j: 10))
    with pytest.raises(ValueError, match=message):
        ps.search(*request_args)


# -- the tree DP (tree-shaped scores, up to a few odd GPUs) ---------------------------------------


@st.composite
def tree_scores(draw, max_gpus, max_odd):
    """(scores, odd): scores of a random group tree (each GPU a path of labels; a pair scores
    what its deepest common group is worth, worth more the deeper), plus 5 points for pairs in
    one top-level group (a NUMA node) except with an `odd` GPU, whose node is unknown: the
    tree rule then breaks around those GPUs, as on a host where NVML lost one GPU's NUMA node."""
    n = draw(st.integers(1, max_gpus))
    depth = draw(st.integers(1, 4))
    fan = draw(st.integers(2, 4))
    labels = draw(st.lists(st.tuples(*[st.integers(0, fan - 1)] * depth), min_size=n,
                           max_size=n))
    rnd = random.Random(draw(st.integers(0, 2**32)))
    worth = {(): draw(st.integers(0, 20))}
    for label in sorted(set(labels)):
        for cut in range(1, depth + 1):
            if label[:cut] not in worth:
                worth[label[:cut]] = worth[label[:cut - 1]] + rnd.randint(1, 60)
    odd = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=min(max_odd, n)))
    scores = [[0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            common = 0
            while common < depth and labels[i][common] == labels[j][common]:
                common += 1
            value = worth[labels[i][:common]]
            if common and i not in odd and j not in odd:
                value += 5
            scores[i][j] = scores[j][i] = value
    return scores, odd


@st.composite
def tree_requests(draw, max_gpus, max_odd):
    scores, odd = draw(tree_scores(max_gpus, max_odd))
    n = len(scores)
    unknown = [i in odd or draw(st.integers(0, 9)) == 0 for i in range(n)]
    available = draw(st.integers(1, (1 << n) - 1))
    members = [i for i in range(n) if available >> i & 1]
    must = sum(1 << i for i in draw(st.lists(st.sampled_from(members), unique=True,
                                             max_size=min(len(members), 4))))
    return scores, unknown, odd, available, must


def key_of(scores, unknown, available, mask):
    """(-set score, weight): the search's order but for the index tie-break."""
    members = [i for i in range(len(scores)) if available >> i & 1]
    chosen = [i for i in members if mask >> i & 1]
    score = sum(scores[a][b] for a, b in itertools.combinations(chosen, 2))
    weight = sum((UNKNOWN_NUMA_WEIGHT if unknown[c] else 0) + sum(scores[c][y] for y in members)
                 for c in chosen)
    return -score, weight


def assert_no_better_swap(scores, unknown, available, must, mask):
    """No set one swap away (a chosen GPU that is not must-include for a free one) comes
    first: a check of optimality that needs no enumeration, for 64 GPUs."""
    here = key_of(scores, unknown, available, mask)
    for out in range(len(scores)):
        if not (mask & ~must) >> out & 1:
            continue
        for into in range(len(scores)):
            if (available & ~mask) >> into & 1:
                other = mask ^ (1 << out) ^ (1 << into)
                assert key_of(scores, unknown, available, other) >= here, (
                    f"swapping GPU {out} for {into} gives a better set than {mask:#x}")


@settings(max_examples=60, deadline=None)
@given(tree_requests(max_gpus=10, max_odd=2))
def test_property_tree_dp_is_optimal_and_both_implementations_agree(case):
    scores, unknown, odd, available, must = case
    fast, slow = compiled().PairScores(scores, unknown), twin().PairScores(scores, unknown)
    assert fast.odd_gpus == slow.odd_gpus
    assert fast.tree_shaped and slow.tree_shaped, "a tree with at most 2 odd GPUs is recognised"
    if not odd:
        assert fast.odd_gpus == ()
    for k in range(max(bin(must).count("1"), 1), bin(available).count("1") + 1):
        want_mask, _ = brute_force(scores, unknown, available, must, k)
        for policy in ("best-effort", "packed"):
            got = fast.search(available, must, k, policy)
            assert got == slow.search(available, must, k, policy)
            assert got[1] == 0, "the tree DP visits no branch-and-bound node"
            mask = got[0]
            assert bin(mask).count("1") == k and mask & must == must and mask & ~available == 0
        assert fast.best_set(available, must, k) == want_mask


@settings(max_examples=15, deadline=None)
@given(tree_requests(max_gpus=64, max_odd=2), st.data())
def test_property_tree_dp_up_to_64_gpus(case, data):
    scores, unknown, odd, available, must = case
    fast, slow = compiled().PairScores(scores, unknown), twin().PairScores(scores, unknown)
    assert fast.tree_shaped and fast.odd_gpus == slow.odd_gpus
    have, lowest = bin(available).count("1"), max(bin(must).count("1"), 1)
    for k in sorted({lowest, have, data.draw(st.integers(lowest, have))}):
        got = fast.search(available, must, k)
        assert got == slow.search(available, must, k)
        assert got[1] == 0
        assert bin(got[0]).count("1") == k and got[0] & must == must
        assert_no_better_swap(scores, unknown, available, must, got[0])
        assert fast.search(available, must, k, "packed") == slow.search(available, must, k,
                                                                         "packed")


def pcie_tree_64(unknown_numa=()):
    """A two-socket PCIe tree of 64 GPUs (PIX pairs, PXB quads, PHB eights, NODE within a
    socket, SYS across), as agent.rm.topology scores it; +5 on one NUMA node when known."""
    def level(i, j):
        if i // 2 == j // 2:
            return 50
        if i // 4 == j // 4:
            return 40
        if i // 8 == j // 8:
            return 30
        return 20 if i // 32 == j // 32 else 10
    return [[0 if i == j else level(i, j) + (5 if i // 32 == j // 32 and i not in unknown_numa
                                              and j not in unknown_numa else 0)
             for j in range(64)] for i in range(64)]


def test_tree_dp_on_a_64_gpu_pcie_tree(impl):
    ps = impl.PairScores(pcie_tree_64())
    assert ps.tree_shaped and ps.odd_gpus == ()
    assert ps.search(ALL64, 0, 32) == (ALL64 >> 32, 0)  # a whole socket: the lower one on a tie
    assert ps.search(ALL64, 1 << 40, 8) == (0xFF << 40, 0)  # must-include: its PHB eight
    # GPUs 0 and 2 busy: of the whole PIX pairs, 4-5 takes the least from what stays free
    assert ps.search(ALL64 & ~bits(0, 2), 0, 2) == (bits(4, 5), 0)


def test_tree_dp_sets_aside_a_gpu_of_unknown_numa_node(impl):
    """GPU 5's NUMA node is unknown, so its pairs lack the same-node points: the scores are not
    tree-shaped, but are once GPU 5 is set aside. A 32-GPU request then takes the other socket
    whole (GPU 5's socket scores less), and a request that must include GPU 5 its PHB eight."""
    unknown = [i == 5 for i in range(64)]
    ps = impl.PairScores(pcie_tree_64(unknown_numa=(5,)), unknown)
    assert ps.tree_shaped and ps.odd_gpus == (5,)
    assert ps.search(ALL64, 0, 32) == (ALL64 ^ (ALL64 >> 32), 0)
    assert ps.search(ALL64, 1 << 5, 8) == (0xFF, 0)


def test_search_of_64_gpus_without_a_tree_uses_branch_and_bound(impl):
    """A ring of 64 (each GPU NV-linked to its two neighbours) is far from a tree: the branch
    and bound answers, and the ring closes over bit 63."""
    scores = [[0 if a == b else (110 if (a - b) % 64 in (1, 63) else 10) for b in range(64)]
              for a in range(64)]
    ps = impl.PairScores(scores)
    assert not ps.tree_shaped and ps.odd_gpus == ()
    mask, nodes = ps.search(ALL64, 1 << 63, 2)
    assert mask == bits(0, 63) and nodes > 0
    assert ps.best_set(ALL64, 0, 3) == bits(0, 1, 2)
