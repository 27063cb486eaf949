"""Single-GPU checks of every stage-1 kernel family at real shapes: the Triton kernels
(fused, records pass), the Gluon kernels (ws, pp) and the P2P fan-out (pytest -m gpu)."""
import pytest
import torch

from tpsample import records
from tpsample.params import row_params
from tpsample.reference import reference_sample

from cases import exact_probs, lm_head_case
from stats import ALPHA, chi2_pvalue
import kernel_cases as kc
from kernel_cases import near_tie_ok

pytestmark = pytest.mark.gpu

WS128 = dict(strategy="ws", BLOCK_B=128, NUM_STAGES=4, EPI_B=64, num_warps=8)
CONFIGS = [None,
           dict(strategy="fused", BLOCK_B=16, BLOCK_D=128, NUM_STAGES=4, num_warps=4),
           dict(strategy="fused", BLOCK_B=64, BLOCK_D=64, NUM_STAGES=3, num_warps=8),
           dict(strategy="logits", BLOCK_B=32, num_warps=4),
           dict(strategy="ws", BLOCK_B=64, NUM_STAGES=6, EPI_B=32, num_warps=4),
           dict(strategy="ws", BLOCK_B=128, NUM_STAGES=4, EPI_B=64, num_warps=8),
           dict(strategy="pp", BLOCK_B=128, NUM_STAGES=6, num_warps=4)]


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.parametrize("B", [1, 7, 64, 200])
def test_kernel_matches_reference_at_llm_shape(B):
    D, V = 4096, 151936
    g = torch.Generator(device="cuda").manual_seed(B)
    h = torch.randn(B, D, device="cuda", generator=g).bfloat16()
    w = (torch.randn(V, D, device="cuda", generator=g) * 0.03).bfloat16()
    temp = torch.full((B,), 0.9, device="cuda")
    temp[::5] = 0.0
    seeds = torch.arange(B, device="cuda") * 17 + 3
    ref = reference_sample(h, w, temperature=temp, seed=seeds, offset=11, vocab_size=151900)
    p = row_params(h, temp, seeds, 11)
    for cfg in CONFIGS:
        rec = kc.fused_records(h, w, bias=None, inv_temp=p.inv_temp, seed=p.seed, offset=p.offset,
                                  num_samples=1, n_real=151900, config=cfg)
        tokens, logprobs, logz = kc.reduce_records(rec[None], p.inv_temp, p.seed, p.offset, "max")
        near_tie_ok(ref, tokens, scale=30.0)
        assert (logz.double() - ref.logz).abs().max() < 1e-3
        same = tokens == ref.tokens
        assert (logprobs.double()[same] - ref.logprobs[same]).abs().max() < 1e-3


@pytest.mark.parametrize("cfg", CONFIGS[1:], ids=lambda c: f"{c['strategy']}{c['BLOCK_B']}")
def test_peer_fanout_stores_the_local_records(cfg):
    """P2P fan-out (peer_ptrs / parity) on one GPU, with two local buffers standing in for the
    peers: every "peer" slot of the buffer parity[0] selects gets exactly the records a local
    call writes (tile-major strides, as VocabParallelSampler uses), nothing else is touched."""
    if cfg["strategy"] == "ws" and not hopper():
        pytest.skip("the warp-specialized kernel is Hopper-only")
    h, w = lm_head_case("zipf", V=1000, D=256, dtype=torch.bfloat16, device="cuda", seed=9)
    B, S, T, P = 200, 2, records.num_tiles(1000), 2
    hh = (h + 0.1 * torch.randn(B, 256, device="cuda")).bfloat16()
    p = row_params(hh, 0.8, torch.arange(B, device="cuda") * 31 + 7, 3)
    kw = dict(bias=None, inv_temp=p.inv_temp, seed=p.seed, offset=p.offset, num_samples=S,
              n_real=1000, config=cfg)
    local = kc.fused_records(hh, w, **kw)
    n = S * B * T * 4
    bufs = torch.full((2, P, n + 64), float("nan"), device="cuda")  # [buffer, peer, slot + pad]
    ptrs = torch.tensor([[bufs[k, q].data_ptr() for q in range(P)] for k in range(2)],
                        dtype=torch.int64, device="cuda")
    mine = torch.full((n,), float("nan"), device="cuda")
    out = records.records_view(mine, S, B, T, tile_major=True)
    kc.fused_records(hh, w, out=out, peer_ptrs=ptrs, parity=torch.tensor(
        [1, 0], dtype=torch.int32, device="cuda"), **kw)
    for q in range(P):
        got = records.records_view(bufs[1, q, :n], S, B, T, tile_major=True)
        assert torch.equal(got, local), f"peer {q}"
    assert bufs[0].isnan().all() and bufs[1, :, n:].isnan().all() and mine.isnan().all()


