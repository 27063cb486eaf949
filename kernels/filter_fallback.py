"""The exact fallback of filtered sampling on the device (one GPU): the rows that the
candidate reduce could not certify, redone from their full logits with no host
synchronisation, so filtered calls stay asynchronous and can be captured in a CUDA graph.

tpsample/filters.py, 5.: a flagged row's kept set reaches below the tiles' candidates, so it
is recomputed from the whole row. fallback_logits_kernel recomputes the flagged rows'
transformed logits (one program per 128-token tile; a call without a flagged row costs each
program one scan of the flags). fallback_rows_kernel redoes each flagged row (one program per
row). Every filter keeps a prefix of the order (x desc, id asc), so the kept set is
{key >= cut} for one 56-bit order key (filter_records.order_key): top-k's cut is the k-th
largest key (a bisection on counts), top-p's the largest key whose prefix mass reaches
p * Z_k (a bisection on masses), and min-p is a threshold on exp(x - x_max). The tokens are
then the Gumbel-max over the kept set with the call's noise, as in filter_records, and the
top-n the n largest keys (one more bisection, compacted and sorted). The outputs are
reference.filtered_rows' up to float32 sums (the tests compare them).
"""
import triton
import triton.language as tl

from .filter_records import ID_MASK, KEY_TOP, NEG_INF, decode_key, order_key, row_filters
from .fused_sample import NOISE_COEF, gumbel_log, philox_word


@triton.jit
def store_to_every_rank(out_ptr, at, value, peer_ptrs_ptr, world, mask=None):
    """value at out_ptr + at in every rank's buffer (FANOUT): peer_ptrs int64 [world] holds
    the address of out_ptr's slot in each rank's buffer (symmetric memory), each one used as
    an element offset from out_ptr."""
    for q in range(world):
        delta = (tl.load(peer_ptrs_ptr + q) - out_ptr.to(tl.int64, bitcast=True)) >> 2
        tl.store(out_ptr + delta + at, value, mask=mask)


@triton.jit
def store_to_owner(out_ptr, at, value, rows, peer_ptrs_ptr, world, mask):
    """value[r, :] at out_ptr + at[r, :] in the buffer of rank rows[r] % world only (the
    row's owner under SPLIT; peer_ptrs as store_to_every_rank)."""
    for q in range(world):
        delta = (tl.load(peer_ptrs_ptr + q) - out_ptr.to(tl.int64, bitcast=True)) >> 2
        tl.store(out_ptr + delta + at, value, mask=mask & ((rows % world) == q)[:, None])


@triton.jit
def send_outputs(l_ptr, b64, stride_lb, slot_stride, peer_ptrs_ptr, rank, world, j, value):
    """SPLIT: an owned row's outputs (fp32 words: tokens' bits, log-probs, log Z at columns
    j) into this rank's slot of row b in every other rank's gathered buffer, where no
    logits of that row are gathered (split_outputs reads them)."""
    mine = l_ptr + rank * slot_stride
    for q in range(world):
        if q != rank:
            delta = (tl.load(peer_ptrs_ptr + q) - mine.to(tl.int64, bitcast=True)) >> 2
            tl.store(mine + delta + b64 * stride_lb + j, value)


@triton.jit
def count_flags(flag_ptr, B, BLOCK_F: tl.constexpr):
    """The number of rows flagged in flag_ptr (int32 [B]), by one scan."""
    flagged = tl.cast(0, tl.int32)
    for b0 in range(0, B, BLOCK_F):
        fb = b0 + tl.arange(0, BLOCK_F)
        flagged += tl.sum(tl.load(flag_ptr + fb, mask=fb < B, other=0))
    return flagged


