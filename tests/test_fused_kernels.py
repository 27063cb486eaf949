"""Stage-1 Triton kernels (interpreted on CPU): records == torch path, tokens == reference."""
import pytest
import torch

import tpsample
from tpsample import launchers, merge, noise, records
from tpsample.params import row_params
from tpsample.reference import reference_sample

import kernel_cases as kc
from cases import random_inputs
from kernel_cases import near_tie_ok

BACKENDS = ["triton", "torch"]


def params(B, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    temp = torch.rand(B, generator=g) * 1.5 + 0.5
    temp[::4] = 0.0  # greedy rows mixed in
    seeds = torch.randint(-(2 ** 62), 2 ** 62, (B,), generator=g)
    offsets = torch.randint(0, 1000, (B,), generator=g)
    return temp.to(device), seeds.to(device), offsets.to(device)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,D,V,vocab", [(5, 64, 1000, 1000),
                                         pytest.param(70, 100, 777, 700, marks=pytest.mark.slow)])
def test_max_merge_matches_reference(backend, dtype, B, D, V, vocab, device):
    h, w = random_inputs(B, D, V, dtype, device)
    bias = torch.randn(V, device=device)
    temp, seeds, offsets = params(B, device)
    out = tpsample.sample(h, w, temperature=temp, seed=seeds, offset=offsets, bias=bias,
                          vocab_size=vocab, num_samples=2, return_logprobs=True, backend=backend)
    ref = reference_sample(h.cpu(), w.cpu(), temperature=temp.cpu(), seed=seeds.cpu(),
                           offset=offsets.cpu(), bias=bias.cpu(), vocab_size=vocab, num_samples=2)
    assert out.tokens.shape == (B, 2) and out.tokens.dtype == torch.int64
    assert int(out.tokens.max()) < vocab and int(out.tokens.min()) >= 0
    mism = near_tie_ok(ref, out.tokens.cpu(), scale=20.0)
    assert mism <= max(1, B // 20)
    tol = 1e-4
    same = out.tokens.cpu() == ref.tokens
    assert torch.allclose(out.logprobs.cpu().double()[same], ref.logprobs[same], atol=tol, rtol=0)
    assert torch.allclose(out.logz.cpu().double(), ref.logz, atol=tol, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_logmass_matches_reference(backend, device):
    B, D, V = 24, 48, 600
    h, w = random_inputs(B, D, V, torch.float32, device, seed=3)
    temp, seeds, offsets = params(B, device, seed=1)
    out = tpsample.sample(h, w, temperature=temp, seed=seeds, offset=offsets, num_samples=3,
                          merge="logmass", vocab_size=590, backend=backend)
    ref = reference_sample(h.cpu(), w.cpu(), temperature=temp.cpu(), seed=seeds.cpu(),
                           offset=offsets.cpu(), num_samples=3, merge="logmass", vocab_size=590)
    assert torch.equal(out.cpu(), ref.tokens)  # no near-ties at these seeds: any mismatch is a bug
    assert out.max() < 590


@pytest.mark.parametrize("backend", BACKENDS)
def test_cdf_matches_reference(backend, device):
    """merge="cdf": the same tokens as the reference (fact 6 in torch on the full row), greedy
    rows (every 4th) included; log-probs and log Z as accurate as the other merges."""
    B, D, V = 24, 48, 600
    h, w = random_inputs(B, D, V, torch.float32, device, seed=4)
    bias = torch.randn(V, device=device)
    temp, seeds, offsets = params(B, device, seed=2)
    out = tpsample.sample(h, w, temperature=temp, seed=seeds, offset=offsets, bias=bias,
                          num_samples=3, merge="cdf", vocab_size=590, return_logprobs=True,
                          backend=backend)
    ref = reference_sample(h.cpu(), w.cpu(), temperature=temp.cpu(), seed=seeds.cpu(),
                           offset=offsets.cpu(), bias=bias.cpu(), num_samples=3, merge="cdf",
                           vocab_size=590)
    # the interval boundaries of fact 6 are running sums: another summation order could move
    # a token only if its uniform lay within rounding of a boundary (~1e-6 per draw)
    assert torch.equal(out.tokens.cpu(), ref.tokens)
    assert out.tokens.max() < 590
    assert torch.allclose(out.logprobs.cpu().double(), ref.logprobs, atol=1e-4, rtol=0)
    assert torch.allclose(out.logz.cpu().double(), ref.logz, atol=1e-4, rtol=0)
    greedy = temp.cpu() == 0
    assert torch.equal(ref.tokens[greedy], ref.scores[greedy].argmax(-1))


@pytest.mark.parametrize("strategy", ["fused", "logits"])
def test_cdf_records_of_every_strategy_match_torch(strategy, device):
    """Every Triton strategy writes the torch path's cdf records, also for a shard starting at
    an id that is not a multiple of 4 (the uniforms are keyed by the tile's first id)."""
    from tpsample.torch_records import records_torch
    B, D, V = 10, 64, 300
    h, w = random_inputs(B, D, V, torch.float32, device, seed=22)
    temp, seeds, offsets = params(B, device, seed=5)
    p = row_params(h, temp, seeds, offsets)
    cfg = dict(strategy=strategy, BLOCK_B=16, BLOCK_D=32, NUM_STAGES=1, num_warps=4)
    for start in (0, 6):
        kw = dict(bias=None, inv_temp=p.inv_temp, seed=p.seed, offset=p.offset, num_samples=2,
                  n_real=V - 5, vocab_start=start)
        got = kc.fused_records(h, w, config=cfg, cdf=True, **kw).cpu()
        want = records_torch(h.cpu(), w.cpu(), **{k: v.cpu() if torch.is_tensor(v) else v
                                                  for k, v in kw.items()}, cdf=True)
        assert torch.equal(got[..., 1], want[..., 1])
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        if start == 0:  # not the records of the Gumbel-max path
            assert not torch.equal(got[..., 1], kc.fused_records(h, w, config=cfg, **kw).cpu()[..., 1])
    with pytest.raises(ValueError, match="need_mass"):
        kc.fused_records(h, w, config=cfg, cdf=True, need_mass=False, **kw)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-3), (torch.float16, 1e-3)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_and_logz_vs_float64(dtype, atol, backend, device):
    B, D, V = 9, 96, 900
    h, w = random_inputs(B, D, V, dtype, device, seed=5)
    bias = torch.randn(V, device=device)
    temp = torch.tensor([0.5, 1.0, 2.0, 0.0, 1.3, 0.7, 1.0, 0.0, 3.0], device=device)
    out = tpsample.sample(h, w, temperature=temp, seed=11, bias=bias, vocab_size=850,
                          return_logprobs=True, backend=backend)
    l = h.cpu().double() @ w.cpu().double().T + bias.cpu().double()
    t = temp.cpu().double()
    l = l / torch.where(t == 0, torch.ones_like(t), t)[:, None]
    l[:, 850:] = float("-inf")
    logp = torch.log_softmax(l, dim=-1)
    assert (out.logz.cpu().double() - torch.logsumexp(l, -1)).abs().max() <= atol
    want = logp.gather(1, out.tokens.cpu()[:, None])[:, 0]
    assert (out.logprobs.cpu().double() - want).abs().max() <= atol
    greedy = t == 0
    assert torch.equal(out.tokens.cpu()[greedy], l[greedy].argmax(-1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_token_invariant_to_batch_layout(backend, device):
    B, D, V = 12, 64, 700
    h, w = random_inputs(40, D, V, torch.float32, device, seed=7)
    temp, seeds, offsets = params(40, device, seed=2)
    kw = dict(num_samples=2, backend=backend)
    base = tpsample.sample(h[:B], w, temperature=temp[:B], seed=seeds[:B], offset=offsets[:B], **kw)
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(0)).to(device)
    permuted = tpsample.sample(h[perm], w, temperature=temp[perm], seed=seeds[perm],
                               offset=offsets[perm], **kw)
    assert torch.equal(permuted, base[perm])
    padded = tpsample.sample(h, w, temperature=temp, seed=seeds, offset=offsets, **kw)
    assert torch.equal(padded[:B], base)  # 40 rows: another batch tile size


@pytest.mark.slow
def test_tokens_invariant_to_tile_sizes_and_backend(device):
    B, D, V = 33, 64, 1000
    h, w = random_inputs(B, D, V, torch.float32, device, seed=9)
    p = row_params(h, 1.0, torch.arange(B, device=device), 5)
    kw = dict(bias=None, inv_temp=p.inv_temp, seed=p.seed, offset=p.offset, num_samples=1, n_real=V)
    results = []
    for cfg in [dict(strategy="fused", BLOCK_B=16, BLOCK_D=32, NUM_STAGES=1, num_warps=4),
                dict(strategy="fused", BLOCK_B=64, BLOCK_D=64, NUM_STAGES=1, num_warps=4),
                dict(strategy="logits", BLOCK_B=32, BLOCK_D=0, NUM_STAGES=0, num_warps=4),
                # fp32 (or no Hopper): the warp-specialized kernel's fallback, "logits"
                dict(strategy="ws", BLOCK_B=128, NUM_STAGES=4, EPI_B=64, num_warps=8),
                # and the ping-pong kernel's: "ws", then "logits"
                dict(strategy="pp", BLOCK_B=128, NUM_STAGES=6, num_warps=4)]:
        rec = kc.fused_records(h, w, config=cfg, **kw)
        results.append(kc.reduce_records(rec[None], p.inv_temp, p.seed, p.offset, "max")[0].cpu())
    from tpsample.torch_records import records_torch
    for tile in (64, 128, 256):
        rec = records_torch(h.cpu(), w.cpu(), tile=tile, **{k: (v.cpu() if torch.is_tensor(v) else v)
                                                           for k, v in kw.items()})
        results.append(merge.reduce_records(rec[None], p.seed.cpu(), p.offset.cpu(),
                                            p.inv_temp.cpu() == 0, "max")[0])
    for r in results[1:]:
        assert torch.equal(r, results[0])
    with pytest.raises(ValueError, match="BLOCK_B of the ping-pong kernel"):
        kc.fused_records(h, w, config=dict(strategy="pp", BLOCK_B=64, NUM_STAGES=6,
                                              num_warps=4), **kw)


@pytest.mark.parametrize("B", [1, 3, 8])
def test_padding_column_trim_is_invisible(B, device):
    """B < BLOCK_B: the epilogue drops padding columns before the noise (HALVINGS > 0); the
    records must equal those of the untrimmed tile, incl. unaligned shards: score, token and
    logit bit for bit; the log-mass up to summation order (a narrower tile may sum its column
    in another order)."""
    D, V = 32, 300
    h, w = random_inputs(B, D, V, torch.float32, device, seed=11)
    temp, seeds, offsets = params(B, device, seed=2)
    p = row_params(h, temp, seeds, offsets)
    bias = torch.randn(V, generator=torch.Generator().manual_seed(B)).to(device)
    kw = dict(bias=bias, inv_temp=p.inv_temp, seed=p.seed, offset=p.offset, num_samples=2,
              n_real=V - 7)
    cfg = dict(strategy="fused", BLOCK_B=16, BLOCK_D=32, NUM_STAGES=1, num_warps=4)
    for start in (0, 5):
        trimmed = kc.fused_records(h, w, vocab_start=start, config=cfg, **kw)
        full = kc.fused_records(h, w, vocab_start=start, config=dict(cfg, TRIM=False), **kw)
        assert torch.equal(trimmed[..., :3], full[..., :3])
        torch.testing.assert_close(trimmed[..., 3], full[..., 3], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("D", [64, 40])
def test_tma_weight_loads_match_pointer_loads(D, device):
    """W through a TMA descriptor (zero-filled ragged vocab / D tails) == pointer loads."""
    B, V = 5, 300
    h, w = random_inputs(B, D, V, torch.float32, device, seed=13)
    p = row_params(h, 0.8, torch.arange(B, device=device), 1)
    kw = dict(bias=None, inv_temp=p.inv_temp, seed=p.seed, offset=p.offset, num_samples=1, n_real=V)
    cfg = dict(strategy="fused", BLOCK_B=16, BLOCK_D=32, NUM_STAGES=1, num_warps=4)
    assert torch.equal(kc.fused_records(h, w, config=dict(cfg, TMA=True), **kw),
                       kc.fused_records(h, w, config=cfg, **kw))


def test_skipping_tile_mass_keeps_tokens_and_degenerate_rows(device):
    """need_mass=False (max merge, no log-probs) stores tile maxima and no logits: same scores
    and tokens, and rows whose log Z is not finite (NaN logit, all -inf) still come back as
    token -1."""
    B, D, V = 6, 32, 300
    h, w = random_inputs(B, D, V, torch.float32, device, seed=12)
    h[1, 0] = float("nan")
    bias = torch.zeros(V, device=device)
    p = row_params(h, 1.0, torch.arange(B, device=device), 3)
    kw = dict(bias=bias, inv_temp=p.inv_temp, seed=p.seed, offset=p.offset, num_samples=2, n_real=V)
    with_mass = kc.fused_records(h, w, **kw)
    without = kc.fused_records(h, w, need_mass=False, **kw)
    assert torch.equal(with_mass[..., :2], without[..., :2])
    t_with = kc.reduce_records(with_mass[None], p.inv_temp, p.seed, p.offset, "max")[0]
    t_without = kc.reduce_records(without[None], p.inv_temp, p.seed, p.offset, "max")[0]
    assert torch.equal(t_with, t_without)
    assert (t_with[1] == -1).all()
    out = tpsample.sample(h, w, bias=torch.full((V,), float("-inf"), device=device), seed=1)
    assert (out == -1).all()


def test_unaligned_vocab_start_noise_path_matches(device):
    """A shard starting at a global id not divisible by 4 takes the per-token noise path."""
    B, D, V = 6, 32, 300
    h, w = random_inputs(B, D, V, torch.float32, device, seed=4)
    p = row_params(h, 1.0, torch.arange(B, device=device), 0)
    kw = dict(bias=None, inv_temp=p.inv_temp, seed=p.seed, offset=p.offset, num_samples=2, n_real=V)
    for start in (0, 3, 130):
        rec = kc.fused_records(h, w, vocab_start=start, **kw).cpu()
        g = noise.gumbel(p.seed.cpu()[:, None], p.offset.cpu()[:, None], 1,
                         start + torch.arange(V)[None, :])
        l = h.cpu() @ w.cpu().T
        z = l + g
        # tile 0's record for sample 1: best score and its global id
        best, idx = z[:, :128].max(-1)
        assert torch.allclose(rec[1, :, 0, 0], best, atol=1e-5)
        assert torch.equal(rec[1, :, 0, 1].long(), start + idx)


def test_same_seed_same_tokens_and_seed_none_follows_manual_seed(device):
    h, w = random_inputs(8, 32, 500, torch.float32, device)
    a = tpsample.sample(h, w, seed=42, offset=7)
    assert torch.equal(a, tpsample.sample(h, w, seed=42, offset=7))
    assert not torch.equal(tpsample.sample(h, w, seed=42, offset=8, num_samples=4),
                           tpsample.sample(h, w, seed=42, offset=7, num_samples=4))
    torch.manual_seed(3)
    x = tpsample.sample(h, w, num_samples=4)
    torch.manual_seed(3)
    assert torch.equal(x, tpsample.sample(h, w, num_samples=4))


@pytest.mark.parametrize("strategy", ["fused", "logits"])
def test_records_land_the_same_in_any_layout(strategy, device):
    """Stage 1 writes through strides: the default row-major buffer, a tile-major [S, T, B, 4]
    one seen as [S, B, T, 4] and a padded slot get identical records; a misaligned or
    2-strided buffer is refused."""
    B, D, V = 6, 64, 300
    h, w = random_inputs(B, D, V, torch.float32, device, seed=21)
    p = row_params(h, 0.7, torch.arange(B, device=device), 1)
    T = records.num_tiles(V)
    cfg = dict(strategy=strategy, BLOCK_B=16, BLOCK_D=32, NUM_STAGES=1, num_warps=4)
    kw = dict(bias=None, inv_temp=p.inv_temp, seed=p.seed, offset=p.offset, num_samples=2, n_real=V - 5,
              config=cfg)
    want = kc.fused_records(h, w, **kw)
    assert want.stride() == (B * T * 4, T * 4, 4, 1)
    tiles = torch.full((2, T, B, 4), -3.0, device=device).transpose(1, 2)
    padded = torch.full((2, B, T + 1, 4), -3.0, device=device)[:, :, :T]
    for out in (tiles, padded):
        kc.fused_records(h, w, out=out, **kw)
        assert torch.equal(out, want)
    assert (padded.as_strided((2, B, 4), (B * (T + 1) * 4, (T + 1) * 4, 1), T * 4) == -3.0).all()
    for merge_mode in ("max", "logmass"):  # stage 2 reads through strides too
        ref = kc.reduce_records(want[None], p.inv_temp, p.seed, p.offset, merge_mode)
        got = kc.reduce_records(tiles[None], p.inv_temp, p.seed, p.offset, merge_mode)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
    bad = torch.empty(2 * B * T * 4 + 1, device=device)[1:].view(2, B, T, 4)
    with pytest.raises(ValueError, match="16-byte aligned"):
        kc.fused_records(h, w, out=bad, **kw)
    with pytest.raises(ValueError, match="strides multiples of 4"):
        kc.fused_records(h, w, out=torch.empty(2, B, T, 8, device=device)[..., ::2], **kw)


@pytest.mark.parametrize("B,D,noise_step,chunks", [
    (3, 64, 0.5, 1), pytest.param(20, 40, 0.0, 1, marks=pytest.mark.slow),
    pytest.param(20, 40, 1.0, 1, marks=pytest.mark.slow),
    (3, 160, 0.0, 2), pytest.param(20, 160, 0.5, 4, marks=pytest.mark.slow),
    pytest.param(20, 40, 0.5, 4, marks=pytest.mark.slow)])
def test_noise_drawn_in_main_loop_is_invisible(B, D, noise_step, chunks, device):
    """NOISE_STEP draws sample 0's noise inside the D loop (overlapped with the loads) instead
    of the epilogue: records bit for bit equal, for trimmed (B = 3) and untrimmed tiles, a
    ragged D, 1.0 (clamped to the last step) and 2 or 4 row blocks drawn in different steps
    (or all in one when the loop is too short). Two samples or an unaligned shard fall back."""
    V = 300
    h, w = random_inputs(B, D, V, torch.float32, device, seed=14)
    temp, seeds, offsets = params(B, device, seed=3)
    p = row_params(h, temp, seeds, offsets)
    bias = torch.randn(V, generator=torch.Generator().manual_seed(B)).to(device)
    cfg = dict(strategy="fused", BLOCK_B=16, BLOCK_D=32, NUM_STAGES=1, num_warps=4)
    for samples, start in ((1, 0), (1, 6), (2, 0)):
        kw = dict(bias=bias, inv_temp=p.inv_temp, seed=p.seed, offset=p.offset,
                  num_samples=samples, n_real=V - 3, vocab_start=start)
        early = kc.fused_records(h, w, config=dict(cfg, NOISE_STEP=noise_step, NOISE_CHUNKS=chunks), **kw)
        assert torch.equal(early, kc.fused_records(h, w, config=cfg, **kw))


def test_kernel_noise_matches_reference_noise(device):
    """The noise the kernels add equals tpsample.noise.gumbel (the torch reference, both logs
    in libdevice/torch precision) up to the error bound of the GPU's fast outer log (noise.py):
    h = 0 and a bias of -100 everywhere but one token per tile make each record's score that
    token's noise exactly; 512 (row, tile) draws over a range of g."""
    B, D, tiles = 16, 32, 32
    V = 128 * tiles
    h = torch.zeros(B, D, device=device)
    w = torch.zeros(V, D, device=device)
    chosen = torch.randint(0, 128, (tiles,), generator=torch.Generator().manual_seed(5)) \
        + torch.arange(tiles) * 128
    bias = torch.full((V,), -100.0)
    bias[chosen] = 0.0
    seeds = torch.arange(B, dtype=torch.int64) * 7919 - 5
    p = row_params(h, 1.0, seeds.to(device), 3)
    rec = kc.fused_records(h, w, bias=bias.to(device), inv_temp=p.inv_temp, seed=p.seed,
                              offset=p.offset, num_samples=1, n_real=V).cpu()
    ref = noise.gumbel(seeds[:, None], torch.full((B, 1), 3), 0, chosen[None, :])
    assert torch.equal(rec[0, :, :, 1], chosen[None, :].float().expand(B, -1))
    torch.testing.assert_close(rec[0, :, :, 0], ref, rtol=2.4e-7, atol=6e-7)


@pytest.mark.parametrize("strategy", ["fused", "logits"])
def test_candidate_planes_equal_torch_with_ties(strategy, device):
    """The candidate planes (the tiles' best four in (logit desc, id asc) order, taken by
    kernels/tile_candidates.py's keys) equal the torch path's stable sort bit for bit,
    on logits that are small integers (exact in any summation order) and so tie often: ties
    broken by the smaller id, a greedy row, a tile with fewer than four allowed tokens (its
    -inf candidates name its smallest disallowed ids), padding past n_real, negative and
    zero logits."""
    from tpsample import constraints as C
    from tpsample.plan import DeviceKind, Layout, make_plan
    from tpsample.torch_records import records_torch
    B, D, V, n_real = 6, 16, 300, 290
    g = torch.Generator().manual_seed(7)
    h = torch.randint(-1, 2, (B, D), generator=g).float()
    w = torch.randint(-1, 2, (V, D), generator=g).float()
    w[:40] = 0.0  # a run of zero logits in the first tile
    mask = torch.randint(-2**31, 2**31 - 1, (B, (V + 31) // 32), generator=g, dtype=torch.int32)
    mask[1, 4:8] = 0  # row 1, tile 1 (ids 128-255): three allowed tokens
    mask[1, 4] = 0b1011  # ids 128, 129 and 131
    temp = torch.tensor([1.0, 0.5, 0.0, 2.0, 1.0, 0.25])
    p = row_params(h, temp, torch.arange(B) * 5, 0)
    T = records.num_tiles(V)
    want = records_torch(h, w, bias=None, inv_temp=p.inv_temp, seed=p.seed, offset=p.offset,
                         num_samples=1, n_real=n_real, candidates=True,
                         constraints=C.Constraints(mask, None, None, None))
    x = want[1:3, ..., 0::2]
    assert (x[..., 1:] == x[..., :-1]).any() and (x == 0).any() and (x < 0).any()
    assert torch.isinf(want[1:3, 1, 1]).any()
    plan = make_plan(DeviceKind.of(h.device), B=B, D=D, V=V, dtype=h.dtype,
                     layout=Layout.of(h, w), candidates=True, masked=True,
                     config=dict(strategy=strategy, BLOCK_B=16, BLOCK_D=16, NUM_STAGES=1,
                                 num_warps=4))
    got = torch.empty(records.planes(1, True), B, T, 4, device=device)
    launchers.stage1(plan, h.to(device), w.to(device), None, p, got, n_real=n_real,
                     mask=mask.to(device))
    assert torch.equal(got[1:3].cpu(), want[1:3])
