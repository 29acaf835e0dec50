"""Exact bytes per rank, and alpha-beta time, for every collective algorithm in this package.

Every formula lives here, and the tests compare the ledger against it exactly. Letters:
  p   ranks in the group; r this rank; n elements of the (flattened) array; w bytes per element
  S   = n * w, the array's size in bytes
  c_i elements in chunk i; chunks follow np.array_split: the first n % p chunks get one more
Functions return `(sent, received)` in bytes for one rank, as Python ints.

Ring (Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in
MPICH", sec. 4; Patarasuk & Yuan 2009). Ranks form the ring r -> r+1 (mod p).
  reduce-scatter: at step s = 0..p-2, rank r sends its partial of chunk (r-s-1) and receives
    chunk (r-s-2). Over the p-1 steps it sends every chunk but r and receives every chunk but
    r-1, ending with the full reduction of chunk r:
        sent = (n - c_r) w            received = (n - c_{r-1}) w
  all-gather: at step s rank r forwards chunk (r-s) and receives chunk (r-s-1): it sends every
    chunk but r+1 and receives every chunk but its own:
        sent = (n - c_{r+1}) w        received = (n - c_r) w
  all-reduce = reduce-scatter + all-gather:
        sent = (2n - c_r - c_{r+1}) w     received = (2n - c_{r-1} - c_r) w
    When p divides n every c_i = n/p and both are 2 (p-1)/p * S: the classic ring volume, which
    tends to 2S, not p S, as p grows.
Binomial tree (Thakur et al. 2005 sec. 3; MPICH's MPIR_Bcast_binomial). Relative rank
  v = (r - root) mod p; parent(v) = v - lowbit(v); children are v + 2^k for every 2^k < lowbit(v)
  (every 2^k for the root) with v + 2^k < p. Each edge carries the whole array once:
    reduce: sent = S if v > 0 else 0;  received = children(v) * S
    broadcast: the same edges reversed;  tree all-reduce = reduce to 0 + broadcast from 0.
Double binary tree (Sanders, Speck & Traff 2009, "Two-tree algorithms for full bandwidth
  broadcast, reduction and scan", sec. 2; NCCL 2.4's trees, src/graph/trees.cc). Tree 0 is NCCL's
  in-order binary tree on the ranks (`btree_links`), tree 1 its mirror r -> p-1-r (p even) or its
  shift r -> r+1 (p odd): the leaves of tree 0 are the odd ranks, those of tree 1 the even ones
  (the even ranks but 0 when p is odd), so no rank is a leaf in both. Half t of the flat array
  (np.array_split in 2: n_0 = ceil(n/2), n_1 = floor(n/2) elements) is reduced up tree t and
  broadcast down it. Per tree a non-root sends its half once up (reduce) and receives it once
  down (broadcast); it receives one half from each child going up and sends one to each child
  going down. With deg_t(r) = [r has a parent in t] + children of r in t, sends equal receives:
        sent = received = (deg_0(r) n_0 + deg_1(r) n_1) w
  A rank has deg <= 3 in one tree and deg 1 in the other (a leaf there; rank 0 of an odd p is
  tree 0's root with one child instead), so it moves at most 3 n_0 + n_1 <= 2n + 1 elements
  each way, about 2S, where the binomial root moves L S: the double tree balances the load.
Pairwise all-to-all (Thakur et al. 2005 sec. 5): at step i = 1..p-1 rank r sends block r+i and
  receives block r-i: every block but its own goes out once and one comes in from each peer.
Linear gather / scatter: the root receives (sends) every other rank's block directly.
Dissemination barrier (Hensgen, Finkel & Manber 1988): ceil(log2 p) rounds; in round k rank r
  sends a 1-byte token to r + 2^k and receives one from r - 2^k.

Alpha-beta (Hockney) time: a step costs alpha + bytes / B; the time is the critical path.
  ring all-reduce  T = 2(p-1) alpha + 2(p-1)/p S/B     (RS or AG alone: half of each term)
  tree all-reduce  T = 2 L (alpha + S/B),  L = ceil(log2 p)
  double tree      T = 2 L (2 alpha + S/B)  (unpipelined; see double_tree_all_reduce_time)
The ring's latency term grows with p, its bandwidth term does not; the tree's is the reverse.
Setting the ring's two terms equal gives the crossover S* = p alpha B below which a ring
all-reduce is latency-bound. `auto_all_reduce` picks whichever of ring and tree is faster.
"""

