"""The plan: a pure function from a call's shape to its kernels (no GPU needed)."""
import json
import warnings

import pytest
import torch

import tpsample
from tpsample import plan as P
from tpsample.plan import DeviceKind, Layout, make_plan

H100 = DeviceKind("cuda", "h100", (9, 0), 132, gluon_missing=None)
H100_NO_GLUON = DeviceKind("cuda", "h100", (9, 0), 132, gluon_missing="Triton 9.9 (test)")
A100 = DeviceKind("cuda", None, (8, 0), 108, gluon_missing="A100 is not a Hopper GPU (sm_90)")
CPU = DeviceKind(interpret=True)


def plan(device=H100, B=256, D=4096, V=151936, dtype=torch.bfloat16, **kw):
    return make_plan(device, B=B, D=D, V=V, dtype=dtype, **kw)


def test_table_config_buckets_and_thin_head_overrides():
    buckets = {16: dict(strategy="fused"), 64: dict(strategy="ws"), 256: dict(strategy="pp")}
    by_max_d = {2048: {64: dict(strategy="logits")}, 5120: {16: dict(strategy="ws")}}

    def look(b, d):
        return P.table_config(buckets, by_max_d, b, d)[0]["strategy"]
    assert [look(b, 8192) for b in (1, 16, 17, 64, 65, 256, 1000)] == \
        ["fused", "fused", "ws", "ws", "pp", "pp", "pp"]
    assert look(64, 2048) == "logits" and look(64, 2049) == "ws" and look(16, 4096) == "ws"
    assert look(16, 6000) == "fused"


@pytest.mark.parametrize("name", ["h100", "h200"])
def test_shipped_tables_hold_only_what_the_plan_reads(name):
    data = json.loads((P.CONFIG_DIR / f"{name}.json").read_text())
    assert set(data) <= {"device", "buckets", "by_max_d"}
    keys = {"strategy", "BLOCK_B", "BLOCK_D", "NUM_STAGES", "num_warps", "EPI_B", "TMA",
            "NOISE_STEP", "NOISE_CHUNKS", "NOISE_EVERY", "BLOCK_K", "EXTRA_B"}
    configs = list(data["buckets"].values()) + [c for o in data["by_max_d"].values() for c in o.values()]
    for cfg in configs:
        assert cfg["strategy"] in ("fused", "ws", "pp") and set(cfg) <= keys, cfg
    for B in (1, 8, 32, 64, 128, 160, 192, 256):  # every shipped cell: no fallback (but
        for need_mass in (False, True):  # the 64-row second tile's with log-masses)
            p = plan(DeviceKind("cuda", name, (9, 0), 132, gluon_missing=None), B=B,
                     need_mass=need_mass)
            spills = name == "h200" and B == 192 and need_mass
            assert p.strategy in ("fused", "ws", "pp"), str(p)
            assert bool(p.fallbacks) == spills and (not spills or "spills" in str(p)), str(p)


def test_h100_table_choices():
    assert plan(B=1).strategy == "fused" and plan(B=128).strategy == "ws"
    assert plan(B=256).strategy == "pp" and plan(B=256).source == "h100 table, bucket 256"
    p32 = plan(B=32, num_samples=1)
    assert p32.cfg["NOISE_CHUNKS"] == 4 and "NOISE_AT" in p32.cfg  # noise inside the loop
    assert "NOISE_AT" not in plan(B=32, num_samples=2).cfg  # one sample only
    assert "NOISE_AT" not in plan(B=32, layout=Layout(vocab_start=6)).cfg  # aligned ids only
    assert plan(B=64, D=8192).cfg["W_DESC"] and not plan(B=64, D=8192, layout=Layout(tma=False)).cfg["W_DESC"]
    assert plan(B=64, D=4096).strategy == "ws" and plan(B=64, D=8192).strategy == "fused"  # D <= 5120 override


