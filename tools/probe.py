"""Where the time of one call goes (CUDA only). Modes:

    python -m tools.probe [--shape 4096x151936] [--batches 1,64,256] [--out probe.json]
        device time (do_bench median ms) of the parts: stage 1 with num_samples = 0
        (matmul + log-mass, no noise), 1 and 2 (each sample adds a noise pass), the
        per-token Philox path (vocab_start % 4 != 0) against the 4-lane one, stage 2, the
        whole tpsample.sample call, and for the "logits" strategy the fp32 cuBLAS GEMM alone
    python -m tools.probe --ab [--shape ...] [--batches ...]
        stage 1 + stage 2 with each epilogue/launch option off and on (padding-column trim,
        programmatic dependent launch of stage 2, skipping the tile log-mass)
    python -m tools.probe --noise [--shape ...] [--batches ...]
        the call with the noise drawn inside the main loop (NOISE_STEP) vs in the epilogue
    python -m tools.probe --logits [--batches 128,256]
        the hybrid's records pass alone (load + max, + log-mass, + noise) per tile shape
    python -m tools.probe --chunks [--batches 128,256]
        the hybrid's stage 1 with V in K chunks, each chunk's records pass on a side stream
        under the next chunk's GEMM
    python -m tools.probe --ws [--shape ...] [--batches 64,128,256]
        the warp-specialized Hopper stage 1 (kernels/gluon_sample.py) per config against the
        shipped strategy and cuBLAS h @ W.T alone; first checks its records against the
        hybrid's on the same inputs (tokens, scores, log-mass; bias, greedy rows, 2 samples)
    python -m tools.probe --api [--shape ...] [--batches ...]
        the same call timed four ways, to tell host from device time: stages 1 + 2 called
        directly (as tune does), tpsample.sample with int seed/offset (as bench does) and
        with tensors, its CUDA-graph replay, and the host µs per sample() call
    python -m tools.probe --host [--profile]
        host (Python) time per call of each piece of the call path, at tiny shapes so the GPU
        never becomes the bottleneck (µs, no synchronisation inside the timed loop)
    python -m tools.probe --pp-trace [--shape ...] [--batches 128,256]
        the ping-pong stage 1 (kernels/gluon_pingpong.py) with per-tile SM clocks: each
        consumer's wait for the other's MMAs, its MMAs, its epilogue, and the cycles the
        tensor cores wait because the next tile's MMAs are not issued yet (S = 0 and 1)
    python -m tools.probe --filters [--shape ...] [--batches 1,16,64,128,256]
        a filtered call (top_k 50 + top_p 0.9 + min_p 0.05) after stage 1: the merge, the
        merge + filter kernel per num_warps, the device fallback's launches, the chain with and
        without programmatic dependent launches (CUDA-graph replays, µs), the rows' known
        prefix sizes, and the whole calls
    python -m tools.probe --candidates [--shape ...] [--batches 16,32,64,128,256]
        stage 1 of a filtered call (the candidate planes) by kernel: the plan's, the fused
        kernel's, ws's (FUSED_TO_WS_CANDIDATES, B <= 64) and the records pass over cuBLAS
        logits, beside the unfiltered stage 1, cuBLAS h @ W.T alone and the whole calls
        (plain; top_k 50 + top_p 0.9 + min_p 0.05), on the benchmark's typical-entropy head
    ncu --clock-control none -k regex:records --launch-skip 2 --launch-count 1 \\
        python -m tools.probe --ncu --batches 64
        three plain stage-1 launches for Nsight Compute
"""
import argparse
import functools
import inspect
import itertools
import json
import os
import statistics
import time

import torch
import triton

from tools import calls
from tpsample import launchers, records
from tpsample.plan import cdiv
from tpsample import sample
from tpsample.params import row_params


