"""The extra tile of constrained decoding (tpsample/constraints.py, 2.): per row, the tokens
listed in logit_adjust that fall in this slot's range, adjusted and written as one more
tile's records; and their bits cleared in the call's copy of the mask, so the tile pass
leaves them out.

Their logits h . w_i: the tile pass computes them anyway, so it keeps them. Per row and
32-token word of the mask, the word's first listed token (the smallest listed id in it, over
all ranks' ranges, so the choice does not depend on the partition) has its bit set in a
`first` plane [B, W]; the tile pass stores that token's raw logit in word i // 32 of a
`held` plane [B, W] fp32 (one slot per word: no ordering, no collisions). A listed token that
shares its word with a smaller listed id (rare: two of 64 random ids share a word with
probability ~0.4 at V = 151936) takes its own dot product from W instead.

listed_prep_kernel, one launch before stage 1: the mask the tile pass reads, the first plane,
and the dot products of the other listed tokens, split over ids (64 per program) and D (up
to 4096 dims per program; partials summed in a fixed order after, so the logits do not
depend on scheduling; programs without such a token read nothing). On Hopper the fused stage-1 kernel is its
programmatic dependent: its matmul runs meanwhile and it waits for the prep grid only before
its epilogue reads the planes. After stage 1 (a programmatic dependent launch
on Hopper): listed_records_kernel, one program per row. The records are those of
tile_records_epilogue for a tile whose tokens are the row's distinct listed ids (Gumbel-max
with the same Philox words, ties to the smaller id), so stage 2, the candidate reduce and
the fallback read it like any other tile; constraints.listed_records is the same in torch.
"""
import triton
import triton.language as tl

from .. import records
from .filter_fallback import store_to_every_rank
from .fused_sample import NOISE_COEF, _max_propagating_nan, gumbel_log, philox_word, put_record

NO_TOKEN = tl.constexpr(records.MAX_VOCAB)


@triton.jit
def _one(x):
    """A scalar as a [1] tensor (put_record stores one record per column)."""
    return x + tl.zeros([1], dtype=x.dtype)


@triton.jit
def _best(z, l, idkey):
    """(best score, its id (the smallest among equal scores; 0 when none), its logit)."""
    best = tl.max(z, axis=0)
    tok = tl.min(tl.where(z == best, idkey, NO_TOKEN), axis=0)
    tok = tl.where(tok == NO_TOKEN, 0, tok)
    logit = tl.max(tl.where(idkey == tok, l, float("-inf")), axis=0)
    return best, tok, logit


@triton.jit
def first_in_word(ids_ptr, b, offs, K, stride_ids, BLOCK_K: tl.constexpr):
    """Whether each id of row b at positions offs (-1 padded) is its word's first listed
    token: no listed id of the row (any range) shares its word with a smaller value."""
    row = ids_ptr + b.to(tl.int64) * stride_ids
    ids = tl.load(row + offs, mask=offs < K, other=-1)
    offs_k = tl.arange(0, BLOCK_K)
    all_ids = tl.load(row + offs_k, mask=offs_k < K, other=-1)
    beaten = (((all_ids[None, :] >> 5) == (ids[:, None] >> 5)) & (all_ids[None, :] >= 0)
              & (all_ids[None, :] < ids[:, None]))
    return tl.max(beaten.to(tl.int32), axis=1) == 0


