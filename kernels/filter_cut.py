"""The exact fallback's fast path: a flagged row's top-p cut and its sample from the row's
fp32 logits, spread over many programs per row.

A row that the candidate records cannot certify (tpsample/filters.py, 5.) is redone from its
transformed logits, which stage 1 of a filtered call writes beside its records (the SIDE
epilogue of kernels/fused_sample.py and kernels/gluon_sample.py), so W is never read again.
This module takes the rows with top-p and/or min-p and no top-k, sampled with replacement
(the common heavy-tail case: top_p alone on a flat row); the rest keep the one-program-per-row
bisection of kernels/filter_fallback.py.

The order sorts a row's tokens by (x desc, id asc); top-p keeps the shortest prefix whose mass
reaches p·Z, i.e. {key >= cut} for one 56-bit order key (filter_records.order_key), the key of
the token at which the prefix mass first reaches p·Z. With A(t) = the mass of the tokens with
x >= t (in units exp(x - x_max)), the cut's logit t* is the largest token logit with
A(t*) >= p·Z. The row is split into G chunks; one launch per STEP, each program taking
(row, chunk) items in turn, every partial sum written per chunk and added in a fixed order
(the tokens do not depend on the grid's timing):

  STATS    per chunk: max, sum of exp(x - chunk max), min finite logit (WINNER: the row
           max from the filter kernel as every chunk's max, one exp per token).
  SELECT   per row: the rows that need a cut (top-p rows; WINNER: those whose winner is
           not kept) appended to the cut list; HIST, COMPACT and FINISH take only its rows,
           in GH chunks of CH columns (WINNER: more and shorter than the other steps' G
           chunks, since about 1 - p of the rows are listed).
  HIST j   (j = 1..PASSES) the bracket [lo, hi) that holds t*, with A(lo) >= p·Z > A(hi):
           NT thresholds spread over the logits the bracket can hold; per chunk the mass in
           [t_i, hi) for each and the smallest and largest logit in the bracket. The next
           bracket lies between the last threshold with A >= p·Z and the one after it (every
           program replays these choices from the partial sums). The first bracket is
           [lo, inf) with lo the largest of x_min, x_max - RANGE (the tokens below weigh at
           most V·e^-RANGE < 1e-9 of Z, and p <= 1 - 2^-24) and x_max + ln((1-p)·Z / N)
           - 1/2 (_first_lo): a top-p cut never lies lower. With EARLY > 0 a bracket whose
           tokens provably number at most EARLY (its mass over the least a token in it
           weighs) ends the passes: the later ones skip the row, and FINISH sorts more keys
           (the launcher sets EARLY = CAP at large B, where a pass costs more than the sort,
           and MID below).
           GUESS (a call with records, WINNER): HIST 1 spreads its thresholds over a window
           SELECT found from the row's records instead (_guess_window: each tile's winner is a
           draw from the tile's softmax, so the tiles' masses above a logit estimate the mass
           above it; the window spans GUESS_SD standard deviations of that estimate each way),
           so HIST 1 leaves the bracket HIST 2 used to (flat rows at V = 151,936: ~1,600
           tokens). The thresholds only choose where the bracket may narrow: a window that
           misses the cut leaves a wider bracket for the next passes, never a wrong one.
  COMPACT  the final bracket's columns into CAP slots per row (an atomic counter claims
           slots; their order does not matter: the next step makes their keys and sorts them).
  FINISH   per row: the keys sorted (SHORT or MID slots when they fit, the usual case after
           three passes, else CAP), the prefix mass from A(hi) on, the cut. A row whose
           bracket holds more than CAP tokens (thousands of exactly tied logits) takes the
           bisection of filter_fallback.key_cut instead (exact, slower).
  SAMPLE   per chunk and sample: the Gumbel-max of the kept tokens ({key >= cut}, and
           exp(x - x_max) >= min_p) with the call's noise (the same Philox words as stage
           1, so the same token as a full row's argmax over the kept set), the kept mass and,
           for raw log-probs, the row's mass at T = 1.
  FINAL    per row: the chunks' winners and masses reduced; tokens, log-probs and log Z as
           fallback_rows_kernel writes them.

Work per row: at most four reads of its logits (STATS, up to three HIST) plus one with noise
(SAMPLE), and a sort of at most CAP keys; no step needs more than max(G, GH)·(NT + 2)
partial sums per row.

WINNER (a tokens-only call, one sample, merge "max"): most rows need neither the cut nor
SAMPLE. The row's Gumbel-max winner over all its tokens, w (the filter kernel stores its key),
is the kept set's winner too whenever w is kept, since the kept set's winner is the largest
perturbed score among the kept tokens, with the same noise. w is kept by top-p when the
tokens ordered before it weigh less than p·Z, which STATS sums in the same read (the mass of
x > x_w, and the count of x == x_w: a tie with another token leaves the question to the cut),
and by min-p when exp(x_w - x_max) >= min_p, SAMPLE's own test. A top-p row keeps w with
probability about p (the nucleus's mass), so with p = 0.9 one row in ten is listed by
SELECT and takes the HIST, COMPACT, FINISH and SAMPLE steps, and the others end at FINAL.
(LOGPROBS, a call that also returns log-probs: its log Z needs the kept mass, so SELECT
lists every top-p row for the cut, whose FINISH adds the sorted bracket's kept keys to A(hi);
SAMPLE sums the kept mass without noise only on the other rows (min-p, RAW, the bisection);
the token comes from the winner check all the same, the winner kept when its key is at or
above the cut; such a call needs no STATS either: x_max and Z are the filter kernel's, from
the records.) SAMPLE then redraws the noise only where
the answer can be: each 128-token tile's record holds its winner (score, id, logit); a tile
whose winner is kept gives the kept set its winner there, so s* = the best kept tile
winner is a lower bound of the answer, and only tiles whose winner scores above s* (their
winner is not kept) can hold a better kept token. SAMPLE reads the logits and draws the
noise only in the 2048-column blocks that hold such a tile: a few per row.
"""
import triton
import triton.language as tl

from .filter_fallback import count_flags, fast_row, key_cut, row_ids, row_x, send_outputs
from .filter_records import ID_MASK, KEY_TOP, NEG_INF, decode_key, order_key
from .fused_sample import NOISE_COEF, gumbel_log, philox_word, philox_words_tile