def setup(D, V, B):
    w = torch.randn(V, D, device="cuda", dtype=torch.bfloat16) * 0.02
    h = torch.randn(B, D, device="cuda", dtype=torch.bfloat16)
    p = row_params(h, 1.0, torch.arange(B, device="cuda"), 0)

    def stage1(S=1, start=0, config=None, cdf=False):
        return calls.fused_records(h, w, bias=None, inv_temp=p.inv_temp, seed=p.seed, offset=p.offset,
                                   num_samples=S, n_real=V, vocab_start=start, config=config,
                                   cdf=cdf)
    return h, w, p, stage1


def device_parts(D, V, B) -> dict:
    bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")  # noqa: E731
    h, w, p, stage1 = setup(D, V, B)
    cfg = calls.kernel_config(B, D, h.dtype)
    rec = stage1()
    r = dict(B=B, config=cfg, s0=bench(lambda: stage1(0)), s1=bench(stage1), s2=bench(lambda: stage1(2)),
             s1_per_token_noise=bench(lambda: stage1(1, start=2)),
             reduce=bench(lambda: calls.reduce_records(rec[None], p.inv_temp, p.seed, p.offset, "max")),
             call=bench(lambda: sample(h, w, seed=1, offset=0)))
    if cfg["strategy"] == "logits":
        r["mm_fp32"] = bench(lambda: launchers.logits_fp32(h, w))
    r["api_overhead"] = r["call"] - r["s1"] - r["reduce"]
    for launch in ((4, 1024, 4), (2, 1024, 4), (1, 4096, 8)):  # alternatives to the default
        r[f"reduce_r{launch[0]}_n{launch[1]}_w{launch[2]}"] = bench(
            lambda: calls.reduce_records(rec[None], p.inv_temp, p.seed, p.offset, "max", launch=launch))
    return r


def ab_parts(D, V, B) -> dict:
    """Whole call (stage 1 + stage 2) with each option toggled against the shipped default."""
    bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=100, return_mode="median")  # noqa: E731
    h, w, p, stage1 = setup(D, V, B)
    cfg = calls.kernel_config(B, D, h.dtype)

    def call(trim=True, pdl=True, mass=True):
        def run():
            calls.PDL = pdl
            rec = calls.fused_records(h, w, bias=None, inv_temp=p.inv_temp, seed=p.seed,
                                      offset=p.offset, num_samples=1, n_real=V,
                                      config=dict(cfg, TRIM=trim), need_mass=mass)
            return calls.reduce_records(rec[None], p.inv_temp, p.seed, p.offset, "max")
        return run
    toks = {k: call(**kw)()[0] for k, kw in dict(default={}, no_trim=dict(trim=False),
                                                   no_pdl=dict(pdl=False),
                                                   no_mass=dict(mass=False)).items()}
    r = dict(B=B, config=cfg, default=bench(call()), no_trim=bench(call(trim=False)),
             no_pdl=bench(call(pdl=False)), no_mass=bench(call(mass=False)),
             none=bench(call(trim=False, pdl=False)),
             tokens_equal=all(torch.equal(t, toks["default"]) for t in toks.values()))
    calls.PDL = True
    return r


