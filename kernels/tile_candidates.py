"""A tile's best four candidates per row as int64 keys: the candidate planes of
tpsample/records.py as the Triton epilogue (fused_sample.tile_records_epilogue) writes them.

The planes hold a tile's four best tokens in the order (logit desc, id asc), NaN as -inf.
Each token becomes one int64 key that orders exactly like that:

    key = sortable(x) * 256 + (255 - local id)

where sortable(x) is the float's bits as an int32 whose signed order is the float order
(the 31 low bits flipped for negative floats) and local id < 256 is the token's index in
the tile. -0.0 becomes +0.0 first (equal as floats, so the smaller id must win their tie);
-inf keys still order by id, so a tile with fewer than four finite logits names its
smallest -inf ids, as the sort in torch_records does. NONE (int64 min) is below every key.
The epilogue takes the four in turn, one max of the keys each (the keys are distinct, so
the taken one becomes NONE): four reductions where a max and a smallest-id reduction per
candidate took eight, and its -inf candidates could repeat an id taken before. One
reduction of four keys merged per step (a custom combine) is not used: Triton's
interpreter runs a custom combine element by element in Python, which made the CPU tests
several times slower. The Gluon epilogue (gluon_sample.py) takes the four from its four
register lanes (docs/design.md has what was tried there).
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
