"""The exact search for the highest-scoring set of k GPUs, on uint64_t bitmasks (compiled;
twin: _topology_py.py).

Owns: `PairScores`, a pair-score matrix converted once into C arrays, and its exact search: a
DP over the group tree when the scores are tree-shaped, else branch and bound; the `packed`
policy first narrows the search to the tightest group of the score tree that holds the
request. One conversion in (the matrix, validated and copied into C arrays at construction;
per search, three ints), the work fully nogil on bitmasks (bit i = GPU index i, at most 64
GPUs), one conversion out (ints). Must not call NVML (the caller passes the scores) nor import
anything of `agent` but `errors` and the siblings `_types` / `_topology_checks`; answers must
equal the twin's, step for step.
"""

from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport free, malloc, qsort

from agent._fast._topology_checks import (
    NODE_BUDGET,
    UNKNOWN_NUMA_WEIGHT,
    check_mask,
    check_request,
    check_scores,
    tree_split,
)

__all__ = ["PairScores"]


# -- the set search ---------------------------------------------------------------------------

cdef inline int _popcount(uint64_t mask) noexcept nogil:
    return __builtin_popcountll(mask)


cdef inline int _lowest(uint64_t mask) noexcept nogil:
    return __builtin_ctzll(mask)


cdef int _compare_int(const void* a, const void* b) noexcept nogil:
    # qsort's callback: plain C, nothing that can raise.
    cdef int x = (<const int*>a)[0]
    cdef int y = (<const int*>b)[0]
    return (x > y) - (x < y)


cdef int64_t _sum_of(const int64_t* values, uint64_t mask) noexcept nogil:
    """Sum of values[i] over the GPUs i in mask."""
    cdef int64_t total = 0
    while mask:
        total += values[_lowest(mask)]
        mask &= mask - 1
    return total


cdef int64_t _set_score(const int* s, int n, uint64_t mask) noexcept nogil:
    """Sum of the pair scores s (n x n, row-major) of every pair of GPUs in mask."""
    cdef int64_t total = 0
    cdef uint64_t inner
    cdef int a, b
    while mask:
        a = _lowest(mask)
        mask &= mask - 1
        inner = mask
        while inner:
            b = _lowest(inner)
            inner &= inner - 1
            total += s[a * n + b]
    return total


cdef struct Search:
    int n
    const int* s                  # n x n pair scores, row-major
    const unsigned char* order    # per GPU, its peers strongest first (n - 1 each, row n wide)
    const uint64_t* twins_after   # per GPU, the later GPUs interchangeable with it
    int64_t w[TOPOLOGY_MAX_GPUS]     # tie-break weight of each GPU for this search
    int64_t gain[TOPOLOGY_MAX_GPUS]  # each GPU's score to the chosen set
    int64_t best_score
    int64_t best_w
    uint64_t best_set
    long long nodes
    long long budget
    bint strict                   # the incumbent is the greedy set (see _consider)


cdef inline void _consider(Search* st, uint64_t mask, int64_t score, int64_t weight) noexcept nogil:
    # While the incumbent is the greedy set, a set of equal value found by the search (in
    # lowest-index order) still replaces it, so ties break as without the greedy start.
    if score > st.best_score or (score == st.best_score and weight < st.best_w) or \
            (st.strict and score == st.best_score and weight == st.best_w):
        st.best_score = score
        st.best_w = weight
        st.best_set = mask
        st.strict = False


cdef void _greedy(Search* st, uint64_t chosen, int r, int64_t score_p, int64_t w_p,
                  uint64_t cand) noexcept nogil:
    """The first incumbent (the twin's `_State.greedy`)."""
    cdef int64_t gain[TOPOLOGY_MAX_GPUS]
    cdef int c, pick, step, n = st.n
    cdef uint64_t rest
    for c in range(n):
        gain[c] = st.gain[c]
    for step in range(r):
        pick = -1
        rest = cand
        while rest:
            c = _lowest(rest)
            rest &= rest - 1
            if pick < 0 or gain[c] > gain[pick] or (gain[c] == gain[pick] and st.w[c] < st.w[pick]):
                pick = c
        score_p += gain[pick]
        w_p += st.w[pick]
        chosen |= (<uint64_t>1) << pick
        cand &= ~((<uint64_t>1) << pick)
        rest = cand
        while rest:
            c = _lowest(rest)
            rest &= rest - 1
            gain[c] += st.s[pick * n + c]
    st.best_score = score_p
    st.best_w = w_p
    st.best_set = chosen
    st.strict = True


