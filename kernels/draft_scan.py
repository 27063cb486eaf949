"""Speculative verification of one-hot drafts around the sampler call (tpsample/verify.py):
one launch before it and one after, where the torch path takes about twenty small ops.

draft_rows_kernel (one program per request b; draft [B, S] int32/int64, seed / offset [B]
int64) writes
    n[b]          the drafts before the first -1 (S when none),
    bad[b]        bit 0: an id outside [-1, vocab); bit 1: an id after a -1,
    seed_rows[b·(S + 1) + i] = seed[b],  offset_rows[b·(S + 1) + i] = offset[b] + i
for the positions i = 0 .. S that the sampler call draws (position i of request b keyed as
plain decoding's step offset_b + i).

accept_scan_kernel (one program per request; y [B·(S + 1)] the sampler's tokens, lp their
log-probs when HAS_LP) accepts x_i while y_i == x_i and i < n[b]; with a = the accepted
count, it writes tokens[b, i] = y[b, i] for i <= a (the accepted drafts, then the first y
that differs or the bonus token) and -1 after, num_accepted[b] = a, and the log-probs
likewise with NaN after. The torch functions tpsample.verify.check_drafts, positions and scan
are the same computation (tested equal).

row_uniforms_kernel gives the draft-probs path its noise (tpsample/noise.py's uniforms, for
per-row keys and per-column ids).
"""
import triton
import triton.language as tl

from .fused_sample import philox_word


@triton.jit
def draft_rows_kernel(draft_ptr, seed_ptr, offset_ptr, n_ptr, bad_ptr, seed_rows_ptr,
                      offset_rows_ptr, vocab, S: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    is_draft = i < S
    d = tl.load(draft_ptr + b * S + i, mask=is_draft, other=-1).to(tl.int64)
    n = tl.min(tl.where(is_draft & (d < 0), i, S), axis=0)
    out_of_range = is_draft & ((d < -1) | (d >= vocab))
    after_end = is_draft & (i > n) & (d >= 0)
    bad = tl.max(tl.where(out_of_range, 1, 0) | tl.where(after_end, 2, 0), axis=0)
    tl.store(n_ptr + b, n.to(tl.int64))
    tl.store(bad_ptr + b, bad.to(tl.int32))
    at = i <= S
    seed = tl.load(seed_ptr + b)
    offset = tl.load(offset_ptr + b)
    tl.store(seed_rows_ptr + b * (S + 1) + i, seed + tl.zeros([BLOCK], tl.int64), mask=at)
    tl.store(offset_rows_ptr + b * (S + 1) + i, offset + i.to(tl.int64), mask=at)


@triton.jit
def accept_scan_kernel(y_ptr, lp_ptr, draft_ptr, n_ptr, tokens_ptr, accepted_ptr, out_lp_ptr,
                       S: tl.constexpr, BLOCK: tl.constexpr, HAS_LP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    at = i <= S
    n = tl.load(n_ptr + b)
    y = tl.load(y_ptr + b * (S + 1) + i, mask=at, other=-1)
    x = tl.load(draft_ptr + b * S + i, mask=i < S, other=-1).to(tl.int64)
    rejected = (i < S) & ((i >= n) | (y != x))
    a = tl.min(tl.where(rejected, i, S), axis=0)
    tl.store(accepted_ptr + b, a.to(tl.int64))
    tl.store(tokens_ptr + b * (S + 1) + i, tl.where(i <= a, y, -1), mask=at)
    if HAS_LP:
        lp = tl.load(lp_ptr + b * (S + 1) + i, mask=at, other=0.0)
        tl.store(out_lp_ptr + b * (S + 1) + i, tl.where(i <= a, lp, float("nan")), mask=at)


@triton.jit
def row_uniforms_kernel(seed_ptr, offset_ptr, index_ptr, out_ptr, C, BLOCKS, c1,
                        BLOCK: tl.constexpr):
    """out[r, j] = noise.uniform(seed[r], offset[r], c1, index[j]) for r < R, j < C (c1 =
    sample | stream), bit for bit: program r · BLOCKS + k writes columns k·BLOCK .. of row r.
    The torch path spends ~200 small ops per call on Philox's rounds."""
    pid = tl.program_id(0).to(tl.int64)
    r = pid // BLOCKS
    j = (pid % BLOCKS) * BLOCK + tl.arange(0, BLOCK)
    m = j < C
    seed = tl.load(seed_ptr + r)
    off = tl.load(offset_ptr + r)
    off_lo = (off & 0xFFFFFFFF).to(tl.uint32)
    off_hi = ((off >> 32) & 0xFFFFFFFF).to(tl.uint32)
    gid = tl.load(index_ptr + j, mask=m, other=0).to(tl.int64)
    x = philox_word(seed, off_lo, off_hi, tl.cast(c1, tl.uint32), gid)
    u = ((x >> 9).to(tl.float32) + 0.5) * (2.0 ** -23)
    tl.store(out_ptr + r * C + j, u, mask=m)
