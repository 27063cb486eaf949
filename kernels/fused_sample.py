"""Stage 1 of the fused sampler: LM-head tile + transforms + Gumbel noise → candidate records.

One program owns a [BLOCK_V, BLOCK_B] tile of logits (vocabulary × batch: the vocabulary
is the MMA's M side, so B = 1 still fills the tensor core), accumulates it in fp32 over
D, applies bias / temperature / padded-vocabulary mask, and writes one record per
(sample, row, tile):

    rec[s, b, t] = (best perturbed score, its global token id, its transformed logit,
                    logsumexp of the tile's transformed logits)

Token ids are stored as float32 (exact below 2**24; the API checks vocab_size). The
[B, V] logits never leave registers. See tpsample/merge.py for why the records suffice.
"""
import triton
import triton.language as tl
from triton import knobs

from .. import records
from .tile_candidates import NONE, candidate_key, key_local_id, key_logit

TWO_POW_M23 = tl.constexpr(1.0 / 8388608.0)
# The outer log of the noise on the MUFU (lg2.approx) instead of libdevice's logf (~30
# instructions); the interpreter has no inline PTX and keeps tl.log (tpsample/noise.py says
# why the approximation is harmless there and not for the inner log, which neg_log_uniform
# computes to full relative accuracy).
FAST_OUTER_LOG = tl.constexpr(not knobs.runtime.interpret)
# -ln(u) = -(n ln 2 + log1p(f)), u = 2**n (1 + f), f in [-1/3, 1/3); log1p(f) = f + f^2 P(f).
# P: degree-7 fit to (log1p(f) - f) / f^2 (float32 coefficients, highest first). Over every
# uniform the noise can produce the result is within 1.5 ulp of -ln(u) (tests/test_noise.py,
# exhaustive; 1.18 ulp with single-rounding FMAs), see noise.py for what that means for g.
LOG1P_P = (0.14095425605773926, -0.15049511194229126, 0.13988324999809265,
           -0.16481566429138184, 0.2001098245382309, -0.25004205107688904,
           0.33333221077919006, -0.49999985098838806)
P7, P6, P5, P4, P3, P2, P1, P0 = (tl.constexpr(c) for c in LOG1P_P)
ONE_MINUS_2M24 = tl.constexpr(1.0 - 2.0 ** -24)
LN2_M23 = tl.constexpr(0.6931471805599453 / 8388608.0)
# Philox's 32 x 32 -> 64-bit multiplies: one mul.wide.u32 each (inline PTX) on the GPU, where
# Triton's tl.philox spends a umulhi and a mul; the same words (GPU test against tl.philox).
# The interpreter runs tl.philox.
PHILOX_MUL = tl.constexpr("umulhi" if knobs.runtime.interpret else "wide")
CDF_STREAM = tl.constexpr(records.CDF_STREAM)
CDF_PICK_STREAM = tl.constexpr(records.CDF_PICK_STREAM)
NOISE_COEF = tl.constexpr(-0.6931471805599453 if FAST_OUTER_LOG.value else -1.0)  # gumbel_log


@triton.jit
def neg_log_uniform(x):
    """-ln(u) for the uniform u of the uint32 Philox words x (noise.bits_to_uniform), float32.

    libdevice's logf spends a third of its ~30 instructions on zeros, infinities and
    denormals, none of which u can be (2**-24 <= u <= 1 - 2**-24): this is its main path
    alone, and builds u from the bits without an int-to-float conversion."""
    t = ((x >> 9) | 0x3F800000).to(tl.float32, bitcast=True)  # 1 + k 2**-23, k = x >> 9
    u = t - ONE_MINUS_2M24  # (k + 0.5) 2**-23, exact
    bits = u.to(tl.int32, bitcast=True)
    ex = (bits - 0x3F2AAAAB) & -8388608  # n << 23, chosen so that u / 2**n is in [2/3, 4/3)
    f = (bits - ex).to(tl.float32, bitcast=True) - 1.0  # exact
    p = tl.fma(f, P7, P6)
    p = tl.fma(p, f, P5)
    p = tl.fma(p, f, P4)
    p = tl.fma(p, f, P3)
    p = tl.fma(p, f, P2)
    p = tl.fma(p, f, P1)
    p = tl.fma(p, f, P0)
    log1p_f = tl.fma(f, f * p, f)
    return -tl.fma(ex.to(tl.float32), LN2_M23, log1p_f)


@triton.jit
def _mul_wide_a(a):
    """(high, low) words of a * 0xD2511F53 (Philox's first round multiplier), uint32: one
    32 x 32 -> 64-bit multiply (IMAD.WIDE.U32) where Triton's umulhi + mul take two."""
    return tl.inline_asm_elementwise(
        "{ .reg .u64 t; mul.wide.u32 t, $2, 0xD2511F53; mov.b64 {$1, $0}, t; }",
        "=r,=r,r", [a], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)


@triton.jit
def _mul_wide_b(a):
    """The same for Philox's second multiplier, 0xCD9E8D57."""
    return tl.inline_asm_elementwise(
        "{ .reg .u64 t; mul.wide.u32 t, $2, 0xCD9E8D57; mov.b64 {$1, $0}, t; }",
        "=r,=r,r", [a], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)


