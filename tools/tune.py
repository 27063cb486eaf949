"""Offline tuning of the stage-1 kernel: `python -m tools.tune [--shapes ...] [--batches ...]`.

For every (D, V) shape and batch size it times every candidate stage-1 configuration
(strategy fused / logits / ws / pp, BLOCK_B, BLOCK_D, NUM_STAGES, num_warps, ...) with
triton.testing.do_bench (median) of a CUDA-graph replay of stages 1 + 2 (device time;
--timing eager for plain calls; --passes N, default 2, times every candidate N times in
alternating forward and reverse order and ranks by the mean), checks that every
configuration returns the SAME tokens (pathwise max merge: tokens may not depend on
tiling), and writes the fastest per batch
bucket as a table in the shipped format (device, buckets, by_max_d: what tpsample.plan
reads) to --out; --log PATH writes the timings of every shape and runner-up. Copy a table
into tpsample/configs/<device>.json to ship it. Nothing is tuned at call time: this is the
explicit offline step.

--max-d N writes the results as overrides for heads with D <= N (every tuned shape must have
one), keyed by the existing batch buckets: e.g. `--shapes 2048x151936 --batches 64 --max-d
2048` when a thin head wants another kernel than the bucket's.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

from tools import calls
from tpsample.params import row_params


# (BLOCK_B, NUM_STAGES, EPI_B, num_warps) of the warp-specialized Hopper kernel: shared
# memory holds the ring (BLOCK_V + BLOCK_B) x 64 x 2 B per stage plus the fp32 tile handed
# to the epilogue, so wide tiles get fewer stages (docs/design.md); the deepest rings that
# fit in 227 KB (128: 5, 64: 8, 32: 10 stages) were added in v1.9
WS_TILES = ((128, 5, 64, 8), (128, 4, 64, 8), (128, 3, 64, 8), (64, 8, 64, 8), (64, 6, 64, 8),
            (64, 6, 32, 4), (64, 4, 64, 8), (32, 10, 32, 4), (32, 8, 32, 4))


# NUM_STAGES of the ping-pong Hopper kernel ([128, 128] tiles, 32 KB per stage; 6 is the most
# that fits next to its 32 KB of per-warp partials)
PP_STAGES = (6, 5)


def candidates(B: int, strategies=("fused", "logits", "ws", "pp")):
    bb_max = min(max(16, triton.next_power_of_2(B)), 128)  # 256: ~2x slower than 128
    # BLOCK_B = 64 is also tried at large B (acc [128, 128+] fp32 spills); NUM_STAGES = 2
    # halves the pipeline's shared memory so two programs share an SM and one's epilogue
    # (Philox, log, exp) overlaps the other's loads.
    for bb in sorted({bb_max, max(16, bb_max // 2), min(64, bb_max)}):
        warps = (4,) if bb <= 16 else (4, 8)
        for bd, st, nw in itertools.product((64, 128, 256), (2, 3, 4, 5), warps):
            if bb * bd * st * 2 + 128 * bd * st * 2 > 200_000:  # shared memory of the pipeline
                continue
            if "fused" in strategies:
                yield dict(strategy="fused", BLOCK_B=bb, BLOCK_D=bd, NUM_STAGES=st, num_warps=nw)
                if bb >= 32:  # noise drawn under the loads of the main loop (not the epilogue)
                    yield dict(strategy="fused", BLOCK_B=bb, BLOCK_D=bd, NUM_STAGES=st,
                               num_warps=nw, NOISE_STEP=0.25)
    if "ws" in strategies and B >= 32:
        for bb, st, eb, nw in WS_TILES:
            if bb <= max(64, triton.next_power_of_2(B)):
                yield dict(strategy="ws", BLOCK_B=bb, NUM_STAGES=st, EPI_B=eb, num_warps=nw)
    if "pp" in strategies and B > 64:
        for st in PP_STAGES:
            yield dict(strategy="pp", BLOCK_B=128, NUM_STAGES=st, num_warps=4)
    if "logits" in strategies:
        for bb, nw in LOGITS_TILES:
            yield dict(strategy="logits", BLOCK_B=bb, num_warps=nw)


# (BLOCK_B, num_warps) of the hybrid's records pass; narrow tiles keep each column's
# reductions inside a warp (probe --logits: 16 x 4 warps is 2x faster for the log-mass)
LOGITS_TILES = ((16, 4), (16, 2), (32, 4), (64, 8), (64, 4), (128, 8))


def around_table(B: int, D: int):
    """The shipped config for B and its neighbours: W through TMA (fewer registers), one
    stage more or less, and the noise drawn at another point of the main loop (or in the
    epilogue)."""
    base = calls.kernel_config(B, D, torch.bfloat16)
    yield base
    if base["strategy"] == "logits":
        for bb, nw in LOGITS_TILES:
            yield dict(base, BLOCK_B=bb, num_warps=nw)
        return
    if base["strategy"] != "fused":  # ws: its neighbours come from candidates(..., ["ws"])
        return
    bb = base["BLOCK_B"]
    for step in (None, 0.125, 0.25, 0.5):
        yield dict(base, NOISE_STEP=step, NOISE_CHUNKS=1)
    if bb >= 32:
        for chunks, every, step in ((2, 4, 0.25), (4, 1, 0.25), (4, 2, 0.125)):
            yield dict(base, NOISE_STEP=step, NOISE_CHUNKS=chunks, NOISE_EVERY=every)
    for st in sorted({base["NUM_STAGES"] - 1, base["NUM_STAGES"], base["NUM_STAGES"] + 1}):
        if st >= 2 and bb * base["BLOCK_D"] * st * 2 + 128 * base["BLOCK_D"] * st * 2 <= 200_000:
            yield dict(base, NUM_STAGES=st, TMA=True)


def candidates_for(B: int, D: int, strategies, extra=()):
    """around_table's configs if "table" is listed, then the listed strategies' candidates,
    then `extra` (configs given on the command line)."""
    rest = [s for s in strategies if s != "table"]
    seen = []
    for c in itertools.chain(around_table(B, D) if "table" in strategies else (),
                             candidates(B, rest) if rest else (), extra):
        if c not in seen:
            seen.append(c)
            yield c


def device_ms(fn, reps_ms: int) -> float:
    """Median ms of fn as a CUDA-graph replay: device time only. An eager call of a thin
    head (D = 2048) takes about as long on the host as on the GPU, so eager timings there
    measure the host as much as the config (docs/design.md)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm on a side stream, as capture requires
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=reps_ms, return_mode="median")
    del graph
    return ms