@pytest.mark.skipif(not hopper(), reason="the warp-specialized kernel is Hopper-only")
@pytest.mark.parametrize("merge", ["max", "logmass"])
def test_ws_kernel_chi2_and_hybrid_records(merge):
    """The warp-specialized kernel (kernels/gluon_sample.py), forced: its tokens follow
    softmax (chi-squared, two samples per row so the sample loop is covered, D = 96 so the
    last D step is a partial TMA box) and its records are the hybrid's (same noise)."""
    h, w = lm_head_case("zipf", V=1000, D=96, dtype=torch.bfloat16, device="cuda", seed=5)
    rows, S = 2000, 20
    hh = h.expand(rows, -1).contiguous()
    p = row_params(hh, 0.9, torch.arange(rows, device="cuda") * 7919 + 1, 0)
    assert kc.stage1_plan(hh, w, config=WS128).strategy == "ws"
    recs = [kc.fused_records(hh, w, bias=None, inv_temp=p.inv_temp, seed=p.seed,
                                offset=p.offset, num_samples=S, n_real=1000, config=cfg)
            for cfg in (WS128,
                        dict(strategy="logits", BLOCK_B=64, num_warps=8))]
    assert (recs[0][..., 1] == recs[1][..., 1]).float().mean() > 0.999
    assert (recs[0][..., 3] - recs[1][..., 3]).abs().max() < 1e-4
    tokens = kc.reduce_records(recs[0][None], p.inv_temp, p.seed, p.offset, merge)[0]
    assert chi2_pvalue(tokens, exact_probs(h, w, temperature=0.9)) > ALPHA


@pytest.mark.skipif(not hopper(), reason="the Gluon kernels are Hopper-only")
@pytest.mark.parametrize("B,cfg", [
    (129, dict(strategy="ws", BLOCK_B=64, NUM_STAGES=6, EPI_B=32, num_warps=4)),
    (170, dict(strategy="ws", BLOCK_B=64, NUM_STAGES=6, EPI_B=32, num_warps=4)),
    (200, dict(strategy="pp", BLOCK_B=128, NUM_STAGES=5, num_warps=4)),
    (300, dict(strategy="pp", BLOCK_B=128, NUM_STAGES=5, num_warps=4)),
    (300, WS128)])
def test_the_last_row_block_inside_the_batch_stores_only_its_own_rows(B, cfg):
    """A batch that does not fill its last row block: that block loads the batch's last
    BLOCK_B rows (gluon_sample.block_start) and stores only the rows past the previous
    block. Every row's records (distinct hidden states and seeds per row) are the records
    pass's over cuBLAS logits (the same noise): the tokens but at near-ties, the log-masses
    to rounding; no row is left unwritten (the buffer starts as NaN)."""
    V, D = 2048, 256
    g = torch.Generator(device="cuda").manual_seed(B)
    w = (torch.randn(V, D, device="cuda", generator=g) * 0.05).bfloat16()
    h = torch.randn(B, D, device="cuda", generator=g).bfloat16()
    p = row_params(h, 0.9, torch.arange(B, device="cuda") * 7919 + 1, 4)
    kw = dict(bias=None, inv_temp=p.inv_temp, seed=p.seed, offset=p.offset, num_samples=1,
              n_real=V - 29, need_mass=True)
    assert kc.stage1_plan(h, w, config=cfg).strategy == cfg["strategy"]
    T = records.num_tiles(V)
    out = records.records_view(torch.full((B * T * 4,), float("nan"), device="cuda"), 1, B, T,
                               tile_major=True)
    got = kc.fused_records(h, w, out=out, config=cfg, **kw)
    want = kc.fused_records(h, w, config=dict(strategy="logits", BLOCK_B=64, num_warps=8), **kw)
    assert not got.isnan().any()
    assert (got[..., 1] == want[..., 1]).float().mean() > 0.999
    assert (got[..., 3] - want[..., 3]).abs().max() < 1e-4


def pp_case(B, D, with_bias, seed):
    """bf16 h [B, D] and W [V, D] (V = 151936 at D >= 4096, else 2048: a multiple of 32), an
    optional bias, temperatures with every 7th row greedy, and their row parameters."""
    V = 2048 if D < 4096 else 151936
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(V, D, device="cuda", generator=g) * 0.05).bfloat16()
    h = torch.randn(B, D, device="cuda", generator=g).bfloat16()
    bias = torch.randn(V, device="cuda", generator=g) if with_bias else None
    temp = torch.rand(B, device="cuda", generator=g) + 0.5
    temp[::7] = 0.0  # greedy rows
    return V, h, w, bias, temp, row_params(h, temp, torch.arange(B, device="cuda") * 13 + 5, 9)


@pytest.mark.skipif(not hopper(), reason="the ping-pong kernel is Hopper-only")
@pytest.mark.parametrize("B,S,with_bias,need_mass,D,vocab_start,extra",
                         [(200, 2, True, True, 96, 0, 0), (256, 1, False, True, 96, 0, 0),
                          (130, 1, True, False, 256, 4096, 0), (256, 1, True, True, 4096, 4096, 0),
                          (1, 1, False, True, 96, 0, 0), (130, 1, True, True, 96, 0, 32),
                          (160, 1, False, False, 4096, 4096, 32),
                          (161, 1, True, False, 256, 0, 64), (192, 1, False, False, 96, 4096, 64)])