from __future__ import annotations

import functools

# A network-like operating point (per-hop latency incl. launch, per-link bandwidth): it only
# decides the "auto" policy and the model column of the benchmark, never a byte count.
ALPHA = 5e-6  # seconds per message step
BANDWIDTH = 25e9  # bytes per second (a 200 Gb/s link)


def chunk_counts(n: int, p: int) -> list[int]:
    """Elements (or rows) per rank, np.array_split's rule: the first n % p get one extra."""
    return list(_counts(int(n), int(p)))


@functools.lru_cache(maxsize=1024)
def _counts(n: int, p: int) -> tuple:  # cached: every all-reduce of a bucket asks again
    base, extra = divmod(n, p)
    return tuple(base + (i < extra) for i in range(p))


def offsets(counts) -> list[int]:
    """Start of every chunk, plus the end: offsets[i]:offsets[i+1] is chunk i."""
    out = [0]
    for c in counts:
        out.append(out[-1] + int(c))
    return out


# -- ring -------------------------------------------------------------------------------------
def ring_reduce_scatter(counts, itemsize: int, rank: int) -> tuple[int, int]:
    p, n = len(counts), sum(counts)
    return (n - counts[rank]) * itemsize, (n - counts[(rank - 1) % p]) * itemsize


def ring_all_gather(counts, itemsize: int, rank: int) -> tuple[int, int]:
    p, n = len(counts), sum(counts)
    return (n - counts[(rank + 1) % p]) * itemsize, (n - counts[rank]) * itemsize


def ring_all_reduce(n: int, p: int, itemsize: int, rank: int) -> tuple[int, int]:
    counts = chunk_counts(n, p)
    s1, r1 = ring_reduce_scatter(counts, itemsize, rank)
    s2, r2 = ring_all_gather(counts, itemsize, rank)
    return s1 + s2, r1 + r2


# -- pipelining (both trees) ----------------------------------------------------------------
# A tree edge's S bytes travel as ceil(S / TREE_CHUNK) messages of at most TREE_CHUNK bytes
# (NCCL's trees stream chunks the same way): a rank forwards chunk k while chunk k+1 arrives,
# so the tree's levels work at once. Chunking splits messages, never bytes: every formula below
# holds for any chunk size, and each element's reduction order is the unchunked one.
TREE_CHUNK = 1 << 19  # bytes per message at most; best of 128 KiB / 512 KiB / 2 MiB measured


