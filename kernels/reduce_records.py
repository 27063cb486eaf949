"""Stage 2: reduce candidate records over groups → tokens, logprobs, log Z (one launch).

The same math as tpsample/merge.py (whose docstring holds the argument); the tests check
that this kernel and merge.reduce_records agree bit for bit on random records.
Records fp32 (score, token, logit, lse), addressed as [slot, S, B, tiles_per_slot, 4]
by strides (any, the last one 1). N = slots × tiles_per_slot groups per row; record n is
slot n // tiles, tile n % tiles, as in merge.reduce_records. Each (sample, row) pair walks
its N records in chunks, carrying the pathwise winner, the log-mass winner and an online
logsumexp; a program handles BLOCK_R (sample, row) pairs at once.

A chunk costs three cross-thread reductions (one over (score, token, logit) tuples, one over
(lse max, NaN flag), one sum), four with the log-mass merge, and the group noise one Philox
call per four records (its four words: the same words as gumbel_noise). (Six or eight reductions and
a Philox call per record took 1.1-1.2x the time on H100.)
"""
import triton
import triton.language as tl

from .. import records
from .fused_sample import bits_to_gumbel, philox

NO_TOKEN = tl.constexpr(records.NO_TOKEN)  # above every valid id
GROUP_STREAM = tl.constexpr(records.GROUP_STREAM)


@triton.jit
def _better(score_a, tok_a, score_b, tok_b):
    """True where candidate b beats a: larger score, ties to the smaller token id."""
    return (score_b > score_a) | ((score_b == score_a) & (tok_b < tok_a))


@triton.jit
def _pathwise(s1, t1, l1, s2, t2, l2):
    """Combine for the pathwise winner: _better, and a NaN score loses to any number (as a
    NaN-ignoring max would; a NaN score only comes with a degenerate row, whose token is -1)."""
    take = _better(s1, t1, s2, t2) | ((s1 != s1) & (s2 == s2))
    return tl.where(take, s2, s1), tl.where(take, t2, t1), tl.where(take, l2, l1)


@triton.jit
def _max_and_flag(m1, f1, m2, f2):
    return tl.maximum(m1, m2), tl.maximum(f1, f2)


@triton.jit
def _keyed(k1, n1, t1, l1, k2, n2, t2, l2):
    """Combine for the group choice: larger key, ties to the smaller record index."""
    take = (k2 > k1) | ((k2 == k1) & (n2 < n1))
    return tl.where(take, k2, k1), tl.where(take, n2, n1), tl.where(take, t2, t1), tl.where(take, l2, l1)