cdef void _insert_desc(int64_t* top, int* count, int limit, int64_t value) noexcept nogil:
    """Keep top[0..count) the `limit` largest values seen, descending."""
    cdef int pos
    if count[0] < limit:
        pos = count[0]
        count[0] += 1
    elif value > top[limit - 1]:
        pos = limit - 1
    else:
        return
    while pos > 0 and top[pos - 1] < value:
        top[pos] = top[pos - 1]
        pos -= 1
    top[pos] = value


cdef void _insert_asc(int64_t* low, int* count, int limit, int64_t value) noexcept nogil:
    """Keep low[0..count) the `limit` smallest values seen, ascending."""
    cdef int pos
    if count[0] < limit:
        pos = count[0]
        count[0] += 1
    elif value < low[limit - 1]:
        pos = limit - 1
    else:
        return
    while pos > 0 and low[pos - 1] > value:
        low[pos] = low[pos - 1]
        pos -= 1
    low[pos] = value


cdef void _bound(Search* st, int64_t score_p, int64_t w_p, uint64_t cand, int r,
                 int64_t* ub, int64_t* min_w) noexcept nogil:
    """Upper bound of the set score and lower bound of the weight over completions of r GPUs
    from cand (the twin's `_State.bound`)."""
    cdef int64_t top[TOPOLOGY_MAX_GPUS]
    cdef int64_t low[TOPOLOGY_MAX_GPUS]
    cdef int ntop = 0, nlow = 0, c, t, y, taken, n = st.n
    cdef int64_t value, total
    cdef uint64_t rest = cand
    cdef const unsigned char* row_order
    cdef const int* row
    while rest:
        c = _lowest(rest)
        rest &= rest - 1
        value = 2 * st.gain[c]
        if r > 1:
            taken = 0
            row = st.s + c * n
            row_order = st.order + c * n
            for t in range(n - 1):
                y = row_order[t]
                if (cand >> y) & 1:
                    value += row[y]
                    taken += 1
                    if taken == r - 1:
                        break
        _insert_desc(top, &ntop, r, value)
        _insert_asc(low, &nlow, r, st.w[c])
    total = 2 * score_p
    for t in range(ntop):
        total += top[t]
    ub[0] = total // 2
    total = w_p
    for t in range(nlow):
        total += low[t]
    min_w[0] = total


cdef void _dfs(Search* st, uint64_t chosen, int r, int64_t score_p, int64_t w_p,
               uint64_t cand) noexcept nogil:
    cdef int count, i, c, n = st.n
    cdef int64_t ub = 0, min_w = 0
    cdef uint64_t rest, inner, low
    cdef const int* row
    if r == 0:
        _consider(st, chosen, score_p, w_p)
        return
    count = _popcount(cand)
    if count < r:
        return
    if count == r:  # every candidate: score it directly
        _consider(st, chosen | cand, score_p + _sum_of(st.gain, cand) + _set_score(st.s, n, cand),
                  w_p + _sum_of(st.w, cand))
        return
    if st.nodes >= st.budget:
        return
    st.nodes += 1
    _bound(st, score_p, w_p, cand, r, &ub, &min_w)
    if ub < st.best_score or (ub == st.best_score and (
            min_w > st.best_w or (min_w == st.best_w and not st.strict))):
        return
    i = _lowest(cand)
    low = (<uint64_t>1) << i
    rest = cand ^ low
    row = st.s + i * n
    inner = rest
    while inner:
        c = _lowest(inner)
        inner &= inner - 1
        st.gain[c] += row[c]
    _dfs(st, chosen | low, r - 1, score_p + st.gain[i], w_p + st.w[i], rest)
    inner = rest
    while inner:
        c = _lowest(inner)
        inner &= inner - 1
        st.gain[c] -= row[c]
    _dfs(st, chosen, r, score_p, w_p, rest & ~st.twins_after[i])