@triton.jit
def _mul(a, M: tl.constexpr):
    """(high, low) words of a * M, uint32: one wide multiply."""
    if M == 0xD2511F53:
        return _mul_wide_a(a)
    else:
        return _mul_wide_b(a)


@triton.jit
def philox_rounds(k0, k1, c0, c1, c2, c3):
    """Philox4x32-10 on uint32 words (key k0, k1) with wide multiplies; the words of tl.philox."""
    for r in tl.static_range(10):
        hi_b, lo_b = _mul(c2, 0xCD9E8D57)
        hi_a, lo_a = _mul(c0, 0xD2511F53)
        c0 = hi_b ^ c1 ^ k0
        c2 = hi_a ^ c3 ^ k1
        c1 = lo_b
        c3 = lo_a
        k0 = tl.add(k0, 0x9E3779B9, sanitize_overflow=False)
        k1 = tl.add(k1, 0xBB67AE85, sanitize_overflow=False)
    return c0, c1, c2, c3


@triton.jit
def philox(seed, c0, c1, c2, c3):
    """tl.philox (Philox4x32-10, key = the int64 seed's low and high words), bit for bit,
    with the multiplies PHILOX_MUL names. (A global read here, not a default argument:
    Triton keys its compile cache on the globals a kernel reads.)"""
    return philox_with(seed, c0, c1, c2, c3, PHILOX_MUL)


@triton.jit
def philox_with(seed, c0, c1, c2, c3, MUL: tl.constexpr):
    """philox with the multiplies MUL names: "wide" (GPU only) or "umulhi" (tl.philox)."""
    if MUL == "umulhi":
        return tl.philox(seed, c0, c1, c2, c3)
    else:
        seed = seed.to(tl.uint64)
        k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
        k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        return philox_rounds(k0, k1, c0.to(tl.uint32, bitcast=True), c1.to(tl.uint32, bitcast=True),
                             c2.to(tl.uint32, bitcast=True), c3.to(tl.uint32, bitcast=True))


@triton.jit
def gumbel_noise(seed, off_lo, off_hi, c1, gid):
    """Gumbel noise for global ids `gid` [BV, 1]; seed/off_* per row [1, BB] (see noise.py)."""
    return bits_to_gumbel(philox_word(seed, off_lo, off_hi, c1, gid))


@triton.jit
def philox_word(seed, off_lo, off_hi, c1, gid):
    """The Philox word behind gumbel_noise."""
    zero = tl.zeros_like(gid + seed).to(tl.uint32)
    c0 = (gid >> 2).to(tl.uint32) + zero
    r0, r1, r2, r3 = philox(seed + zero.to(tl.int64), c0, c1 + zero, off_lo + zero,
                               off_hi + zero)
    lane = (gid & 3) + zero.to(gid.dtype)
    x = tl.where(lane == 0, r0, r1)
    x = tl.where(lane == 2, r2, x)
    return tl.where(lane == 3, r3, x)


@triton.jit
def gumbel_log(x):
    """The outer log of the noise of Philox words x in the units NOISE_COEF turns into
    Gumbel noise: g = NOISE_COEF * gumbel_log(x). log2 on the MUFU (the interpreter: ln)."""
    e = neg_log_uniform(x)  # Exp(1); needs full relative accuracy near u = 1
    if FAST_OUTER_LOG:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [e],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.log(e)


@triton.jit
def bits_to_gumbel(x):
    return gumbel_log(x) * NOISE_COEF


@triton.jit
def gumbel_noise_tile(seed, off_lo, off_hi, c1, gid0, BLOCK_V: tl.constexpr, BLOCK_B: tl.constexpr):
    """gumbel_noise for the BLOCK_V consecutive ids gid0 + [0, BLOCK_V), gid0 % 4 == 0:
    one Philox call per four ids (its four words are the four lanes). [BLOCK_V, BLOCK_B]."""
    return bits_to_gumbel(philox_words_tile(seed, off_lo, off_hi, c1, gid0, BLOCK_V, BLOCK_B))