@triton.jit
def fallback_logits_kernel(h_ptr, w_ptr, bias_ptr, inv_temp_ptr, flag_ptr, out_ptr, B, V_rows,
                           n_real, D, stride_hb, stride_wv, stride_ob, mask_ptr, stride_mask,
                           vocab_start, peer_ptrs_ptr, world, calls_ptr, n_tiles, side_ptr,
                           stride_side, HAS_BIAS: tl.constexpr, BLOCK_V: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
                           HAS_MASK: tl.constexpr = False, PDL: tl.constexpr = False,
                           FANOUT: tl.constexpr = False, FROM_SIDE: tl.constexpr = False,
                           BLOCK_R: tl.constexpr = 32, SPLIT: tl.constexpr = False,
                           BLOCK_M: tl.constexpr = 16, F32_DOT: tl.constexpr = False):
    """out[b, tile] = (h[b] . W[tile] + bias) * (1/T_b), -inf from n_real on, for the rows
    b with flag[b] != 0 (out: fp32 [B, n_tiles * BLOCK_V]; other rows are not written); the
    programs take the tiles in turn (a grid of about two per SM: a call without a flagged row
    then costs few programs, one scan of the flags each).
    HAS_MASK: also -inf where the row's mask (int32 [B, W], global ids) has a 0 bit; listed
    tokens of constrained decoding come after (listed_records_kernel, FALLBACK). PDL: a
    programmatic dependent of the filter kernel (it waits for the flags, then lets its own
    dependent start: the near-empty launches of a call without flagged rows overlap).
    FANOUT (tensor parallel): out is this rank's shard slot of a [world, B, tiles * BLOCK_V]
    buffer and each row is stored into that slot of every rank's buffer (peer_ptrs: int64
    [world], the slot's address in each rank's buffer, symmetric memory); a rank whose
    exchange has failed (calls[0] < 0) stores nothing. FROM_SIDE: the rows are read from
    side_ptr (fp32 [B, n_tiles * BLOCK_V], row stride stride_side: the transformed logits
    stage 1 wrote, mask applied) instead of recomputed, BLOCK_R rows per step. SPLIT (with
    FANOUT and FROM_SIDE): row b goes only to its owner, rank b % world, which alone redoes
    it (kernels/filter_cut.py, SPLIT). Recomputed rows: BLOCK_M at a time by tl.dot, on
    float32 operands without TF32 where F32_DOT (float32 inputs; bfloat16 under the
    interpreter, whose dot does not take it), else on the inputs' dtype."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    flagged = count_flags(flag_ptr, B, BLOCK_F)
    if FANOUT:
        flagged = tl.where(tl.load(calls_ptr) < 0, 0, flagged)
    for tile in range(tl.program_id(0), tl.where(flagged > 0, n_tiles, 0), tl.num_programs(0)):
        offs_v = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_v = offs_v < V_rows
        if FROM_SIDE:  # a copy, BLOCK_R rows per step (a row per step leaves each program
            for b0 in range(0, B, BLOCK_R):  # waiting on one 512-byte load at a time)
                rows = b0 + tl.arange(0, BLOCK_R)
                keep = tl.load(flag_ptr + rows, mask=rows < B, other=0) != 0
                keep2 = keep[:, None] & (offs_v[None, :] >= 0)
                rows64 = rows.to(tl.int64)[:, None]
                l = tl.load(side_ptr + rows64 * stride_side + offs_v[None, :], mask=keep2)
                at = rows64 * stride_ob + offs_v[None, :]
                if SPLIT:
                    store_to_owner(out_ptr, at, l, rows, peer_ptrs_ptr, world, keep2)
                elif FANOUT:
                    store_to_every_rank(out_ptr, at, l, peer_ptrs_ptr, world, keep2)
                else:
                    tl.store(out_ptr + at, l, mask=keep2)
        else:  # BLOCK_M rows per step, by the tensor cores: the tile's W is read from
            for b0 in range(0, B, BLOCK_M):  # L2 once per step, not once per row
                rows = b0 + tl.arange(0, BLOCK_M)
                keep = tl.load(flag_ptr + rows, mask=rows < B, other=0) != 0
                if tl.sum(keep.to(tl.int32)) > 0:
                    l = _recomputed_logits(h_ptr, w_ptr, bias_ptr, inv_temp_ptr, rows, keep,
                                           offs_v, mask_v, n_real, D, stride_hb, stride_wv,
                                           mask_ptr, stride_mask, vocab_start, HAS_BIAS,
                                           BLOCK_D, HAS_MASK, F32_DOT)
                    keep2 = keep[:, None] & (offs_v[None, :] >= 0)
                    at = rows.to(tl.int64)[:, None] * stride_ob + offs_v[None, :]
                    if FANOUT:
                        store_to_every_rank(out_ptr, at, l, peer_ptrs_ptr, world, keep2)
                    else:
                        tl.store(out_ptr + at, l, mask=keep2)


@triton.jit
def _recomputed_logits(h_ptr, w_ptr, bias_ptr, inv_temp_ptr, rows, keep, offs_v, mask_v, n_real,
                       D, stride_hb, stride_wv, mask_ptr, stride_mask, vocab_start,
                       HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr, HAS_MASK: tl.constexpr,
                       F32_DOT: tl.constexpr):
    """The transformed logits [rows, tile offs_v] (rows: int32 [BLOCK_M], keep: the rows to
    compute), recomputed from h and W by tl.dot: fp32 sums of the exact products (F32_DOT:
    float32 operands without TF32, as stage 1 takes float32 inputs), in another order than
    stage 1's."""
    acc = tl.zeros((rows.shape[0], offs_v.shape[0]), dtype=tl.float32)
    rows64 = rows.to(tl.int64)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        hv = tl.load(h_ptr + rows64[:, None] * stride_hb + offs_d[None, :],
                     mask=keep[:, None] & mask_d[None, :], other=0.0)
        wv = tl.load(w_ptr + offs_v[:, None].to(tl.int64) * stride_wv + offs_d[None, :],
                     mask=mask_v[:, None] & mask_d[None, :], other=0.0)
        if F32_DOT:
            acc = tl.dot(hv.to(tl.float32), tl.trans(wv.to(tl.float32)), acc,
                         input_precision="ieee")
        else:
            acc = tl.dot(hv, tl.trans(wv), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_v, mask=mask_v, other=0.0)[None, :]
    if HAS_MASK:
        gid = vocab_start + offs_v
        word = tl.load(mask_ptr + rows64[:, None] * stride_mask + (gid >> 5)[None, :],
                       mask=keep[:, None] & (offs_v < n_real)[None, :], other=0)
        acc = tl.where(((word >> (gid & 31)[None, :]) & 1) != 0, acc, NEG_INF)
    inv = tl.load(inv_temp_ptr + rows, mask=keep, other=1.0)
    l = acc * tl.where(inv == 0.0, 1.0, inv)[:, None]
    return tl.where((offs_v < n_real)[None, :], l, NEG_INF)


