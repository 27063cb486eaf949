"""The noise function, in plain torch integer ops (bit-identical to the Triton kernels,
which call tl.philox).

The uniform for (row b, token i, sample s) is a fixed function of
(seed[b], offset[b], s, i) only:

    x = Philox4x32-10(key = (seed_lo, seed_hi),
                      counter = (i >> 2, s | stream, offset_lo, offset_hi))[i & 3]
    u = ((x >> 9) + 0.5) * 2**-23                 # in [2**-24, 1 - 2**-24], exact in fp32

One Philox call yields four words; token i uses word i & 3 of counter i >> 2, so four
neighbouring tokens share one call. `stream` is 0 for token noise, 2**31 for the
group-level noise of the log-mass merge (where i is the group's record index), and 2**30
(2**30 + 2**29) for the subgroup (subgroup-choice) uniforms of the inverse-CDF mode (where
i is the tile's first global id, plus the subgroup for the former: merge.py, fact 6), so no
two of them reuse a counter. Because nothing depends on the batch position, the tile size
or the tensor-parallel layout, the same seed gives the same tokens everywhere.

The Gumbel tails are truncated at u = 2**-24 and 1 - 2**-24 (|g| <= 16.6): a
distortion of order 2**-24 per draw, far below what any test can see and shared by
every float32 sampler.

On the GPU the kernels take the OUTER log of g = -log(e), e = -log(u), with the MUFU
(lg2.approx.ftz.f32 times ln 2) rather than libdevice's logf. Its error is absolute:
at most 2**-22 for e in [0.5, 2] and 2 ulp of log2(e) elsewhere, i.e. below 5e-7 on g for
every e the uniforms can give (6e-8 <= e <= 16.7), which is a fixed perturbation of the
score l + g smaller than the rounding of a float32 logit of size >= 8 (ulp = 9.5e-7): it can
only reorder candidates that were already within rounding of a tie. The INNER log needs
relative accuracy: near u = 1, e is tiny and an absolute error of 2**-22 would be a large
relative error in e, i.e. a large error in the high-g tail that decides the winners. The
kernels compute it as libdevice's logf does (u = 2**n (1 + f), f in [-1/3, 1/3), log1p(f) by
a polynomial) minus the branches for zeros, infinities and denormals, which u never is
(kernels/fused_sample.neg_log_uniform): within 1.5 ulp of -ln(u) for each of the 2**23
uniforms (tested exhaustively), so the error on g = -ln(e) is at most 1.8e-7, inside the outer
log's bound. This module (the reference) computes both logs exactly as torch does; tests
compare kernel tokens with it up to such near-ties (tests/kernel_cases.near_tie_ok).
"""
from __future__ import annotations

import math

import torch

from .records import CDF_PICK_STREAM, CDF_STREAM, GROUP_STREAM, MAX_SAMPLES, TOKEN_STREAM  # noqa: F401

MASK32 = 0xFFFFFFFF
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10


def _mulhilo32(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of a * m for a in [0, 2**32), without int64 overflow."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    p_hi, p_lo = a_hi * m, a_lo * m  # each < 2**48
    hi = (p_hi + (p_lo >> 16)) >> 16
    lo = (((p_hi & 0xFFFF) << 16) + p_lo) & MASK32
    return hi, lo


def philox4x32(c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor,
               k0: torch.Tensor, k1: torch.Tensor, rounds: int = PHILOX_ROUNDS) -> tuple:
    """Philox4x32 on int64 tensors holding uint32 values (broadcasting). Returns 4 words."""
    c0, c1, c2, c3, k0, k1 = torch.broadcast_tensors(c0, c1, c2, c3, k0, k1)
    for _ in range(rounds):
        hi0, lo0 = _mulhilo32(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo32(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & MASK32
        k1 = (k1 + PHILOX_W1) & MASK32
    return c0, c1, c2, c3


def split64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Low and high uint32 words (as int64) of an int64 tensor's bit pattern."""
    x = x.to(torch.int64)
    return x & MASK32, (x >> 32) & MASK32


# On the CPU, Philox over more words than this runs in slices of rows: its int64 temporaries
# then stay small enough for the allocator to reuse, where whole [B, V] ones are mapped and
# faulted in afresh by every operation (20,000 rows x 1,024 ids: 4 x faster in slices).
CPU_SLICE_WORDS = 1 << 20


def philox_bits(seed: torch.Tensor, offset: torch.Tensor, sample: int | torch.Tensor, index: torch.Tensor,
                stream: int = 0) -> torch.Tensor:
    """uint32 word (as int64) for each (row, index): seed/offset [B, 1], index [1, N] or [B, N]."""
    index = index.to(torch.int64)
    c1 = torch.as_tensor(sample, dtype=torch.int64, device=index.device) | stream
    if index.device.type == "cpu":
        shape = torch.broadcast_shapes(seed.shape, offset.shape, c1.shape, index.shape)
        words = math.prod(shape)
        if words > CPU_SLICE_WORDS and len(shape) and shape[0] > 1:  # (elementwise: exact)
            seed, offset, c1, index = torch.broadcast_tensors(seed, offset, c1, index)  # views
            step = max(1, CPU_SLICE_WORDS * shape[0] // words)
            return torch.cat([_philox_words(seed[i:i + step], offset[i:i + step], c1[i:i + step],
                                            index[i:i + step]) for i in range(0, shape[0], step)])
    return _philox_words(seed, offset, c1, index)


def _philox_words(seed, offset, c1, index):
    k0, k1 = split64(seed)
    o0, o1 = split64(offset)
    words = philox4x32(index >> 2, c1, o0, o1, k0, k1)
    lane = index & 3
    x = torch.where(lane == 0, words[0], words[1])
    x = torch.where(lane == 2, words[2], x)
    return torch.where(lane == 3, words[3], x)


def bits_to_uniform(x: torch.Tensor) -> torch.Tensor:
    """uint32 word → float32 uniform in the open interval (0, 1)."""
    return ((x >> 9).to(torch.float32) + 0.5) * (2.0 ** -23)


def uniform(seed: torch.Tensor, offset: torch.Tensor, sample: int | torch.Tensor,
            index: torch.Tensor, stream: int = 0) -> torch.Tensor:
    return bits_to_uniform(philox_bits(seed, offset, sample, index, stream))


def gumbel(seed: torch.Tensor, offset: torch.Tensor, sample: int | torch.Tensor,
           index: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """Standard Gumbel noise g = -log(-log u), float32."""
    return -torch.log(-torch.log(uniform(seed, offset, sample, index, stream)))


def cdf_uniforms(seed: torch.Tensor, offset: torch.Tensor, sample: int, tile_start: torch.Tensor,
                 subgroups: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse-CDF mode's uniforms for tiles starting at global ids tile_start [T]:
    (subgroup uniforms [B, T, subgroups], subgroup-choice uniform [B, T]) for seed/offset
    [B] int64 (merge.py, fact 6). Subgroup k of a tile uses id tile_start + k of the stream
    CDF_STREAM, the choice id tile_start of CDF_PICK_STREAM."""
    seed, offset = seed[:, None, None], offset[:, None, None]
    ids = tile_start.to(torch.int64)[None, :, None]
    u_sub = uniform(seed, offset, sample, ids + torch.arange(subgroups, device=ids.device),
                    stream=CDF_STREAM)
    u_pick = uniform(seed, offset, sample, ids, stream=CDF_PICK_STREAM)[..., 0]
    return u_sub, u_pick