@triton.jit
def philox_words_tile(seed, off_lo, off_hi, c1, gid0, BLOCK_V: tl.constexpr,
                      BLOCK_B: tl.constexpr):
    """The Philox words behind gumbel_noise_tile."""
    q = (gid0 >> 2) + tl.arange(0, BLOCK_V // 4)
    zero = tl.zeros((BLOCK_V // 4, BLOCK_B), dtype=tl.uint32)
    r0, r1, r2, r3 = philox(seed + zero.to(tl.int64), q.to(tl.uint32)[:, None] + zero,
                               c1 + zero, off_lo + zero, off_hi + zero)
    x = tl.join(tl.join(r0, r2), tl.join(r1, r3))  # [V/4, B, k, a] holds word 2k + a
    return tl.reshape(tl.permute(x, (0, 2, 3, 1)), (BLOCK_V, BLOCK_B))  # id 4q + 2k + a


@triton.jit
def row_noise_keys(seed_ptr, offset_ptr, offs_b, mask_b):
    """Per-column Philox key and counter words: seed [1, BB] int64, offset lo/hi [1, BB]."""
    seed = tl.load(seed_ptr + offs_b, mask=mask_b, other=0)[None, :]
    off = tl.load(offset_ptr + offs_b, mask=mask_b, other=0)
    off_lo = (off & 0xFFFFFFFF).to(tl.uint32)[None, :]
    off_hi = ((off >> 32) & 0xFFFFFFFF).to(tl.uint32)[None, :]
    return seed, off_lo, off_hi


@triton.jit
def leading_columns(x, BLOCK_V: tl.constexpr, BLOCK_B: tl.constexpr, HALVINGS: tl.constexpr):
    """x[:, :BLOCK_B >> HALVINGS] of x [BLOCK_V, BLOCK_B], by repeated halving (no slicing in
    Triton): the noise of padding columns is otherwise computed and thrown away (B = 1 uses
    one column of 16)."""
    for i in tl.static_range(HALVINGS):
        x = tl.permute(tl.reshape(x, (BLOCK_V, 2, BLOCK_B >> (i + 1))), (0, 2, 1))
        x, _unused = tl.split(x)
    return x


@triton.jit
def _max_propagating_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def tile_records_epilogue(
    acc, pid_v, offs_b, mask_b, B, bias_ptr, inv_temp_ptr, seed_ptr, offset_ptr, rec_ptr,
    V_rows, n_real, vocab_start, num_samples, rec_stride_s, rec_stride_b, rec_stride_t, peer_ptrs,
    parity_ptr, HAS_BIAS: tl.constexpr, ALIGNED4: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_B: tl.constexpr, NUM_PEERS: tl.constexpr, HALVINGS: tl.constexpr, TILE_MASS: tl.constexpr,
    g_pre=None, PRE_NOISE: tl.constexpr = False, CDF: tl.constexpr = False,
    CANDIDATES: tl.constexpr = 0, NO_REPLACE: tl.constexpr = False, RAW_MASS: tl.constexpr = False,
    mask_ptr=None, stride_mask=0, HAS_MASK: tl.constexpr = False,
    first_ptr=None, held_ptr=None, HELD: tl.constexpr = False,
    side_ptr=None, stride_side=0, SIDE: tl.constexpr = False,
):
    """acc [BLOCK_V, BLOCK_B] raw fp32 logits of tile pid_v → one record per (sample, row).
    SIDE: the tile's transformed logits (NaN as -inf, -inf past the vocabulary) also go to
    side_ptr (fp32 [B, tiles * BLOCK_V], row stride stride_side): the logits a filtered
    call's exact fallback reads (kernels/filter_cut.py) instead of recomputing them.
    HAS_MASK: mask_ptr int32 [B, W] (row stride stride_mask) allows global id i of row b by
    bit i % 32 of word i // 32; a token it does not allow is -inf from the start
    (tpsample/constraints.py). HELD (a call with listed tokens, whose bits the mask has
    cleared): where bit i % 32 of first_ptr's word i // 32 is set (int32 [B, W], same row
    stride), the raw logit h.w_i goes to held_ptr's word i // 32 (fp32 [B, W]) for the extra
    tile (kernels/listed_records.py).
    CANDIDATES > 0: also the candidate planes and the raw plane after the sample planes
    (tpsample/records.py; RAW_MASS: the raw plane holds the tile's log-mass at T = 1, else a
    copy of the log-mass); NO_REPLACE: sample plane s holds the tile's (s+1)-th best score
    under sample 0's noise.

    inv_temp[b] == 0 marks a greedy row: logits at T = 1, no noise. With NUM_PEERS == 0 the
    records go to rec_ptr; otherwise peer_ptrs [2, NUM_PEERS] (int64) holds the address of this
    rank's slot in each peer's exchange buffer, for each of two alternating buffers, and every
    record is stored to all peers of buffer parity_ptr[0] (P2P fan-out). The parity lives on
    the device so a captured CUDA graph alternates buffers too. PRE_NOISE: g_pre holds the
    noise of the only sample (computed inside the main loop, see tile_logits). CDF: the token
    by inverse CDF (cdf_index) instead of Gumbel-max; needs TILE_MASS, not PRE_NOISE."""
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    if HALVINGS > 0:  # B <= BLOCK_B >> HALVINGS: drop padding columns before the noise
        acc = leading_columns(acc, BLOCK_V, BLOCK_B, HALVINGS)
        offs_b = tl.arange(0, BLOCK_B >> HALVINGS)
        mask_b = offs_b < B
    if HAS_MASK:  # one bit per token; 32 neighbours share a word (one cache line)
        gid = vocab_start + offs_v
        at_m = offs_b[None, :].to(tl.int64) * stride_mask + (gid >> 5)[:, None]
        live = mask_b[None, :] & (offs_v < n_real)[:, None]
        word = tl.load(mask_ptr + at_m, mask=live, other=0)
        if HELD:  # at most one listed token per word keeps its raw logit (the word's first)
            first = tl.load(first_ptr + at_m, mask=live, other=0)
            tl.store(held_ptr + at_m, acc, mask=((first >> (gid & 31)[:, None]) & 1) != 0)
    # Transforms: l = (h.w + bias) * (1 / T); rows beyond the real vocabulary are -inf.
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_v, mask=offs_v < V_rows, other=0.0)[:, None]
    if HAS_MASK:
        acc = tl.where(((word >> (gid & 31)[:, None]) & 1) != 0, acc, float("-inf"))
    if RAW_MASS:  # the log-mass at T = 1
        raw = tl.where((offs_v < n_real)[:, None], acc, float("-inf"))
        raw_m = tl.reduce(raw, 0, _max_propagating_nan)
        raw = tl.where(raw != raw, float("-inf"), raw)
        raw_ms = tl.where(raw_m == float("-inf"), 0.0, raw_m)
        raw_lse = tl.where(raw_m != raw_m, raw_m,
                           raw_ms + tl.log(tl.sum(tl.exp(raw - raw_ms[None, :]), axis=0)))
    inv_t = tl.load(inv_temp_ptr + offs_b, mask=mask_b, other=1.0)
    greedy = inv_t == 0.0
    l = acc * tl.where(greedy, 1.0, inv_t)[None, :]
    l = tl.where((offs_v < n_real)[:, None], l, float("-inf"))
    # The tile max, NaN if any logit of the row in this tile is NaN (a NaN-propagating max:
    # one instruction per token, where a separate any-NaN reduction costs two more)
    m = tl.reduce(l, 0, _max_propagating_nan)
    l = tl.where(l != l, float("-inf"), l)
    if SIDE:
        tl.store(side_ptr + offs_b[None, :].to(tl.int64) * stride_side + offs_v[:, None], l,
                 mask=mask_b[None, :])

    # The tile's log-mass (NaN with m). Without TILE_MASS (no log-probs, max merge) the tile
    # max stands in: log Z is then wrong but unused, and it is still finite exactly when the
    # true one is (degenerate rows agree); the records' logit field is then 0 (see
    # sample_and_store).
    if CDF:  # the log-mass from the subgroups' weights, which the inverse CDF reuses
        e, e_sum, scaled, top = cdf_weights(l, BLOCK_V)
        lse = tl.where(m != m, m, top + tl.log(tl.sum(scaled, axis=0)))
    elif TILE_MASS:
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        lse = m_safe + tl.log(tl.sum(tl.exp(l - m_safe[None, :]), axis=0))
    else:
        lse = m

    seed, off_lo, off_hi = row_noise_keys(seed_ptr, offset_ptr, offs_b, mask_b)
    tile_start = vocab_start + pid_v * BLOCK_V
    local = tl.arange(0, BLOCK_V)[:, None]

    rec = offs_b.to(tl.int64) * rec_stride_b + pid_v.to(tl.int64) * rec_stride_t
    if CANDIDATES > 0:  # the tile's best four by their keys (kernels/tile_candidates.py)
        tl.static_assert(CANDIDATES == 4)
        keys = candidate_key(l, local)
        k0 = tl.max(keys, axis=0)
        keys = tl.where(keys == k0[None, :], NONE, keys)
        k1 = tl.max(keys, axis=0)
        keys = tl.where(keys == k1[None, :], NONE, keys)
        k2 = tl.max(keys, axis=0)
        keys = tl.where(keys == k2[None, :], NONE, keys)
        k3 = tl.max(keys, axis=0)
        cand = rec + num_samples * rec_stride_s
        put_record(rec_ptr, cand, key_logit(k0), (tile_start + key_local_id(k0)).to(tl.float32),
                   key_logit(k1), (tile_start + key_local_id(k1)).to(tl.float32), mask_b,
                   peer_ptrs, parity_ptr, NUM_PEERS)
        put_record(rec_ptr, cand + rec_stride_s, key_logit(k2),
                   (tile_start + key_local_id(k2)).to(tl.float32), key_logit(k3),
                   (tile_start + key_local_id(k3)).to(tl.float32), mask_b, peer_ptrs,
                   parity_ptr, NUM_PEERS)
        if RAW_MASS:
            raw_field = raw_lse
        else:
            raw_field = lse
        zero = tl.zeros_like(lse)
        put_record(rec_ptr, cand + (CANDIDATES // 2) * rec_stride_s, raw_field, zero, zero, zero,
                   mask_b, peer_ptrs, parity_ptr, NUM_PEERS)
    if NO_REPLACE:
        if ALIGNED4:
            x = philox_words_tile(seed, off_lo, off_hi, tl.cast(0, tl.uint32), tile_start,
                                  BLOCK_V, BLOCK_B >> HALVINGS)
        else:
            x = philox_word(seed, off_lo, off_hi, tl.cast(0, tl.uint32), tile_start + local)
        z = tl.fma(gumbel_log(x), tl.where(greedy, 0.0, NOISE_COEF)[None, :], l)
        for s in range(num_samples):
            best = tl.max(z, axis=0)
            idx = tl.min(tl.where(z == best[None, :], local, BLOCK_V), axis=0)
            logit = tl.sum(tl.where(local == idx[None, :], l, 0.0), axis=0)
            z = tl.where(local == idx[None, :], float("-inf"), z)
            put_record(rec_ptr, rec + s * rec_stride_s, best, (tile_start + idx).to(tl.float32),
                       logit, lse, mask_b, peer_ptrs, parity_ptr, NUM_PEERS)
    elif PRE_NOISE:
        sample_and_store(0, l, greedy, seed, off_lo, off_hi, tile_start, local, mask_b, lse,
                         rec_ptr, rec, peer_ptrs, parity_ptr, ALIGNED4, BLOCK_V,
                         BLOCK_B >> HALVINGS, NUM_PEERS, TILE_MASS, g_pre, True)
    else:
        for s in range(num_samples):
            sample_and_store(s, l, greedy, seed, off_lo, off_hi, tile_start, local, mask_b, lse,
                             rec_ptr, rec + s * rec_stride_s, peer_ptrs, parity_ptr, ALIGNED4,
                             BLOCK_V, BLOCK_B >> HALVINGS, NUM_PEERS, TILE_MASS, CDF=CDF,
                             cdf_w=(e, e_sum, scaled) if CDF else None)


@triton.jit
def sample_and_store(s, l, greedy, seed, off_lo, off_hi, tile_start, local, mask_b, lse, rec_ptr,
                     rec, peer_ptrs, parity_ptr, ALIGNED4: tl.constexpr, BLOCK_V: tl.constexpr,
                     BLOCK_B: tl.constexpr, NUM_PEERS: tl.constexpr, TILE_MASS: tl.constexpr,
                     g_pre=None, PRE_NOISE: tl.constexpr = False, CDF: tl.constexpr = False,
                     cdf_w=None):
    """Sample s of one tile: Gumbel-max over the tile and its record (see the epilogue).
    Without TILE_MASS no log-prob is wanted: the winner's logit (a masked gather, one more
    cross-thread reduction) is not extracted and the record holds 0 there. CDF: the token by
    inverse CDF (greedy columns: the first maximum), the score field its logit; cdf_w: what
    cdf_weights returned for l."""
    if CDF:
        z = l
        e, e_sum, scaled = cdf_w
        pick = cdf_index(e, e_sum, scaled, seed, off_lo, off_hi, tl.cast(s, tl.uint32),
                         tile_start, ALIGNED4)
    elif PRE_NOISE:
        z = tl.where(greedy[None, :], l, l + g_pre)
    else:
        if ALIGNED4:
            x = philox_words_tile(seed, off_lo, off_hi, tl.cast(s, tl.uint32), tile_start,
                                  BLOCK_V, BLOCK_B)
        else:
            x = philox_word(seed, off_lo, off_hi, tl.cast(s, tl.uint32), tile_start + local)
        # l + g in one FMA, l exactly for greedy columns (the noise is finite)
        z = tl.fma(gumbel_log(x), tl.where(greedy, 0.0, NOISE_COEF)[None, :], l)
    # argmax, first index among equal maxima: a plain max, then the smallest index holding it
    # (z is never NaN: NaN logits became -inf above), ~5 instructions per token fewer than
    # tl.max(return_indices=True), which carries the index through every comparison
    best = tl.max(z, axis=0)
    idx = tl.min(tl.where(z == best[None, :], local, BLOCK_V), axis=0)
    if CDF:
        idx = tl.where(greedy, idx, pick)
    if TILE_MASS:
        logit = tl.sum(tl.where(local == idx[None, :], l, 0.0), axis=0)
    else:
        logit = tl.zeros_like(best)
    if CDF:
        best = logit
    token = (tile_start + idx).to(tl.float32)
    if NUM_PEERS == 0:
        store_record(rec_ptr, rec, best, token, logit, lse, mask_b)
    else:
        row = tl.load(parity_ptr) * NUM_PEERS
        for p in tl.static_range(NUM_PEERS):
            # the peer slot as an element offset from rec_ptr (slots are 16-byte aligned): a
            # pointer made from an integer loses its alignment, and the stores their width
            delta = (tl.load(peer_ptrs + row + p) - rec_ptr.to(tl.int64, bitcast=True)) >> 2
            store_record_16b(rec_ptr + tl.multiple_of(delta, 4), rec, best, token, logit, lse,
                             mask_b)


@triton.jit
def put_record(rec_ptr, rec, f0, f1, f2, f3, mask_b, peer_ptrs, parity_ptr,
               NUM_PEERS: tl.constexpr):
    """One record per column at rec_ptr + rec, or into every peer (see the epilogue)."""
    if NUM_PEERS == 0:
        store_record(rec_ptr, rec, f0, f1, f2, f3, mask_b)
    else:
        row = tl.load(parity_ptr) * NUM_PEERS
        for p in tl.static_range(NUM_PEERS):
            delta = (tl.load(peer_ptrs + row + p) - rec_ptr.to(tl.int64, bitcast=True)) >> 2
            store_record_16b(rec_ptr + tl.multiple_of(delta, 4), rec, f0, f1, f2, f3, mask_b)


@triton.jit
def _first_crossing(weight, target, pos, AXIS: tl.constexpr, N: tl.constexpr):
    """merge.inverse_cdf along AXIS of weight (>= 0), target = u times the total (broadcastable,
    AXIS kept at 1): the first position whose running sum exceeds the target among those of
    positive weight, else the last of positive weight, else 0. (The total may be summed in
    another order than the running sums: a target at or above their last is the fallback.)"""
    csum = tl.cumsum(weight, axis=AXIS)
    positive = weight > 0.0
    # one reduction for both rules: crossings keep their position, the other positive weights
    # rank after them in reverse order (so the last comes first), weight 0 after everything
    key = tl.where((csum > target) & positive, pos, tl.where(positive, 2 * N - 1 - pos, 2 * N))
    key = tl.min(key, axis=AXIS)
    return tl.where(key < N, key, tl.where(key < 2 * N, 2 * N - 1 - key, 0))


@triton.jit
def cdf_weights(l, BLOCK_V: tl.constexpr):
    """fact 6's weights (tpsample/merge.py) of the transformed logits l [BLOCK_V, BB] (NaN
    already -inf), in 4 subgroups of BLOCK_V / 4 ids: e = exp(l - m_j) [4, SUB, BB], their sums
    S_j [4, 1, BB], the subgroups' masses S_j exp(m_j - M) [4, BB] (0 where the subgroup is
    empty) and M [BB] (0 where the whole tile is): log Z of the tile = M + log(sum of masses)."""
    SUB: tl.constexpr = BLOCK_V // 4
    x = tl.reshape(l, (4, SUB, l.shape[1]))
    m = tl.max(x, axis=1)  # [4, BB]
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    e = tl.exp(x - m_safe[:, None, :])
    e_sum = tl.sum(e, axis=1, keep_dims=True)
    top = tl.max(m, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    scaled = tl.where(m == float("-inf"), 0.0,
                      tl.reshape(e_sum, (4, l.shape[1])) * tl.exp(m_safe - top[None, :]))
    return e, e_sum, scaled, top


@triton.jit
def cdf_index(e, e_sum, scaled, seed, off_lo, off_hi, s, tile_start, ALIGNED4: tl.constexpr):
    """The tile's token by inverse CDF (tpsample/merge.py, fact 6) from cdf_weights' e, e_sum
    and scaled: each subgroup picks one with its uniform, then one more uniform picks the
    subgroup by its mass. The uniforms are noise.cdf_uniforms' (ALIGNED4: tile_start % 4 == 0,
    the four subgroups' words are one Philox call's). The index in the tile [BB]."""
    SUB: tl.constexpr = e.shape[1]
    k = tl.arange(0, 4)[:, None]
    if ALIGNED4:
        zero = tl.zeros_like(seed).to(tl.uint32)
        r0, r1, r2, r3 = philox(seed, (tile_start >> 2).to(tl.uint32) + zero,
                                (s | CDF_STREAM) + zero, off_lo + zero, off_hi + zero)
        u_sub = tl.where(k == 0, r0, tl.where(k == 1, r1, tl.where(k == 2, r2, r3)))
    else:
        u_sub = philox_word(seed, off_lo, off_hi, s | CDF_STREAM, tile_start + k)
    u_sub = ((u_sub >> 9).to(tl.float32) + 0.5) * TWO_POW_M23
    within = _first_crossing(e, u_sub[:, None, :] * e_sum, tl.arange(0, SUB)[None, :, None], 1,
                             SUB)
    u_pick = philox_word(seed, off_lo, off_hi, s | CDF_PICK_STREAM,
                         tile_start + tl.zeros((1, 1), dtype=tl.int32))
    u_pick = ((u_pick >> 9).to(tl.float32) + 0.5) * TWO_POW_M23  # [1, BB]
    sub = _first_crossing(scaled, u_pick * tl.sum(scaled, axis=0)[None, :], k, 0, 4)
    return sub * SUB + tl.sum(tl.where(k == sub[None, :], within, 0), axis=0)


@triton.jit
def store_record(base, rec, best, token, logit, lse, mask):
    """The records at base + rec [BB] (element offsets): four 4-byte stores."""
    tl.store(base + rec + 0, best, mask=mask)
    tl.store(base + rec + 1, token, mask=mask)
    tl.store(base + rec + 2, logit, mask=mask)
    tl.store(base + rec + 3, lse, mask=mask)


@triton.jit
def store_record_16b(base, rec, best, token, logit, lse, mask):
    """The same as one [BB, 4] store of whole records, for stores into peers over NVLink, where
    every partial-sector write is its own transaction (with the tile-major exchange layout a
    program's records are one contiguous run). rec: multiples of 4, base
    16-byte aligned: vector stores as wide as the layout gives a thread (2 fields at
    BLOCK_B = 64 with 4 warps, 4 where a thread holds a whole record)."""
    # join stacks on a new last axis: [BB, j, k] holds field 2j + k
    val = tl.reshape(tl.join(tl.join(best, logit), tl.join(token, lse)), (best.shape[0], 4))
    at = tl.multiple_of(rec, 4)[:, None] + tl.arange(0, 4)[None, :]
    tl.store(base + at, val, mask=mask[:, None])


@triton.jit
def tile_logits(h_ptr, w_ptr, pid_v, pid_b, B, D, V_rows, stride_hb, stride_wv,
                EVEN_D: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_V: tl.constexpr,
                BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, NUM_STAGES: tl.constexpr,
                W_DESC: tl.constexpr = False, seed_ptr=None, offset_ptr=None, tile_start=0,
                NOISE_AT: tl.constexpr = -1, HALVINGS: tl.constexpr = 0,
                NOISE_CHUNKS: tl.constexpr = 1, NOISE_EVERY: tl.constexpr = 0):
    """fp32 logits of one [BLOCK_V, BLOCK_B] tile (vocab × batch) = W_tile · h_tileᵀ.
    W_DESC: w_ptr is a TMA tensor descriptor of W with block [BLOCK_V, BLOCK_D] (the copy
    engine fills out-of-range rows/columns with zeros and no thread holds W addresses).
    NOISE_AT >= 0 (< number of D steps): also return the tile's Gumbel noise for sample 0,
    [BLOCK_V, BLOCK_B >> HALVINGS], computed in D step NOISE_AT while the next stages' loads
    are in flight (in the epilogue it would run with the memory pipe idle). Else g is 0.
    NOISE_CHUNKS (1, 2 or 4) splits it into row blocks drawn NOISE_EVERY steps apart, so no
    single step outlasts the loads in flight."""
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_d = tl.arange(0, BLOCK_D)
    mask_v = offs_v < V_rows
    mask_b = offs_b < B
    if not W_DESC:
        w_ptrs = w_ptr + offs_v[:, None].to(tl.int64) * stride_wv + offs_d[None, :]
    h_ptrs = h_ptr + offs_b[None, :].to(tl.int64) * stride_hb + offs_d[:, None]
    acc = tl.zeros((BLOCK_V, BLOCK_B), dtype=tl.float32)
    CHUNK_V: tl.constexpr = BLOCK_V // NOISE_CHUNKS
    g0 = tl.zeros((CHUNK_V, BLOCK_B >> HALVINGS), dtype=tl.float32)
    g1 = tl.zeros((CHUNK_V, BLOCK_B >> HALVINGS), dtype=tl.float32)
    g2 = tl.zeros((CHUNK_V, BLOCK_B >> HALVINGS), dtype=tl.float32)
    g3 = tl.zeros((CHUNK_V, BLOCK_B >> HALVINGS), dtype=tl.float32)
    for k in tl.range(0, D, BLOCK_D, num_stages=NUM_STAGES):
        if W_DESC:
            w = w_ptr.load([pid_v * BLOCK_V, k])
        elif EVEN_D:
            w = tl.load(w_ptrs, mask=mask_v[:, None], other=0.0)
        else:
            w = tl.load(w_ptrs, mask=mask_v[:, None] & (offs_d[None, :] + k < D), other=0.0)
        if EVEN_D:
            h = tl.load(h_ptrs, mask=mask_b[None, :], other=0.0)
        else:
            h = tl.load(h_ptrs, mask=mask_b[None, :] & (offs_d[:, None] + k < D), other=0.0)
        if FP32_DOT:  # fp32 inputs, or the interpreter (whose bf16 dot is wrong)
            acc = tl.dot(w.to(tl.float32), h.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, h, acc)
        if NOISE_AT >= 0:
            if k == NOISE_AT * BLOCK_D:
                g0 = tile_noise(seed_ptr, offset_ptr, tile_start, pid_b, B, CHUNK_V, BLOCK_B,
                                HALVINGS)
            if NOISE_CHUNKS > 1:
                if k == (NOISE_AT + NOISE_EVERY) * BLOCK_D:
                    g1 = tile_noise(seed_ptr, offset_ptr, tile_start + CHUNK_V, pid_b, B, CHUNK_V,
                                    BLOCK_B, HALVINGS)
            if NOISE_CHUNKS > 2:
                if k == (NOISE_AT + 2 * NOISE_EVERY) * BLOCK_D:
                    g2 = tile_noise(seed_ptr, offset_ptr, tile_start + 2 * CHUNK_V, pid_b, B,
                                    CHUNK_V, BLOCK_B, HALVINGS)
                if k == (NOISE_AT + 3 * NOISE_EVERY) * BLOCK_D:
                    g3 = tile_noise(seed_ptr, offset_ptr, tile_start + 3 * CHUNK_V, pid_b, B,
                                    CHUNK_V, BLOCK_B, HALVINGS)
        if not W_DESC:
            w_ptrs += BLOCK_D
        h_ptrs += BLOCK_D
    if NOISE_CHUNKS == 1:
        g = g0
    elif NOISE_CHUNKS == 2:
        g = stack_rows(g0, g1)
    else:
        g = stack_rows(stack_rows(g0, g1), stack_rows(g2, g3))
    return acc, offs_b, mask_b, g


@triton.jit
def stack_rows(a, b):
    """[R, C], [R, C] → [2R, C], a's rows first (no concatenation op in Triton)."""
    x = tl.permute(tl.join(a, b), (2, 0, 1))
    return tl.reshape(x, (2 * x.shape[1], x.shape[2]))


@triton.jit
def tile_noise(seed_ptr, offset_ptr, tile_start, pid_b, B, BLOCK_V: tl.constexpr,
               BLOCK_B: tl.constexpr, HALVINGS: tl.constexpr):
    """Sample 0's noise for the tile's (possibly trimmed) columns, as the epilogue draws it."""
    offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B >> HALVINGS)
    mask_b = offs_b < B
    seed, off_lo, off_hi = row_noise_keys(seed_ptr, offset_ptr, offs_b, mask_b)
    return gumbel_noise_tile(seed, off_lo, off_hi, tl.cast(0, tl.uint32), tile_start, BLOCK_V,
                             BLOCK_B >> HALVINGS)


@triton.jit
def fused_sample_records_kernel(
    h_ptr, w_ptr, bias_ptr, inv_temp_ptr, seed_ptr, offset_ptr, rec_ptr,
    B, D, V_rows, n_real, vocab_start, num_samples,
    stride_hb, stride_wv, rec_stride_s, rec_stride_b, rec_stride_t, peer_ptrs, parity_ptr,
    mask_ptr, stride_mask, first_ptr, held_ptr, side_ptr, stride_side,
    HAS_BIAS: tl.constexpr, EVEN_D: tl.constexpr, FP32_DOT: tl.constexpr, ALIGNED4: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_STAGES: tl.constexpr, NUM_PEERS: tl.constexpr, HALVINGS: tl.constexpr,
    TILE_MASS: tl.constexpr, PDL: tl.constexpr, W_DESC: tl.constexpr = False,
    NOISE_AT: tl.constexpr = -1, NOISE_CHUNKS: tl.constexpr = 1, NOISE_EVERY: tl.constexpr = 0,
    CDF: tl.constexpr = False, CANDIDATES: tl.constexpr = 0, NO_REPLACE: tl.constexpr = False,
    RAW_MASS: tl.constexpr = False, HAS_MASK: tl.constexpr = False, HELD: tl.constexpr = False,
    AFTER_PREP: tl.constexpr = False, SIDE: tl.constexpr = False,
):
    """NOISE_AT >= 0 requires num_samples == 1 and ALIGNED4 (the launcher checks).
    CANDIDATES, NO_REPLACE, RAW_MASS, mask_ptr (read when HAS_MASK), first_ptr / held_ptr
    (HELD): see tile_records_epilogue. AFTER_PREP: launched as a programmatic dependent of
    listed_records.listed_prep_kernel, which writes the mask and first planes: the matmul
    runs meanwhile, the epilogue waits for that grid first."""
    pid_b = tl.program_id(0)  # batch tiles vary fastest: neighbours share the W tile in L2
    pid_v = tl.program_id(1)
    if PDL:  # stage 2 may be scheduled now; its gdc_wait holds it until this grid is done
        tl.extra.cuda.gdc_launch_dependents()
    acc, offs_b, mask_b, g = tile_logits(
        h_ptr, w_ptr, pid_v, pid_b, B, D, V_rows, stride_hb, stride_wv, EVEN_D, FP32_DOT,
        BLOCK_V, BLOCK_B, BLOCK_D, NUM_STAGES, W_DESC, seed_ptr, offset_ptr,
        vocab_start + pid_v * BLOCK_V, NOISE_AT, HALVINGS, NOISE_CHUNKS, NOISE_EVERY)
    if AFTER_PREP:
        tl.extra.cuda.gdc_wait()
    tile_records_epilogue(acc, pid_v, offs_b, mask_b, B, bias_ptr, inv_temp_ptr, seed_ptr,
                          offset_ptr, rec_ptr, V_rows, n_real, vocab_start, num_samples,
                          rec_stride_s, rec_stride_b, rec_stride_t, peer_ptrs, parity_ptr, HAS_BIAS,
                          ALIGNED4, BLOCK_V, BLOCK_B, NUM_PEERS, HALVINGS, TILE_MASS, g,
                          NOISE_AT >= 0, CDF, CANDIDATES, NO_REPLACE, RAW_MASS, mask_ptr,
                          stride_mask, HAS_MASK, first_ptr, held_ptr, HELD, side_ptr,
                          stride_side, SIDE)


@triton.jit
def logits_records_kernel(
    logits_ptr, bias_ptr, inv_temp_ptr, seed_ptr, offset_ptr, rec_ptr,
    B, V_rows, n_real, vocab_start, num_samples, stride_lb, rec_stride_s, rec_stride_b, rec_stride_t,
    peer_ptrs, parity_ptr, mask_ptr, stride_mask, first_ptr, held_ptr, side_ptr, stride_side,
    HAS_BIAS: tl.constexpr, ALIGNED4: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_B: tl.constexpr,
    NUM_PEERS: tl.constexpr, HALVINGS: tl.constexpr, TILE_MASS: tl.constexpr, PDL: tl.constexpr,
    CDF: tl.constexpr = False, CANDIDATES: tl.constexpr = 0, NO_REPLACE: tl.constexpr = False,
    RAW_MASS: tl.constexpr = False, HAS_MASK: tl.constexpr = False, HELD: tl.constexpr = False,
    SIDE: tl.constexpr = False,
):
    """The same records from fp32 logits [B, V_rows] computed elsewhere (cuBLAS, large B)."""
    pid_b = tl.program_id(0)
    pid_v = tl.program_id(1)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    mask_b = offs_b < B
    ptrs = logits_ptr + offs_b[None, :].to(tl.int64) * stride_lb + offs_v[:, None]
    acc = tl.load(ptrs, mask=mask_b[None, :] & (offs_v < V_rows)[:, None], other=0.0)
    tile_records_epilogue(acc, pid_v, offs_b, mask_b, B, bias_ptr, inv_temp_ptr, seed_ptr,
                          offset_ptr, rec_ptr, V_rows, n_real, vocab_start, num_samples,
                          rec_stride_s, rec_stride_b, rec_stride_t, peer_ptrs, parity_ptr, HAS_BIAS,
                          ALIGNED4, BLOCK_V, BLOCK_B, NUM_PEERS, HALVINGS, TILE_MASS, CDF=CDF,
                          CANDIDATES=CANDIDATES, NO_REPLACE=NO_REPLACE, RAW_MASS=RAW_MASS,
                          mask_ptr=mask_ptr, stride_mask=stride_mask, HAS_MASK=HAS_MASK,
                          first_ptr=first_ptr, held_ptr=held_ptr, HELD=HELD, side_ptr=side_ptr,
                          stride_side=stride_side, SIDE=SIDE)