def test_pp_kernel_records_equal_ws_records(B, S, with_bias, need_mass, D, vocab_start, extra):
    """The ping-pong kernel (kernels/gluon_pingpong.py) draws the same noise from the same
    logits as the ws kernel: best score, token and logit of every record are bit-identical
    (S = 1 takes its chunk loop, S = 2 the unrolled sample loop; D = 96 ends on a partial TMA
    box; B = 130 and 200 end on a partial batch tile; extra: the rows past 128 in the second
    [128, 32 / 64] accumulator, partial there too). Its log-masses are merged per warp, so
    they agree to rounding. Also through the P2P fan-out path (two local stand-in peers)."""
    V, h, w, bias, temp, p = pp_case(B, D, with_bias, seed=B * 7 + S)
    kw = dict(bias=bias, inv_temp=p.inv_temp, seed=p.seed, offset=p.offset, num_samples=S,
              n_real=V - 29, vocab_start=vocab_start, need_mass=need_mass)
    pp = dict(strategy="pp", BLOCK_B=128, NUM_STAGES=6, num_warps=4, EXTRA_B=64 if extra else 0)
    plan = kc.stage1_plan(h, w, vocab_start=vocab_start, config=pp, need_mass=need_mass)
    assert plan.strategy == "pp" and plan.cfg.get("EXTRA_B", 0) == extra
    ws = kc.fused_records(h, w, config=dict(strategy="ws", BLOCK_B=128, NUM_STAGES=5, EPI_B=64,
                                                num_warps=8), **kw)
    got = kc.fused_records(h, w, config=pp, **kw)
    assert torch.equal(got[..., :3], ws[..., :3])
    rel = (got[..., 3] - ws[..., 3]).abs() / ws[..., 3].abs().clamp_min(1.0)
    assert rel.max().item() < 1e-6
    T, P = records.num_tiles(V), 2
    n = S * B * T * 4
    bufs = torch.full((2, P, n + 64), float("nan"), device="cuda")
    ptrs = torch.tensor([[bufs[k, q].data_ptr() for q in range(P)] for k in range(2)],
                        dtype=torch.int64, device="cuda")
    out = records.records_view(torch.full((n,), float("nan"), device="cuda"), S, B, T, tile_major=True)
    kc.fused_records(h, w, out=out, peer_ptrs=ptrs, config=pp, parity=torch.tensor(
        [0, 0], dtype=torch.int32, device="cuda"), **kw)
    for q in range(P):
        assert torch.equal(records.records_view(bufs[0, q, :n], S, B, T, tile_major=True), got)
    assert bufs[1].isnan().all() and out.isnan().all()


@pytest.mark.skipif(not hopper(), reason="the ping-pong kernel is Hopper-only")
@pytest.mark.parametrize("B,with_bias,D,vocab_start,extra",
                         [(256, True, 96, 0, 0), (130, False, 256, 4096, 0), (1, True, 4096, 0, 0),
                          (150, True, 256, 0, 64)])
def test_pp_cdf_records_match_torch_records(B, with_bias, D, vocab_start, extra):
    """The ping-pong kernel's cdf records against the torch path's on the
    same bf16 inputs (fp32 logits there): the same tokens but where rounding of the logits or
    of a running sum moves an interval boundary across a uniform (expected: none in these
    ~10^4 draws; allowed: 1 in 2000), each record's logit that of its token, the log-masses to
    rounding, greedy rows (every 7th) the first maximum, padded rows never."""
    from tpsample.torch_records import records_torch
    V, h, w, bias, temp, p = pp_case(B, D, with_bias, seed=B * 11 + D)
    kw = dict(bias=bias, inv_temp=p.inv_temp, seed=p.seed, offset=p.offset, num_samples=1,
              n_real=V - 29, vocab_start=vocab_start)
    pp = dict(strategy="pp", BLOCK_B=128, NUM_STAGES=5, num_warps=4, EXTRA_B=extra)
    # (a config with the second row tile: cdf calls take two 128-row blocks, as the plan says)
    assert "EXTRA_B" not in kc.stage1_plan(h, w, vocab_start=vocab_start, config=pp,
                                           cdf=True).cfg
    got = kc.fused_records(h, w, config=pp, cdf=True, **kw)
    want = records_torch(h, w, cdf=True, **kw)
    same = got[..., 1] == want[..., 1]
    assert (~same).sum().item() <= max(1, same.numel() // 2000), (~same).sum().item()
    assert got[..., 1].max().item() < vocab_start + V - 29
    assert torch.allclose(got[..., 2][same], want[..., 2][same], rtol=1e-4, atol=1e-4)
    assert torch.equal(got[..., 0], got[..., 2])  # the score field holds the token's logit
    assert torch.allclose(got[..., 3], want[..., 3], rtol=1e-5, atol=1e-4)
    greedy = (temp == 0)[None, :, None].expand_as(same)
    assert same[greedy].all()