@triton.jit
def _mask_row(mask_ptr, eff_ptr, first_ptr, ids_ptr, b, K, W, n_real, vocab_start, stride_mask,
              stride_eff, stride_ids, HAS_MASK: tl.constexpr, BLOCK_W: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """Row b of eff [B, W], the mask the tile pass reads: the allowed mask's words (all ones
    without HAS_MASK) with this slot's listed ids' bits cleared; and of first [B, W] (same
    row stride): the bits of this slot's listed ids that are their word's first."""
    offs_k = tl.arange(0, BLOCK_K)  # (the ids first: their loads overlap the words')
    ids = tl.load(ids_ptr + b.to(tl.int64) * stride_ids + offs_k, mask=offs_k < K, other=-1)
    loc = ids - vocab_start
    ok = (ids >= 0) & (loc >= 0) & (loc < n_real)
    bit = 1 << (ids & 31).to(tl.int32)
    at = b.to(tl.int64) * stride_eff + (ids >> 5)
    first = first_in_word(ids_ptr, b, offs_k, K, stride_ids, BLOCK_K)
    for w0 in range(0, W, BLOCK_W):
        offs = w0 + tl.arange(0, BLOCK_W)
        if HAS_MASK:
            words = tl.load(mask_ptr + b.to(tl.int64) * stride_mask + offs, mask=offs < W)
        else:
            words = tl.full([BLOCK_W], -1, dtype=tl.int32)
        tl.store(eff_ptr + b.to(tl.int64) * stride_eff + offs, words, mask=offs < W)
        tl.store(first_ptr + b.to(tl.int64) * stride_eff + offs, tl.zeros_like(words),
                 mask=offs < W)
    tl.debug_barrier()  # the row's words are in place before any thread changes a bit
    tl.atomic_and(eff_ptr + at, ~bit, mask=ok)
    tl.atomic_or(first_ptr + at, bit, mask=ok & first)


@triton.jit
def _dots_part(h_ptr, w_ptr, ids_ptr, dots_ptr, b, j, sp, splits, K, D, n_real, vocab_start,
               stride_hb, stride_wv, stride_ids, SPLIT_D: tl.constexpr, BLOCK_K: tl.constexpr,
               CHUNK_K: tl.constexpr):
    """The partial dot products h[b] . w[id] over dims [sp·SPLIT_D, (sp + 1)·SPLIT_D) of the
    listed ids [j·CHUNK_K, (j + 1)·CHUNK_K) of row b in this slot's range that are not their
    word's first (the tile pass keeps those), into dots [B, splits, BLOCK_K] (0 for the
    others). One id at a time, each a single [SPLIT_D] load of its weight row: a chunk
    rarely has more than one such id, so the program's critical path is one load, where
    walking [CHUNK_K, BLOCK_D] blocks over D was SPLIT_D / BLOCK_D dependent loads."""
    k_idx = tl.arange(0, CHUNK_K)
    offs_k = j * CHUNK_K + k_idx
    ids = tl.load(ids_ptr + b.to(tl.int64) * stride_ids + offs_k, mask=offs_k < K, other=-1)
    loc = ids - vocab_start
    ok = (ids >= 0) & (loc >= 0) & (loc < n_real)
    # (as 0/1 integers: a select here trips a layout bug of Triton 3.6 at CHUNK_K = 64)
    pending = ok.to(tl.int64) * (1 - first_in_word(ids_ptr, b, offs_k, K, stride_ids,
                                                    BLOCK_K).to(tl.int64))
    acc = tl.zeros([CHUNK_K], dtype=tl.float32)
    if tl.max(pending, axis=0) > 0:
        offs_d = sp * SPLIT_D + tl.arange(0, SPLIT_D)
        md = offs_d < D
        hv = tl.load(h_ptr + b.to(tl.int64) * stride_hb + offs_d, mask=md, other=0.0)
        hv = hv.to(tl.float32)
        while tl.max(pending, axis=0) > 0:
            k = tl.min(tl.where(pending != 0, k_idx, CHUNK_K), axis=0)
            row = tl.sum(loc * (k_idx == k).to(tl.int64), axis=0)
            wv = tl.load(w_ptr + row * stride_wv + offs_d, mask=md, other=0.0)
            dot = tl.sum(wv.to(tl.float32) * hv, axis=0)
            acc += (k_idx == k).to(tl.float32) * dot
            pending = pending * (k_idx != k).to(tl.int64)
    tl.store(dots_ptr + (b.to(tl.int64) * splits + sp) * BLOCK_K + offs_k, acc)


@triton.jit
def listed_prep_kernel(mask_ptr, eff_ptr, first_ptr, ids_ptr, h_ptr, w_ptr, dots_ptr, K, W, D,
                       n_real, vocab_start, stride_mask, stride_eff, stride_ids, stride_hb,
                       stride_wv, splits, HAS_MASK: tl.constexpr, BLOCK_W: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT_D: tl.constexpr, CHUNK_K: tl.constexpr,
                       PDL: tl.constexpr = False):
    """Before stage 1, one launch: program (b, 0) writes row b of the eff and first planes
    (_mask_row); program (b, 1 + j·splits + s) part (j, s) of row b's dot products of the
    listed tokens the tile pass does not keep (_dots_part; they read only hidden and W).
    PDL: the next launch may start at once (the fused
    stage-1 kernel, a programmatic dependent that waits for this grid before its epilogue)."""
    b = tl.program_id(0)
    p = tl.program_id(1)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if p == 0:
        _mask_row(mask_ptr, eff_ptr, first_ptr, ids_ptr, b, K, W, n_real, vocab_start,
                  stride_mask, stride_eff, stride_ids, HAS_MASK, BLOCK_W, BLOCK_K)
    else:
        _dots_part(h_ptr, w_ptr, ids_ptr, dots_ptr, b, (p - 1) // splits, (p - 1) % splits,
                   splits, K, D, n_real, vocab_start, stride_hb, stride_wv, stride_ids, SPLIT_D,
                   BLOCK_K, CHUNK_K)


@triton.jit
def listed_logits(dots_ptr, held_ptr, bias_ptr, ids_ptr, values_ptr, penalty_ptr, mask_ptr, b,
                  K, SPLITS, n_real, vocab_start, stride_ids, stride_mask, stride_held,
                  HAS_BIAS: tl.constexpr, HAS_PENALTY: tl.constexpr, HAS_MASK: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """Row b's listed tokens [BLOCK_K]: ids (int64), ok (in this slot's range), keep (ok, the
    first entry of its id, allowed), locc (the weight row; 0 where not ok) and x, the
    adjusted logit before the temperature (-inf where not keep); the dot products from the
    held plane (row stride stride_held) for its words' first tokens, else from
    listed_prep_kernel's partials, summed in a fixed order."""
    offs_k = tl.arange(0, BLOCK_K)
    row_ids = ids_ptr + b.to(tl.int64) * stride_ids
    row_vals = values_ptr + b.to(tl.int64) * stride_ids
    ids = tl.load(row_ids + offs_k, mask=offs_k < K, other=-1)
    loc = ids - vocab_start
    ok = (ids >= 0) & (loc >= 0) & (loc < n_real)
    # a repeated id: its first entry carries the sum of its values, the others leave
    first = ok
    vsum = tl.zeros([BLOCK_K], dtype=tl.float32)
    for j0 in tl.static_range(0, BLOCK_K, 16):
        jj = j0 + tl.arange(0, 16)
        id_j = tl.load(row_ids + jj, mask=jj < K, other=-2)
        v_j = tl.load(row_vals + jj, mask=jj < K, other=0.0)
        eq = ids[:, None] == id_j[None, :]
        dup = tl.max((eq & (jj[None, :] < offs_k[:, None])).to(tl.int32), axis=1)
        first = first & (dup == 0)
        vsum += tl.sum(tl.where(eq, v_j[None, :], 0.0), axis=1)
    keep = first
    if HAS_MASK:
        word = tl.load(mask_ptr + b.to(tl.int64) * stride_mask + (ids >> 5), mask=ok, other=0)
        keep = keep & (((word >> (ids & 31).to(tl.int32)) & 1) != 0)
    locc = tl.where(ok, loc, 0)
    x = tl.zeros([BLOCK_K], dtype=tl.float32)
    for sp in range(SPLITS):
        x += tl.load(dots_ptr + (b.to(tl.int64) * SPLITS + sp) * BLOCK_K + offs_k)
    held = ok & first_in_word(ids_ptr, b, offs_k, K, stride_ids, BLOCK_K)
    x = tl.where(held, tl.load(held_ptr + b.to(tl.int64) * stride_held + (ids >> 5), mask=held,
                               other=0.0), x)
    if HAS_BIAS:
        x += tl.load(bias_ptr + locc, mask=keep, other=0.0)
    if HAS_PENALTY:
        r = tl.load(penalty_ptr + b)
        x = tl.where(x > 0, x / r, x * r)
    x = tl.where(keep, x + vsum, float("-inf"))
    return ids, ok, keep, locc, x


@triton.jit
def listed_records_kernel(
    dots_ptr, held_ptr, bias_ptr, ids_ptr, values_ptr, penalty_ptr, mask_ptr,
    inv_temp_ptr, seed_ptr, offset_ptr, rec_ptr, peer_ptrs, parity_ptr,
    K, SPLITS, n_real, vocab_start, num_samples, stride_ids, stride_mask, stride_held,
    rec_stride_s, rec_stride_b, rec_stride_t, tile,
    HAS_BIAS: tl.constexpr, HAS_PENALTY: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_PEERS: tl.constexpr,
    CANDIDATES: tl.constexpr, NO_REPLACE: tl.constexpr, RAW_MASS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Row b: ids/values [B, K] (int64 -1 padded / fp32), penalty [B], mask int32 [B, W] (the
    allowed mask, HAS_MASK), held (the tile pass's) and dots (listed_prep_kernel's) → the
    records of tile `tile` (every plane). Rows [0, n_real) of this slot are its real tokens,
    global ids vocab_start + row.
    PDL: a dependent launch of stage 1 that waits for it first."""
    b = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    ids, ok, keep, locc, x = listed_logits(
        dots_ptr, held_ptr, bias_ptr, ids_ptr, values_ptr, penalty_ptr, mask_ptr, b, K, SPLITS,
        n_real, vocab_start, stride_ids, stride_mask, stride_held, HAS_BIAS, HAS_PENALTY,
        HAS_MASK, BLOCK_K)
    inv = tl.load(inv_temp_ptr + b)
    greedy = inv == 0.0
    l = x * tl.where(greedy, 1.0, inv)
    m = tl.reduce(l, 0, _max_propagating_nan)
    l = tl.where(l != l, float("-inf"), l)
    m_safe = tl.where(tl.abs(m) == float("inf"), 0.0, m)
    lse = tl.where(m != m, m, m_safe + tl.log(tl.sum(tl.exp(l - m_safe), axis=0)))
    idkey = tl.where(keep, ids, NO_TOKEN)

    seed = tl.load(seed_ptr + b)
    off = tl.load(offset_ptr + b)
    off_lo = (off & 0xFFFFFFFF).to(tl.uint32)
    off_hi = ((off >> 32) & 0xFFFFFFFF).to(tl.uint32)
    gid = tl.where(ids >= 0, ids, 0)
    coef = tl.where(greedy, 0.0, NOISE_COEF)
    mask_b = _one(b) < 1 << 30
    rec = _one(b.to(tl.int64) * rec_stride_b + tl.cast(tile, tl.int64) * rec_stride_t)
    lse1 = _one(lse)
    if NO_REPLACE:
        z = tl.fma(gumbel_log(philox_word(seed, off_lo, off_hi, tl.cast(0, tl.uint32), gid)),
                   coef, l)
        for s in range(num_samples):
            best, tok, logit = _best(z, l, idkey)
            put_record(rec_ptr, rec + s * rec_stride_s, _one(best), _one(tok.to(tl.float32)),
                       _one(logit), lse1, mask_b, peer_ptrs, parity_ptr, NUM_PEERS)
            z = tl.where(idkey == tok, float("-inf"), z)
    else:
        for s in range(num_samples):
            z = tl.fma(gumbel_log(philox_word(seed, off_lo, off_hi, tl.cast(s, tl.uint32), gid)),
                       coef, l)
            best, tok, logit = _best(z, l, idkey)
            put_record(rec_ptr, rec + s * rec_stride_s, _one(best), _one(tok.to(tl.float32)),
                       _one(logit), lse1, mask_b, peer_ptrs, parity_ptr, NUM_PEERS)
    if CANDIDATES > 0:
        c = l
        cand = rec + num_samples * rec_stride_s
        for j in tl.static_range(CANDIDATES // 2):
            x_a, i_a, _a = _best(c, c, idkey)
            c = tl.where(idkey == i_a, float("-inf"), c)
            x_b, i_b, _b = _best(c, c, idkey)
            c = tl.where(idkey == i_b, float("-inf"), c)
            put_record(rec_ptr, cand + j * rec_stride_s, _one(x_a), _one(i_a.to(tl.float32)),
                       _one(x_b), _one(i_b.to(tl.float32)), mask_b, peer_ptrs, parity_ptr,
                       NUM_PEERS)
        if RAW_MASS:
            r_m = tl.reduce(x, 0, _max_propagating_nan)
            xr = tl.where(x != x, float("-inf"), x)
            r_s = tl.where(tl.abs(r_m) == float("inf"), 0.0, r_m)
            raw = tl.where(r_m != r_m, r_m, r_s + tl.log(tl.sum(tl.exp(xr - r_s), axis=0)))
        else:
            raw = lse
        zero = tl.zeros([1], dtype=tl.float32)
        put_record(rec_ptr, cand + (CANDIDATES // 2) * rec_stride_s, _one(raw), zero, zero,
                   zero, mask_b, peer_ptrs, parity_ptr, NUM_PEERS)


@triton.jit
def listed_fallback_kernel(
    dots_ptr, held_ptr, bias_ptr, ids_ptr, values_ptr, penalty_ptr, mask_ptr, inv_temp_ptr,
    flag_ptr, out_ptr, K, SPLITS, n_real, vocab_start, stride_ids, stride_mask, stride_held,
    stride_ob,
    peer_ptrs_ptr, world, calls_ptr,
    HAS_BIAS: tl.constexpr, HAS_PENALTY: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr = False, FANOUT: tl.constexpr = False,
):
    """The device fallback's full rows (kernels/filter_fallback.py): for the rows with
    flag[b] != 0, the listed tokens' transformed logits into out [B, >= V_rows] fp32 at their
    rows, after fallback_logits_kernel wrote -inf there (their bits are cleared in its mask).
    PDL: a programmatic dependent of fallback_logits_kernel. FANOUT (tensor parallel): as
    fallback_logits_kernel's, into this rank's slot of every rank's buffer (after its stores,
    in stream order), nothing once the exchange has failed (calls[0] < 0)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    go = tl.load(flag_ptr + b) != 0
    if FANOUT:
        go = go & (tl.load(calls_ptr) >= 0)
    if go:
        ids, ok, keep, locc, x = listed_logits(
            dots_ptr, held_ptr, bias_ptr, ids_ptr, values_ptr, penalty_ptr, mask_ptr, b, K,
            SPLITS, n_real, vocab_start, stride_ids, stride_mask, stride_held, HAS_BIAS,
            HAS_PENALTY, HAS_MASK, BLOCK_K)
        inv = tl.load(inv_temp_ptr + b)
        l = x * tl.where(inv == 0.0, 1.0, inv)
        at = b.to(tl.int64) * stride_ob + locc
        if FANOUT:
            store_to_every_rank(out_ptr, at, l, peer_ptrs_ptr, world, keep)
        else:
            tl.store(out_ptr + at, l, mask=keep)