NT = tl.constexpr(16)       # thresholds per HIST pass
PASSES = tl.constexpr(3)    # HIST passes: the bracket narrows NT-fold (or to its range) each
CAP = tl.constexpr(2048)    # compaction slots per row
SHORT = tl.constexpr(128)   # brackets of at most SHORT / MID keys take a shorter sort
MID = tl.constexpr(512)     # (flat rows: ~100 keys; Zipf tails at T = 1.5: 300-450)
RANGE = tl.constexpr(40.0)  # nats below the row max that can hold a top-p cut
GUESS_SD = tl.constexpr(4.0)  # GUESS: the window's half-width in standard deviations
GUESS_STEPS = tl.constexpr(11)  # and the bisection steps that place its ends
STATS = tl.constexpr(0)
COMPACT = tl.constexpr(PASSES.value + 1)
FINISH = tl.constexpr(PASSES.value + 2)
SAMPLE = tl.constexpr(PASSES.value + 3)
FINAL = tl.constexpr(PASSES.value + 4)
SELECT = tl.constexpr(PASSES.value + 5)  # (launched between STATS and HIST 1)
INF = tl.constexpr(float("inf"))
CUT_STEPS = (SELECT.value,) + tuple(range(1, FINISH.value + 1))  # only top-p rows take them


@triton.jit
def _row_stats(part_ptr, b, B, G, W, BLOCK_G: tl.constexpr):
    """x_max, Z (in units exp(x - x_max)) and the smallest finite logit, from STATS."""
    g = tl.arange(0, BLOCK_G)
    at = part_ptr + (tl.cast(b, tl.int64) * G + g) * W
    cmax = tl.load(at, mask=g < G, other=NEG_INF)
    csum = tl.load(at + 1, mask=g < G, other=0.0)
    xmax = tl.max(cmax)
    z = tl.sum(tl.where(cmax > NEG_INF, csum * tl.exp(cmax - xmax), 0.0))
    return xmax, z, tl.min(tl.load(at + 2, mask=g < G, other=INF))


@triton.jit
def _winner_kept(part_ptr, b, B, G, W, w_key, cut, p, m, xmax, z, BY_CUT: tl.constexpr,
                 BLOCK_G: tl.constexpr):
    """Whether the row's sample-0 winner (order key w_key) is kept (module docstring,
    WINNER): from STATS' partial sums of the mass above its logit and the count of tokens at
    it; BY_CUT (no STATS: XMAX_KNOWN) from the cut FINISH found, as SAMPLE tests a token
    ({key >= cut}, cut 0 on a row without top-p)."""
    x_w = decode_key(w_key)
    if BY_CUT:
        return (w_key >= cut) & (tl.exp(x_w - xmax) >= m)
    g = tl.arange(0, BLOCK_G)
    at = part_ptr + (tl.cast(b, tl.int64) * G + g) * W
    cmax = tl.load(at, mask=g < G, other=NEG_INF)
    above = tl.sum(tl.where(cmax > NEG_INF, tl.load(at + 3, mask=g < G, other=0.0)
                            * tl.exp(cmax - xmax), 0.0))
    ties = tl.sum(tl.load(at + 4, mask=g < G, other=0.0))
    kept_p = (p >= 1.0) | ((ties == 1.0) & (above < p * z))
    return kept_p & (tl.exp(x_w - xmax) >= m)


