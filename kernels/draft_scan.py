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

The probs_* kernels below are the draft-probs path after its matmul.
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


# ---- full draft distributions (tpsample/verify.py's draft-probs path on the kernels) ----
# p_r, the processed distribution of row r, keeps a prefix of the row's order (logit
# descending, id ascending): with a cut (HAS_CUT: top-k / top-p, found by a sort in torch)
# the tokens up to (cut_l, cut_id); without one the tokens with exp(l - l_max) >= min_p
# (all finite ones where min_p is 0); on greedy rows (inv_temp 0) the argmax with the
# smallest id. log p = l - log Z_kept on the kept tokens (float64). The kernels read the
# matmul's logits and apply the temperature themselves (SCALE: l · inv_temp, 1 on greedy
# rows, the multiply torch's path does), so the [R, C] logits are read, never rewritten.
# Each row is split into G chunks of CHUNK columns. Launches:
#   probs_max    per row and chunk (read once, whole): the max, the smallest id there, the
#                draft's logit, NaNs; without a filter (MASS) also the chunk's mass
#                sum exp(l - chunk max)
#   probs_mass   (a filter: min-p or a cut) per row and chunk: the kept mass under the row max
#   probs_accept per request: the verdicts, the picked row's max, argmax id and log Z
#   probs_pick   per request and chunk of PICK_CHUNK columns: the best residual and target
#                scores at the picked row
#   probs_finish per request: the pick and the outputs.
# A row whose log Z is not finite (a NaN, +inf, nothing finite) accepts nothing and picks
# nothing (-1).
NONE_ID = tl.constexpr(9223372036854775807)


@triton.jit
def _kept(l, ids, xmax, top, greedy, m, cut_l, cut_id, HAS_CUT: tl.constexpr):
    if HAS_CUT:
        k = (l > cut_l) | ((l == cut_l) & (ids <= cut_id))
    else:
        k = tl.where(m > 0, tl.exp(l.to(tl.float64) - xmax.to(tl.float64)) >= m.to(tl.float64),
                     l > float("-inf"))
    k = k & (l > float("-inf"))
    return tl.where(greedy, (l == xmax) & (ids == top), k)


@triton.jit
def _row_filters(r, inv_ptr, min_p_ptr, cut_l_ptr, cut_id_ptr, HAS_CUT: tl.constexpr):
    greedy = tl.load(inv_ptr + r) == 0
    m = tl.load(min_p_ptr + r)
    cut_l = 0.0
    cut_id = 0
    if HAS_CUT:
        cut_l = tl.load(cut_l_ptr + r)
        cut_id = tl.load(cut_id_ptr + r)
    return greedy, m, cut_l, cut_id


@triton.jit
def _scale(inv_ptr, r, SCALE: tl.constexpr):
    """Row r's logit multiplier: 1 / T (1 on greedy rows) when SCALE, else 1."""
    inv = tl.load(inv_ptr + r)
    return tl.where(inv == 0, 1.0, inv) if SCALE else tl.full([], 1.0, tl.float32)


@triton.jit
def _chunk_block(l_ptr, ids_ptr, id0, r, c, c0, C, s, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                 ARANGE: tl.constexpr):
    """Columns c·CHUNK + c0 + [0, BLOCK) of row r: (logits · s, -inf past C; ids, -1 past C).
    ARANGE: the ids are id0 + column (not read from ids_ptr)."""
    cols = c * CHUNK + c0 + tl.arange(0, BLOCK)
    ok = cols < C
    if ARANGE:
        ids = tl.where(ok, id0 + cols.to(tl.int64), -1)
    else:
        ids = tl.load(ids_ptr + cols, mask=ok, other=-1)
    return tl.load(l_ptr + r * C + cols, mask=ok, other=float("-inf")) * s, ids


