"""Stage 2 of filtered sampling: candidate planes → tokens, log-probs, top log-probs, flags.

tpsample/filters.py holds the argument and filters.reduce_candidates the same math in torch
(the tests compare the two on the same records). One program per row, after the call's
reduce_records launch (whose outputs it overwrites where the row is filtered, sampled
without replacement, or asks for raw log-probs). The row's records sit in registers as
[records, CANDIDATES] (one load: the log-masses, the candidates' logits and ids), each
candidate with a 56-bit key that orders it as the row's order does (the logit's
order-preserving bits, then the inverted id). The known prefix (the candidates above tau, at
most CAP of them) is a prefix of each record's candidates, so one cumulative sum over the
records' counts compacts it through a scratch row; it is then sorted by that key in the
smallest of SORT_A / SORT_B / CAP slots that holds it (the sort is the kernel's largest
part, and its cost grows with its size, not with the prefix), and the filters are a
cumulative sum and three masks over it.
"""
import triton
import triton.language as tl

from .. import records
from .fused_sample import NOISE_COEF, gumbel_log, philox_word

NO_TOKEN = tl.constexpr(records.NO_TOKEN)
ID_MASK = tl.constexpr((1 << 24) - 1)
KEY_TOP = tl.constexpr((1 << 56) - 1)
NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def order_key(x, tok):
    """int64 key, larger = earlier in the order (x desc, id asc); x float32, tok float32 id."""
    b = x.to(tl.int32, bitcast=True)
    ob = tl.where(b >= 0, b.to(tl.int64) + 2147483648, 2147483647 - (b & 0x7FFFFFFF).to(tl.int64))
    return (ob << 24) | (ID_MASK - tok.to(tl.int64))


@triton.jit
def kth_key(key, valid, k):
    """The largest v with #{valid & key >= v} >= k: the k-th largest valid key (k >= 1)."""
    lo = tl.cast(0, tl.int64)
    hi = tl.cast(KEY_TOP, tl.int64)
    for _ in range(57):
        mid = lo + (hi - lo + 1) // 2
        ok = tl.sum(tl.where(valid & (key >= mid), 1, 0)) >= k
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def decode_key(key):
    """The logit of order_key's key (key >= 0)."""
    ob = key >> 24
    bits = tl.where(ob >= 2147483648, ob - 2147483648, 4294967295 - ob)
    return bits.to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def pathwise_winner(plane_ptr, at_n, n_ok):
    """The winner of one sample plane's records (reduce_records' pathwise max: the largest
    score, ties to the smaller id) as (token int64, its logit), by two max reductions of
    order keys. -0.0 is +0.0 first (equal scores tie on ids); a -inf or NaN score never wins
    (a row where all are has no finite log Z: its token becomes 0 anyway)."""
    sc = tl.load(plane_ptr + at_n, mask=n_ok, other=NEG_INF)
    sc = tl.where(sc == 0.0, 0.0, sc)
    tok = tl.load(plane_ptr + at_n + 1, mask=n_ok, other=NO_TOKEN)
    key = tl.where(sc > NEG_INF, order_key(sc, tok), -1)
    best = tl.max(key)
    x = tl.max(tl.where(key == best, tl.load(plane_ptr + at_n + 2, mask=n_ok, other=NEG_INF),
                        NEG_INF))
    return tl.where(best >= 0, ID_MASK - (best & ID_MASK), 0), x


@triton.jit
def next_below(key, prev):
    """The largest key below prev (-1 when none)."""
    return tl.max(tl.where(key < prev, key, -1))


@triton.jit
def row_filters(b, top_k_ptr, top_p_ptr, min_p_ptr, HAS_K: tl.constexpr, HAS_P: tl.constexpr,
                HAS_M: tl.constexpr):
    """Row b's (top_k int32, top_p fp32, min_p fp32), the 'off' values where not given."""
    k = tl.cast(0, tl.int32)
    p = tl.cast(1.0, tl.float32)
    m = tl.cast(0.0, tl.float32)
    if HAS_K:
        k = tl.load(top_k_ptr + b)
    if HAS_P:
        p = tl.load(top_p_ptr + b)
    if HAS_M:
        m = tl.load(min_p_ptr + b)
    return k, p, m


@triton.jit
def masses_logsumexp(v):
    """logsumexp of a vector of log-masses (-inf: none; any NaN gives NaN)."""
    nan = tl.max((v != v).to(tl.int32))
    v = tl.where(v != v, NEG_INF, v)
    m = tl.max(v)
    safe = tl.where(tl.abs(m) == float("inf"), 0.0, m)
    lz = tl.where(tl.abs(m) == float("inf"), m, m + tl.log(tl.sum(tl.exp(v - safe))))
    return tl.where(nan > 0, float("nan"), lz)


