import pytest
import torch
import triton
import triton.language as tl

from tpsample import noise
from tpsample.kernels.fused_sample import neg_log_uniform, philox_with

# Known-answer vectors of Philox4x32-10 from the Random123 distribution (kat_vectors).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("ctr,key,expected", KAT)
def test_philox_known_answers(ctr, key, expected):
    t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    out = noise.philox4x32(*map(t, ctr), *map(t, key))
    assert tuple(int(x) for x in out) == expected


def test_uniform_is_open_interval_and_exact_at_extremes():
    x = torch.tensor([0, 0xFFFFFFFF, 511, 512], dtype=torch.int64)
    u = noise.bits_to_uniform(x)
    assert u[0] == 2.0 ** -24 and u[1] == 1 - 2.0 ** -24
    assert (u > 0).all() and (u < 1).all()
    assert torch.isfinite(-torch.log(-torch.log(u))).all()


def test_noise_depends_only_on_seed_offset_sample_id():
    seed = torch.tensor([[5], [5], [6]])
    off = torch.tensor([[0], [0], [0]])
    ids = torch.arange(64)[None, :]
    g = noise.gumbel(seed, off, 0, ids)
    assert torch.equal(g[0], g[1]) and not torch.equal(g[0], g[2])
    assert not torch.equal(g[0], noise.gumbel(seed, off + 1, 0, ids)[0])
    assert not torch.equal(g[0], noise.gumbel(seed, off, 1, ids)[0])
    assert not torch.equal(g[0], noise.gumbel(seed, off, 0, ids, stream=noise.GROUP_STREAM)[0])
    # a slice of ids sees the same values as the full range (no dependence on layout)
    assert torch.equal(g[:, 13:29], noise.gumbel(seed, off, 0, ids[:, 13:29]))


def test_negative_seeds_and_offsets_use_the_int64_bit_pattern():
    s = torch.tensor([[-1]])
    lo, hi = noise.split64(s)
    assert int(lo) == 0xFFFFFFFF and int(hi) == 0xFFFFFFFF
    g = noise.gumbel(s, torch.tensor([[-(2 ** 63)]]), 0, torch.arange(8)[None, :])
    assert torch.isfinite(g).all()


@pytest.mark.parametrize("index_rows", [1, 37])
def test_cpu_slices_of_rows_give_the_same_words(monkeypatch, index_rows):
    """Above CPU_SLICE_WORDS the CPU draws Philox words in slices of rows: the same words."""
    g = torch.Generator().manual_seed(3)
    seed = torch.randint(-(1 << 62), 1 << 62, (37, 1), generator=g)
    offset = torch.randint(0, 1 << 40, (37, 1), generator=g)
    sample = torch.randint(0, 4, (37, 1), generator=g)
    index = torch.randint(0, 1 << 31, (index_rows, 300), generator=g)
    whole = noise.philox_bits(seed, offset, sample, index, stream=2)
    monkeypatch.setattr(noise, "CPU_SLICE_WORDS", 1000)  # slices of 3 rows, the last of 1
    calls = []
    words = noise._philox_words
    monkeypatch.setattr(noise, "_philox_words", lambda *a: calls.append(a[3].shape) or words(*a))
    sliced = noise.philox_bits(seed, offset, sample, index, stream=2)
    assert len(calls) == 13 and calls[0] == (3, 300) and calls[-1] == (1, 300)
    assert torch.equal(sliced, whole)


def test_uniforms_look_uniform():
    from scipy import stats
    u = noise.uniform(torch.tensor([[123]]), torch.tensor([[0]]), 0, torch.arange(200_000)[None, :])
    assert stats.kstest(u[0].double().numpy(), "uniform").pvalue > 1e-4


@triton.jit
def _neg_log_uniform_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs).to(tl.uint32, bitcast=True)  # Philox words are uint32
    tl.store(out_ptr + offs, neg_log_uniform(x))