@triton.jit
def probs_max_kernel(l_ptr, ids_ptr, id0, C, inv_ptr, draft_ptr, pmax_ptr, ptop_ptr, plx_ptr,
                     pnan_ptr, pz_ptr, G, S: tl.constexpr, CHUNK: tl.constexpr,
                     SCALE: tl.constexpr, MASS: tl.constexpr, ARANGE: tl.constexpr):
    """Program r·G + c: chunk c of row r = b·(S + 1) + i of l [R, C] (ids [C] the columns'
    global ids), read once, whole: its largest logit, the smallest id there, the largest
    logit of the draft x = draft[b, i]'s columns (i < S), whether it holds a NaN; with MASS
    (no filter: every finite logit is kept) also sum exp(l - the chunk's max) over its
    finite logits (fp32 terms summed in float64). [R, G] each."""
    pid = tl.program_id(0).to(tl.int64)
    r = pid // G
    c = pid % G
    b = r // (S + 1)
    i = r % (S + 1)
    s = _scale(inv_ptr, r, SCALE)
    x = tl.load(draft_ptr + b * S + i, mask=i < S, other=-1)
    l, ids = _chunk_block(l_ptr, ids_ptr, id0, r, c, 0, C, s, CHUNK, CHUNK, ARANGE)
    finite_or_inf = tl.where(l == l, l, float("-inf"))  # (NaN: the row has no answer)
    xmax = tl.max(finite_or_inf, axis=0)
    tl.store(pmax_ptr + pid, xmax)
    tl.store(ptop_ptr + pid, tl.min(tl.where(finite_or_inf == xmax, ids, NONE_ID), axis=0))
    tl.store(plx_ptr + pid, tl.max(tl.where(ids == x, finite_or_inf, float("-inf")), axis=0))
    tl.store(pnan_ptr + pid, tl.max((l != l).to(tl.int32), axis=0))
    if MASS:
        z = tl.where(finite_or_inf > float("-inf"), tl.exp(finite_or_inf - xmax), 0.0)
        tl.store(pz_ptr + pid, tl.sum(z.to(tl.float64), axis=0))


@triton.jit
def _rows_stats(r, on, pmax_ptr, ptop_ptr, plx_ptr, pnan_ptr, G, BLOCK_G: tl.constexpr):
    """Rows r [N] (where on), from their G chunks' partials each: the largest logit, the
    smallest id there, the draft's logit, whether log Z is not finite; and the chunks'
    maxima [N, BLOCK_G]."""
    g = tl.arange(0, BLOCK_G)[None, :]
    ok = on[:, None] & (g < G)
    at = r[:, None] * G + g
    pm = tl.load(pmax_ptr + at, mask=ok, other=float("-inf"))
    xmax = tl.max(pm, axis=1)
    pt = tl.load(ptop_ptr + at, mask=ok, other=NONE_ID)
    top = tl.min(tl.where(pm == xmax[:, None], pt, NONE_ID), axis=1)
    lx = tl.max(tl.load(plx_ptr + at, mask=ok, other=float("-inf")), axis=1)
    nan = tl.max(tl.load(pnan_ptr + at, mask=ok, other=0), axis=1)
    bad = (nan > 0) | (xmax == float("inf")) | (xmax == float("-inf"))
    return xmax, top, lx, bad, pm