@triton.jit
def fast_row(b, flag_ptr, inv_temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, calls_ptr,
             HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_M: tl.constexpr,
             SLOTTED: tl.constexpr):
    """Whether flagged row b takes kernels/filter_cut.py's path: flagged 1 (not 2: its top n
    log-probs need this module's path), filtered by top-p and/or min-p, no top-k (and,
    tensor parallel, its gather did not fail). Also returns (p, min_p)."""
    k, p, m = row_filters(b, top_k_ptr, top_p_ptr, min_p_ptr, HAS_K, HAS_P, HAS_M)
    inv = tl.load(inv_temp_ptr + b)
    ok = (tl.load(flag_ptr + b) == 1) & (k <= 0) & ((p < 1.0) | (m > 0.0)) & (inv != 0.0)
    if SLOTTED:
        ok = ok & (tl.load(calls_ptr) >= 0)
    return ok, p, m


@triton.jit
def split_outputs(l_ptr, b, stride_lb, slot_stride, owner, tokens_ptr, logprobs_ptr, logz_ptr,
                  S):
    """Row b's outputs as its owner sent them (send_outputs: S tokens' bits, S log-probs,
    log Z, from column 0 of the owner's slot of row b)."""
    b64 = b.to(tl.int64)
    src = l_ptr + owner.to(tl.int64) * slot_stride + b64 * stride_lb
    for s in range(S):
        tok = tl.load(src + s).to(tl.int32, bitcast=True).to(tl.int64)
        tl.store(tokens_ptr + b64 * S + s, tok)
        tl.store(logprobs_ptr + b64 * S + s, tl.load(src + S + s))
    tl.store(logz_ptr + b, tl.load(src + 2 * S))


