"""Pure-Python twin of agent._fast.topology: the exact search for the highest-scoring set of k
GPUs, as bitmasks.

Owns: the same API and the same answers as topology.pyx, for hosts without the compiled
extension (and as the reference the tests compare the compiled module against). Sets are ints
used as bitmasks, bit i = GPU i, at most 64 GPUs (`_types.MAX_GPUS`). The search is the same
algorithm as the compiled one, step for step (same order, bounds, node budget), so even a
search cut by the budget answers the same. Must not import anything of `agent` but `errors`
and its siblings `_types` / `_topology_checks`; no NVML calls (the caller passes the scores).
"""

from __future__ import annotations

from collections.abc import Sequence

from agent._fast._topology_checks import (
    NODE_BUDGET,
    UNKNOWN_NUMA_WEIGHT,
    check_mask,
    check_request,
    check_scores,
    tree_split,
)

__all__ = ["PairScores"]


def _bits(mask: int):
    """The set bits of mask, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _popcount(mask: int) -> int:
    return bin(mask).count("1")


class PairScores:
    """A symmetric matrix of pair scores, ready for `search` (see topology.pyx's PairScores).

    Built once per device set; each search is then one call with bitmasks in and out.
    """

    def __init__(self, scores: Sequence[Sequence[int]], unknown: Sequence[bool] | None = None):
        matrix, flags = check_scores(scores, unknown)
        n = len(matrix)
        self._n = n
        self._s = matrix
        self._unknown = flags
        # Each GPU's peers, strongest first (ties: lower index): the bound's top-(r-1) scan.
        self._order = [sorted((j for j in range(n) if j != i), key=lambda j, i=i: (-matrix[i][j], j))
                       for i in range(n)]
        # Interchangeable GPUs: the same score to every third GPU and the same NUMA flag. The
        # relation is transitive; twins_after[i] = the later members of i's class.
        twins = [0] * n
        for i in range(n):
            for j in range(i + 1, n):
                if flags[i] == flags[j] and all(matrix[i][x] == matrix[j][x]
                                                for x in range(n) if x != i and x != j):
                    twins[i] |= 1 << j
        self._twins_after = twins
        # Tree-shaped scores (but for a few odd GPUs): (root, masks, cross, kids) of the other
        # GPUs' tree, searched by the tree DP once per subset of the odd GPUs.
        split = tree_split(matrix)
        self._odd, self._tree = split if split is not None else ([], None)

    @property
    def n(self) -> int:
        return self._n

    @property
    def tree_shaped(self) -> bool:
        """True when the scores are tree-shaped, but for at most MAX_ODD odd GPUs, and searches
        use the exact tree DP rather than branch and bound."""
        return self._tree is not None

    @property
    def odd_gpus(self) -> tuple[int, ...]:
        """The GPUs set aside to make the rest tree-shaped (empty unless `tree_shaped`)."""
        return tuple(self._odd)

    def pair(self, i: int, j: int) -> int:
        """The score of GPUs i and j (0 for i == j)."""
        if not (0 <= i < self._n and 0 <= j < self._n):
            raise IndexError(f"GPU pair ({i}, {j}) outside 0..{self._n - 1}")
        return self._s[i][j]

    def set_score(self, mask: int) -> int:
        """Sum of the pair scores of every pair of GPUs in mask."""
        mask = check_mask(self._n, mask)
        members = list(_bits(mask))
        s = self._s
        return sum(s[a][b] for x, a in enumerate(members) for b in members[x + 1:])

    def best_set(self, available: int, must: int, k: int, policy: str = "best-effort") -> int:
        """The chosen set of k GPUs as a mask (see `search`)."""
        return self.search(available, must, k, policy)[0]

    def search(self, available: int, must: int, k: int,
               policy: str = "best-effort") -> tuple[int, int]:
        """(mask, nodes): the best k-GPU subset of `available` holding `must`, and how many
        branch-and-bound nodes it took (0 when the tree DP answered: tree-shaped scores). Best:
        the highest set score, then the fewest GPUs of unknown NUMA node, then the smallest sum
        of link degrees within `available` (the least link weight taken from what stays free),
        then the lowest GPU indices. `packed` first narrows `available` to the tightest group
        of the score tree that holds the request."""
        avail, must, k, packed = check_request(self._n, available, must, k, policy)
        s, n = self._s, self._n
        members = list(_bits(avail))
        w = [0] * n
        for c in members:
            w[c] = (UNKNOWN_NUMA_WEIGHT if self._unknown[c] else 0) + sum(s[c][y] for y in members)
        region = self._packed_region(avail, must, k) if packed else avail
        if self._tree is not None:
            return self._tree_search(region, must, k, w), 0
        gain = [0] * n
        score_p = w_p = 0
        for x in _bits(must):
            score_p += gain[x]
            w_p += w[x]
            for c in range(n):
                gain[c] += s[x][c]
        st = _State(s, self._order, self._twins_after, w, gain, k)
        st.greedy(must, k - _popcount(must), score_p, w_p, region & ~must)
        st.dfs(must, k - _popcount(must), score_p, w_p, region & ~must)
        return st.best_set, st.nodes

    def _tree_search(self, region: int, must: int, k: int, w: list[int]) -> int:
        """The tree DP's answer (topology.pyx's `_tree_search`): for each subset of the odd GPUs
        in `region` (holding the must-include ones, in counting order), the DP over the other
        GPUs' tree with each GPU's score to that subset added to it; the best by `_better`."""
        s, n = self._s, self._n
        odd = [x for x in self._odd if region >> x & 1]
        odd_mask = 0
        for x in self._odd:
            odd_mask |= 1 << x
        best = None
        for pick in range(1 << len(odd)):
            chosen = [odd[b] for b in range(len(odd)) if pick >> b & 1]
            mask = 0
            for x in chosen:
                mask |= 1 << x
            left = k - len(chosen)
            if must & odd_mask & ~mask or left < 0:
                continue
            gain = [sum(s[x][c] for x in chosen) for c in range(n)]
            score = sum(s[a][b] for y, a in enumerate(chosen) for b in chosen[y + 1:])
            weight = sum(w[x] for x in chosen)
            table = _tree_table(self._tree, n, self._tree[0], region & ~odd_mask,
                                must & ~odd_mask, left, w, gain)
            if left >= len(table) or table[left] is None:
                continue
            score_t, weight_t, mask_t = table[left]
            cand = (score + score_t, weight + weight_t, mask | mask_t)
            if best is None or _better(cand, best):
                best = cand
        return best[2]

    def _packed_region(self, avail: int, must: int, k: int) -> int:
        """Descend the score tree from `avail`: at each score threshold, ascending, keep the
        child group (GPUs joined by pair scores >= threshold) that holds `must` and has the
        fewest GPUs but at least k (ties: lowest GPU); stop when none does."""
        s = self._s
        members = list(_bits(avail))
        values = sorted({s[a][b] for x, a in enumerate(members) for b in members[x + 1:]})
        node = avail
        for t in values:
            best = 0
            best_count = 0
            remaining = node
            while remaining:
                group = frontier = remaining & -remaining
                while frontier:
                    low = frontier & -frontier
                    frontier ^= low
                    i = low.bit_length() - 1
                    new = 0
                    for j in _bits(node & ~group):
                        if s[i][j] >= t:
                            new |= 1 << j
                    group |= new
                    frontier |= new
                remaining &= ~group
                count = _popcount(group)
                if group & must == must and count >= k and (best == 0 or count < best_count):
                    best, best_count = group, count
            if best == 0:
                break
            node = best
        return node


def _better(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
    """Whether set a = (score, weight, mask) comes before set b of the same size: the higher
    score, the lower weight, then the one holding the lowest GPU of the two's difference (for
    sets of one size, that is the lexicographically lower sorted index list)."""
    if a[0] != b[0]:
        return a[0] > b[0]
    if a[1] != b[1]:
        return a[1] < b[1]
    d = a[2] ^ b[2]
    return bool(a[2] & d & -d)


def _tree_table(tree, n: int, node: int, region: int, must: int, k: int, w: list[int],
                gain: list[int]) -> list[tuple[int, int, int] | None]:
    """The tree DP (topology.pyx's `_table`): for each count c = 0..min(k, GPUs of `region`
    under `node`), the best set of c GPUs of the node's group holding its must-include GPUs, as
    (score, weight, mask), None where there is none; a set's score counts gain[g] for each of
    its GPUs g (its score to the odd GPUs taken). A group's children are combined one by
    one, a knapsack over counts: c1 GPUs from the ones so far and c2 from the next child add
    cross * c1 * c2 (every pair across two children scores `cross`). Each table entry is the
    best of its count by the search's full order, and that order is kept by unions of disjoint
    sets, so the root's entry k is the search's answer."""
    _, masks, cross, kids = tree
    if not masks[node] & region:
        return [(0, 0, 0)]
    if node < n:
        bit = 1 << node
        return [None if must & bit else (0, 0, 0), (gain[node], w[node], bit)][:k + 1]
    out = None
    t = cross[node]
    for kid in kids[node]:
        if not masks[kid] & region:
            continue
        sub = _tree_table(tree, n, kid, region, must, k, w, gain)
        if out is None:
            out = sub
            continue
        a, b = len(out) - 1, len(sub) - 1
        merged: list[tuple[int, int, int] | None] = []
        for total in range(min(k, a + b) + 1):
            best = None
            for j in range(max(0, total - a), min(b, total) + 1):
                x, y = out[total - j], sub[j]
                if x is None or y is None:
                    continue
                cand = (x[0] + y[0] + t * (total - j) * j, x[1] + y[1], x[2] | y[2])
                if best is None or _better(cand, best):
                    best = cand
            merged.append(best)
        out = merged
    return out


class _State:
    """One search's mutable state (the compiled module keeps it in a C struct)."""

    def __init__(self, s, order, twins_after, w, gain, k):
        self.s, self.order, self.twins_after, self.w, self.gain = s, order, twins_after, w, gain
        self.best_score = -1
        self.best_w = 0
        self.best_set = 0
        self.nodes = 0
        # True while the incumbent is the greedy set: a set of equal value found by the
        # search (in lowest-index order) still replaces it, so ties break the same way.
        self.strict = False

    def consider(self, mask: int, score: int, weight: int) -> None:
        if score > self.best_score or (score == self.best_score and weight < self.best_w) or \
                (self.strict and score == self.best_score and weight == self.best_w):
            self.best_score, self.best_w, self.best_set = score, weight, mask
            self.strict = False

    def greedy(self, chosen: int, r: int, score_p: int, w_p: int, cand: int) -> None:
        """The first incumbent: add the candidate of highest gain (then lowest weight, lowest
        index) r times."""
        s, w = self.s, self.w
        gain = list(self.gain)
        for _ in range(r):
            pick = -1
            for c in _bits(cand):
                if pick < 0 or gain[c] > gain[pick] or (gain[c] == gain[pick] and w[c] < w[pick]):
                    pick = c
            score_p += gain[pick]
            w_p += w[pick]
            chosen |= 1 << pick
            cand &= ~(1 << pick)
            for c in _bits(cand):
                gain[c] += s[pick][c]
        self.best_score, self.best_w, self.best_set, self.strict = score_p, w_p, chosen, True

    def bound(self, score_p: int, w_p: int, cand: int, r: int) -> tuple[int, int]:
        """(upper bound of the set score, lower bound of the weight) over completions of r
        GPUs from cand: each candidate's gain to the chosen set plus half its r-1 strongest
        links within cand, the r best of those; the r lightest weights."""
        s, order, gain, w = self.s, self.order, self.gain, self.w
        tops = []
        weights = []
        for c in _bits(cand):
            t = 2 * gain[c]
            if r > 1:
                taken = 0
                row = s[c]
                for y in order[c]:
                    if cand >> y & 1:
                        t += row[y]
                        taken += 1
                        if taken == r - 1:
                            break
            tops.append(t)
            weights.append(w[c])
        tops.sort(reverse=True)
        weights.sort()
        return (2 * score_p + sum(tops[:r])) // 2, w_p + sum(weights[:r])

    def dfs(self, chosen: int, r: int, score_p: int, w_p: int, cand: int) -> None:
        if r == 0:
            self.consider(chosen, score_p, w_p)
            return
        count = _popcount(cand)
        if count < r:
            return
        s, gain, w = self.s, self.gain, self.w
        if count == r:  # every candidate: score it directly
            members = list(_bits(cand))
            total, weight = score_p, w_p
            for x, c in enumerate(members):
                total += gain[c]
                weight += w[c]
                for y in members[x + 1:]:
                    total += s[c][y]
            self.consider(chosen | cand, total, weight)
            return
        if self.nodes >= NODE_BUDGET:
            return
        self.nodes += 1
        ub, min_w = self.bound(score_p, w_p, cand, r)
        if ub < self.best_score or (ub == self.best_score and (
                min_w > self.best_w or (min_w == self.best_w and not self.strict))):
            return
        low = cand & -cand
        i = low.bit_length() - 1
        rest = cand ^ low
        row = s[i]
        for c in _bits(rest):
            gain[c] += row[c]
        self.dfs(chosen | low, r - 1, score_p + gain[i], w_p + w[i], rest)
        for c in _bits(rest):
            gain[c] -= row[c]
        self.dfs(chosen, r, score_p, w_p, rest & ~self.twins_after[i])