@triton.jit
def _group_gumbels(seed, off_lo, off_hi, c1, n0, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """gumbel_noise of records n0 + [0, BLOCK_N) (n0 % 4 == 0) for each of BLOCK_R rows:
    one Philox call per four records, whose four words are the four records' words."""
    q = (n0 // 4 + tl.arange(0, BLOCK_N // 4))[None, :]
    zero = tl.zeros((BLOCK_R, BLOCK_N // 4), dtype=tl.uint32)
    r0, r1, r2, r3 = philox(seed + zero.to(tl.int64), q.to(tl.uint32) + zero, c1 + zero,
                            off_lo + zero, off_hi + zero)
    x = tl.join(tl.join(r0, r2), tl.join(r1, r3))  # [R, N/4, k, a] holds word 2k + a
    return bits_to_gumbel(tl.reshape(x, (BLOCK_R, BLOCK_N)))


@triton.jit
def reduce_records_kernel(
    rec_ptr, inv_temp_ptr, seed_ptr, offset_ptr, tokens_ptr, logprobs_ptr, logz_ptr,
    B, S, N, tiles_per_slot, rec_stride_slot, rec_stride_s, rec_stride_b, rec_stride_t, parity_ptr,
    parity_stride,
    LOGMASS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, USE_PARITY: tl.constexpr,
    ONE_SLOT: tl.constexpr = False, PDL: tl.constexpr = False, DEPENDENT: tl.constexpr = False,
):
    # USE_PARITY: the records are in buffer parity_ptr[0] of two, parity_stride elements apart;
    # parity_ptr[1] counts finished programs, and the last one flips the parity for the next
    # call (one launch less than a separate flip; in a CUDA graph it alternates all the same)
    # A program reduces BLOCK_R (sample, row) pairs; pair r is sample r // B of row r % B.
    # ONE_SLOT: slots == 1 (N == tiles_per_slot): no integer division per record.
    # PDL: launched as a programmatic dependent of stage 1; wait until its records are visible.
    # DEPENDENT: then let the filter kernel start (it reads the records, then waits for this grid).
    if PDL:
        tl.extra.cuda.gdc_wait()
        if DEPENDENT:
            tl.extra.cuda.gdc_launch_dependents()
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < S * B
    s = r // B
    b = r % B
    greedy = tl.load(inv_temp_ptr + b, mask=r_ok, other=1.0) == 0.0
    seed = tl.load(seed_ptr + b, mask=r_ok, other=0)[:, None]
    off = tl.load(offset_ptr + b, mask=r_ok, other=0)
    off_lo = (off & 0xFFFFFFFF).to(tl.uint32)[:, None]
    off_hi = ((off >> 32) & 0xFFFFFFFF).to(tl.uint32)[:, None]
    c1 = s.to(tl.uint32)[:, None] | GROUP_STREAM

    if USE_PARITY:
        parity = tl.load(parity_ptr)
        rec_ptr += parity.to(tl.int64) * parity_stride
    row = (s.to(tl.int64) * rec_stride_s + b.to(tl.int64) * rec_stride_b)[:, None]
    inf = float("inf")
    best_s = tl.full((BLOCK_R,), -inf, tl.float32)
    best_t = tl.full((BLOCK_R,), NO_TOKEN, tl.float32)
    best_l = tl.zeros((BLOCK_R,), tl.float32)
    mass_s = tl.full((BLOCK_R,), -inf, tl.float32)
    mass_t = tl.full((BLOCK_R,), NO_TOKEN, tl.float32)
    mass_l = tl.zeros((BLOCK_R,), tl.float32)
    run_m = tl.full((BLOCK_R,), -inf, tl.float32)
    run_sum = tl.zeros((BLOCK_R,), tl.float32)
    any_nan = tl.zeros((BLOCK_R,), tl.int32)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)[None, :]
        ok = (n < N) & r_ok[:, None]
        if ONE_SLOT:
            at = row + n.to(tl.int64) * rec_stride_t
        else:
            at = (row + (n // tiles_per_slot).to(tl.int64) * rec_stride_slot
                  + (n % tiles_per_slot) * rec_stride_t)
        sc = tl.load(rec_ptr + at + 0, mask=ok, other=-inf)
        tk = tl.load(rec_ptr + at + 1, mask=ok, other=NO_TOKEN)
        lg = tl.load(rec_ptr + at + 2, mask=ok, other=0.0)
        ls = tl.load(rec_ptr + at + 3, mask=ok, other=-inf)

        # pathwise max, smallest token among equal scores (merge.pathwise_max)
        c_s, c_t, c_l = tl.reduce((sc, tk, lg), 1, _pathwise)
        take = _better(best_s, best_t, c_s, c_t) | (n0 == 0)
        best_s = tl.where(take, c_s, best_s)
        best_t = tl.where(take, c_t, best_t)
        best_l = tl.where(take, c_l, best_l)

        # online logsumexp of the group log-masses (a NaN poisons the row)
        is_nan = ls != ls
        ls = tl.where(is_nan, -inf, ls)
        c_m, c_nan = tl.reduce((ls, is_nan.to(tl.int32)), 1, _max_and_flag)
        any_nan = tl.maximum(any_nan, c_nan)
        new_m = tl.maximum(run_m, c_m)
        safe_m = tl.where(tl.abs(new_m) == inf, 0.0, new_m)
        run_sum = run_sum * tl.exp(run_m - safe_m) + tl.sum(tl.exp(ls - safe_m[:, None]), axis=1)
        run_m = new_m

        if LOGMASS:
            # Group-Gumbel-Max (merge.group_gumbel_choice): argmax_k (L_k + h_k), the first
            # index among equal keys
            h = _group_gumbels(seed, off_lo, off_hi, c1, n0, BLOCK_R, BLOCK_N)
            key = tl.where(ok, ls + h, -inf)
            k_s, _, k_t, k_l = tl.reduce((key, n + tl.zeros_like(r)[:, None], tk, lg), 1, _keyed)
            take_m = (k_s > mass_s) | (n0 == 0)
            mass_s = tl.where(take_m, k_s, mass_s)
            mass_t = tl.where(take_m, k_t, mass_t)
            mass_l = tl.where(take_m, k_l, mass_l)

    if LOGMASS:
        best_t = tl.where(greedy, best_t, mass_t)
        best_l = tl.where(greedy, best_l, mass_l)
    logz = tl.where(tl.abs(run_m) == inf, run_m, run_m + tl.log(run_sum))
    logz = tl.where(any_nan > 0, float("nan"), logz)
    finite = (logz == logz) & (tl.abs(logz) != inf)
    out = b.to(tl.int64) * S + s
    tl.store(tokens_ptr + out, tl.where(finite, best_t, -1.0).to(tl.int64), mask=r_ok)
    tl.store(logprobs_ptr + out, tl.where(finite, best_l - logz, float("nan")), mask=r_ok)
    tl.store(logz_ptr + b, logz, mask=r_ok & (s == 0))
    if USE_PARITY:
        # every program read the parity before its increment (acq_rel orders them), so the
        # program that sees all others done may flip it
        done = tl.atomic_add(parity_ptr + 1, 1, sem="acq_rel")
        if done == tl.num_programs(0) - 1:
            tl.store(parity_ptr, 1 - parity)
            tl.store(parity_ptr + 1, 0)