@triton.jit
def row_x(row, v, N, slots, SLOTTED: tl.constexpr):
    """The row's logits at columns v (any shape; -inf at v >= N). The row is row[0 : N] or,
    SLOTTED, the ranks' shards one after the other: slots = (columns per shard n, the shard
    stride in floats, starts_ptr: int64 [world], each shard's first global id)."""
    if SLOTTED:
        n, stride, starts_ptr = slots
        slot = v // n
        return tl.load(row + slot.to(tl.int64) * stride + (v - slot * n), mask=v < N,
                       other=NEG_INF)
    else:
        return tl.load(row + v, mask=v < N, other=NEG_INF)


@triton.jit
def row_ids(v, N, vocab_start, slots, SLOTTED: tl.constexpr):
    """The global token ids of columns v (as row_x)."""
    if SLOTTED:
        n, stride, starts_ptr = slots
        slot = v // n
        return tl.load(starts_ptr + slot, mask=v < N, other=0).to(tl.int32) + (v - slot * n)
    else:
        return vocab_start + v


@triton.jit
def row_keys(row, v0, N, vocab_start, slots, BLOCK: tl.constexpr, SLOTTED: tl.constexpr):
    """Logits, order keys (-1: not a candidate, x = -inf) and global ids of the row's
    columns [v0, v0 + BLOCK) (row_x)."""
    v = v0 + tl.arange(0, BLOCK)
    x = row_x(row, v, N, slots, SLOTTED)
    gid = row_ids(v, N, vocab_start, slots, SLOTTED)
    key = tl.where(x > NEG_INF, order_key(x, gid), -1)
    return x, key, gid