@triton.jit
def filter_records_kernel(
    rec_ptr, st_slot, st_plane, st_b, st_t, inv_temp_ptr, seed_ptr, offset_ptr,
    top_k_ptr, top_p_ptr, min_p_ptr, tokens_ptr, logprobs_ptr, logz_ptr, top_tok_ptr,
    top_lp_ptr, flag_ptr, scratch_ptr, win_at, S, T, N, n_top, parity_ptr, parity_stride,
    gate_ptr, HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_M: tl.constexpr, RAW: tl.constexpr,
    REPLACE: tl.constexpr, USE_PARITY: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_U: tl.constexpr, CAP: tl.constexpr, SORT_A: tl.constexpr, SORT_B: tl.constexpr,
    PDL: tl.constexpr = False, PATHWISE: tl.constexpr = False,
    WINNER_CERT: tl.constexpr = False, GATE: tl.constexpr = False,
):
    """records [slots, planes, B, T, 4] by strides (st_*: elements); outputs [B, S], [B],
    [B, n_top], flag int32 [B] (1: the row needs the exact fallback; 2: on the
    one-program-per-row path, its top n tokens not all known; a row flagged 1 with top n
    has their logits in its top log-prob plane, for the fallback to finish). USE_PARITY: the
    fan-out's two buffers. The known prefix is sorted in SORT_A, SORT_B or CAP slots, the
    fewest that hold it (SORT_A <= SORT_B <= CAP, powers of 2). GATE: gate (bool [1]) is
    set when a row is flagged (tpsample/fallback_gate.py; the fallback's rows kernel clears
    it).

    PATHWISE (merge "max"): this kernel is the call's whole stage 2. Rows without filters
    take sample s's pathwise winner over sample plane s (pathwise_winner: reduce_records'
    token), its logit over this kernel's log Z; with USE_PARITY its last program flips the
    parity. With replacement every row's sample-0 winner is also stored as its order key
    (logit, id) at scratch[win_at + b], and the row's largest logit and its log Z as keys at
    scratch[win_at + B + b] and [win_at + 2B + b], for the fast path's winner check and its
    cut (kernels/filter_cut.py, XMAX_KNOWN); the first program zeroes the fast path's cut
    list count (int32 at scratch[win_at + 3B], tpsample/filters.py scratch_words).
    WINNER_CERT (PATHWISE, REPLACE, S = 1, no top-n, a call that returns tokens only): a row
    whose candidates do not certify its kept set is certified all the same when its pathwise
    winner is kept, as the known prefix or min-p alone tells (tpsample/filters.py, 2.): it is
    the kept set's winner; its token is written, its log-prob and log Z are NaN (as the fast path
    writes them in such a call).
    PDL: a programmatic dependent of the launch before (stage 1 or the exchange), whose
    records it waits for.
    Otherwise reduce_records runs before it (and flips the parity) and writes the unfiltered
    rows' tokens and log-probs; PDL: a programmatic dependent of reduce_records, which lets
    it start once stage 1's records are complete; it reads the records at once and waits
    for reduce_records to end before it touches the outputs."""
    if PDL:
        if PATHWISE:
            tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        if USE_PARITY and not PATHWISE:  # reduce_records flips the parity at its end
            tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    if USE_PARITY:
        parity = tl.load(parity_ptr)
        if PATHWISE:
            rec_ptr += parity.to(tl.int64) * parity_stride
        else:
            rec_ptr += (1 - parity).to(tl.int64) * parity_stride
    row_ptr = rec_ptr + b.to(tl.int64) * st_b

    # record n (slot n // T, tile n % T): its log-mass, and its K candidates in their order
    n = tl.arange(0, BLOCK_N)
    n_ok = n < N
    at_n = (n // T).to(tl.int64) * st_slot + (n % T).to(tl.int64) * st_t
    c = tl.arange(0, K)[None, :]
    at = at_n[:, None] + (S + c // 2).to(tl.int64) * st_plane + (c % 2) * 2
    x = tl.load(row_ptr + at, mask=n_ok[:, None], other=NEG_INF)
    tok = tl.load(row_ptr + at + 1, mask=n_ok[:, None], other=NO_TOKEN)
    logz = masses_logsumexp(tl.load(row_ptr + at_n + 3, mask=n_ok, other=NEG_INF))
    if RAW:
        logz_raw = masses_logsumexp(tl.load(row_ptr + at_n + (S + K // 2) * st_plane,
                                            mask=n_ok, other=NEG_INF))
    else:
        logz_raw = logz
    finite_row = (logz == logz) & (tl.abs(logz) != float("inf"))
    u_tok0 = tl.cast(0, tl.int64)
    u_x0 = tl.cast(0.0, tl.float32)
    if PATHWISE and REPLACE:  # sample 0's winner: its loads share the log-masses' sectors
        u_tok0, u_x0 = pathwise_winner(row_ptr, at_n, n_ok)
    tau = tl.max(tl.where(c == K - 1, x, NEG_INF))
    finite = x > NEG_INF
    key = tl.where(finite, order_key(x, tok), -1)
    xmax = tl.max(x)
    xm = tl.where(tl.abs(xmax) == float("inf"), 0.0, xmax)
    # the known prefix: the tokens above tau (all candidates), at most CAP of them; a
    # record's known candidates are a prefix of its K (they are in the order)
    kmin = ((order_key(tau, tl.cast(0.0, tl.float32)) >> 24) + 1) << 24
    known = key >= kmin
    M = tl.sum(known.to(tl.int32))
    bound = tau  # >= any token outside the known prefix
    if M > CAP:
        kmin = kth_key(key, finite, CAP)
        known = key >= kmin
        M = CAP
        bound = tl.max(tl.where(finite & (key < kmin), x, NEG_INF))
    per_n = tl.sum(known.to(tl.int32), 1)
    pos = (tl.cumsum(per_n, 0) - per_n)[:, None] + c
    scratch = scratch_ptr + b.to(tl.int64) * CAP
    tl.store(scratch + pos, key, mask=known)
    tl.debug_barrier()

    inv = tl.load(inv_temp_ptr + b)
    k, p, m = row_filters(b, top_k_ptr, top_p_ptr, min_p_ptr, HAS_K, HAS_P, HAS_M)
    if M <= SORT_A:
        known_prefix(b, row_ptr, scratch, M, bound, xm, logz, logz_raw, finite_row, inv, k, p, m,
                     seed_ptr, offset_ptr, tokens_ptr, logprobs_ptr, logz_ptr, top_tok_ptr,
                     top_lp_ptr, flag_ptr, S, T, N, n_top, st_slot, st_plane, st_t, RAW,
                     REPLACE, PDL, BLOCK_U, SORT_A, PATHWISE, at_n, n_ok, u_tok0, u_x0, WINNER_CERT,
                     gate_ptr, GATE)
    elif M <= SORT_B:
        known_prefix(b, row_ptr, scratch, M, bound, xm, logz, logz_raw, finite_row, inv, k, p, m,
                     seed_ptr, offset_ptr, tokens_ptr, logprobs_ptr, logz_ptr, top_tok_ptr,
                     top_lp_ptr, flag_ptr, S, T, N, n_top, st_slot, st_plane, st_t, RAW,
                     REPLACE, PDL, BLOCK_U, SORT_B, PATHWISE, at_n, n_ok, u_tok0, u_x0, WINNER_CERT,
                     gate_ptr, GATE)
    else:
        known_prefix(b, row_ptr, scratch, M, bound, xm, logz, logz_raw, finite_row, inv, k, p, m,
                     seed_ptr, offset_ptr, tokens_ptr, logprobs_ptr, logz_ptr, top_tok_ptr,
                     top_lp_ptr, flag_ptr, S, T, N, n_top, st_slot, st_plane, st_t, RAW,
                     REPLACE, PDL, BLOCK_U, CAP, PATHWISE, at_n, n_ok, u_tok0, u_x0, WINNER_CERT,
                     gate_ptr, GATE)
    if PATHWISE and REPLACE:
        tl.store(scratch_ptr + win_at + b, order_key(u_x0, u_tok0))
        tl.store(scratch_ptr + win_at + tl.num_programs(0) + b, order_key(xmax, u_tok0))
        tl.store(scratch_ptr + win_at + 2 * tl.num_programs(0) + b, order_key(logz, u_tok0))
    if b == 0:
        tl.store(scratch_ptr + win_at + 3 * tl.num_programs(0), tl.cast(0, tl.int64))
    if PATHWISE and USE_PARITY:
        # every program read the parity before its increment (acq_rel orders them), so the
        # program that sees all others done may flip it (as reduce_records does)
        done = tl.atomic_add(parity_ptr + 1, 1, sem="acq_rel")
        if done == tl.num_programs(0) - 1:
            tl.store(parity_ptr, 1 - parity)
            tl.store(parity_ptr + 1, 0)


@triton.jit
def known_prefix(b, row_ptr, scratch, M, bound, xm, logz, logz_raw, finite_row, inv, k, p, m,
                 seed_ptr, offset_ptr, tokens_ptr, logprobs_ptr, logz_ptr, top_tok_ptr,
                 top_lp_ptr, flag_ptr, S, T, N, n_top, st_slot, st_plane, st_t,
                 RAW: tl.constexpr, REPLACE: tl.constexpr, PDL: tl.constexpr,
                 BLOCK_U: tl.constexpr, SORT: tl.constexpr, PATHWISE: tl.constexpr, at_n,
                 n_ok, u_tok0, u_x0, WINNER_CERT: tl.constexpr, gate_ptr, GATE: tl.constexpr):
    """The row's known prefix (M keys in scratch, M <= SORT) sorted, the filters and
    certificates over it, the samples and the top-n; writes the row's outputs. PATHWISE:
    (u_tok0, u_x0) is sample 0's pathwise winner; WINNER_CERT: filter_records_kernel's."""
    q = tl.arange(0, SORT)
    ks = tl.sort(tl.load(scratch + q, mask=q < M, other=-1), descending=True)
    valid = ks >= 0
    xs = decode_key(ks)
    ids = ID_MASK - (ks & ID_MASK)
    e = tl.where(valid, tl.exp(xs - xm), 0.0)

    greedy = inv == 0.0
    kon = k > 0
    pon = p < 1.0
    mon = m > 0.0
    filtered = (kon | pon | mon) & (inv != 0.0)
    in_k = ((q < k).to(tl.int32) + (k <= 0).to(tl.int32)) > 0
    ek = tl.where(in_k, e, 0.0)
    zk = tl.where(kon, tl.sum(ek), tl.exp(logz - xm))
    target = p * zk
    before = tl.cumsum(ek, 0) - ek
    keep_p = ((before < target).to(tl.int32) + (p >= 1.0).to(tl.int32)) > 0
    keep = valid & in_k & keep_p & (e >= m)
    cert_k = (k <= 0) | (k <= M)
    cert_p = (p >= 1.0) | kon | (tl.sum(e) >= target)
    cert_m = mon & (tl.exp(bound - xm) < m) & (cert_k | (p >= 1.0))
    cert = ((kon | pon) & cert_k & cert_p) | cert_m
    won = cert != cert  # the winner certificate (WINNER_CERT)
    if WINNER_CERT:
        # a known token's keep is exact (the prefix before it is known) unless top-p's
        # target needs an uncertified top-k's mass; min-p alone tests any token exactly
        known_kept = tl.sum(((ks == order_key(u_x0, u_tok0.to(tl.float32))) & keep)
                            .to(tl.int32)) > 0
        min_p_kept = (k <= 0) & (p >= 1.0) & (tl.exp(u_x0 - xm) >= m)
        won = (((known_kept & ((k <= 0) | (p >= 1.0))) | min_p_kept) & (cert == 0) & filtered
               & finite_row)
    logz_kept = xm + tl.log(tl.sum(tl.where(keep, e, 0.0)))
    lz = tl.where(filtered & finite_row, logz_kept, logz)  # degenerate rows keep their log Z
    to_raw = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, inv))
    gid = ids.to(tl.int32)

    seed = tl.load(seed_ptr + b)
    off = tl.load(offset_ptr + b)
    off_lo = (off & 0xFFFFFFFF).to(tl.uint32)
    off_hi = ((off >> 32) & 0xFFFFFFFF).to(tl.uint32)
    if PDL and not PATHWISE:  # reduce_records writes the outputs this kernel reads
        tl.extra.cuda.gdc_wait()
    # the samples
    z0 = tl.fma(gumbel_log(philox_word(seed, off_lo, off_hi, tl.cast(0, tl.uint32), gid)),
                NOISE_COEF, xs)
    prev = tl.cast(KEY_TOP + 1, tl.int64)
    u_prev = tl.cast(KEY_TOP + 1, tl.int64)
    for s in range(S):
        if REPLACE:
            z = tl.fma(gumbel_log(philox_word(seed, off_lo, off_hi, tl.cast(s, tl.uint32), gid)),
                       NOISE_COEF, xs)
            zkey = tl.where(keep, order_key(z, ids), -1)
            best = tl.max(zkey)
        else:
            zkey = tl.where(keep, order_key(z0, ids), -1)
            best = next_below(zkey, prev)
            prev = best
        pick = ID_MASK - (best & ID_MASK)
        x_tok = tl.max(tl.where(zkey == best, xs, NEG_INF))
        tok_out = tl.where(best >= 0, pick, -1).to(tl.int64)
        if not REPLACE:
            # rows without filters: their S best perturbed scores are in the sample planes
            u_best = tl.cast(-1, tl.int64)
            for u0 in range(0, S * N, BLOCK_U):
                u = u0 + tl.arange(0, BLOCK_U)
                ua = ((u // N) * st_plane + ((u % N) // T).to(tl.int64) * st_slot
                      + ((u % N) % T).to(tl.int64) * st_t)
                sc = tl.load(row_ptr + ua, mask=u < S * N, other=NEG_INF)
                tk = tl.load(row_ptr + ua + 1, mask=u < S * N, other=NO_TOKEN)
                uk = tl.where(sc > NEG_INF, order_key(sc, tk), -1)
                u_best = tl.maximum(u_best, next_below(uk, u_prev))
            u_x = tl.cast(NEG_INF, tl.float32)
            for u0 in range(0, S * N, BLOCK_U):
                u = u0 + tl.arange(0, BLOCK_U)
                ua = ((u // N) * st_plane + ((u % N) // T).to(tl.int64) * st_slot
                      + ((u % N) % T).to(tl.int64) * st_t)
                sc = tl.load(row_ptr + ua, mask=u < S * N, other=NEG_INF)
                tk = tl.load(row_ptr + ua + 1, mask=u < S * N, other=NO_TOKEN)
                lg = tl.load(row_ptr + ua + 2, mask=u < S * N, other=NEG_INF)
                uk = tl.where(sc > NEG_INF, order_key(sc, tk), -1)
                u_x = tl.maximum(u_x, tl.max(tl.where(uk == u_best, lg, NEG_INF)))
            u_prev = u_best
            tok_out = tl.where(filtered, tok_out,
                               tl.where(u_best >= 0, ID_MASK - (u_best & ID_MASK), -1).to(tl.int64))
            x_tok = tl.where(filtered, x_tok, u_x)
        at_out = b.to(tl.int64) * S + s
        if REPLACE and PATHWISE:  # unfiltered rows: sample s's pathwise winner
            if s == 0:
                u_tok, u_x = u_tok0, u_x0
            else:
                u_tok, u_x = pathwise_winner(row_ptr + s * st_plane, at_n, n_ok)
            tok_out = tl.where(filtered, tok_out, u_tok)
            x_tok = tl.where(filtered, x_tok, u_x)
        elif REPLACE:  # unfiltered rows keep reduce_records' token; its logit for the log-prob
            tok_out = tl.where(filtered, tok_out, tl.load(tokens_ptr + at_out))
            x_tok = tl.where(filtered, x_tok,
                             tl.load(logprobs_ptr + at_out) + tl.load(logz_ptr + b))
        if RAW:
            lp = x_tok * to_raw - logz_raw
        else:
            lp = x_tok - lz
        lp = tl.where(tok_out >= 0, lp, NEG_INF)
        if WINNER_CERT:
            tok_out = tl.where(won, u_tok0, tok_out)
            lp = tl.where(won, float("nan"), lp)
        tl.store(tokens_ptr + at_out, tl.where(finite_row, tok_out, -1))
        tl.store(logprobs_ptr + at_out, tl.where(finite_row, lp, float("nan")))

    fallback = finite_row & ((filtered & (cert == 0) & (won == 0)) | (n_top > M))
    # the top-n log-probs: the first n of the sorted known prefix (a flagged row's top n are
    # known when n <= M, but not its kept set: its logits wait there for the cut's FINAL,
    # kernels/filter_cut.py, which makes them log-probs; raw ones need no kept set)
    if RAW:
        top_lp = xs * to_raw - logz_raw
    else:
        top_lp = tl.where((keep == 0) & filtered, NEG_INF, xs - lz)
        top_lp = tl.where(fallback, xs, top_lp)
    at_top = b.to(tl.int64) * n_top + q
    tl.store(top_tok_ptr + at_top, tl.where(finite_row, tl.where(valid, ids, 0), -1), mask=q < n_top)
    tl.store(top_lp_ptr + at_top, tl.where(finite_row, top_lp, float("nan")), mask=q < n_top)
    if RAW:
        lz = logz_raw
    tl.store(logz_ptr + b, tl.where(won, float("nan"), lz))
    # flag 1: redo the row; 2: redo it on the one-program-per-row path (fallback_rows_kernel),
    # which finds top n tokens the known prefix does not hold
    tl.store(flag_ptr + b, tl.where(fallback, tl.where(n_top > M, 2, 1), 0).to(tl.int32))
    if GATE:
        tl.store(gate_ptr, fallback, mask=fallback)
