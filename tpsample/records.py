"""The candidate-record contract: what stage 1 writes, the exchange moves and stage 2 reads.

Every implementation of stage 1 (the Triton and Gluon kernels, the torch path) writes, per
(sample s, row b, tile t of TILE consecutive vocabulary ids), one record of FIELDS float32
values:

    score     the tile's best perturbed score (max over the tile of l_i + g_i; greedy rows:
              max l_i; merge "cdf": the chosen token's logit)
    token     the global id of that token, as float32: exact below MAX_VOCAB = 2**24
    logit     its transformed logit l_i (0 when no log-prob is wanted: need_mass=False)
    log_mass  logsumexp of the tile's transformed logits (need_mass=False: the tile max,
              which is finite exactly when the log-mass is)

Records are addressed as [slots, S, B, T, FIELDS] through strides (the field dimension
contiguous, whole records 16-byte aligned); a slot is one rank's shard under tensor
parallelism. The tile size is the same everywhere, so the group merges ("logmass", "cdf")
partition the vocabulary identically on every path.

Filtered sampling, top log-probs and samples without replacement (tpsample/filters.py) add
planes after the S sample planes of a row's records, in the same [.., planes, B, T, FIELDS]
layout so they travel with the records:

    candidate planes  CANDIDATES // 2 of them: plane j holds the tile's candidates 2j and
                      2j + 1 in (logit desc, id asc) order as (logit, id, logit, id), the
                      transformed logits of the tile's CANDIDATES best tokens (-inf past
                      the tile's finite ones)
    raw plane         (logsumexp of the tile's logits at T = 1, 0, 0, 0)

and without replacement sample plane s holds the tile's (s+1)-th best perturbed score
under sample 0's noise instead of sample s's best.

The noise is Philox4x32-10 keyed by (seed, offset, sample | stream, id) (tpsample/noise.py
spells it out); the stream flags keep the draws of different purposes apart:

    TOKEN_STREAM     per-token Gumbel noise of stage 1 (id = global token id)
    GROUP_STREAM     per-record Gumbel noise of the log-mass merge (id = record index)
    CDF_STREAM       merge "cdf": the four subgroup uniforms (id = tile start + subgroup)
    CDF_PICK_STREAM  merge "cdf": the uniform choosing the subgroup (id = tile start)
    ACCEPT_STREAM    speculative verification with draft distributions: the acceptance
                     uniform of a draft position (id = 0; tpsample/verify.py)

The sample index shares the counter word with the flags, hence MAX_SAMPLES.
"""
from __future__ import annotations

import torch

FIELDS = ("score", "token", "logit", "log_mass")
WIDTH = len(FIELDS)
TILE = 128
MAX_VOCAB = 1 << 24
NO_TOKEN = float(MAX_VOCAB)  # above every valid token id

CDF_SUBGROUPS = 4  # merge "cdf": a tile is 4 subgroups of TILE // 4 consecutive ids
TOKEN_STREAM = 0
GROUP_STREAM = 1 << 31
CDF_STREAM = 1 << 30
CDF_PICK_STREAM = (1 << 30) | (1 << 29)
ACCEPT_STREAM = 1 << 29
MAX_SAMPLES = 1 << 29
CANDIDATES = 4
CANDIDATE_PLANES = CANDIDATES // 2


def planes(num_samples: int, candidates: bool) -> int:
    """Record planes per row: the samples', then (candidates) the candidate and raw planes."""
    return num_samples + (CANDIDATE_PLANES + 1 if candidates else 0)


def num_tiles(rows: int) -> int:
    """Tiles covering `rows` vocabulary rows."""
    return -(-rows // TILE)


def records_view(flat: torch.Tensor, S: int, B: int, T: int,
                 tile_major: bool = False) -> torch.Tensor:
    """[..., S·B·T·WIDTH] fp32 → the records view [..., S, B, T, WIDTH]. Row-major by default
    (a row's records contiguous: what stage 2 reads best); tile_major lays them out
    [S, T, B, WIDTH], so the records of one stage-1 program (one tile, its rows) are one
    contiguous run: what the P2P fan-out writes best over NVLink."""
    lead = flat.shape[:-1]
    if tile_major:
        return flat.view(*lead, S, T, B, WIDTH).transpose(-3, -2)
    return flat.view(*lead, S, B, T, WIDTH)


def check_layout(out: torch.Tensor, shape: tuple) -> None:
    """Stage 1 writes records through strides: the field dim contiguous, every other stride
    a multiple of WIDTH floats and the base 16-byte aligned (whole records, never split
    across cache sectors)."""
    ok = (tuple(out.shape) == shape and out.dtype == torch.float32 and out.stride(-1) == 1
          and all(st % WIDTH == 0 for st in out.stride()[:-1]) and out.data_ptr() % 16 == 0)
    if not ok:
        raise ValueError(f"records `out` must be fp32 {list(shape)}, last dim contiguous, other "
                         f"strides multiples of {WIDTH}, 16-byte aligned; got {out.dtype} "
                         f"{list(out.shape)} strides {out.stride()}")