def noise_placement(D, V, B) -> dict:
    """Whole call with sample 0's noise drawn at fraction k of the main loop (NOISE_STEP = k),
    whole or in row blocks (NOISE_CHUNKS, NOISE_EVERY), against the epilogue."""
    bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=100, return_mode="median")  # noqa: E731
    h, w, p, stage1 = setup(D, V, B)
    cfg = calls.kernel_config(B, D, h.dtype)

    def call(**over):
        def run():
            rec = calls.fused_records(h, w, bias=None, inv_temp=p.inv_temp, seed=p.seed,
                                      offset=p.offset, num_samples=1, n_real=V, config=dict(cfg, **over))
            return calls.reduce_records(rec[None], p.inv_temp, p.seed, p.offset, "max")
        return run
    if cfg["strategy"] == "fused":
        variants = {"epilogue": dict(NOISE_STEP=None),
                    **{f"at{k}": dict(NOISE_STEP=k, NOISE_CHUNKS=1) for k in (0.0, 0.25, 0.5)}}
        for chunks, every, step in ((2, 2, 0.125), (2, 4, 0.25), (4, 1, 0.25), (4, 2, 0.125),
                                    (4, 4, 0.0)):
            variants[f"c{chunks}_e{every}_at{step}"] = dict(NOISE_STEP=step, NOISE_CHUNKS=chunks,
                                                            NOISE_EVERY=every)
    else:  # large B: the shipped hybrid against the fused kernel with the noise in its loop
        variants = {"shipped": {}}
        for bb, bd, st, step in itertools.product((64, 128), (64, 128), (3, 4), (None, 0.25, 0.5)):
            if (bb + 128) * bd * st * 2 <= 220_000:
                variants[f"fused_b{bb}_d{bd}_st{st}_at{step}"] = dict(
                    strategy="fused", BLOCK_B=bb, BLOCK_D=bd, NUM_STAGES=st, num_warps=8,
                    NOISE_STEP=step)
    r = dict(B=B, config=cfg)
    ref = call()()[0]
    for name, over in variants.items():
        try:
            tok = call(**over)()[0]
            r[name] = bench(call(**over))
            r[name + "_same"] = bool(torch.equal(tok, ref))
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: report, go on
            r[name] = f"error: {type(e).__name__}"
    return r


def host_us(fn, n=300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6


def host_parts():
    h, w, p, stage1 = setup(256, 4096, 1)
    rec = stage1()
    seeds = p.seed
    parts = {
        "torch.full": lambda: torch.full((1,), 1.0, device="cuda"),
        "torch.empty": lambda: torch.empty(1, device="cuda"),
        "row_params(float T, int seed, int offset)": lambda: row_params(h, 1.0, 1, 0),
        "row_params(float T, tensor seed, int offset)": lambda: row_params(h, 1.0, seeds, 0),
        "fused_records": stage1,
        "reduce_records": lambda: calls.reduce_records(rec[None], p.inv_temp, p.seed, p.offset, "max"),
        "sample()": lambda: sample(h, w, seed=seeds, offset=0),
    }
    for name, fn in parts.items():
        print(f"{host_us(fn):8.1f} us  {name}", flush=True)
    return parts


def logits_pass(D, V, B) -> dict:
    """The hybrid's records pass alone on precomputed fp32 logits: what its time is made of
    (load + max only, + log-mass, + one sample) for a few tile shapes, against a plain copy
    of the logits (the bandwidth bound of that pass)."""
    from tpsample.kernels.fused_sample import logits_records_kernel
    bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=100, return_mode="median")  # noqa: E731
    h, w, p, _ = setup(D, V, B)
    logits = launchers.logits_fp32(h, w)
    T = records.num_tiles(V)
    out = torch.empty(2, B, T, 4, device="cuda")
    r = dict(B=B, copy_logits=bench(lambda: torch.empty_like(logits).copy_(logits)) / 2,
             mm_fp32=bench(lambda: launchers.logits_fp32(h, w)))
    for bb, nw in ((64, 8), (32, 4), (16, 4), (128, 8)):
        for name, S, mass in (("max_only", 0, False), ("mass", 0, True), ("sample", 1, False),
                              ("sample_mass", 1, True)):
            def run():
                logits_records_kernel[(cdiv(B, bb), T)](
                    logits, p.inv_temp, p.inv_temp, p.seed, p.offset, out, B, V, V, 0, S,
                    logits.stride(0), *out.stride()[:3], p.seed, p.seed, p.seed, 0,
                    HAS_BIAS=False, ALIGNED4=True, BLOCK_V=records.TILE, BLOCK_B=bb, NUM_PEERS=0,
                    HALVINGS=0, TILE_MASS=mass, PDL=False, num_warps=nw)
            r[f"bb{bb}_w{nw}_{name}"] = bench(run)
    return r


