"""A tile's best four candidates per row in one reduction: the candidate planes of
tpsample/records.py as the Triton epilogue (fused_sample.tile_records_epilogue) writes them.

The planes hold a tile's four best tokens in the order (logit desc, id asc), NaN as -inf.
Each token becomes one int64 key that orders exactly like that:

    key = sortable(x) * 256 + (255 - local id)

where sortable(x) is the float's bits as an int32 whose signed order is the float order
(the 31 low bits flipped for negative floats) and local id < 256 is the token's index in
the tile. -0.0 becomes +0.0 first (equal as floats, so the smaller id must win their tie);
-inf keys still order by id, so a tile with fewer than four finite logits names its
smallest -inf ids, as the sort in torch_records does. NONE (int64 min) is below every key.

A row's keys then reduce over the tile with top4_merge, which maps two descending lists of
four keys to the descending four largest of their union: the elementwise max of one list
and the other reversed is a bitonic sequence holding those four (the classic merge step),
and two rounds of compare-exchange sort it. The operation is associative and commutative
on distinct keys (the four largest of a set), so any reduction tree gives the same four.
Before, the epilogue took the four in turn: a max and a smallest-id reduction each, eight
reductions instead of one (and its -inf candidates could repeat an id taken before). The
Gluon epilogue (gluon_sample.py) still takes them in turn, four lanes at a time: there the
same reduction of four int64 keys gained nothing and its shared-memory scratch overflows
the ring at BLOCK_B = 128 (docs/design.md).
"""
import triton
import triton.language as tl

NONE = tl.constexpr(-(1 << 63))


@triton.jit
def candidate_key(x, local):
    """int64 key of logit x (fp32) at tile-local id `local` (int32, < 256)."""
    x = tl.where(x != x, float("-inf"), x)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 → +0.0
    b = x.to(tl.int32, bitcast=True)
    s = b ^ ((b >> 31) & 0x7FFFFFFF)
    return (s.to(tl.int64) << 8) | (255 - local).to(tl.int64)


@triton.jit
def key_logit(key):
    """The fp32 logit of a key."""
    s = (key >> 8).to(tl.int32)
    return (s ^ ((s >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def key_local_id(key):
    """The tile-local id (int32) of a key."""
    return 255 - (key & 255).to(tl.int32)


@triton.jit
def _exchange(a, b):
    return tl.maximum(a, b), tl.minimum(a, b)


@triton.jit
def sort4(k0, k1, k2, k3):
    """Four keys in descending order (five compare-exchanges)."""
    k0, k1 = _exchange(k0, k1)
    k2, k3 = _exchange(k2, k3)
    k0, k2 = _exchange(k0, k2)
    k1, k3 = _exchange(k1, k3)
    k1, k2 = _exchange(k1, k2)
    return k0, k1, k2, k3


@triton.jit
def top4_merge(a0, a1, a2, a3, b0, b1, b2, b3):
    """The four largest of two descending lists of four keys, descending."""
    m0 = tl.maximum(a0, b3)
    m1 = tl.maximum(a1, b2)
    m2 = tl.maximum(a2, b1)
    m3 = tl.maximum(a3, b0)
    m0, m2 = _exchange(m0, m2)
    m1, m3 = _exchange(m1, m3)
    m0, m1 = _exchange(m0, m1)
    m2, m3 = _exchange(m2, m3)
    return m0, m1, m2, m3