@triton.jit
def probs_mass_kernel(l_ptr, ids_ptr, id0, C, inv_ptr, min_p_ptr, cut_l_ptr, cut_id_ptr,
                      pmax_ptr, ptop_ptr, plx_ptr, pnan_ptr, pz_ptr, G, GT,
                      HAS_CUT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                      BLOCK_G: tl.constexpr, SCALE: tl.constexpr, ARANGE: tl.constexpr):
    """Program r·G + c (a filter: min-p or a cut): the kept tokens' mass of chunk c of row
    r, sum exp(l - l_max) under the row's max (float64) [R, G]. The rows' stats: [R, GT]
    partials (GT = G; tensor parallel: every rank's G chunks, gathered)."""
    pid = tl.program_id(0).to(tl.int64)
    r = pid // G
    c = pid % G
    one = r + tl.zeros([1], tl.int64)
    xmax1, top1, _, _, _ = _rows_stats(one, one >= 0, pmax_ptr, ptop_ptr, plx_ptr, pnan_ptr,
                                       GT, BLOCK_G)
    xmax = tl.max(xmax1, axis=0)
    top = tl.min(top1, axis=0)
    greedy, m, cut_l, cut_id = _row_filters(r, inv_ptr, min_p_ptr, cut_l_ptr, cut_id_ptr,
                                            HAS_CUT)
    s = _scale(inv_ptr, r, SCALE)
    z = tl.zeros([BLOCK], tl.float64)
    for c0 in range(0, CHUNK, BLOCK):
        l, ids = _chunk_block(l_ptr, ids_ptr, id0, r, c, c0, C, s, CHUNK, BLOCK, ARANGE)
        k = _kept(l, ids, xmax, top, greedy, m, cut_l, cut_id, HAS_CUT)
        z += tl.where(k, tl.exp(l.to(tl.float64) - xmax.to(tl.float64)), 0.0)
    tl.store(pz_ptr + pid, tl.sum(z, axis=0))


@triton.jit
def _rows_logp(r, on, draft, inv_ptr, min_p_ptr, cut_l_ptr, cut_id_ptr, pmax_ptr, ptop_ptr,
               plx_ptr, pnan_ptr, pz_ptr, G, HAS_CUT: tl.constexpr, BLOCK_G: tl.constexpr,
               MASS: tl.constexpr):
    """Rows r [BLOCK_S] (where on), from their G chunks' partials each: the largest logit,
    the smallest id there, log Z of the kept tokens (float64; NaN where log Z is not
    finite) and log p of the token draft [BLOCK_S] there (-inf where not kept). MASS: the
    chunks' masses are each under the chunk's own max."""
    xmax, top, lx, bad, pm = _rows_stats(r, on, pmax_ptr, ptop_ptr, plx_ptr, pnan_ptr, G,
                                         BLOCK_G)
    g = tl.arange(0, BLOCK_G)[None, :]
    z = tl.load(pz_ptr + r[:, None] * G + g, mask=on[:, None] & (g < G), other=0.0)
    if MASS:
        z = tl.where(pm > float("-inf"),
                     z * tl.exp(pm.to(tl.float64) - xmax.to(tl.float64)[:, None]), 0.0)
    logz = tl.where(bad, float("nan"), xmax.to(tl.float64) + tl.log(tl.sum(z, axis=1)))
    greedy = tl.load(inv_ptr + r, mask=on, other=1.0) == 0
    m = tl.load(min_p_ptr + r, mask=on, other=0.0)
    cut_l = 0.0
    cut_id = 0
    if HAS_CUT:
        cut_l = tl.load(cut_l_ptr + r, mask=on, other=0.0)
        cut_id = tl.load(cut_id_ptr + r, mask=on, other=0)
    k_x = _kept(lx, draft, xmax, top, greedy, m, cut_l, cut_id, HAS_CUT) & (draft >= 0)
    lp_x = tl.where(k_x, tl.where(greedy, 0.0, lx.to(tl.float64) - logz), float("-inf"))
    return xmax, top, logz, tl.where(bad, float("nan"), lp_x)


