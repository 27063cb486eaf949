"""Philox4x32-10 (Salmon et al., SC'11) for Triton, bit-identical to tl.philox and to
tpsample/noise.py, written for the epilogue's budget:

- each round's two 32x32 -> 64-bit products are one widening multiply (hi and lo words of
  one IMAD.WIDE) instead of a mul.hi plus a mul.lo;
- the key schedule runs on the key's own shape: the key comes from the row's seed, so with
  k0/k1 of shape [1, B] it costs B lanes, not [V, B] elements.
"""
import triton
import triton.language as tl

ROUND_A = tl.constexpr(0xD2511F53)
ROUND_B = tl.constexpr(0xCD9E8D57)
KEY_A = tl.constexpr(0x9E3779B9)
KEY_B = tl.constexpr(0xBB67AE85)


@triton.jit
def _mulhilo(a, b: tl.constexpr):
    p = a.to(tl.uint64) * tl.full((1,), b, tl.uint64)
    return (p >> 32).to(tl.uint32), p.to(tl.uint32)


@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Ten Philox rounds of counter (c0, c1, c2, c3) uint32 under key (k0, k1) uint32; all
    broadcast together. Returns the four uint32 output words."""
    for _ in tl.static_range(10):
        hi_b, lo_b = _mulhilo(c2, ROUND_B)
        hi_a, lo_a = _mulhilo(c0, ROUND_A)
        c0 = hi_b ^ c1 ^ k0
        c2 = hi_a ^ c3 ^ k1
        c1 = lo_b
        c3 = lo_a
        k0 = k0 + KEY_A
        k1 = k1 + KEY_B
    return c0, c1, c2, c3