def test_kernel_inner_log_within_1p5_ulp_for_every_uniform(device):
    """The kernels' -ln(u) (a polynomial without libdevice's special cases) against float64,
    exhaustively: all 2**23 uniforms bits_to_uniform can give. 1.5 ulp bounds the g error by
    2e-7, below the outer log's (noise.py); the CPU interpreter rounds each FMA twice."""
    k = torch.arange(1 << 23, dtype=torch.int64)
    x = (k << 9).to(torch.int32).to(device)  # the 23 bits the uniform keeps; the rest are dropped
    out = torch.empty(1 << 23, dtype=torch.float32, device=device)
    _neg_log_uniform_kernel[((1 << 23) // 8192,)](x, out, BLOCK=8192)
    e = out.cpu().double()
    exact = -torch.log((k.double() + 0.5) * 2.0 ** -23)
    ulp = (exact.float().nextafter(torch.tensor(float("inf"))) - exact.float()).double()
    err = ((e - exact).abs() / ulp)
    assert err.max().item() <= 1.5, f"{err.max().item():.2f} ulp at k = {int(err.argmax())}"
    # and the bits the kernel ignores do not matter
    lo = (k[:4096] << 9 | 0x1FF).to(torch.int32).to(device)
    out_lo = torch.empty(4096, dtype=torch.float32, device=device)
    _neg_log_uniform_kernel[(1,)](lo, out_lo, BLOCK=4096)
    assert torch.equal(out_lo.cpu(), out[:4096].cpu())


@triton.jit
def _philox_both_kernel(seed_ptr, ctr_ptr, out_ptr, N: tl.constexpr, MUL: tl.constexpr):
    i = tl.arange(0, N)
    seed = tl.load(seed_ptr + i)
    c0 = tl.load(ctr_ptr + 4 * i).to(tl.uint32, bitcast=True)
    c1 = tl.load(ctr_ptr + 4 * i + 1).to(tl.uint32, bitcast=True)
    c2 = tl.load(ctr_ptr + 4 * i + 2).to(tl.uint32, bitcast=True)
    c3 = tl.load(ctr_ptr + 4 * i + 3).to(tl.uint32, bitcast=True)
    a0, a1, a2, a3 = philox_with(seed, c0, c1, c2, c3, MUL)
    b0, b1, b2, b3 = tl.philox(seed, c0, c1, c2, c3)
    row = out_ptr + 8 * i
    tl.store(row + 0, a0.to(tl.int32, bitcast=True))
    tl.store(row + 1, a1.to(tl.int32, bitcast=True))
    tl.store(row + 2, a2.to(tl.int32, bitcast=True))
    tl.store(row + 3, a3.to(tl.int32, bitcast=True))
    tl.store(row + 4, b0.to(tl.int32, bitcast=True))
    tl.store(row + 5, b1.to(tl.int32, bitcast=True))
    tl.store(row + 6, b2.to(tl.int32, bitcast=True))
    tl.store(row + 7, b3.to(tl.int32, bitcast=True))


@pytest.mark.parametrize("mul", ["umulhi", "wide"])
def test_philox_multiplies_equal_tl_philox(device, mul):
    """fused_sample.philox with its multiplies as one mul.wide.u32 each (GPU only: inline PTX)
    is Triton's Philox4x32-10 bit for bit, and both match the torch reference
    (noise.philox4x32), extremes included (all-ones words)."""
    if mul == "wide" and device.type != "cuda":
        pytest.skip("inline PTX: GPU only")
    g = torch.Generator().manual_seed(11)
    n = 4096
    seed = torch.randint(-(2 ** 63), 2 ** 63 - 1, (n,), generator=g, dtype=torch.int64)
    ctr = torch.randint(-(2 ** 31), 2 ** 31 - 1, (n, 4), generator=g, dtype=torch.int32)
    seed[:3] = torch.tensor([-1, 0, -1])
    ctr[:3] = torch.tensor([[-1, -1, -1, -1], [0, 0, 0, 0], [-65536, 65535, -1, 65535]],
                           dtype=torch.int32)
    out = torch.empty(n, 8, dtype=torch.int32, device=device)
    _philox_both_kernel[(1,)](seed.to(device), ctr.to(device), out, N=n, MUL=mul)
    out = out.cpu()
    assert torch.equal(out[:, :4], out[:, 4:])
    u32 = lambda t: t.to(torch.int64) & noise.MASK32  # noqa: E731
    k0, k1 = noise.split64(seed)
    want = noise.philox4x32(*(u32(ctr[:, k]) for k in range(4)), k0, k1)
    for k in range(4):
        assert torch.equal(u32(out[:, k]), want[k])