def pass_orders(n: int, passes: int) -> list[list[int]]:
    """The order candidates are timed in, per pass: forward, then reverse, alternately. At
    B >= 64 the GPU runs at its power cap and heats as a sweep goes on, so one forward pass
    favours the candidates timed first (docs/design.md); the mean over alternating passes
    does not."""
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    return [list(range(n)) if k % 2 == 0 else list(range(n - 1, -1, -1)) for k in range(passes)]


def tune_shape(D: int, V: int, batches, reps_ms: int, log, strategies, extra=(),
               graph: bool = True, passes: int = 2) -> dict:
    w = torch.randn(V, D, device="cuda", dtype=torch.bfloat16) * 0.02
    out = {}
    for B in batches:
        h = torch.randn(B, D, device="cuda", dtype=torch.bfloat16)
        p = row_params(h, 1.0, torch.arange(B, device="cuda") + 7, 3)

        def run(cfg):
            rec = calls.fused_records(h, w, bias=None, inv_temp=p.inv_temp, seed=p.seed,
                                      offset=p.offset, num_samples=1, n_real=V, config=cfg)
            return calls.reduce_records(rec[None], p.inv_temp, p.seed, p.offset, "max")[0]

        def time_cfg(cfg):
            return device_ms(lambda: run(cfg), reps_ms) if graph else triton.testing.do_bench(
                lambda: run(cfg), warmup=10, rep=reps_ms, return_mode="median")

        ref_tokens, timed = None, []  # [(ms per pass, cfg, mismatch)]
        for cfg in candidates_for(B, D, strategies, extra):
            try:
                tokens = run(cfg)
                ms = time_cfg(cfg)
            except Exception as e:  # e.g. out of shared memory for this tile shape
                log(f"  B={B} {cfg}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:80]})")
                continue
            if ref_tokens is None:
                ref_tokens = tokens
            mismatch = int((tokens != ref_tokens).sum())
            timed.append(([ms], cfg, mismatch))
            log(f"  B={B} {cfg}: {ms:.4f} ms, token mismatches vs first config: {mismatch}")
        for order in pass_orders(len(timed), passes)[1:]:
            for i in order:
                timed[i][0].append(time_cfg(timed[i][1]))
        results = [(sum(t) / len(t), cfg, mismatch) for t, cfg, mismatch in timed]
        if passes > 1:
            for ms, cfg, _ in results:
                log(f"  B={B} {cfg}: mean of {passes} passes {ms:.4f} ms")
        results.sort(key=lambda r: r[0])
        best_ms, best_cfg, _ = results[0]
        out[B] = dict(ms=best_ms, config=best_cfg,
                      max_mismatch=max(r[2] for r in results),
                      runner_up=[dict(ms=r[0], config=r[1]) for r in results[1:4]])
        log(f"D={D} V={V} B={B}: best {best_ms:.4f} ms {best_cfg}")
    del w
    torch.cuda.empty_cache()
    return out