cdef uint64_t _packed_region(const int* s, int n, uint64_t avail, uint64_t must,
                             int k) noexcept nogil:
    """The twin's `PairScores._packed_region`: descend the score tree from avail, keeping the
    smallest child group that still holds must and k GPUs."""
    cdef int values[TOPOLOGY_MAX_GPUS * TOPOLOGY_MAX_GPUS]
    cdef int nvalues = 0, distinct = 0, v, a, b, i, j, count, best_count
    cdef uint64_t inner, node = avail, remaining, group, frontier, lowbit, new, best
    cdef int threshold
    for a in range(n):  # the pair scores within avail
        if (avail >> a) & 1:
            for b in range(a + 1, n):
                if (avail >> b) & 1:
                    values[nvalues] = s[a * n + b]
                    nvalues += 1
    if nvalues == 0:
        return node
    qsort(values, nvalues, sizeof(int), _compare_int)
    for v in range(nvalues):
        if distinct == 0 or values[distinct - 1] != values[v]:
            values[distinct] = values[v]
            distinct += 1
    for v in range(distinct):
        threshold = values[v]
        best = 0
        best_count = 0
        remaining = node
        while remaining:
            group = remaining & (~remaining + 1)
            frontier = group
            while frontier:
                lowbit = frontier & (~frontier + 1)
                frontier ^= lowbit
                i = _lowest(lowbit)
                new = 0
                inner = node & ~group
                while inner:
                    j = _lowest(inner)
                    inner &= inner - 1
                    if s[i * n + j] >= threshold:
                        new |= (<uint64_t>1) << j
                group |= new
                frontier |= new
            remaining &= ~group
            count = _popcount(group)
            if (group & must) == must and count >= k and (best == 0 or count < best_count):
                best = group
                best_count = count
        if best == 0:
            break
        node = best
    return node


# -- the tree DP (tree-shaped scores) ---------------------------------------------------------

cdef enum:
    TREE_NODES = 2 * TOPOLOGY_MAX_GPUS  # GPUs, then at most n - 1 groups


cdef struct Entry:
    int64_t score                 # -1: no set of this count
    int64_t weight
    uint64_t mask


cdef struct Tree:
    int n
    int k
    uint64_t region
    uint64_t must
    const uint64_t* masks         # per node, its GPUs (node i < n: GPU i)
    const int* cross              # per group, the score of every pair across two children
    const int* kid_start          # per group, where its children start in kids
    const int* kid_count
    const int* kids
    const int64_t* w              # tie-break weight of each GPU for this search
    const int64_t* gain           # each GPU's score to the odd GPUs taken


cdef inline bint _better(int64_t score, int64_t weight, uint64_t mask,
                         const Entry* than) noexcept nogil:
    """The twin's `_better`: higher score, lower weight, then holding the lowest GPU of the
    difference."""
    cdef uint64_t d
    if score != than.score:
        return score > than.score
    if weight != than.weight:
        return weight < than.weight
    d = mask ^ than.mask
    return (mask & d & (~d + 1)) != 0


cdef int _table(const Tree* tr, int node, Entry* out) noexcept nogil:
    """The twin's `_tree_table` into out[0..size]; returns size (<= k). Combines in place,
    counts descending, so one child table of k + 1 entries per level of the tree is all the
    stack it takes (under 100 KiB at 64 GPUs)."""
    cdef Entry sub[TOPOLOGY_MAX_GPUS + 1]
    cdef int size = -1, b, x, j, total, top, kid, k = tr.k
    cdef int64_t t, score, weight
    cdef uint64_t bit, mask
    cdef Entry best
    cdef Entry* a
    if not (tr.masks[node] & tr.region):
        out[0].score = 0
        out[0].weight = 0
        out[0].mask = 0
        return 0
    if node < tr.n:
        bit = (<uint64_t>1) << node
        out[0].score = -1 if tr.must & bit else 0
        out[0].weight = 0
        out[0].mask = 0
        if k == 0:
            return 0
        out[1].score = tr.gain[node]
        out[1].weight = tr.w[node]
        out[1].mask = bit
        return 1
    t = tr.cross[node]
    for x in range(tr.kid_count[node]):
        kid = tr.kids[tr.kid_start[node] + x]
        if not (tr.masks[kid] & tr.region):
            continue
        if size < 0:
            size = _table(tr, kid, out)
            continue
        b = _table(tr, kid, sub)
        top = size + b if size + b < k else k
        total = top
        while total >= 0:  # out[total] reads only out[<= total], not yet overwritten
            best.score = -1
            best.weight = 0
            best.mask = 0
            j = total - size if total > size else 0
            while j <= b and j <= total:
                a = &out[total - j]
                if a.score >= 0 and sub[j].score >= 0:
                    score = a.score + sub[j].score + t * (total - j) * j
                    weight = a.weight + sub[j].weight
                    mask = a.mask | sub[j].mask
                    if best.score < 0 or _better(score, weight, mask, &best):
                        best.score = score
                        best.weight = weight
                        best.mask = mask
                j += 1
            out[total] = best
            total -= 1
        size = top
    if size < 0:
        out[0].score = 0
        out[0].weight = 0
        out[0].mask = 0
        size = 0
    return size