@triton.jit
def probs_accept_kernel(inv_ptr, min_p_ptr, cut_l_ptr, cut_id_ptr, pmax_ptr, ptop_ptr,
                        plx_ptr, pnan_ptr, pz_ptr, GT, q_ptr, V, draft_ptr, n_ptr,
                        seed_rows_ptr, offset_rows_ptr, accepted_ptr, lpx_ptr, bad_ptr,
                        rmax_ptr, rtop_ptr, rlogz_ptr, ACCEPT: tl.constexpr, S: tl.constexpr,
                        HAS_CUT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
                        MASS: tl.constexpr):
    """Program b: the verdicts of request b, x_i accepted while u_i · q_i(x_i) < p_i(x_i)
    and i < n[b] (u_i = noise.uniform(seed, offset + i, 0, 0, ACCEPT) of position i); the
    accepted count a, the drafts' log p (lpx [B·(S + 1)]), whether the picked row
    b·(S + 1) + a has no finite log Z (bad), and that row's max, smallest id there and
    log Z (rmax, rtop, rlogz [B]). The S + 1 rows at once, from their [R, GT] partials
    (tensor parallel: every rank's chunks, gathered; every rank computes the same)."""
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_S)
    on = i <= S
    is_draft = i < S
    r = b * (S + 1) + i
    x = tl.load(draft_ptr + b * S + i, mask=is_draft, other=-1).to(tl.int64)
    xmax, top, logz, lp_x = _rows_logp(r, on, x, inv_ptr, min_p_ptr, cut_l_ptr, cut_id_ptr,
                                       pmax_ptr, ptop_ptr, plx_ptr, pnan_ptr, pz_ptr, GT,
                                       HAS_CUT, BLOCK_G, MASS)
    q_x = tl.load(q_ptr + (b * S + i) * V + tl.minimum(tl.maximum(x, 0), V - 1), mask=is_draft,
                  other=0.0)
    seed = tl.load(seed_rows_ptr + r, mask=on, other=0)
    off = tl.load(offset_rows_ptr + r, mask=on, other=0)
    w = philox_word(seed, (off & 0xFFFFFFFF).to(tl.uint32),
                    ((off >> 32) & 0xFFFFFFFF).to(tl.uint32), tl.cast(ACCEPT, tl.uint32),
                    tl.zeros([BLOCK_S], tl.int64))
    u = ((w >> 9).to(tl.float32) + 0.5) * (2.0 ** -23)
    n = tl.load(n_ptr + b)
    ok = (x >= 0) & (u.to(tl.float64) * q_x.to(tl.float64) < tl.exp(lp_x)) & (i < n)
    a = tl.min(tl.where(is_draft & ~ok, i, S), axis=0).to(tl.int64)
    tl.store(lpx_ptr + r, lp_x, mask=is_draft)
    tl.store(accepted_ptr + b, a)
    pick = i == a
    logz_a = tl.sum(tl.where(pick, logz, 0.0), axis=0)
    tl.store(bad_ptr + b, (logz_a != logz_a).to(tl.int32))
    tl.store(rmax_ptr + b, tl.sum(tl.where(pick, xmax, 0.0), axis=0))
    tl.store(rtop_ptr + b, tl.sum(tl.where(pick, top, 0), axis=0))
    tl.store(rlogz_ptr + b, logz_a)


@triton.jit
def _better(z, zid, best, best_id):
    return (z > best) | ((z == best) & (zid < best_id))