def test_fallbacks_are_recorded_with_their_reason():
    p = plan(B=256, V=151937)  # V not a multiple of 4: no Gluon kernel
    assert p.strategy == "logits"
    assert [s for s, _ in p.fallbacks] == ["pp -> ws", "ws -> logits"]
    assert "multiples of 4" in p.fallbacks[1][1]
    p = plan(B=256, V=151940)  # multiple of 4, not of 32: ws takes it
    assert p.strategy == "ws" and "multiple of 32" in p.fallbacks[0][1]
    p = plan(H100_NO_GLUON, B=256)
    assert p.strategy == "logits" and all("Triton 9.9" in why for _, why in p.fallbacks)
    assert plan(B=256, dtype=torch.float32).strategy == "logits"  # fp32 default: ws -> logits
    assert plan(A100, B=256).strategy == "logits" and "not a Hopper" in plan(A100, B=256).fallbacks[0][1]
    assert plan(A100, B=16).strategy == "fused" and not plan(A100, B=16).fallbacks


def test_cdf_takes_pp_at_large_batch_and_the_records_pass_elsewhere():
    assert plan(B=256, merge="cdf").strategy == "pp"
    p = plan(B=128, merge="cdf")  # the table says ws, which has no cdf epilogue
    assert p.strategy == "pp" and p.fallbacks == (("ws -> pp", "the warp-specialized kernel has no cdf epilogue"),)
    assert plan(B=64, merge="cdf", D=2048).strategy == "logits"
    assert plan(B=256, merge="cdf", num_samples=2).strategy == "logits"
    assert plan(B=256, merge="cdf", V=151940).strategy == "logits"
    with pytest.raises(ValueError, match="need_mass"):
        plan(merge="cdf", need_mass=False)
    with pytest.raises(ValueError, match="BLOCK_B of the ping-pong kernel"):
        plan(config=dict(strategy="pp", BLOCK_B=64, NUM_STAGES=5, num_warps=4))
    with pytest.raises(ValueError, match="strategy"):
        plan(config=dict(strategy="persistent", BLOCK_B=64))


def test_candidate_calls_take_ws_where_a_gluon_kernel_would_run():
    """Filtered calls (candidate planes) keep the Hopper kernels through ws's candidate
    epilogue; pp has none, and neither has a without-replacement or cdf one."""
    p = plan(B=256, candidates=True)  # the table says pp
    assert p.strategy == "ws" and p.fallbacks == (("pp -> ws", "the ping-pong kernel has no candidate epilogue"),)
    assert plan(B=128, candidates=True, raw_mass=True).strategy == "ws"
    assert plan(B=256, candidates=True, masked=True).strategy == "ws"
    assert plan(B=16, candidates=True).strategy == "fused"  # the fused kernel has candidates
    assert plan(B=32, D=8192, candidates=True).strategy == "fused"
    p = plan(B=64, D=8192, candidates=True)  # the table says fused
    assert p.strategy == "ws" and p.fallbacks[0][0] == "fused -> ws"
    assert plan(B=64, D=8192, candidates=True, V=151937).strategy == "fused"
    assert plan(A100, B=64, candidates=True).strategy == "fused"
    p = plan(B=256, candidates=True, replacement=False, num_samples=2)
    assert p.strategy == "logits" and "without-replacement" in p.fallbacks[-1][1]
    assert plan(B=256, candidates=True, merge="cdf").strategy == "logits"
    assert plan(B=256, candidates=True, V=151940).strategy == "ws"  # pp refuses, ws takes it
    assert plan(B=256, candidates=True, V=151937).strategy == "logits"  # neither takes it


def test_stage2_launch_and_pdl():
    assert plan(B=8).reduce == (1, 2048, 4) and plan(B=8).pdl
    assert plan(B=8, merge="logmass").reduce[2] == 8  # group noise: 8 warps
    assert plan(B=8, slots=2).reduce == (1, 4096, 4)
    assert not plan(A100, B=8).pdl
    cpu = plan(CPU, B=3, D=64, V=1000, num_samples=2)
    assert cpu.strategy == "fused" and cpu.reduce == (8, 8, 4) and not cpu.pdl