def chunked_hybrid(D, V, B) -> dict:
    """The hybrid's stage 1 with V cut into K chunks: GEMM of chunk k+1 (current stream) while
    the records pass of chunk k runs on a side stream, against K = 1 (what ships)."""
    from tpsample.kernels.fused_sample import logits_records_kernel
    bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=100, return_mode="median")  # noqa: E731
    h, w, p, _ = setup(D, V, B)
    cfg = calls.kernel_config(B, D, h.dtype)
    T = records.num_tiles(V)
    out = torch.empty(1, B, T, 4, device="cuda")
    side = torch.cuda.Stream()
    bb, nw = cfg["BLOCK_B"], cfg["num_warps"]

    def records(logits, t0, t1, stream):
        v0 = t0 * records.TILE
        view = out[:, :, t0:t1]
        with torch.cuda.stream(stream):
            logits_records_kernel[(cdiv(B, bb), t1 - t0)](
                logits, p.inv_temp, p.inv_temp, p.seed, p.offset, view, B, logits.shape[1], V - v0, v0, 1,
                logits.stride(0), *view.stride()[:3], p.seed, p.seed, p.seed, 0,
                HAS_BIAS=False, ALIGNED4=True, BLOCK_V=records.TILE, BLOCK_B=bb, NUM_PEERS=0,
                HALVINGS=0, TILE_MASS=False, PDL=False, num_warps=nw)

    def run(K):
        main = torch.cuda.current_stream()
        per = cdiv(T, K)
        for t0 in range(0, T, per):
            t1 = min(T, t0 + per)
            logits = launchers.logits_fp32(h, w[t0 * records.TILE: min(V, t1 * records.TILE)])
            if K == 1:
                records(logits, t0, t1, main)
                continue
            side.wait_stream(main)
            records(logits, t0, t1, side)
            logits.record_stream(side)
        main.wait_stream(side)
        return out

    want = run(1).clone()
    r = dict(B=B, mm_fp32=bench(lambda: launchers.logits_fp32(h, w)))
    for K in (1, 2, 3, 4, 6, 8):
        assert torch.equal(run(K), want), K
        r[f"K{K}"] = bench(lambda: run(K))
    return r


def launch_paths():
    """Host µs of one stage-1 launch: Triton's JIT dispatch vs its compiled handle."""
    from tpsample.kernels.fused_sample import fused_sample_records_kernel as kern
    h, w, p, stage1 = setup(256, 4096, 1)
    out = stage1()
    args = (h, w, p.inv_temp, p.inv_temp, p.seed, p.offset, out, 1, 256, 4096, 4096, 0, 1,
            h.stride(0), w.stride(0), *out.stride()[:3], p.seed, p.seed, p.seed, 0)
    consts = dict(HAS_BIAS=False, EVEN_D=True, FP32_DOT=False, ALIGNED4=True, BLOCK_V=128,
                  BLOCK_B=16, BLOCK_D=128, NUM_STAGES=4, NUM_PEERS=0, HALVINGS=4, TILE_MASS=False,
                  PDL=False, W_DESC=False)
    grid = (1, 32, 1)
    handle = kern[grid](*args, **consts, num_warps=4)
    # every constexpr in signature order, defaults included (the launcher takes them all)
    params = list(inspect.signature(kern.fn).parameters.values())[len(args):]
    full = (*args, *(consts.get(q.name, q.default) for q in params))
    stream = torch.cuda.current_stream().cuda_stream
    runner = handle[grid]
    paths = {
        "jit fn[grid](...)": lambda: kern[grid](*args, **consts, num_warps=4),
        "compiled handle[grid](...)": lambda: handle[grid](*full, stream=stream),
        "compiled runner (grid bound)": lambda: runner(*full, stream=stream),
        "handle.run (raw launcher)": lambda: handle.run(1, 32, 1, stream, handle.function,
                                                        handle.packed_metadata, None, None, None, *full),
    }
    for name, fn in paths.items():
        print(f"{host_us(fn, n=2000):8.1f} us  {name}", flush=True)