@triton.jit
def _kept_tile_winners(rec_row, st_slot, st_t, T_rec, N_rec, cut, m, xmax,
                       BLOCK_R: tl.constexpr):
    """(s*, its logit): the largest order key (score, id) among the row's tile winners
    (sample plane 0 of its N_rec records, T_rec per slot) that are kept ({key >= cut} and
    exp(x - x_max) >= min_p, from the record's logit); -1 when none is."""
    n = tl.arange(0, BLOCK_R)
    ok = n < N_rec
    at = (n // T_rec).to(tl.int64) * st_slot + (n % T_rec).to(tl.int64) * st_t
    sc = tl.load(rec_row + at, mask=ok, other=NEG_INF)
    tok = tl.load(rec_row + at + 1, mask=ok, other=0.0)
    x = tl.load(rec_row + at + 2, mask=ok, other=NEG_INF)
    kept = (sc > NEG_INF) & (x > NEG_INF) & (order_key(x, tok) >= cut) & (tl.exp(x - xmax) >= m)
    k = tl.where(kept, order_key(sc, tok), -1)
    best = tl.max(k)
    return best, tl.max(tl.where(k == best, x, NEG_INF))


@triton.jit
def _blocks_above(rec_row, st_slot, st_t, T_rec, N_rec, c0, c1, s_star, BLOCK: tl.constexpr,
                  BLOCK_TC: tl.constexpr):
    """For the tiles of the columns [c0, c1) (BLOCK_TC >= their number; tile j of the row's
    columns is record (j // T_rec, j % T_rec): a slot's columns are whole tiles): the index
    of each one's BLOCK-column block from c0, or -1 where its winner is not above s*. One
    load of the chunk's records, so the blocks' loop waits on no load to skip a block."""
    j = c0 // 128 + tl.arange(0, BLOCK_TC)
    ok = (j < N_rec) & (j * 128 < c1)
    at = (j // T_rec).to(tl.int64) * st_slot + (j % T_rec).to(tl.int64) * st_t
    sc = tl.load(rec_row + at, mask=ok, other=NEG_INF)
    tok = tl.load(rec_row + at + 1, mask=ok, other=0.0)
    above = ok & (sc > NEG_INF) & (order_key(sc, tok) > s_star)
    return tl.where(above, (j * 128 - c0) // BLOCK, -1)


@triton.jit
def _kept_mass(row, c0, c1, cut, m, xmax, to_raw, slots, vocab_start, BLOCK: tl.constexpr,
               SLOTTED: tl.constexpr, RAW: tl.constexpr):
    """(the kept tokens' mass in units exp(x - x_max), RAW: the chunk's mass at T = 1 in
    units exp((x - x_max) · T)) over columns [c0, c1): SAMPLE's sums, without its noise."""
    cols = tl.arange(0, BLOCK)
    mass = tl.zeros((BLOCK,), tl.float32)
    raw = tl.zeros((BLOCK,), tl.float32)
    xn = row_x(row, c0 + cols, c1, slots, SLOTTED)
    for v0 in range(c0, c1, BLOCK):
        x = xn
        xn = row_x(row, v0 + BLOCK + cols, c1, slots, SLOTTED)
        gid = row_ids(v0 + cols, c1, vocab_start, slots, SLOTTED)
        e = tl.exp(x - xmax)
        key = tl.where(x > NEG_INF, order_key(x, gid), -1)
        mass += tl.where((key >= cut) & (e >= m), e, 0.0)
        if RAW:
            raw += tl.exp(x * to_raw - xmax * to_raw)
    return tl.sum(mass), tl.sum(raw)


@triton.jit
def _noise_free_sums(row, c0, c1, cut, p, m, xmax, keys, inv_temp_ptr, b, mine, slots,
                     vocab_start, BLOCK: tl.constexpr, SLOTTED: tl.constexpr,
                     RAW: tl.constexpr):
    """SAMPLE of a LOGPROBS row under the winner check: the chunk's kept mass and RAW mass
    at mine[0:2] (_kept_mass), unless FINISH summed the kept mass (_sample_sums_mass; the
    bracket's size is at keys[CAP])."""
    if _sample_sums_mass(tl.load(keys + CAP), p, m, RAW):
        mass, raw = _kept_mass(row, c0, c1, cut, m, xmax, 1.0 / tl.load(inv_temp_ptr + b),
                               slots, vocab_start, BLOCK, SLOTTED, RAW)
        tl.store(mine, mass)
        tl.store(mine + 1, raw)


@triton.jit
def _logz(parts, G, W, xmax, to_raw, RAW: tl.constexpr, BLOCK_G: tl.constexpr):
    """The row's log Z from SAMPLE's per-chunk sums at `parts` (W words per chunk): of the
    kept set, or RAW at T = 1."""
    gs = tl.arange(0, BLOCK_G)
    at = parts + gs * W
    if RAW:
        return xmax * to_raw + tl.log(tl.sum(tl.load(at + 1, mask=gs < G, other=0.0)))
    return xmax + tl.log(tl.sum(tl.load(at, mask=gs < G, other=0.0)))


@triton.jit
def _sample_sums_mass(n, p, m, RAW: tl.constexpr):
    """Whether SAMPLE sums the kept mass of a LOGPROBS row, else FINISH did: a top-p row
    whose bracket took the sort (n <= CAP keys: A(hi) plus the sorted keys' masses from the
    cut up) and that has no min-p (with min-p the kept set is {key >= cut} and
    exp(x - x_max) >= min_p, which SAMPLE tests per token), not RAW (its mass at T = 1)."""
    return (p >= 1.0) | (n > CAP) | (m > 0.0) | RAW


@triton.jit
def _first_lo(xmax, xmin, target, z, N):
    """A logit below the cut's: the tokens at or below the cut's logit t* weigh more than
    Z - p·Z (the tokens above it weigh less than p·Z), and at most N·exp(t* - xmax), so
    t* > xmax + ln((Z - p·Z) / N); half a nat lower covers the sums' rounding. Never below
    the smallest logit or RANGE under the max."""
    bound = xmax + tl.log((z - target) / N) - 0.5
    return tl.maximum(tl.maximum(xmin, xmax - RANGE), tl.where(z > target, bound, NEG_INF))


@triton.jit
def _thresholds(lo, u, NT_: tl.constexpr):
    """NT_ thresholds over [lo, u]: lo + (u - lo) * i / NT_, i = 1..NT_."""
    i = (tl.arange(0, NT_) + 1).to(tl.float32)
    return lo + (u - lo) * (i / NT_)


@triton.jit
def _guess_window(rec_row, st_slot, st_t, T_rec, N_rec, xmax, lo, p, BLOCK_R: tl.constexpr):
    """GUESS: a window [glo, ghi] of logits that likely holds the top-p cut, from the row's
    records alone (module docstring, GUESS). Each tile's sample-0 winner is a draw from the
    tile's softmax, so A^(t) = sum over tiles of m_tile [x_winner >= t] estimates the mass
    above t without bias (m_tile: the tile's mass, from its log-mass), with a variance of
    about p (1 - p) sum m_tile^2 near the cut. The window runs from where A^ falls below
    p Z + GUESS_SD sd to where it falls below p Z - GUESS_SD sd, both found by one bisection
    over [lo, x_max] (to 1/2^GUESS_STEPS of it, each end on its side). The sums are in fixed
    point (int64), so the window does not depend on the order of the records (one device and
    a tensor-parallel gather of the same tiles give the same window)."""
    n = tl.arange(0, BLOCK_R)
    ok = n < N_rec
    at = (n // T_rec).to(tl.int64) * st_slot + (n % T_rec).to(tl.int64) * st_t
    x = tl.load(rec_row + at + 2, mask=ok, other=NEG_INF)
    lm = tl.load(rec_row + at + 3, mask=ok, other=NEG_INF)
    live = ok & (x > NEG_INF) & (lm > NEG_INF) & (lm == lm)
    w = tl.where(live, tl.exp(tl.minimum(lm - xmax, 20.0)), 0.0)  # (a tile weighs <= 128)
    wi = (w * 4294967296.0).to(tl.int64)  # units 2^-32 of the largest token's weight
    total = tl.sum(wi)
    hi16 = wi >> 16
    sd = tl.sqrt((tl.sum(hi16 * hi16).to(tl.float32)) * (p * (1.0 - p))) * 65536.0
    mid_mass = total.to(tl.float32) * p
    two = tl.arange(0, 2)
    # [A^(glo) >= this, A^(ghi) < this]: both ends bisected at once, one reduction a step
    goal = (mid_mass + tl.where(two == 0, GUESS_SD, -GUESS_SD) * sd).to(tl.int64)
    bot = tl.zeros((2,), tl.float32) + lo
    top = tl.zeros((2,), tl.float32) + xmax
    for _ in range(GUESS_STEPS):
        c = (bot + top) * 0.5
        up = tl.sum(tl.where(x[None, :] >= c[:, None], wi[None, :], 0), axis=1) >= goal
        bot = tl.where(up, c, bot)
        top = tl.where(up, top, c)
    return tl.sum(tl.where(two == 0, bot, 0.0)), tl.sum(tl.where(two == 1, top, 0.0))


@triton.jit
def _window_at(hist_ptr, b, GH, W):
    """Where SELECT keeps row b's window (glo, ghi): HIST's plane 0, which no pass writes."""
    return hist_ptr + tl.cast(b, tl.int64) * GH * W


@triton.jit
def _pass_thresholds(j, lo_e, u, guess_ptr, GUESS: tl.constexpr, NT_: tl.constexpr):
    """HIST pass j's NT_ thresholds over its bracket [lo_e, u]: evenly spread (_thresholds);
    GUESS, pass 1: spread over SELECT's window [glo, ghi] (both ends in) kept within
    [lo_e, u], unless that window is no narrower than the even spread's."""
    t = _thresholds(lo_e, u, NT_)
    if GUESS:
        if j == 1:
            glo = tl.maximum(tl.load(guess_ptr), lo_e)
            ghi = tl.minimum(tl.load(guess_ptr + 1), u)
            if (glo < ghi) & ((ghi - glo) * NT_ < (u - lo_e) * (NT_ - 1)):
                i = tl.arange(0, NT_).to(tl.float32)
                t = glo + (ghi - glo) * (i / (NT_ - 1))
    return t


@triton.jit
def _hist_slice(x, hi, lo_e, xmax, t, acc, nmin, nmax):
    """One HIST slice x [SUB, 1] added to the per-lane sums acc [SUB, NT] (the mass of the
    tokens in [t_i, hi)) and the range [nmin, nmax] of its logits in [lo_e, hi)."""
    below = x < hi
    e = tl.where(below & (x > NEG_INF), tl.exp(x - xmax), 0.0)
    # (a 1.0 / 0.0 factor and an FMA: two instructions a threshold where a select and an add
    # took three; the sums are the same bits)
    acc += e * (x >= t[None, :]).to(tl.float32)
    inside = below & (x >= lo_e)
    nmin = tl.minimum(nmin, tl.where(inside, x, INF))
    nmax = tl.maximum(nmax, tl.where(inside, x, NEG_INF))
    return acc, nmin, nmax


@triton.jit
def _bracket(part_ptr, b, B, G, W, done, target, z, N, xmax, xmin, NT_: tl.constexpr,
             BLOCK_G: tl.constexpr, EARLY: tl.constexpr, GUESS: tl.constexpr):
    """The bracket after `done` HIST passes: (lo, hi, A(hi), the range [bmin, bmax] the last
    pass saw inside its bracket, which bounds every logit of this one, and whether another
    pass narrows it). With EARLY > 0 a bracket whose tokens provably fit EARLY slots ends the
    passes: each weighs at least exp(lo - x_max), so they number at most (A(lo) - A(hi)) /
    exp(lo - x_max) (5 % over it for the sums' rounding); the later passes skip the row."""
    lo = _first_lo(xmax, xmin, target, z, N)
    hi = tl.cast(INF, tl.float32)
    a_hi = tl.cast(0.0, tl.float32)
    bmin = xmin
    bmax = xmax
    live = b >= 0
    g = tl.arange(0, BLOCK_G)
    i = tl.arange(0, NT_)
    for j in range(1, done + 1):
        if live:
            lo_e = tl.maximum(lo, bmin)
            u = tl.maximum(tl.minimum(tl.minimum(xmax, bmax), hi), lo_e)
            t = _pass_thresholds(j, lo_e, u, _window_at(part_ptr, b, G, W), GUESS, NT_)
            at = part_ptr + ((tl.cast(b, tl.int64) + j * B) * G + g) * W
            s = tl.load(at[:, None] + i[None, :], mask=(g < G)[:, None], other=0.0)
            a = a_hi + tl.sum(s, axis=0)
            bmin = tl.min(tl.load(at + NT_, mask=g < G, other=INF))
            bmax = tl.max(tl.load(at + NT_ + 1, mask=g < G, other=NEG_INF))
            js = tl.sum((a >= target).to(tl.int32))  # thresholds at or below the cut's logit
            lo = tl.where(js == 0, lo_e, tl.max(tl.where(i == js - 1, t, NEG_INF)))
            a_next = tl.max(tl.where(i == js, a, NEG_INF))
            hi = tl.where(js == NT_, hi, tl.max(tl.where(i == js, t, NEG_INF)))
            a_hi = tl.where(js == NT_, a_hi, a_next)
            if EARLY > 0:
                a_lo = tl.max(tl.where(i == js - 1, a, NEG_INF))
                live = (js == 0) | ((a_lo - a_hi) * 1.05 > EARLY * tl.exp(lo - xmax))
    return lo, hi, a_hi, bmin, bmax, live


@triton.jit
def _sorted_cut(keys, n, row, N, vocab_start, slots, a_hi, target, xmax, SIZE: tl.constexpr,
                SLOTTED: tl.constexpr):
    """(the cut, the kept mass {key >= cut}) from the bracket's n <= SIZE columns (COMPACT's
    slots): their keys sorted descending, the prefix mass from A(hi) on; the cut is the last
    key whose prefix mass before it is below p·Z."""
    q = tl.arange(0, SIZE)
    v = tl.load(keys + q, mask=q < n, other=N).to(tl.int32)
    x = row_x(row, v, N, slots, SLOTTED)
    k = tl.where(x > NEG_INF, order_key(x, row_ids(v, N, vocab_start, slots, SLOTTED)), -1)
    ks = tl.sort(k, descending=True)
    valid = ks >= 0
    e = tl.where(valid, tl.exp(decode_key(tl.where(valid, ks, 0)) - xmax), 0.0)
    before = a_hi + tl.cumsum(e, 0) - e
    kept = valid & (before < target)
    # the last kept key (none only if rounding put A(hi) at p·Z: the first)
    cut = tl.min(tl.where(kept, ks, KEY_TOP + 1))
    cut = tl.where(cut > KEY_TOP, tl.max(ks), cut)
    return cut, a_hi + tl.sum(tl.where(valid & (ks >= cut), e, 0.0))


@triton.jit
def _noisy_key(x, gid, seed, off_lo, off_hi, s, col0, BLOCK: tl.constexpr,
               ALIGNED4: tl.constexpr):
    """The order keys of x + Gumbel noise (sample s; the call's Philox words, as stage 1 drew
    them) for a block of BLOCK columns of global ids gid (ALIGNED4: gid = col0 + 0..BLOCK-1,
    col0 a multiple of 4, one Philox call per four words)."""
    if ALIGNED4:
        words = tl.reshape(philox_words_tile(seed, off_lo, off_hi, tl.cast(s, tl.uint32), col0,
                                             BLOCK, 1), (BLOCK,))
    else:
        words = philox_word(seed, off_lo, off_hi, tl.cast(s, tl.uint32), gid)
    return order_key(tl.fma(gumbel_log(words), NOISE_COEF, x), gid)


@triton.jit
def _send_one(l_ptr, b64, stride_lb, slot_stride, peer_ptrs_ptr, rank, world, tok, lp, lz):
    """SPLIT, a one-sample row: its token, log-prob and log Z to the others."""
    send_outputs(l_ptr, b64, stride_lb, slot_stride, peer_ptrs_ptr, rank, world, 0,
                 tok.to(tl.int32).to(tl.float32, bitcast=True))
    send_outputs(l_ptr, b64, stride_lb, slot_stride, peer_ptrs_ptr, rank, world, 1, lp)
    send_outputs(l_ptr, b64, stride_lb, slot_stride, peer_ptrs_ptr, rank, world, 2, lz)


@triton.jit
def _top_logprobs(top_tok_ptr, top_lp_ptr, b64, n_top, cut, m, xmax, lz,
                  BLOCK_N: tl.constexpr):
    """FINAL's top n of a row (n_top > 0, processed log-probs): the filter kernel wrote the
    row's first n tokens and, since it flagged the row, their logits where the log-probs go
    (kernels/filter_records.py); a kept token ({key >= cut} and min-p) gets x - log Z, the
    others -inf, as fallback_rows_kernel writes them."""
    q = tl.arange(0, BLOCK_N)
    at = b64 * n_top + q
    x = tl.load(top_lp_ptr + at, mask=q < n_top, other=NEG_INF)
    tok = tl.load(top_tok_ptr + at, mask=q < n_top, other=0)
    kept = (order_key(x, tok.to(tl.float32)) >= cut) & (tl.exp(x - xmax) >= m)
    tl.store(top_lp_ptr + at, tl.where(kept, x - lz, NEG_INF), mask=q < n_top)


@triton.jit
def _winner_outputs(tokens_ptr, logprobs_ptr, logz_ptr, count_ptr, b, best, x, parts, G, W,
                    xmax, inv_temp_ptr, l_ptr, stride_lb, slot_stride, peer_ptrs_ptr, rank,
                    split, top_tok_ptr, top_lp_ptr, n_top, cut, m, LOGPROBS: tl.constexpr,
                    RAW: tl.constexpr, SPLIT: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """FINAL of a WINNER row: the token of order key `best` (-1: none), whose logit is x;
    LOGPROBS: its log-prob and the row's log Z from SAMPLE's sums at `parts`, else NaN, and
    the top n (_top_logprobs; cut: FINISH's, 0 without top-p)."""
    b64 = tl.cast(b, tl.int64)
    tok = tl.where(best >= 0, ID_MASK - (best & ID_MASK), -1)
    lp = tl.cast(float("nan"), tl.float32)
    lz = lp
    if LOGPROBS:
        to_raw = 1.0 / tl.load(inv_temp_ptr + b)
        lz = _logz(parts, G, W, xmax, to_raw, RAW, BLOCK_G)
        if RAW:
            lp = x * to_raw - lz
        else:
            lp = x - lz
        lp = tl.where(best >= 0, lp, NEG_INF)
        if not RAW:  # (raw top log-probs need no kept set: the filter kernel's stand)
            if n_top > 0:
                _top_logprobs(top_tok_ptr, top_lp_ptr, b64, n_top, cut, m, xmax, lz, BLOCK_N)
    tl.store(tokens_ptr + b64, tok)
    tl.store(logprobs_ptr + b64, lp)
    tl.store(logz_ptr + b, lz)
    tl.atomic_add(count_ptr + 1, 1)  # (count[1]: the rows this path redid)
    if SPLIT:
        _send_one(l_ptr, b64, stride_lb, slot_stride, peer_ptrs_ptr, rank, split, tok, lp, lz)


@triton.jit
def cut_step_kernel(
    l_ptr, stride_lb, N, vocab_start, inv_temp_ptr, seed_ptr, offset_ptr, top_k_ptr,
    top_p_ptr, min_p_ptr, tokens_ptr, logprobs_ptr, logz_ptr, flag_ptr, count_ptr, part_ptr,
    keys_ptr, win_ptr, win_at, rec_ptr, st_slot, st_b, st_t, T_rec, N_rec, parity_ptr,
    parity_stride, B, G, C, W, S, starts_ptr, slot_n, slot_stride, calls_ptr, peer_ptrs_ptr,
    rank, split, hist_ptr, GH, CH, top_tok_ptr, top_lp_ptr, n_top, STEP: tl.constexpr,
    HAS_K: tl.constexpr,
    HAS_P: tl.constexpr, HAS_M: tl.constexpr,
    RAW: tl.constexpr, ALIGNED4: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_F: tl.constexpr, PDL: tl.constexpr = False, SLOTTED: tl.constexpr = False,
    WINNER: tl.constexpr = False, USE_PARITY: tl.constexpr = False,
    BLOCK_R: tl.constexpr = 16, BLOCK_TC: tl.constexpr = 16, SPLIT: tl.constexpr = False,
    BLOCK_GH: tl.constexpr = 16, LOGPROBS: tl.constexpr = False,
    XMAX_KNOWN: tl.constexpr = False, EARLY: tl.constexpr = 0, BLOCK_N: tl.constexpr = 16,
):
    """One STEP (module docstring) for the rows fast_row takes. l [B, N] fp32 logits (row stride
    stride_lb; SLOTTED: [world, B, slot_n] as filter_fallback.fallback_rows_kernel reads them);
    part fp32 [SAMPLE + 1, B, G, W] (W >= max(NT + 2, S + 2, 5)), hist fp32 [PASSES + 1, B, GH,
    W] and keys int64 [B, CAP + 2 + G * S] (slots, counter, cut, the chunks' winners): this
    call's workspace; the cut list, int32 [1 + B] (SELECT's count, then its rows), is at
    win[win_at + 3B] (tpsample/filters.py scratch_words), its count zeroed by STATS or, in
    calls without STATS (XMAX_KNOWN), by the filter kernel; chunk g of a row is
    columns [g·C, (g+1)·C) (HIST and COMPACT: [g·CH, (g+1)·CH)), C and CH multiples of BLOCK.
    Outputs as fallback_rows_kernel's ([B, S], [B]); count[1] += the rows done (FINAL:
    count int32 [2], whose [0] counts the rows of fallback_rows_kernel's own path). The
    programs take the items (rows × chunks, or rows for FINISH / FINAL) in turn; a call without
    a flagged row costs each program one scan of the flags. WINNER (S = 1, merge "max"): the
    rows whose winner (key at win[win_at + b], the filter kernel's) is kept take it, and skip
    every step from HIST to SAMPLE unless LOGPROBS (then they take the cut, and SAMPLE's
    noise-free sums where FINISH did not sum their kept mass); SAMPLE draws noise only in the
    blocks with a tile winner above s* (records [slots, planes, B, T_rec, 4] by strides, N_rec =
    slots · T_rec, BLOCK_TC >= a chunk's tiles; USE_PARITY: the fan-out's two buffers, this
    call's the one the filter kernel's parity flip left); FINAL writes tokens, and log-probs and
    log Z (NaN without LOGPROBS). top_tok / top_lp [B, n_top]: a row's first n tokens and
    (flagged 1, n_top > 0) their logits, which the filter kernel wrote; FINAL makes the
    logits processed log-probs (not RAW: raw ones are final there). XMAX_KNOWN (WINNER, and
    no top-p in the call or LOGPROBS): x_max and log Z are the filter kernel's (keys at
    win[win_at + B + b], [win_at + 2B + b]), STATS is not launched, and a winner is kept by
    FINISH's cut. EARLY: a bracket of at most EARLY tokens ends the HIST passes (module
    docstring). The items are the rows b = rank + k · split (one device: rank 0, split 1).
    SPLIT (tensor parallel, SLOTTED): split = world, each rank redoes the rows it owns (filter_fallback.fallback_logits_kernel gathered
    each row to its owner only) and FINAL also sends their outputs to the other ranks
    (peer_ptrs: int64 [world], this rank's slot in each rank's buffer;
    filter_fallback.send_outputs)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tl.static_assert(XMAX_KNOWN or not LOGPROBS)  # (its winners are kept by the cut)
    flagged = count_flags(flag_ptr, B, BLOCK_F)
    # (inside the filter kernels' scratch, which a replayed call passes anew)
    list_ptr = (win_ptr + win_at + 3 * B).to(tl.pointer_type(tl.int32), bitcast=True)
    if STEP == STATS:  # (calls without STATS have it zeroed by the filter kernel)
        if tl.program_id(0) == 0:
            tl.store(list_ptr, 0)  # SELECT's count
    LISTED: tl.constexpr = (STEP > STATS) and (STEP <= FINISH)  # over SELECT's cut list
    PER_ROW: tl.constexpr = (STEP == FINISH) or (STEP == FINAL) or (STEP == SELECT)
    owned = (B - rank + split - 1) // split
    if LISTED:
        listed = tl.where(flagged > 0, tl.load(list_ptr), 0)
        if PER_ROW:
            items = listed
        else:
            items = listed * GH
    elif PER_ROW:
        items = tl.where(flagged > 0, owned, 0)
    else:
        items = tl.where(flagged > 0, owned * G, 0)
    slots = (slot_n, slot_stride, starts_ptr)
    RI = CAP + 2 + G * S  # keys row stride
    for it in range(tl.program_id(0), items, tl.num_programs(0)):
        if LISTED:
            if PER_ROW:
                k = it
                g = 0
            else:
                k = it // GH
                g = it - k * GH
            b = tl.load(list_ptr + 1 + k)
        elif PER_ROW:
            b = rank + it * split
            g = 0
        else:
            k = it // G
            g = it - k * G
            b = rank + k * split
        ok, p, m = fast_row(b, flag_ptr, inv_temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
                            calls_ptr, HAS_K, HAS_P, HAS_M, SLOTTED)
        if STEP == SELECT:
            ok = ok & (p < 1.0)  # the cut's steps: top-p rows only
        if ok:
            b64 = tl.cast(b, tl.int64)
            row = l_ptr + b64 * stride_lb
            keys = keys_ptr + b64 * RI
            if LISTED:  # GH chunks of CH columns
                c0 = g * CH
                c1 = tl.minimum(c0 + CH, N)
                mine = hist_ptr + ((b64 + STEP * B) * GH + g) * W
            else:
                c0 = g * C
                c1 = tl.minimum(c0 + C, N)
                mine = part_ptr + ((b64 + STEP * B) * G + g) * W
            cols = tl.arange(0, BLOCK)
            if STEP == STATS:  # online max and sum per lane, one read
                lm = tl.full((BLOCK,), NEG_INF, tl.float32)
                ls = tl.zeros((BLOCK,), tl.float32)
                lmin = tl.full((BLOCK,), INF, tl.float32)
                lgt = tl.zeros((BLOCK,), tl.float32)  # WINNER: the mass above x_w, ties
                leq = tl.zeros((BLOCK,), tl.float32)
                x_w = tl.cast(INF, tl.float32)
                xr = tl.cast(NEG_INF, tl.float32)
                if WINNER:  # the row max is the filter kernel's (the largest candidate):
                    # one exp per token, no running max to rescale by
                    x_w = decode_key(tl.load(win_ptr + win_at + b64))
                    xr = decode_key(tl.load(win_ptr + win_at + B + b64))
                    lm = tl.full((BLOCK,), 0.0, tl.float32) + xr
                safe_r = tl.where(xr > NEG_INF, xr, 0.0)
                xn = row_x(row, c0 + cols, c1, slots, SLOTTED)
                for v0 in range(c0, c1, BLOCK):
                    x = xn  # the next block's load in flight while this one is summed
                    xn = row_x(row, v0 + BLOCK + cols, c1, slots, SLOTTED)
                    if WINNER:
                        ex = tl.exp(x - safe_r)
                        ls += ex
                        lgt += tl.where(x > x_w, ex, 0.0)
                        leq += tl.where(x == x_w, 1.0, 0.0)
                    else:
                        up = tl.maximum(lm, x)
                        safe = tl.where(up > NEG_INF, up, 0.0)
                        rescale = tl.exp(lm - safe)
                        ls = ls * rescale + tl.exp(x - safe)
                        lm = up
                    lmin = tl.minimum(lmin, tl.where(x > NEG_INF, x, INF))
                cmax = tl.max(lm)
                to_cmax = tl.exp(lm - tl.where(cmax > NEG_INF, cmax, 0.0))
                tl.store(mine, cmax)
                tl.store(mine + 1, tl.sum(ls * to_cmax))
                tl.store(mine + 2, tl.min(lmin))
                if WINNER:
                    tl.store(mine + 3, tl.sum(lgt))
                    tl.store(mine + 4, tl.sum(leq))
            else:
                if XMAX_KNOWN:  # the filter kernel's row max and log Z (no STATS launched)
                    xmax = decode_key(tl.load(win_ptr + win_at + B + b64))
                    z = tl.exp(decode_key(tl.load(win_ptr + win_at + 2 * B + b64)) - xmax)
                    xmin = tl.cast(NEG_INF, tl.float32)
                else:
                    xmax, z, xmin = _row_stats(part_ptr, b, B, G, W, BLOCK_G)
                target = p * z
                w_key = tl.cast(0, tl.int64)
                won = w_key < 0
                cut = tl.cast(0, tl.int64)  # (FINAL's top n; the winner's branch below
                # compiles without WINNER too)
                if WINNER and not LISTED:  # (SELECT lists only rows whose winner is not kept)
                    w_key = tl.load(win_ptr + win_at + b64)
                    if XMAX_KNOWN and (STEP != SELECT):  # (SAMPLE, FINAL: FINISH's cut)
                        if p < 1.0:
                            cut = tl.load(keys + CAP + 1)
                    won = _winner_kept(part_ptr, b, B, G, W, w_key, cut, p, m, xmax, z,
                                       XMAX_KNOWN, BLOCK_G)
                if STEP == SELECT:
                    if (not won) or LOGPROBS:  # (log Z needs the kept mass, so the cut)
                        at = tl.atomic_add(list_ptr, 1)
                        tl.store(list_ptr + 1 + at, b, mask=at < B)  # (B rows at most)
                        tl.store(keys + CAP, tl.cast(0, tl.int64))  # COMPACT's counter
                        if WINNER:  # HIST 1's thresholds from the records (GUESS)
                            rec_row = rec_ptr + b64 * st_b
                            if USE_PARITY:
                                rec_row += (1 - tl.load(parity_ptr)).to(tl.int64) * parity_stride
                            glo, ghi = _guess_window(rec_row, st_slot, st_t, T_rec, N_rec, xmax,
                                                     _first_lo(xmax, xmin, target, z, N), p,
                                                     BLOCK_R)
                            tl.store(_window_at(hist_ptr, b, GH, W), glo)
                            tl.store(_window_at(hist_ptr, b, GH, W) + 1, ghi)
                elif won:
                    if (STEP == SAMPLE) and LOGPROBS:  # the sums, no noise (FINISH's cut)
                        _noise_free_sums(row, c0, c1, cut, p, m, xmax, keys, inv_temp_ptr, b, mine,
                                         slots, vocab_start, BLOCK, SLOTTED, RAW)
                    elif STEP == FINAL:
                        _winner_outputs(tokens_ptr, logprobs_ptr, logz_ptr, count_ptr, b, w_key,
                                        decode_key(w_key),
                                        part_ptr + (b64 + SAMPLE * B) * G * W, G, W, xmax,
                                        inv_temp_ptr, l_ptr, stride_lb, slot_stride,
                                        peer_ptrs_ptr, rank, split, top_tok_ptr, top_lp_ptr,
                                        n_top, cut, m, LOGPROBS, RAW, SPLIT, BLOCK_G, BLOCK_N)
                elif STEP <= PASSES:  # HIST
                    lo, hi, a_hi, bmin, bmax, live = _bracket(hist_ptr, b, B, GH, W, STEP - 1,
                                                              target, z, N, xmax, xmin, NT,
                                                              BLOCK_GH, EARLY, WINNER)
                    if live:  # (else an earlier pass's bracket fits the slots)
                        lo_e = tl.maximum(lo, bmin)
                        t = _pass_thresholds(STEP, lo_e,
                                             tl.maximum(tl.minimum(tl.minimum(xmax, bmax), hi),
                                                        lo_e),
                                             _window_at(hist_ptr, b, GH, W), WINNER, NT)
                        # per-lane sums, reduced once (SUB-row slices keep [SUB, NT] in
                        # registers)
                        acc = tl.zeros((SUB, NT), dtype=tl.float32)
                        nmin = tl.full((SUB, 1), INF, tl.float32)
                        nmax = tl.full((SUB, 1), NEG_INF, tl.float32)
                        # SUB columns at a time, four slices' loads in flight: the loop
                        # steps over four slices, each reloaded where it was summed, so no
                        # register is copied while its load is pending (a rotation xa <- xb
                        # waits for the load, one memory latency per slice); slices past c1
                        # are -inf and add nothing
                        sub = tl.arange(0, SUB)[:, None]
                        xa = row_x(row, c0 + sub, c1, slots, SLOTTED)
                        xb = row_x(row, c0 + SUB + sub, c1, slots, SLOTTED)
                        xc = row_x(row, c0 + 2 * SUB + sub, c1, slots, SLOTTED)
                        xd = row_x(row, c0 + 3 * SUB + sub, c1, slots, SLOTTED)
                        for v0 in range(c0, c1, 4 * SUB):
                            acc, nmin, nmax = _hist_slice(xa, hi, lo_e, xmax, t, acc, nmin, nmax)
                            xa = row_x(row, v0 + 4 * SUB + sub, c1, slots, SLOTTED)
                            acc, nmin, nmax = _hist_slice(xb, hi, lo_e, xmax, t, acc, nmin, nmax)
                            xb = row_x(row, v0 + 5 * SUB + sub, c1, slots, SLOTTED)
                            acc, nmin, nmax = _hist_slice(xc, hi, lo_e, xmax, t, acc, nmin, nmax)
                            xc = row_x(row, v0 + 6 * SUB + sub, c1, slots, SLOTTED)
                            acc, nmin, nmax = _hist_slice(xd, hi, lo_e, xmax, t, acc, nmin, nmax)
                            xd = row_x(row, v0 + 7 * SUB + sub, c1, slots, SLOTTED)
                        tl.store(mine + tl.arange(0, NT), tl.sum(acc, axis=0))
                        tl.store(mine + NT, tl.min(nmin))
                        tl.store(mine + NT + 1, tl.max(nmax))
                elif STEP == COMPACT:
                    lo, hi, a_hi, bmin, bmax, _ = _bracket(hist_ptr, b, B, GH, W, PASSES, target, z,
                                                         N, xmax, xmin, NT, BLOCK_GH, EARLY,
                                                         WINNER)
                    # a slot per selected column from one atomic each (its key is made in
                    # FINISH): a block holds one or two of the bracket's ~100 tokens, so a
                    # per-block count and scan (two block reductions) would cost more
                    counter = keys + CAP + tl.zeros((BLOCK,), tl.int32)
                    one = tl.full((BLOCK,), 1, tl.int64)
                    xn = row_x(row, c0 + cols, c1, slots, SLOTTED)
                    for v0 in range(c0, c1, BLOCK):
                        x = xn
                        xn = row_x(row, v0 + BLOCK + cols, c1, slots, SLOTTED)
                        sel = (x >= lo) & (x < hi)
                        pos = tl.atomic_add(counter, one, mask=sel, sem="relaxed")
                        tl.store(keys + pos, (v0 + cols).to(tl.int64), mask=sel & (pos < CAP))
                elif STEP == FINISH:
                    lo, hi, a_hi, bmin, bmax, _ = _bracket(hist_ptr, b, B, GH, W, PASSES, target, z,
                                                         N, xmax, xmin, NT, BLOCK_GH, EARLY,
                                                         WINNER)
                    n = tl.load(keys + CAP)
                    kept = tl.cast(0.0, tl.float32)
                    if n <= SHORT:
                        cut, kept = _sorted_cut(keys, n, row, N, vocab_start, slots, a_hi,
                                                target, xmax, SHORT, SLOTTED)
                    elif n <= MID:
                        cut, kept = _sorted_cut(keys, n, row, N, vocab_start, slots, a_hi,
                                                target, xmax, MID, SLOTTED)
                    elif n <= CAP:
                        cut, kept = _sorted_cut(keys, n, row, N, vocab_start, slots, a_hi,
                                                target, xmax, CAP, SLOTTED)
                    else:  # more than CAP tokens in the bracket (ties): the bisection
                        cut = key_cut(row, N, vocab_start, slots, tl.cast(0, tl.int64), target,
                                      xmax, True, BLOCK, SLOTTED)
                    tl.store(keys + CAP + 1, cut)
                    if LOGPROBS:
                        if not _sample_sums_mass(n, p, m, RAW):  # SAMPLE's sums in its place
                            gs = tl.arange(0, BLOCK_G)
                            tl.store(part_ptr + ((b64 + SAMPLE * B) * G + gs) * W,
                                     tl.where(gs == 0, kept, 0.0), mask=gs < G)
                elif STEP == SAMPLE and WINNER:
                    cut = tl.cast(0, tl.int64)
                    if p < 1.0:
                        cut = tl.load(keys + CAP + 1)
                    rec_row = rec_ptr + b64 * st_b
                    if USE_PARITY:
                        rec_row += (1 - tl.load(parity_ptr)).to(tl.int64) * parity_stride
                    s_star, s_x = _kept_tile_winners(rec_row, st_slot, st_t, T_rec, N_rec, cut,
                                                     m, xmax, BLOCK_R)
                    if LOGPROBS:
                        _noise_free_sums(row, c0, c1, cut, p, m, xmax, keys, inv_temp_ptr, b, mine,
                                         slots, vocab_start, BLOCK, SLOTTED, RAW)
                    seed = tl.load(seed_ptr + b)
                    off = tl.load(offset_ptr + b)
                    off_lo = (off & 0xFFFFFFFF).to(tl.uint32)
                    off_hi = ((off >> 32) & 0xFFFFFFFF).to(tl.uint32)
                    best = tl.full((BLOCK,), -1, tl.int64)
                    best_x = tl.full((BLOCK,), NEG_INF, tl.float32)
                    hits = _blocks_above(rec_row, st_slot, st_t, T_rec, N_rec, c0, c1, s_star,
                                         BLOCK, BLOCK_TC)
                    for v0 in range(c0, c1, BLOCK):
                        if tl.max((hits == (v0 - c0) // BLOCK).to(tl.int32)) > 0:
                            x = row_x(row, v0 + cols, c1, slots, SLOTTED)
                            gid = row_ids(v0 + cols, c1, vocab_start, slots, SLOTTED)
                            key = tl.where(x > NEG_INF, order_key(x, gid), -1)
                            keep = (key >= cut) & (tl.exp(x - xmax) >= m)
                            zkey = tl.where(keep, _noisy_key(x, gid, seed, off_lo, off_hi, 0,
                                                             vocab_start + v0, BLOCK, ALIGNED4),
                                            -1)
                            up = zkey > best
                            best = tl.where(up, zkey, best)
                            best_x = tl.where(up, x, best_x)
                    top = tl.max(best)
                    top_x = tl.max(tl.where(best == top, best_x, NEG_INF))
                    tl.store(keys + CAP + 2 + g, tl.maximum(top, s_star))
                    tl.store(mine + 2, tl.where(s_star > top, s_x, top_x))
                elif STEP == SAMPLE:
                    cut = tl.cast(0, tl.int64)
                    if p < 1.0:
                        cut = tl.load(keys + CAP + 1)
                    inv = tl.load(inv_temp_ptr + b)
                    to_raw = 1.0 / inv
                    seed = tl.load(seed_ptr + b)
                    off = tl.load(offset_ptr + b)
                    off_lo = (off & 0xFFFFFFFF).to(tl.uint32)
                    off_hi = ((off >> 32) & 0xFFFFFFFF).to(tl.uint32)
                    for s in range(S):  # per-lane winners and masses, reduced once
                        best = tl.full((BLOCK,), -1, tl.int64)
                        best_x = tl.full((BLOCK,), NEG_INF, tl.float32)
                        mass = tl.zeros((BLOCK,), tl.float32)
                        raw = tl.zeros((BLOCK,), tl.float32)
                        xn = row_x(row, c0 + cols, c1, slots, SLOTTED)
                        for v0 in range(c0, c1, BLOCK):
                            x = xn
                            xn = row_x(row, v0 + BLOCK + cols, c1, slots, SLOTTED)
                            gid = row_ids(v0 + cols, c1, vocab_start, slots, SLOTTED)
                            key = tl.where(x > NEG_INF, order_key(x, gid), -1)
                            e = tl.exp(x - xmax)
                            keep = (key >= cut) & (e >= m)
                            if s == 0:
                                mass += tl.where(keep, e, 0.0)
                                if RAW:
                                    raw += tl.exp(x * to_raw - xmax * to_raw)
                            zkey = tl.where(keep, _noisy_key(x, gid, seed, off_lo, off_hi, s,
                                                             vocab_start + v0, BLOCK, ALIGNED4),
                                            -1)
                            up = zkey > best
                            best = tl.where(up, zkey, best)
                            best_x = tl.where(up, x, best_x)
                        top = tl.max(best)
                        if s == 0:
                            tl.store(mine, tl.sum(mass))
                            tl.store(mine + 1, tl.sum(raw))
                        tl.store(keys + CAP + 2 + g * S + s, top)
                        tl.store(mine + 2 + s, tl.max(tl.where(best == top, best_x, NEG_INF)))
                elif WINNER:  # FINAL
                    gs = tl.arange(0, BLOCK_G)
                    parts = part_ptr + (b64 + SAMPLE * B) * G * W
                    ck = tl.load(keys + CAP + 2 + gs, mask=gs < G, other=-1)
                    best = tl.max(ck)
                    x = tl.max(tl.where(ck == best, tl.load(parts + gs * W + 2, mask=gs < G,
                                                            other=NEG_INF), NEG_INF))
                    _winner_outputs(tokens_ptr, logprobs_ptr, logz_ptr, count_ptr, b, best, x,
                                    parts, G, W, xmax, inv_temp_ptr, l_ptr, stride_lb, slot_stride,
                                    peer_ptrs_ptr, rank, split, top_tok_ptr, top_lp_ptr, n_top,
                                    cut, m, LOGPROBS, RAW, SPLIT, BLOCK_G, BLOCK_N)
                else:  # FINAL
                    gs = tl.arange(0, BLOCK_G)
                    parts = part_ptr + ((b64 + SAMPLE * B) * G + gs) * W
                    kept = tl.sum(tl.load(parts, mask=gs < G, other=0.0))
                    lz = xmax + tl.log(kept)
                    inv = tl.load(inv_temp_ptr + b)
                    to_raw = 1.0 / inv
                    logz_raw = xmax * to_raw + tl.log(tl.sum(tl.load(parts + 1, mask=gs < G,
                                                                     other=0.0)))
                    for s in range(S):
                        ck = tl.load(keys + CAP + 2 + gs * S + s, mask=gs < G, other=-1)
                        best = tl.max(ck)
                        best_x = tl.max(tl.where(ck == best, tl.load(parts + 2 + s, mask=gs < G,
                                                                     other=NEG_INF), NEG_INF))
                        tok = tl.where(best >= 0, ID_MASK - (best & ID_MASK), -1)
                        if RAW:
                            lp = best_x * to_raw - logz_raw
                        else:
                            lp = best_x - lz
                        at = b64 * S + s
                        lp = tl.where(best >= 0, lp, NEG_INF)
                        tl.store(tokens_ptr + at, tok)
                        tl.store(logprobs_ptr + at, lp)
                        if SPLIT:
                            send_outputs(l_ptr, b64, stride_lb, slot_stride, peer_ptrs_ptr, rank,
                                         split, s, tok.to(tl.int32).to(tl.float32, bitcast=True))
                            send_outputs(l_ptr, b64, stride_lb, slot_stride, peer_ptrs_ptr, rank,
                                         split, S + s, lp)
                    if not RAW:
                        if n_top > 0:
                            cut = tl.cast(0, tl.int64)
                            if p < 1.0:
                                cut = tl.load(keys + CAP + 1)
                            _top_logprobs(top_tok_ptr, top_lp_ptr, b64, n_top, cut, m, xmax, lz,
                                          BLOCK_N)
                    if RAW:
                        lz = logz_raw
                    tl.store(logz_ptr + b, lz)
                    tl.atomic_add(count_ptr + 1, 1)
                    if SPLIT:
                        send_outputs(l_ptr, b64, stride_lb, slot_stride, peer_ptrs_ptr, rank,
                                     split, 2 * S, lz)