def chunk_spans(n: int, itemsize: int, chunk: int | None = None) -> list[tuple[int, int]]:
    """[start, end) element spans of n elements in messages of at most `chunk` bytes (at least
    one element each); n = 0 is one empty message, as unchunked."""
    step = max(1, (TREE_CHUNK if chunk is None else chunk) // max(int(itemsize), 1))
    return [(a, min(a + step, n)) for a in range(0, n, step)] or [(0, 0)]


# -- binomial tree ----------------------------------------------------------------------------
def tree_children(v: int, p: int) -> list[int]:
    """Children of relative rank v in the binomial tree of p ranks, nearest first."""
    low = v & -v if v else 1 << max(p - 1, 0).bit_length()
    return [v + (1 << k) for k in range(low.bit_length() - 1) if v + (1 << k) < p]


def tree_parent(v: int) -> int:
    return v - (v & -v)


def tree_reduce(n: int, p: int, itemsize: int, rank: int, root: int = 0) -> tuple[int, int]:
    v, size = (rank - root) % p, n * itemsize
    return (size if v else 0), len(tree_children(v, p)) * size


def tree_broadcast(n: int, p: int, itemsize: int, rank: int, root: int = 0) -> tuple[int, int]:
    received, sent = tree_reduce(n, p, itemsize, rank, root)
    return sent, received


def tree_all_reduce(n: int, p: int, itemsize: int, rank: int) -> tuple[int, int]:
    s1, r1 = tree_reduce(n, p, itemsize, rank, 0)
    s2, r2 = tree_broadcast(n, p, itemsize, rank, 0)
    return s1 + s2, r1 + r2


# -- double binary tree -----------------------------------------------------------------------
def btree_links(m: int, p: int) -> tuple:
    """(parent, left, right) of m in NCCL's in-order binary tree on 0..p-1; None if absent.

    Rank 0 is the root with one child, the largest power of two below p. Below it, m's lowest set
    bit b gives its height: children m - b/2 and the largest of m + b/2, m + b/4, ..., m + 1
    below p (none if m = p-1); parent whichever of m - b, m + b has lowest set bit 2b (m - b if
    m + b >= p). Odd m are the leaves. In order: left subtree < m < right subtree, so the tree
    read left to right is 0, 1, ..., p-1 (ncclGetBtree, NCCL src/graph/trees.cc).
    """
    if m == 0:
        return None, None, (1 << (p - 1).bit_length() - 1 if p > 1 else None)
    b = m & -m
    up = (m ^ b) | (b << 1)  # m with bit b moved up to 2b
    parent = up if up < p else m ^ b
    half = b >> 1
    if half == 0:
        return parent, None, None
    k = half
    while k and m + k >= p:  # the right subtree is cut off by p: take the largest that fits
        k >>= 1
    return parent, m - half, (m + k if k else None)


def double_tree_links(rank: int, p: int, tree: int) -> tuple:
    """(parent, left, right) of `rank` in tree 0 or 1 of the double binary tree; None if absent.

    Tree 1 is tree 0 on relabelled ranks: mirrored m = p-1-r when p is even, shifted m = r-1
    when p is odd (ncclGetDtree). "left" is the child whose subtree comes first in tree order.
    """
    if tree == 0:
        m, back = rank, (lambda v: v)
    elif p % 2 == 0:
        m, back = p - 1 - rank, (lambda v: p - 1 - v)
    else:
        m, back = (rank - 1) % p, (lambda v: (v + 1) % p)
    return tuple(None if v is None else back(v) for v in btree_links(m, p))


def double_tree_all_reduce(n: int, p: int, itemsize: int, rank: int) -> tuple[int, int]:
    """sent = received = (deg_0(r) n_0 + deg_1(r) n_1) w, as derived in the module docstring."""
    halves = (n - n // 2, n // 2)  # np.array_split(x, 2)
    moved = 0
    for t, h in enumerate(halves):
        degree = sum(v is not None for v in double_tree_links(rank, p, t))
        moved += degree * h * itemsize
    return moved, moved


def all_reduce(n: int, p: int, itemsize: int, rank: int, algorithm: str) -> tuple[int, int]:
    if algorithm == "auto":
        algorithm = auto_all_reduce(n * itemsize, p)
    f = {
        "ring": ring_all_reduce,
        "tree": tree_all_reduce,
        "double_tree": double_tree_all_reduce,
    }[algorithm]
    return f(n, p, itemsize, rank)


# -- all-to-all, gather, scatter, barrier ------------------------------------------------------
def pairwise_all_to_allv(send_counts, recv_counts, itemsize: int, rank: int, exchange=False):
    """send_counts[j] / recv_counts[j]: elements to / from rank j. With `exchange`, the counts
    themselves first travel as one int64 to and from every peer: 8 (p-1) bytes each way."""
    p = len(send_counts)
    sent = (sum(send_counts) - send_counts[rank]) * itemsize
    received = (sum(recv_counts) - recv_counts[rank]) * itemsize
    extra = 8 * (p - 1) if exchange else 0
    return sent + extra, received + extra


def pairwise_all_to_all(n: int, p: int, itemsize: int, rank: int) -> tuple[int, int]:
    """n elements split into p equal blocks (p divides n)."""
    block = [n // p] * p
    return pairwise_all_to_allv(block, block, itemsize, rank)


def linear_gather(counts, itemsize: int, rank: int, root: int = 0) -> tuple[int, int]:
    if rank == root:
        return 0, (sum(counts) - counts[root]) * itemsize
    return counts[rank] * itemsize, 0


def linear_scatter(count: int, p: int, itemsize: int, rank: int, root: int = 0):
    if rank == root:
        return (p - 1) * count * itemsize, 0
    return 0, count * itemsize


def dissemination_barrier(p: int) -> tuple[int, int]:
    rounds = (p - 1).bit_length()  # ceil(log2 p)
    return rounds, rounds


# -- alpha-beta time ---------------------------------------------------------------------------
def ring_all_reduce_time(nbytes: int, p: int, alpha=ALPHA, bandwidth=BANDWIDTH) -> float:
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / bandwidth


def tree_all_reduce_time(nbytes: int, p: int, alpha=ALPHA, bandwidth=BANDWIDTH) -> float:
    return 2 * (p - 1).bit_length() * (alpha + nbytes / bandwidth)


def double_tree_all_reduce_time(nbytes: int, p: int, alpha=ALPHA, bandwidth=BANDWIDTH) -> float:
    """Unpipelined double tree: both trees run at once, each of depth L = ceil(log2 p).

    One-port model (as the binomial tree's: a rank receives one message at a time, and sends one
    at a time). Going up, each level is an interior rank receiving S/2 from each of its two
    children: 2 alpha + S/B; going down, it sends S/2 to each: the same. Its leaf half in the
    other tree leaves first and arrives last, on the other direction of its link, so the trees do
    not wait for each other. Hence T = 2 L (2 alpha + S/B): the binomial tree's bandwidth term and
    twice its latency term - an upper bound (the root's one child makes the top level cheaper).
    NCCL pipelines chunks of each half through the tree, so every level works at once and the
    bandwidth term falls towards the ring's 2 S/B; double_tree.py does too (TREE_CHUNK), but
    this model, and so `auto`'s choice, stays the unpipelined one.
    """
    return 2 * (p - 1).bit_length() * (2 * alpha + nbytes / bandwidth)


def ring_crossover(p: int, alpha=ALPHA, bandwidth=BANDWIDTH) -> float:
    """S* = p alpha B: below it the ring's latency term dominates its bandwidth term."""
    return p * alpha * bandwidth


def auto_all_reduce(nbytes: int, p: int, alpha=ALPHA, bandwidth=BANDWIDTH) -> str:
    """ "tree" if its model time beats the ring's, else "ring" (ties, p <= 3: ring).

    Solving T_tree < T_ring for S gives S < (p-1-L) alpha B / (L - (p-1)/p), L = ceil(log2 p):
    about 100 KB at p=4, 235 KB at p=8, 450 KB at p=16, 4.4 MB at p=256 with the defaults.
    The double tree is not a candidate: unpipelined, its model time 2L(2 alpha + S/B) is never
    below the binomial tree's 2L(alpha + S/B). What it buys is balance - every rank moves about
    2S each way (at most 2n + 1 elements), not the binomial root's L S - which this time model
    does not price.
    """
    tree = tree_all_reduce_time(nbytes, p, alpha, bandwidth)
    return "tree" if tree < ring_all_reduce_time(nbytes, p, alpha, bandwidth) else "ring"


def bus_factor(op: str, p: int) -> float:
    """nccl-tests' busbw = algbw * factor, comparable to a link's speed across p."""
    if p == 1:
        return 1.0
    return {"all_reduce": 2 * (p - 1) / p, "reduce_scatter": (p - 1) / p}.get(
        op, (p - 1) / p if op in ("all_gather", "all_to_all") else 1.0
    )
