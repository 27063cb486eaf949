"""Stage 2: reduce candidate records over groups → tokens, logprobs, log Z (one launch).

The same math as tpsample/merge.py (whose docstring holds the argument); the tests check
that this kernel and merge.reduce_records agree bit for bit on random records.
Records fp32 (score, token, logit, lse), addressed as [slot, S, B, tiles_per_slot, 4]
by strides (N = slots × tiles_per_slot groups per row; record n is slot n // tiles, tile
n % tiles, as in merge.reduce_records); program (b, s) walks row b's N records in chunks, carrying the pathwise winner, the log-mass winner and an online
logsumexp.
"""
import triton
import triton.language as tl

from .fused_sample import gumbel_noise

NO_TOKEN: tl.constexpr = 16777216.0  # 2**24, above every valid id
GROUP_STREAM: tl.constexpr = 0x80000000


@triton.jit
def _better(score_a, tok_a, score_b, tok_b):
    """True where candidate b beats a: larger score, ties to the smaller token id."""
    return (score_b > score_a) | ((score_b == score_a) & (tok_b < tok_a))


@triton.jit
def reduce_records_kernel(
    rec_ptr, inv_temp_ptr, seed_ptr, offset_ptr, tokens_ptr, logprobs_ptr, logz_ptr,
    B, N, tiles_per_slot, rec_stride_slot, rec_stride_s, rec_stride_b,
    LOGMASS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    s = tl.program_id(1)
    num_samples = tl.num_programs(1)
    greedy = tl.load(inv_temp_ptr + b) == 0.0
    seed = tl.load(seed_ptr + b)
    off = tl.load(offset_ptr + b)
    off_lo = (off & 0xFFFFFFFF).to(tl.uint32)
    off_hi = ((off >> 32) & 0xFFFFFFFF).to(tl.uint32)

    row = rec_ptr + s.to(tl.int64) * rec_stride_s + b.to(tl.int64) * rec_stride_b
    best_s = float("-inf")
    best_t = NO_TOKEN
    best_l = 0.0
    mass_s = float("-inf")
    mass_t = NO_TOKEN
    mass_l = 0.0
    run_m = float("-inf")
    run_sum = 0.0
    any_nan = 0
    first = 1
    for n0 in range(0, N, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        ok = n < N
        at = row + (n // tiles_per_slot).to(tl.int64) * rec_stride_slot + (n % tiles_per_slot) * 4
        sc = tl.load(at + 0, mask=ok, other=float("-inf"))
        tk = tl.load(at + 1, mask=ok, other=NO_TOKEN)
        lg = tl.load(at + 2, mask=ok, other=0.0)
        ls = tl.load(at + 3, mask=ok, other=float("-inf"))

        # pathwise max, smallest token among equal scores (merge.pathwise_max)
        c_s = tl.max(sc, axis=0)
        c_t = tl.min(tl.where(sc == c_s, tk, NO_TOKEN), axis=0)
        c_l = tl.sum(tl.where((sc == c_s) & (tk == c_t), lg, 0.0), axis=0)
        take = _better(best_s, best_t, c_s, c_t) | (first == 1)
        best_s = tl.where(take, c_s, best_s)
        best_t = tl.where(take, c_t, best_t)
        best_l = tl.where(take, c_l, best_l)

        # online logsumexp of the group log-masses (a NaN poisons the row)
        is_nan = ls != ls
        any_nan = tl.maximum(any_nan, tl.max(is_nan.to(tl.int32), axis=0))
        ls = tl.where(is_nan, float("-inf"), ls)
        new_m = tl.maximum(run_m, tl.max(ls, axis=0))
        safe_m = tl.where(tl.abs(new_m) == float("inf"), 0.0, new_m)
        run_sum = run_sum * tl.exp(run_m - safe_m) + tl.sum(tl.exp(ls - safe_m), axis=0)
        run_m = new_m

        if LOGMASS:
            # Group-Gumbel-Max (merge.group_gumbel_choice): argmax_k (L_k + h_k)
            h = gumbel_noise(seed, off_lo, off_hi, s.to(tl.uint32) | GROUP_STREAM, n[:, None])
            key = tl.where(ok, ls + tl.reshape(h, (BLOCK_N,)), float("-inf"))
            k_s, k_i = tl.max(key, axis=0, return_indices=True, return_indices_tie_break_left=True)
            k_sel = tl.arange(0, BLOCK_N) == k_i
            take_m = (k_s > mass_s) | (first == 1)
            mass_s = tl.where(take_m, k_s, mass_s)
            mass_t = tl.where(take_m, tl.sum(tl.where(k_sel, tk, 0.0), axis=0), mass_t)
            mass_l = tl.where(take_m, tl.sum(tl.where(k_sel, lg, 0.0), axis=0), mass_l)
        first = 0

    if LOGMASS:
        best_t = tl.where(greedy, best_t, mass_t)
        best_l = tl.where(greedy, best_l, mass_l)
    logz = tl.where(tl.abs(run_m) == float("inf"), run_m, run_m + tl.log(run_sum))
    logz = tl.where(any_nan > 0, float("nan"), logz)
    finite = (logz == logz) & (tl.abs(logz) != float("inf"))
    out = b.to(tl.int64) * num_samples + s
    tl.store(tokens_ptr + out, tl.where(finite, best_t, 0.0).to(tl.int64))
    tl.store(logprobs_ptr + out, tl.where(finite, best_l - logz, float("nan")))
    if s == 0:
        tl.store(logz_ptr + b, logz)