@triton.jit
def probs_pick_kernel(l_ptr, ids_ptr, id0, C, inv_ptr, min_p_ptr, cut_l_ptr, cut_id_ptr, q_ptr,
                      V, n_ptr, seed_rows_ptr, offset_rows_ptr, accepted_ptr, rmax_ptr,
                      rtop_ptr, rlogz_ptr, G, pbest_ptr, pid_ptr, plp_ptr, pmass_ptr,
                      S: tl.constexpr, HAS_CUT: tl.constexpr, CHUNK: tl.constexpr,
                      BLOCK: tl.constexpr, SCALE: tl.constexpr, ARANGE: tl.constexpr):
    """Program b·G + c (after probs_accept_kernel): over chunk c of row r = b·(S + 1) + a
    (a = the accepted count), with the token noise of that position, the best score of the
    target log p and, where the drafts were rejected there (a < n), of the residual
    log max(0, p - q_a), each with its id (ties to the smaller) and log p, and whether the
    residual has mass there: pbest, pid, plp [B, G, 2] (residual, target), pmass [B, G].
    The residual's p and p - q are float64; without a rejection they are not computed."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // G
    c = pid % G
    n = tl.load(n_ptr + b)
    a = tl.load(accepted_ptr + b)
    r = b * (S + 1) + a
    xmax = tl.load(rmax_ptr + b)
    top = tl.load(rtop_ptr + b)
    logz = tl.load(rlogz_ptr + b)
    greedy, m, cut_l, cut_id = _row_filters(r, inv_ptr, min_p_ptr, cut_l_ptr, cut_id_ptr,
                                            HAS_CUT)
    s = _scale(inv_ptr, r, SCALE)
    seed = tl.load(seed_rows_ptr + r)
    off = tl.load(offset_rows_ptr + r)
    off_lo = (off & 0xFFFFFFFF).to(tl.uint32)
    off_hi = ((off >> 32) & 0xFFFFFFFF).to(tl.uint32)
    q_row = q_ptr + (b * S + tl.minimum(a, S - 1)) * V
    zr = tl.full([BLOCK], float("-inf"), tl.float32)
    zr_id = tl.full([BLOCK], NONE_ID, tl.int64)
    zr_lp = tl.zeros([BLOCK], tl.float64)
    zp = tl.full([BLOCK], float("-inf"), tl.float32)
    zp_id = tl.full([BLOCK], NONE_ID, tl.int64)
    zp_lp = tl.zeros([BLOCK], tl.float64)
    mass = tl.zeros([BLOCK], tl.int32)
    if a < n:  # a rejection: the residual (and the target, should it have no mass)
        for c0 in range(0, CHUNK, BLOCK):
            l, ids = _chunk_block(l_ptr, ids_ptr, id0, r, c, c0, C, s, CHUNK, BLOCK, ARANGE)
            k = _kept(l, ids, xmax, top, greedy, m, cut_l, cut_id, HAS_CUT)
            lp = tl.where(k, tl.where(greedy, 0.0, l.to(tl.float64) - logz), float("-inf"))
            p = tl.exp(lp)
            q = tl.load(q_row + tl.minimum(tl.maximum(ids, 0), V - 1),
                        mask=(l > float("-inf")) & (l < float("inf")), other=0.0)
            res = tl.maximum(p - q.to(tl.float64), 0.0)
            word = philox_word(seed, off_lo, off_hi, tl.cast(0, tl.uint32), ids)
            g = -tl.log(-tl.log(((word >> 9).to(tl.float32) + 0.5) * (2.0 ** -23)))
            z1 = tl.where(res > 0, tl.log(res).to(tl.float32) + g, float("-inf"))
            z2 = tl.where(p > 0, lp.to(tl.float32) + g, float("-inf"))
            mass = mass | (res > 0).to(tl.int32)
            b1 = _better(z1, ids, zr, zr_id)
            zr_id = tl.where(b1, ids, zr_id)
            zr_lp = tl.where(b1, lp, zr_lp)
            zr = tl.where(b1, z1, zr)
            b2 = _better(z2, ids, zp, zp_id)
            zp_id = tl.where(b2, ids, zp_id)
            zp_lp = tl.where(b2, lp, zp_lp)
            zp = tl.where(b2, z2, zp)
    else:  # every draft accepted: the bonus token from p
        for c0 in range(0, CHUNK, BLOCK):
            l, ids = _chunk_block(l_ptr, ids_ptr, id0, r, c, c0, C, s, CHUNK, BLOCK, ARANGE)
            k = _kept(l, ids, xmax, top, greedy, m, cut_l, cut_id, HAS_CUT)
            lp = tl.where(k, tl.where(greedy, 0.0, l.to(tl.float64) - logz), float("-inf"))
            word = philox_word(seed, off_lo, off_hi, tl.cast(0, tl.uint32), ids)
            g = -tl.log(-tl.log(((word >> 9).to(tl.float32) + 0.5) * (2.0 ** -23)))
            z2 = tl.where(k, lp.to(tl.float32) + g, float("-inf"))
            b2 = _better(z2, ids, zp, zp_id)
            zp_id = tl.where(b2, ids, zp_id)
            zp_lp = tl.where(b2, lp, zp_lp)
            zp = tl.where(b2, z2, zp)
    br = tl.max(zr, axis=0)
    br_id = tl.min(tl.where(zr == br, zr_id, NONE_ID), axis=0)
    bp = tl.max(zp, axis=0)
    bp_id = tl.min(tl.where(zp == bp, zp_id, NONE_ID), axis=0)
    tl.store(pbest_ptr + pid * 2, br)
    tl.store(pid_ptr + pid * 2, br_id)
    tl.store(plp_ptr + pid * 2, tl.max(tl.where((zr == br) & (zr_id == br_id), zr_lp,
                                                float("-inf")), axis=0))
    tl.store(pbest_ptr + pid * 2 + 1, bp)
    tl.store(pid_ptr + pid * 2 + 1, bp_id)
    tl.store(plp_ptr + pid * 2 + 1, tl.max(tl.where((zp == bp) & (zp_id == bp_id), zp_lp,
                                                    float("-inf")), axis=0))
    tl.store(pmass_ptr + pid, tl.max(mass, axis=0))


@triton.jit
def probs_finish_kernel(draft_ptr, accepted_ptr, lpx_ptr, bad_ptr, pbest_ptr, pid_ptr,
                        plp_ptr, pmass_ptr, G, tokens_ptr, lp_out_ptr, S: tl.constexpr,
                        HAS_LP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program b (after probs_pick_kernel): the pick (the residual's best over the chunks if
    it has mass in any, else the target's; -1 where no score is finite or the picked row's
    log Z is not: bad[b]), then tokens [B, S + 1] (the accepted drafts, the pick, -1 after),
    and with HAS_LP their log p (float32; NaN after and at -1)."""
    b = tl.program_id(0).to(tl.int64)
    a = tl.load(accepted_ptr + b)
    g = tl.arange(0, BLOCK_G)
    on = g < G
    use_res = tl.max(tl.load(pmass_ptr + b * G + g, mask=on, other=0), axis=0) > 0
    k = tl.where(use_res, 0, 1)
    z = tl.load(pbest_ptr + (b * G + g) * 2 + k, mask=on, other=float("-inf"))
    zid = tl.load(pid_ptr + (b * G + g) * 2 + k, mask=on, other=NONE_ID)
    zlp = tl.load(plp_ptr + (b * G + g) * 2 + k, mask=on, other=float("-inf"))
    best = tl.max(z, axis=0)
    tok = tl.min(tl.where(z == best, zid, NONE_ID), axis=0)
    lp_tok = tl.max(tl.where((z == best) & (zid == tok), zlp, float("-inf")), axis=0)
    bad = tl.load(bad_ptr + b) != 0
    found = (best > float("-inf")) & ~bad
    tok = tl.where(found, tok, -1)
    pos = tl.arange(0, BLOCK_S)
    out = pos <= S
    drafts = tl.load(draft_ptr + b * S + pos, mask=pos < S, other=-1)
    tokens = tl.where(pos < a, drafts, tl.where(pos == a, tok, -1))
    tl.store(tokens_ptr + b * (S + 1) + pos, tokens, mask=out)
    if HAS_LP:
        lp_d = tl.load(lpx_ptr + b * (S + 1) + pos, mask=pos < S, other=float("nan"))
        lp_o = tl.where(pos < a, lp_d, tl.where(pos == a, lp_tok, float("nan")))
        lp_o = tl.where(tokens < 0, float("nan"), lp_o)
        tl.store(lp_out_ptr + b * (S + 1) + pos, lp_o.to(tl.float32), mask=out)