@triton.jit
def key_cut(row, N, vocab_start, slots, floor_key, target, xmax, MASS: tl.constexpr,
            BLOCK: tl.constexpr, SLOTTED: tl.constexpr):
    """The largest c >= floor_key (int64) whose tokens {key >= c} reach `target`: in number
    (MASS False: the target-th largest key; floor_key when the row has fewer) or in mass
    exp(x - xmax) (MASS: the key of the token where the prefix mass, in order, first reaches
    target). A bisection over the key range; counts are exact in float32 (N < 2**24)."""
    lo = floor_key
    hi = tl.cast(KEY_TOP, tl.int64)
    for _ in range(57):
        mid = lo + (hi - lo + 1) // 2
        total = tl.cast(0.0, tl.float32)
        for v0 in range(0, N, BLOCK):
            x, key, gid = row_keys(row, v0, N, vocab_start, slots, BLOCK, SLOTTED)
            if MASS:
                total += tl.sum(tl.where(key >= mid, tl.exp(x - xmax), 0.0))
            else:
                total += tl.sum((key >= mid).to(tl.float32))
        ok = total >= target
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def fallback_rows_kernel(
    l_ptr, stride_lb, N, vocab_start, inv_temp_ptr, seed_ptr, offset_ptr, top_k_ptr, top_p_ptr,
    min_p_ptr, tokens_ptr, logprobs_ptr, logz_ptr, top_tok_ptr, top_lp_ptr, flag_ptr,
    scratch_ptr, count_ptr, S, n_top, starts_ptr, slot_n, slot_stride, calls_ptr, rank, world,
    gate_ptr, HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_M: tl.constexpr, RAW: tl.constexpr,
    REPLACE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, CAP: tl.constexpr,
    PDL: tl.constexpr = False, SLOTTED: tl.constexpr = False, FAST: tl.constexpr = False,
    SPLIT: tl.constexpr = False, GATE: tl.constexpr = False,
):
    """Rows b with flag[b] != 0: logits l [B, N] (fallback_logits_kernel) → their tokens,
    log-probs and log Z [B, S] / [B] when the row is filtered, and their top-n [B, n_top]
    (the outputs of filter_records_kernel, overwritten); count int32 [2]: count[0] += the
    rows done here, count[1] += the split rows copied (kernels/filter_cut.py counts the rows
    it redoes there, so a pipeline can tell the two paths' rows apart). PDL: a
    programmatic dependent of the kernel before it (fallback_logits or listed_fallback).
    SLOTTED (tensor parallel): l is [world, B, slot_n], every rank's shard of the rows
    (stride_lb = slot_n, slot_stride = B * slot_n; shard r's first global id starts[r]),
    gathered by the exchange of kernels/exchange_wait.py; when that exchange failed
    (calls[0] < 0) the flagged rows get the degenerate outputs (token -1, NaN log-probs).
    FAST: the rows that fast_row takes are left to kernels/filter_cut.py. SPLIT (with FAST
    and SLOTTED): those rows were redone by their owner (rank b % world), which sent their
    outputs here (send_outputs): the rows this rank does not own copy them (split_outputs).
    GATE: program 0 clears gate (bool [1]), which the filter kernel set if it flagged a row
    (tpsample/fallback_gate.py)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    if GATE:
        if b == 0:
            tl.store(gate_ptr, tl.cast(0, tl.int1))
    slots = (slot_n, slot_stride, starts_ptr)
    flagged = tl.load(flag_ptr + b) != 0
    if SLOTTED:
        calls = tl.load(calls_ptr)
        if flagged & (calls < 0):
            nan = float("nan")
            for s in range(S):
                tl.store(tokens_ptr + b.to(tl.int64) * S + s, tl.cast(-1, tl.int64))
                tl.store(logprobs_ptr + b.to(tl.int64) * S + s, nan)
            tl.store(logz_ptr + b, nan)
            q = tl.arange(0, BLOCK_N)
            tl.store(top_tok_ptr + b.to(tl.int64) * n_top + q, tl.full((BLOCK_N,), -1, tl.int64),
                     mask=q < n_top)
            tl.store(top_lp_ptr + b.to(tl.int64) * n_top + q, tl.full((BLOCK_N,), nan, tl.float32),
                     mask=q < n_top)
        flagged = flagged & (calls >= 0)
    if FAST:
        fast, p_, m_ = fast_row(b, flag_ptr, inv_temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
                                calls_ptr, HAS_K, HAS_P, HAS_M, SLOTTED)
        flagged = flagged & ~fast
        if SPLIT:
            if fast & (b % world != rank):
                split_outputs(l_ptr, b, stride_lb, slot_stride, b % world, tokens_ptr,
                              logprobs_ptr, logz_ptr, S)
                tl.atomic_add(count_ptr + 1, 1)  # (count[1]: filter_cut.py's rows)
    if flagged:
        tl.atomic_add(count_ptr, 1)
        row = l_ptr + b.to(tl.int64) * stride_lb
        inv = tl.load(inv_temp_ptr + b)
        seed = tl.load(seed_ptr + b)
        off = tl.load(offset_ptr + b)
        off_lo = (off & 0xFFFFFFFF).to(tl.uint32)
        off_hi = ((off >> 32) & 0xFFFFFFFF).to(tl.uint32)
        xmax = tl.cast(NEG_INF, tl.float32)
        for v0 in range(0, N, BLOCK):
            x, key, gid = row_keys(row, v0, N, vocab_start, slots, BLOCK, SLOTTED)
            xmax = tl.maximum(xmax, tl.max(x))
        z = tl.cast(0.0, tl.float32)  # flagged rows are finite: xmax is
        for v0 in range(0, N, BLOCK):
            x, key, gid = row_keys(row, v0, N, vocab_start, slots, BLOCK, SLOTTED)
            z += tl.sum(tl.exp(x - xmax))
        logz = xmax + tl.log(z)

        k, p, m = row_filters(b, top_k_ptr, top_p_ptr, min_p_ptr, HAS_K, HAS_P, HAS_M)
        on = (k > 0).to(tl.int32) + (p < 1.0).to(tl.int32) + (m > 0.0).to(tl.int32)
        filtered = on * (inv != 0.0).to(tl.int32) > 0
        m = tl.where(filtered, m, 0.0)
        cut = tl.cast(0, tl.int64)
        if filtered:
            zk = z
            if k > 0:
                cut = key_cut(row, N, vocab_start, slots, tl.cast(0, tl.int64), k, 0.0, False, BLOCK, SLOTTED)
                zk = tl.cast(0.0, tl.float32)
                for v0 in range(0, N, BLOCK):
                    x, key, gid = row_keys(row, v0, N, vocab_start, slots, BLOCK, SLOTTED)
                    zk += tl.sum(tl.where(key >= cut, tl.exp(x - xmax), 0.0))
            if p < 1.0:
                cut = key_cut(row, N, vocab_start, slots, cut, p * zk, xmax, True, BLOCK, SLOTTED)
        kept_mass = tl.cast(0.0, tl.float32)
        for v0 in range(0, N, BLOCK):
            x, key, gid = row_keys(row, v0, N, vocab_start, slots, BLOCK, SLOTTED)
            e = tl.exp(x - xmax)
            kept_mass += tl.sum(tl.where((key >= cut) & (e >= m), e, 0.0))
        lz = tl.where(filtered, xmax + tl.log(kept_mass), logz)
        to_raw = tl.where(inv == 0.0, 1.0, 1.0 / tl.where(inv == 0.0, 1.0, inv))
        logz_raw = logz
        if RAW:
            rmax = xmax * to_raw
            rs = tl.cast(0.0, tl.float32)
            for v0 in range(0, N, BLOCK):
                x, key, gid = row_keys(row, v0, N, vocab_start, slots, BLOCK, SLOTTED)
                rs += tl.sum(tl.exp(x * to_raw - rmax))
            logz_raw = rmax + tl.log(rs)

        if filtered:  # the samples: Gumbel-max (or top-S) over the kept set
            prev = tl.cast(KEY_TOP + 1, tl.int64)
            for s in range(S):
                c1 = tl.cast(0, tl.uint32)
                if REPLACE:
                    c1 = tl.cast(s, tl.uint32)
                best = tl.cast(-1, tl.int64)
                best_x = tl.cast(NEG_INF, tl.float32)
                for v0 in range(0, N, BLOCK):
                    x, key, gid = row_keys(row, v0, N, vocab_start, slots, BLOCK, SLOTTED)
                    keep = (key >= cut) & (tl.exp(x - xmax) >= m)
                    zs = tl.fma(gumbel_log(philox_word(seed, off_lo, off_hi, c1, gid)),
                                NOISE_COEF, x)
                    zkey = tl.where(keep, order_key(zs, gid), -1)
                    if not REPLACE:
                        zkey = tl.where(zkey < prev, zkey, -1)
                    chunk_best = tl.max(zkey)
                    chunk_x = tl.max(tl.where(zkey == chunk_best, x, NEG_INF))
                    best_x = tl.where(chunk_best > best, chunk_x, best_x)
                    best = tl.maximum(best, chunk_best)
                prev = best
                tok = tl.where(best >= 0, ID_MASK - (best & ID_MASK), -1)
                if RAW:
                    lp = best_x * to_raw - logz_raw
                else:
                    lp = best_x - lz
                at = b.to(tl.int64) * S + s
                tl.store(tokens_ptr + at, tok)
                tl.store(logprobs_ptr + at, tl.where(best >= 0, lp, NEG_INF))
            if RAW:
                tl.store(logz_ptr + b, logz_raw)
            else:
                tl.store(logz_ptr + b, lz)

        if n_top > 0:  # the first n of the order: compact the keys >= the n-th, sort them
            cn = key_cut(row, N, vocab_start, slots, tl.cast(0, tl.int64), n_top, 0.0, False, BLOCK, SLOTTED)
            scratch = scratch_ptr + b.to(tl.int64) * CAP
            taken = tl.cast(0, tl.int32)
            for v0 in range(0, N, BLOCK):
                x, key, gid = row_keys(row, v0, N, vocab_start, slots, BLOCK, SLOTTED)
                sel = (key >= cn) & (key >= 0)
                pos = taken + tl.cumsum(sel.to(tl.int32), 0) - 1
                tl.store(scratch + pos, key, mask=sel & (pos < BLOCK_N))
                taken += tl.sum(sel.to(tl.int32))
            tl.debug_barrier()
            q = tl.arange(0, BLOCK_N)
            ks = tl.sort(tl.load(scratch + q, mask=(q < taken) & (q < n_top), other=-1),
                         descending=True)
            xs = decode_key(ks)
            valid = ks >= 0
            if RAW:
                top_lp = xs * to_raw - logz_raw
            else:
                kept = (ks >= cut) & (tl.exp(xs - xmax) >= m)
                top_lp = tl.where(kept, xs - lz, NEG_INF)
            at_top = b.to(tl.int64) * n_top + q
            tl.store(top_tok_ptr + at_top, tl.where(valid, ID_MASK - (ks & ID_MASK), 0),
                     mask=q < n_top)
            tl.store(top_lp_ptr + at_top, tl.where(valid, top_lp, NEG_INF), mask=q < n_top)