def test_plans_are_frozen_hashable_and_printable():
    p = plan(B=128)
    assert hash(p) == hash(plan(B=128)) and p == plan(B=128)
    with pytest.raises(Exception):
        p.strategy = "fused"
    text = str(plan(B=256, V=151940))
    assert "stage 1: ws" in text and "fallback pp -> ws" in text and "stage 2: reduce_records" in text
    assert P.with_options(p, pdl=False).pdl is False


def test_explain_is_public_and_checks_its_device():
    p = tpsample.explain(256, 4096, 151936, device="h100")
    assert isinstance(p, tpsample.Plan) and p.B == 256 and p.device.startswith("h100")
    assert tpsample.explain(4, 64, 1000, device="cpu").backend in ("triton", "torch")
    with pytest.raises(ValueError, match="device"):
        tpsample.explain(4, 64, 1000, device="b200")


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(merge="foo"), ValueError, "merge must be one of"),
    (dict(num_samples=0), ValueError, "num_samples"),
    (dict(dtype=torch.int8), TypeError, "dtype must be bfloat16"),
    (dict(B=0), ValueError, "B must be an int"),
    (dict(world=0), ValueError, "world must be an int"),
])
def test_explain_rejects_what_sample_rejects(kwargs, error, match):
    """explain() checks merge, num_samples and dtype as sample() does (sample()'s messages)."""
    args = dict(B=4, D=64, V=1000, device="cpu")
    args.update(kwargs)
    B, D, V = args.pop("B"), args.pop("D"), args.pop("V")
    with pytest.raises(error, match=match):
        tpsample.explain(B, D, V, **args)
    if "merge" in kwargs:  # the same message as sample()'s
        with pytest.raises(error, match=match):
            tpsample.sample(torch.zeros(1, 64), torch.zeros(1000, 64), merge=kwargs["merge"])


def test_gluon_fallback_warns_once_per_process(monkeypatch):
    from tpsample import pipeline
    monkeypatch.setattr(pipeline, "_WARNED", set())
    p = plan(H100_NO_GLUON, B=256)
    with pytest.warns(RuntimeWarning, match="Triton 9.9"):
        pipeline._warn_gluon_fallback(p, H100_NO_GLUON)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipeline._warn_gluon_fallback(p, H100_NO_GLUON)
        pipeline._warn_gluon_fallback(plan(H100_NO_GLUON, B=8), H100_NO_GLUON)  # no fallback


def test_gluon_compat_reports_why_the_kernels_cannot_run(monkeypatch):
    """kernels/gluon_compat: the kernels' version-dependent names exist wherever Gluon does,
    and a Triton outside SUPPORTED gets a reason that names the supported versions (what the
    plan and tpsample.explain show)."""
    from tpsample.kernels import gluon_compat as gc
    assert (gc.unavailable_reason() is None) == gc.AVAILABLE
    if gc.HAS_GLUON:
        assert all(callable(f) for f in (gc.thread_barrier, gc.tma_load, gc.reinterpret))
    monkeypatch.setattr(gc, "TRITON_VERSION", (3, 99))
    reason = gc.unavailable_reason()
    assert reason is not None and "3.6, 3.7, 3.8, 3.9" in reason
    monkeypatch.setattr(gc, "HAS_GLUON", False)
    assert "no Gluon" in gc.unavailable_reason()