cdef uint64_t _tree_search(Tree* tr, int root, const int* s, const int* odd_all, int nodd_all,
                           uint64_t region, uint64_t must, int k) noexcept nogil:
    """The twin's `PairScores._tree_search`: the tree DP once per subset of the odd GPUs in
    region that holds the must-include ones, the best answer by `_better`."""
    cdef int odd[TOPOLOGY_MAX_GPUS]
    cdef int64_t gain[TOPOLOGY_MAX_GPUS]
    cdef Entry table[TOPOLOGY_MAX_GPUS + 1]
    cdef Entry best
    cdef int nodd = 0, x, y, c, b, left, size, n = tr.n
    cdef uint64_t odd_mask = 0, mask, pick
    cdef int64_t score, weight
    for x in range(nodd_all):
        odd_mask |= (<uint64_t>1) << odd_all[x]
        if (region >> odd_all[x]) & 1:
            odd[nodd] = odd_all[x]
            nodd += 1
    tr.gain = gain
    tr.region = region & ~odd_mask
    tr.must = must & ~odd_mask
    best.score = -1
    best.weight = 0
    best.mask = 0
    for pick in range((<uint64_t>1) << nodd):
        mask = 0
        for b in range(nodd):
            if (pick >> b) & 1:
                mask |= (<uint64_t>1) << odd[b]
        left = k - _popcount(mask)
        if (must & odd_mask & ~mask) or left < 0:
            continue
        for c in range(n):
            gain[c] = 0
        score = 0
        weight = 0
        for b in range(nodd):
            if (pick >> b) & 1:
                x = odd[b]
                weight += tr.w[x]
                for c in range(n):
                    gain[c] += s[x * n + c]
                for y in range(b + 1, nodd):
                    if (pick >> y) & 1:
                        score += s[x * n + odd[y]]
        tr.k = left
        size = _table(tr, root, table)
        if left > size or table[left].score < 0:
            continue
        score += table[left].score
        weight += table[left].weight
        mask |= table[left].mask
        if best.score < 0 or _better(score, weight, mask, &best):
            best.score = score
            best.weight = weight
            best.mask = mask
    return best.mask