def check_override(max_d: int, shapes, batches, path: Path) -> None:
    """--max-d: overrides are keyed by the --out table's existing buckets, for D <= max_d only."""
    if max_d < 1:
        raise SystemExit(f"--max-d must be >= 1, got {max_d}")
    wide = [D for D, _ in shapes if D > max_d]
    if wide:
        raise SystemExit(f"--max-d {max_d}: every --shapes D must be <= {max_d}, got {wide}")
    if not path.exists():
        raise SystemExit(f"--max-d needs an existing table to override ({path} is missing)")
    known = {int(b) for b in json.loads(path.read_text())["buckets"]}
    strays = [b for b in batches if b not in known]
    if strays:
        raise SystemExit(f"--max-d: --batches must be buckets of {path.name} {sorted(known)}, "
                         f"got {strays}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x151936,8192x128256")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--rep-ms", type=int, default=40)
    ap.add_argument("--strategies", default="fused,logits,ws,pp",
                    help="comma list of fused,logits,ws,pp and 'table' (the shipped config and "
                         "its TMA / stage / noise-placement neighbours: quick re-tune)")
    ap.add_argument("--out", required=True,
                    help="the table to write (shipped format); an existing one keeps the "
                         "buckets this run does not tune")
    ap.add_argument("--log", default=None, help="JSON path for the timings of every shape")
    ap.add_argument("--timing", choices=("graph", "eager"), default="graph",
                    help="graph: each config timed as a CUDA-graph replay (device time, the "
                         "default); eager: plain calls (includes the host's dispatch time)")
    ap.add_argument("--extra", default="[]",
                    help="JSON list of configs timed besides the strategies' candidates, e.g. "
                         "an older table's entry")
    ap.add_argument("--passes", type=int, default=2,
                    help="time every candidate this many times, alternately in forward and "
                         "reverse order, and rank by the mean (the GPU heats during a sweep)")
    ap.add_argument("--max-d", type=int, default=None,
                    help="write the results as overrides for D <= this (keyed by the existing "
                         "batch buckets) instead of the buckets themselves")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
    path = Path(args.out)
    extra = json.loads(args.extra)
    if not isinstance(extra, list) or not all(isinstance(c, dict) and "strategy" in c for c in extra):
        raise SystemExit(f"--extra must be a JSON list of config objects with a 'strategy', got {args.extra!r}")
    if args.passes < 1:
        raise SystemExit(f"--passes must be >= 1, got {args.passes}")
    if not torch.cuda.is_available():
        sys.exit("tools.tune needs a CUDA device")
    if args.max_d is not None:
        check_override(args.max_d, shapes, batches, path)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    table = {}
    for D, V in shapes:
        table[f"{D}x{V}"] = tune_shape(D, V, batches, args.rep_ms, log, args.strategies.split(","),
                                       extra, graph=args.timing == "graph", passes=args.passes)
    # one config per batch bucket: the one with the lowest summed time over the shapes
    buckets = {}
    for B in batches:
        scores = {}
        for shape in table:
            for r in [table[shape][B]] + table[shape][B]["runner_up"]:
                key = json.dumps(r["config"], sort_keys=True)
                scores.setdefault(key, []).append(r["ms"] / table[shape][B]["ms"])
        full = {k: sum(v) for k, v in scores.items() if len(v) == len(table)}
        buckets[B] = json.loads(min(full, key=full.get)) if full else table[next(iter(table))][B]["config"]
    path.parent.mkdir(parents=True, exist_ok=True)
    by_max_d = {}
    if path.exists():  # re-tuning some batch sizes keeps the other buckets
        old = json.loads(path.read_text())
        by_max_d = {int(d): {int(b): c for b, c in over.items()}
                    for d, over in old.get("by_max_d", {}).items()}
        if args.max_d is not None:
            by_max_d[args.max_d] = {**by_max_d.get(args.max_d, {}), **buckets}
            buckets = {}
        buckets = {**{int(b): c for b, c in old["buckets"].items()}, **buckets}
    buckets = dict(sorted(buckets.items()))
    extra = {"by_max_d": {d: dict(sorted(o.items())) for d, o in sorted(by_max_d.items())}} if by_max_d else {}
    path.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), buckets=buckets,
                                    **extra), indent=1, sort_keys=True))
    if args.log:
        Path(args.log).write_text(json.dumps(table, indent=1))
    print(f"{'shape':>14} {'B':>4} {'best ms':>8}  config")
    for shape, rows in table.items():
        for B, r in rows.items():
            print(f"{shape:>14} {B:>4} {r['ms']:8.4f}  {r['config']}  mismatches={r['max_mismatch']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