def test_the_side_output_transpose_costs_a_stage_only_where_shared_memory_runs_out():
    """The ws kernel's side output through shared memory (launchers.WS_SIDE_ROWS) needs a
    [BLOCK_V, EPI_B, 4] fp32 scratch: the stages drop only where the configs of the shipped
    tables would not fit an H100 / H200's 227 KB. The estimate errs high: with five stages
    at BLOCK_B 128, and ten at BLOCK_B 32, Triton reported 245,888 and 237,760 bytes on an
    H200 (OutOfResources)."""
    from tpsample import launchers as L
    limit = 232448
    for (stages, block_b, reported) in ((5, 128, 245888), (10, 32, 237760)):
        per = (L.BLOCK_V + block_b) * 64 * 2
        need = stages * per + L.BLOCK_V * block_b * 4 + L.BLOCK_V * 32 * 4 + L.SMEM_SLACK
        assert reported <= need < reported + L.SMEM_SLACK
    cases = {(5, 128): 4, (4, 128): 4, (10, 32): 9, (8, 32): 8, (8, 64): 7, (6, 64): 6}
    for (stages, block_b), want in cases.items():
        cfg = dict(NUM_STAGES=stages, EPI_B=32)
        assert L._ws_stages(cfg, block_b, 64, limit) == want, (stages, block_b)
        assert L._ws_stages(cfg, block_b, 64, limit + 65536) == stages  # (room: no drop)


def test_pp_second_row_tile_stages_fit_shared_memory():
    """pp's stages with the second row tile: each adds [EXTRA_B, BLOCK_K] of hidden
    states, so an H200's 227 KB holds five at 32 rows and four at 64 (the shipped
    NUM_STAGES 5); without the tile the config's own count (six fit at 128 rows)."""
    from tpsample import launchers as L
    limit = 232448
    cfg = dict(NUM_STAGES=5)
    assert L.pp_stages(dict(cfg, EXTRA_B=32), 64, limit) == 5
    assert L.pp_stages(dict(cfg, EXTRA_B=64), 64, limit) == 4
    assert L.pp_stages(dict(NUM_STAGES=6), 64, limit) == 6


def test_pp_second_row_tile_covers_the_batch_past_128_rows():
    """A pp config with EXTRA_B (the most rows past 128 its second accumulator takes) gets
    the smallest of 32 / 64 that covers B - 128 rows, none where B <= 128 or B > 128 +
    EXTRA_B; calls that tile cannot take (more samples, candidates, a mask) get 64-row ws."""
    dev = DeviceKind("cuda", None, (9, 0), 132, gluon_missing=None)
    cfg = dict(strategy="pp", BLOCK_B=128, NUM_STAGES=5, num_warps=4, EXTRA_B=64)
    def extra(B, **kw):
        p = plan(dev, B=B, config=cfg, **dict(dict(need_mass=False), **kw))
        return p.strategy, p.cfg.get("EXTRA_B")
    assert [extra(B) for B in (100, 128, 129, 160, 161, 192, 193, 256)] == [
        ("pp", None), ("pp", None), ("pp", 32), ("pp", 32), ("pp", 64), ("pp", 64),
        ("pp", None), ("pp", None)]
    assert extra(160, merge="cdf", need_mass=True) == ("pp", None)  # (its epilogue spills with the tile)
    for kw in (dict(num_samples=2), dict(candidates=True), dict(masked=True),
               dict(candidates=True, replacement=False)):
        p = plan(dev, B=160, config=cfg, **kw)
        assert p.strategy in ("ws", "logits") and "EXTRA_B" not in p.cfg, (kw, str(p))
        assert "second row tile" in p.fallbacks[0][1]
    assert plan(dev, B=160, config=cfg, candidates=True).cfg["BLOCK_B"] == 64
    assert extra(160, need_mass=True) == ("pp", 32)  # (no spills with the log-masses)
    p = plan(dev, B=161, config=cfg, need_mass=True)  # (64 rows: spills, so 64-row ws)
    assert p.strategy == "ws" and "spills" in p.fallbacks[0][1]
    p = plan(dev, B=160, V=151936 - 16, config=cfg)  # (pp needs V % 32: 64-row ws, as before)
    assert p.strategy == "ws" and p.cfg["BLOCK_B"] == 64 and "multiple of 32" in p.fallbacks[0][1]
    with pytest.raises(ValueError, match="EXTRA_B"):
        plan(dev, B=160, config=dict(cfg, EXTRA_B=48))