cdef class PairScores:
    """A symmetric matrix of pair scores, converted once into C arrays, and the exact search
    for the highest-scoring set of k GPUs over it.

    `scores[i][j]` is the score of GPUs i and j (ints in [0, MAX_PAIR_SCORE], symmetric; the
    diagonal is ignored), `unknown[i]` true when GPU i's NUMA node is unknown. Thread-safe:
    each search keeps its state on the C stack, without the GIL.
    """

    cdef int _n
    cdef int* _s
    cdef unsigned char* _order
    cdef uint64_t _twins_after[TOPOLOGY_MAX_GPUS]
    cdef unsigned char _unknown[TOPOLOGY_MAX_GPUS]
    cdef int _root                # the group tree's root, -1 when the scores are not tree-shaped
    cdef int _nodd                # the odd GPUs set aside from the tree (tree_split)
    cdef int _odd[TOPOLOGY_MAX_GPUS]
    cdef uint64_t _tmasks[TREE_NODES]
    cdef int _tcross[TREE_NODES]
    cdef int _tkid_start[TREE_NODES]
    cdef int _tkid_count[TREE_NODES]
    cdef int _tkids[TREE_NODES]

    def __cinit__(self):
        self._s = NULL
        self._order = NULL

    def __init__(self, scores, unknown=None):
        matrix, flags = check_scores(scores, unknown)
        cdef int n = len(matrix), i, j, x, t, y
        cdef bint same
        self._n = n
        self._s = <int*>malloc(max(n * n, 1) * sizeof(int))
        self._order = <unsigned char*>malloc(max(n * n, 1) * sizeof(unsigned char))
        if self._s == NULL or self._order == NULL:
            raise MemoryError()
        for i in range(n):
            row = matrix[i]
            self._unknown[i] = 1 if flags[i] else 0
            for j in range(n):
                self._s[i * n + j] = <int>row[j]
        with nogil:
            for i in range(n):
                # peers of i, strongest first, ties by lower index (insertion sort, stable)
                t = 0
                for j in range(n):
                    if j == i:
                        continue
                    y = t
                    while y > 0 and self._s[i * n + self._order[i * n + y - 1]] < self._s[i * n + j]:
                        self._order[i * n + y] = self._order[i * n + y - 1]
                        y -= 1
                    self._order[i * n + y] = <unsigned char>j
                    t += 1
                self._twins_after[i] = 0
            for i in range(n):
                for j in range(i + 1, n):
                    if self._unknown[i] != self._unknown[j]:
                        continue
                    same = True
                    for x in range(n):
                        if x != i and x != j and self._s[i * n + x] != self._s[j * n + x]:
                            same = False
                            break
                    if same:
                        self._twins_after[i] |= (<uint64_t>1) << j
        self._root = -1
        self._nodd = 0
        split = tree_split(matrix)
        if split is not None:
            odd, (root, masks, cross, kids) = split
            for x in range(len(odd)):
                self._odd[x] = odd[x]
            self._nodd = len(odd)
            t = 0
            for x in range(len(masks)):
                self._tmasks[x] = masks[x]
                self._tcross[x] = cross[x]
                self._tkid_start[x] = t
                self._tkid_count[x] = len(kids[x])
                for y in kids[x]:
                    self._tkids[t] = y
                    t += 1
            self._root = root

    def __dealloc__(self):
        free(self._s)
        free(self._order)

    @property
    def n(self):
        return self._n

    @property
    def tree_shaped(self):
        """True when the scores are tree-shaped, but for at most MAX_ODD odd GPUs, and searches
        use the exact tree DP rather than branch and bound."""
        return self._root >= 0

    @property
    def odd_gpus(self):
        """The GPUs set aside to make the rest tree-shaped (empty unless `tree_shaped`)."""
        return tuple(self._odd[x] for x in range(self._nodd))

    def pair(self, int i, int j):
        """The score of GPUs i and j (0 for i == j)."""
        if not (0 <= i < self._n and 0 <= j < self._n):
            raise IndexError(f"GPU pair ({i}, {j}) outside 0..{self._n - 1}")
        return self._s[i * self._n + j]

    def set_score(self, mask):
        """Sum of the pair scores of every pair of GPUs in mask."""
        cdef uint64_t m = check_mask(self._n, mask)
        cdef int64_t total
        with nogil:
            total = _set_score(self._s, self._n, m)
        return total

    def best_set(self, available, must, k, policy="best-effort"):
        """The chosen set of k GPUs as a mask (see `search`)."""
        return self.search(available, must, k, policy)[0]

    def search(self, available, must, k, policy="best-effort"):
        """(mask, nodes): the best k-GPU subset of `available` holding `must`, and how many
        branch-and-bound nodes it took (0 when the tree DP answered: tree-shaped scores). Best:
        the highest set score, then the fewest GPUs of unknown NUMA node, then the smallest sum
        of link degrees within `available` (the least link weight taken from what stays free),
        then the lowest GPU indices. `packed` first narrows `available` to the tightest group
        of the score tree that holds the request."""
        py_avail, py_must, py_k, py_packed = check_request(self._n, available, must, k, policy)
        cdef uint64_t avail = py_avail, req = py_must, region, rest, inner
        cdef int size = py_k, n = self._n, c, y, x
        cdef bint packed = py_packed
        cdef int64_t unknown_weight = UNKNOWN_NUMA_WEIGHT, score_p = 0, w_p = 0, deg
        cdef Search st
        cdef Tree tr
        st.n = n
        st.s = self._s
        st.order = self._order
        st.twins_after = self._twins_after
        st.best_score = -1
        st.best_w = 0
        st.best_set = 0
        st.strict = False
        st.nodes = 0
        st.budget = NODE_BUDGET
        with nogil:
            for c in range(n):
                st.w[c] = 0
                st.gain[c] = 0
            rest = avail
            while rest:
                c = _lowest(rest)
                rest &= rest - 1
                deg = unknown_weight if self._unknown[c] else 0
                inner = avail
                while inner:
                    y = _lowest(inner)
                    inner &= inner - 1
                    deg += self._s[c * n + y]
                st.w[c] = deg
            region = _packed_region(self._s, n, avail, req, size) if packed else avail
            if self._root >= 0:
                tr.n = n
                tr.masks = self._tmasks
                tr.cross = self._tcross
                tr.kid_start = self._tkid_start
                tr.kid_count = self._tkid_count
                tr.kids = self._tkids
                tr.w = st.w
                # st.nodes stays 0: no branch and bound
                st.best_set = _tree_search(&tr, self._root, self._s, self._odd, self._nodd,
                                           region, req, size)
            else:
                rest = req
                while rest:
                    x = _lowest(rest)
                    rest &= rest - 1
                    score_p += st.gain[x]
                    w_p += st.w[x]
                    for c in range(n):
                        st.gain[c] += self._s[x * n + c]
                _greedy(&st, req, size - _popcount(req), score_p, w_p, region & ~req)
                _dfs(&st, req, size - _popcount(req), score_p, w_p, region & ~req)
        return st.best_set, st.nodes