def host_profile(fn, n=500, top=30):
    """cProfile of n calls: where the host time of one call goes (per-call µs by function)."""
    import cProfile
    import pstats
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]  # by own (tottime) time
    print(f"top {top} functions by own time, µs per call of the profiled function:")
    for (file, line, name), (cc, nc, tt, ct, _) in rows:
        print(f"{tt / n * 1e6:8.1f} own {ct / n * 1e6:8.1f} cum  {nc / n:5.1f}x  "
              f"{os.path.basename(file)}:{line}({name})")


WS_CONFIGS = [dict(BLOCK_B=bb, NUM_STAGES=st, EPI_B=eb, num_warps=nw, BLOCK_K=bk)
              for bb, st, bk in ((128, 4, 64), (256, 2, 64), (256, 4, 32), (64, 6, 64))
              for eb, nw in ((64, 8), (32, 4)) if not (bb == 256 and nw == 8)]


def ws_check(D=4096, V=50000, batches=(64, 200)) -> list:
    """Records of the warp-specialized kernel against the hybrid's (cuBLAS fp32 logits): the
    same noise, so tokens agree except where fp32 accumulation order flips a near-tie."""
    out = []
    for B, S, with_bias in itertools.product(batches, (1, 2), (False, True)):
        w = torch.randn(V, D, device="cuda", dtype=torch.bfloat16) * 0.05
        h = torch.randn(B, D, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(V, device="cuda") if with_bias else None
        temp = torch.rand(B, device="cuda") + 0.5
        temp[::7] = 0.0  # greedy rows
        p = row_params(h, temp, torch.arange(B, device="cuda") + 17, 5)
        recs = {}
        for name, cfg in (("ref", dict(strategy="logits", BLOCK_B=64, BLOCK_D=0, NUM_STAGES=0,
                                       num_warps=8)),
                          ("ws", dict(strategy="ws", **WS_CONFIGS[0])),
                          ("ws256", dict(strategy="ws", **WS_CONFIGS[3]))):
            recs[name] = calls.fused_records(h, w, bias=bias, inv_temp=p.inv_temp, seed=p.seed,
                                             offset=p.offset, num_samples=S, n_real=V - 3,
                                             config=cfg)
        a, b = recs["ref"], recs["ws"]
        same = (a[..., 1] == b[..., 1]).float().mean().item()
        row = dict(B=B, S=S, bias=with_bias, token_agree=same,
                   agree_256=(a[..., 1] == recs["ws256"][..., 1]).float().mean().item(),
                   best_err_256=(a[..., 0] - recs["ws256"][..., 0]).abs().max().item(),
                   best_err=(a[..., 0] - b[..., 0]).abs().max().item(),
                   lse_err=(a[..., 3] - b[..., 3]).abs().max().item(),
                   logit_err=(a[..., 2] - b[..., 2]).abs().max().item())
        ta, _, _ = calls.reduce_records(a[None], p.inv_temp, p.seed, p.offset, "max")
        tb, _, _ = calls.reduce_records(b[None], p.inv_temp, p.seed, p.offset, "max")
        row["sample_agree"] = (ta == tb).float().mean().item()
        out.append(row)
        print("check " + " ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return out


def ws_sweep(D, V, B) -> dict:
    bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=60, return_mode="median")  # noqa: E731
    h, w, p, stage1 = setup(D, V, B)

    def call(cfg):
        def run():
            rec = stage1(config=cfg)
            return calls.reduce_records(rec[None], p.inv_temp, p.seed, p.offset, "max")
        return run
    r = dict(B=B, mm=bench(lambda: h @ w.T), shipped=bench(call(None)),
             sample=bench(lambda: sample(h, w, seed=1, offset=0)))
    for cfg in WS_CONFIGS:
        key = "ws_b{BLOCK_B}_s{NUM_STAGES}_k{BLOCK_K}_e{EPI_B}_w{num_warps}".format(**cfg)
        try:
            r[key] = bench(call(dict(strategy="ws", **cfg)))
        except Exception as e:  # noqa: BLE001 - a config that does not compile/fit is skipped
            r[key] = float("nan")
            print(f"{key}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    best = min((k for k in r if k.startswith("ws_")), key=lambda k: r[k] if r[k] == r[k] else 1e9)
    r.update(best=best, best_x_mm=r[best] / r["mm"], shipped_x_mm=r["shipped"] / r["mm"])
    return r


def candidate_stage1(D, V, B) -> dict:
    """Stage 1 with the candidate planes per kernel (see the module docstring), ms."""
    from tpsample.launch.bench import typical_head
    from tpsample.plan import (FUSED_TO_WS_CANDIDATES, TO_LOGITS_CANDIDATES, DeviceKind, Layout,
                               default_config, load_table, make_plan, table_config)
    bench = lambda f: triton.testing.do_bench(f, warmup=30, rep=150, return_mode="median")  # noqa: E731
    h, w = typical_head(D, V, B, torch.bfloat16, "cuda")
    p = row_params(h, 0.8, torch.arange(B, device="cuda"), 1)
    kind = DeviceKind.of(h.device)
    table = (table_config(*load_table(kind.table), B, D)[0] if kind.table
             else default_config(kind, B, h.dtype)[0])
    # where the table has no fused config: the default one of the largest fused bucket
    fused = table if table["strategy"] == "fused" else default_config(kind, min(B, 64), h.dtype)[0]
    arms = dict(plain=(None, False), plan=(None, True), fused=(fused, True),
                logits=(TO_LOGITS_CANDIDATES, True))
    if B <= 64:
        arms["ws"] = (FUSED_TO_WS_CANDIDATES, True)
    r = dict(B=B)
    for name, (config, cand) in arms.items():
        plan = make_plan(kind, B=B, D=D, V=V, dtype=h.dtype, layout=Layout.of(h, w),
                         candidates=cand, config=config)
        rec = torch.empty(records.planes(1, cand), B, records.num_tiles(V), records.WIDTH,
                          device="cuda")
        try:
            r[name] = bench(lambda: launchers.stage1(plan, h, w, None, p, rec, n_real=V))
        except Exception as e:  # noqa: BLE001 - a config that does not compile/fit is skipped
            r[name] = float("nan")
            print(f"{name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        if name == "plan":
            r["plan_strategy"] = plan.strategy
    r.update(mm=bench(lambda: h @ w.T), call_plain=bench(lambda: sample(h, w, temperature=0.8, seed=1)),
             call_kpm=bench(lambda: sample(h, w, temperature=0.8, seed=1, top_k=50, top_p=0.9,
                                           min_p=0.05)))
    return r


@functools.lru_cache(maxsize=1)
def _typical_head(D, V, rows=256):
    from tpsample.launch.bench import typical_head
    return typical_head(D, V, rows, torch.bfloat16, "cuda")


def filter_stage(D, V, B) -> dict:
    """What a filtered call (top_k 50 + top_p 0.9 + min_p 0.05) costs after stage 1, µs
    (CUDA-graph replays): reduce_records alone (what merges other than "max" run before the
    filter kernel), the filtered stage 2 per num_warps (with merge "max" the filter kernel
    alone), the device fallback's launches (no row flagged), and the whole chain with and
    without programmatic dependent launches; the rows' known-prefix sizes; the whole calls
    (ms, eager)."""
    from tpsample.plan import DeviceKind, Layout, make_plan, with_options
    from tpsample import filters as F
    from tpsample.params import Filters
    graph = lambda f: triton.testing.do_bench_cudagraph(f, rep=100, return_mode="median") * 1e3  # noqa: E731
    bench = lambda f: triton.testing.do_bench(f, warmup=30, rep=150, return_mode="median")  # noqa: E731
    h, w = _typical_head(D, V)
    h = h[:B].contiguous()
    p = row_params(h, 0.8, torch.arange(B, device="cuda"), 1)
    filt = Filters(torch.full((B,), 50, dtype=torch.int32, device="cuda"),
                   torch.full((B,), 0.9, device="cuda"), torch.full((B,), 0.05, device="cuda"))
    plan = make_plan(DeviceKind.of(h.device), B=B, D=D, V=V, dtype=h.dtype,
                     layout=Layout.of(h, w), candidates=True)
    T = records.num_tiles(V)
    rec = torch.empty(records.planes(1, True), B, T, records.WIDTH, device="cuda")
    launchers.stage1(plan, h, w, None, p, rec, n_real=V)
    recs = rec[None]
    x = F.candidate_planes(recs, 1)[0].reshape(B, -1)
    known = (x > x.reshape(B, -1, records.CANDIDATES)[..., -1].amax(-1, keepdim=True)).sum(-1)
    out = launchers.filtered_outputs(B, 1, 0, "cuda")
    logits = torch.empty(B, T * records.TILE, dtype=torch.float32, device="cuda")
    count = torch.zeros(2, dtype=torch.int32, device="cuda")
    r = dict(B=B, strategy=plan.strategy, known_median=known.float().median().item(),
             known_max=known.max().item(), warps=launchers.filter_warps(B),
             merge=graph(lambda: launchers.stage2(plan, recs[:, :1], p, out=out[:3])))

    def chain(pl, fallback=True):
        def run():
            launchers.stage2_filtered(pl, recs, p, filt, out=out)
            if fallback:
                launchers.fallback_on_device(h, w, None, p, filt, out, logits, count, n_real=V,
                                             pdl=pl.pdl)
        return run
    shipped = launchers.filter_warps
    for warps in (4, 8, 16):
        launchers.filter_warps = lambda B, warps=warps: warps
        r[f"stage2_w{warps}"] = graph(chain(plan, False))
    launchers.filter_warps = shipped
    chain(plan)()
    r["flagged"] = int(out.fallback.sum())
    r["chain_pdl"] = graph(chain(plan))
    r["chain_no_pdl"] = graph(chain(with_options(plan, pdl=False)))
    r["stage1_ms"] = bench(lambda: launchers.stage1(plan, h, w, None, p, rec, n_real=V))
    r["call_plain_ms"] = bench(lambda: sample(h, w, temperature=0.8, seed=1))
    r["call_kpm_ms"] = bench(lambda: sample(h, w, temperature=0.8, seed=1, top_k=50, top_p=0.9,
                                            min_p=0.05))
    return r


def api_paths(D, V, B) -> dict:
    """One shape, B rows: device vs host time of the public call (see the module docstring)."""
    bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")  # noqa: E731
    h, w, p, stage1 = setup(D, V, B)
    step = itertools.count()
    seed_t = torch.full((B,), 1234, dtype=torch.int64, device="cuda")
    off_t = torch.zeros(B, dtype=torch.int64, device="cuda")
    int_call = lambda: sample(h, w, seed=1234, offset=next(step))  # noqa: E731
    tensor_call = lambda: sample(h, w, seed=seed_t, offset=off_t)  # noqa: E731
    r = dict(B=B, strategy=calls.kernel_config(B, D, h.dtype)["strategy"],
             stages=bench(lambda: calls.reduce_records(stage1()[None], p.inv_temp, p.seed,
                                                       p.offset, "max")),
             sample_int=bench(int_call), sample_tensor=bench(tensor_call))
    tensor_call()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm the call on the capture stream first
        tensor_call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tensor_call()
    r["graph"] = bench(graph.replay)
    r["host_us_int"] = host_us(int_call, n=100)
    r["host_us_tensor"] = host_us(tensor_call, n=100)
    r["sample_int_again"] = bench(int_call)
    return r


def pp_trace(D, V, B) -> dict:
    """Per-tile clocks of pp (calls.TRACE) with S = 0 (no noise), S = 1 and the cdf records
    (keys S0_*, S1_*, cdf_*), medians over tiles, in SM cycles. A program's tiles alternate consumers: tile n + 2's MMAs are issued
    by tile n's consumer once its epilogue is done, so the tensor cores idle for
    max(0, issue(n + 2) - mma_done(n + 1)) whenever an epilogue outlasts the other tile's
    MMAs; idle_share is the sum of those gaps over the programs' spans."""
    h, w, p, stage1 = setup(D, V, B)
    cfg = calls.kernel_config(B, D, h.dtype)
    if cfg["strategy"] != "pp":
        cfg = dict(strategy="pp", BLOCK_B=128, NUM_STAGES=5, num_warps=4)
    tiles = triton.cdiv(V, 128) * triton.cdiv(B, 128)
    nprog = min(tiles, torch.cuda.get_device_properties(0).multi_processor_count)
    out = dict(B=B, D=D, stages=cfg["NUM_STAGES"])
    for name, S, cdf in (("S0", 0, False), ("S1", 1, False), ("cdf", 1, True)):
        trace = torch.zeros(tiles, 4, dtype=torch.int64, device="cuda")
        calls.TRACE = trace
        try:
            for _ in range(3):
                stage1(S=S, config=cfg, cdf=cdf)
            torch.cuda.synchronize()
        finally:
            calls.TRACE = None
        t = trace.cpu()
        wait, mma, epi = (t[:, 1] - t[:, 0]), (t[:, 2] - t[:, 1]), (t[:, 3] - t[:, 2])
        idle = span = 0
        for prog in range(nprog):
            seq = t[prog::nprog]
            span += int(seq[:, 3].max() - seq[:, 0].min())
            idle += int((seq[2:, 1] - seq[1:-1, 2]).clamp(min=0).sum())
        med = lambda x: float(x.double().median())  # noqa: E731
        out.update({f"{name}_wait": med(wait), f"{name}_mma": med(mma),
                    f"{name}_epilogue": med(epi), f"{name}_idle_share": idle / span,
                    f"{name}_span": span / nprog})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="4096x151936")
    ap.add_argument("--batches", default="1,16,32,64,128,256")
    ap.add_argument("--out", default=None)
    ap.add_argument("--host", action="store_true")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--ab", action="store_true")
    ap.add_argument("--logits", action="store_true", help="breakdown of the hybrid's records pass")
    ap.add_argument("--noise", action="store_true", help="where the noise is drawn (NOISE_AT)")
    ap.add_argument("--chunks", action="store_true", help="hybrid with V chunks on two streams")
    ap.add_argument("--profile", action="store_true", help="with --host: cProfile of sample()")
    ap.add_argument("--ws", action="store_true", help="warp-specialized Hopper stage 1")
    ap.add_argument("--api", action="store_true", help="host vs device time of sample()")
    ap.add_argument("--pp-trace", action="store_true", help="per-tile clocks of the pp kernel")
    ap.add_argument("--candidates", action="store_true",
                    help="stage 1 of a filtered call per kernel")
    ap.add_argument("--filters", action="store_true",
                    help="a filtered call after stage 1: the filter kernel, fallback, PDL")
    args = ap.parse_args(argv)
    if args.host:
        launch_paths()
        parts = host_parts()
        if args.profile:
            host_profile(parts["sample()"])
        return None
    D, V = (int(x) for x in args.shape.split("x"))
    batches = [int(b) for b in args.batches.split(",")]
    if args.ncu:
        for B in batches:
            stage1 = setup(D, V, B)[3]
            for _ in range(3):
                stage1()
        torch.cuda.synchronize()
        return None
    rows = []
    if args.ws:
        rows.append(dict(check=ws_check()))
    for B in batches:
        rows.append((filter_stage if args.filters else candidate_stage1 if args.candidates else pp_trace if args.pp_trace else api_paths if args.api else ws_sweep if args.ws else ab_parts if args.ab else logits_pass if args.logits else chunked_hybrid
                     if args.chunks else noise_placement if args.noise else device_parts)(D, V, B))
        print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()),
              flush=True)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), shape=args.shape, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
