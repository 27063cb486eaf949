"""Tensor-parallel scaling benchmark: tpsample.VocabParallelSampler vs all-gathering logits.

    torchrun --nproc-per-node=N -m tpsample.launch.bench [--shapes 8192x128256,4096x151936]
        [--batches 1,16,64,256] [--iters 100] [--out DIR] [--transports symm_mem,nccl] [--no-graph]
        [--profile]
    python -m tpsample.launch.bench --plot OUT/tp1.json OUT/tp2.json OUT/tp4.json --out OUT

Each rank holds a random bf16 shard of a D x V LM head (first V % N ranks get one extra row);
h [B, D] is equal on all ranks. Variants: mm_local, allgather_multinomial, allgather_gumbel
(all-gathered logits, then sampling) and tpsample_<transport> (VocabParallelSampler). Latency:
CUDA events around each call + host sync, median per rank, max over ranks: eager; eager with the
ranks' GPUs lined up by a one-element all-reduce before each call (untimed, as the model's last
collective lines them up in a decode step); CUDA-graph replay of one captured call.
Writes OUT/tp<N>.json (rank 0); --plot: OUT/tp_scaling_<D>x<V>.png.
--profile: also the device time per call of each kernel of the tpsample calls (torch.profiler,
rank 0; the barrier kernel's time includes waiting for the slowest peer).
Without CUDA (or --cpu): gloo, D=256 V=8192, B=1,4,16, 20 iters, transport gloo, no graphs.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

BASE = "allgather_multinomial"
SHORT = {"mm_local": "mm", BASE: "ag_multi", "allgather_gumbel": "ag_gumbel"}
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated", category=FutureWarning)

def log(msg: str):
    print(msg, file=sys.stderr, flush=True)

def short(name: str) -> str:
    return SHORT.get(name, name.replace("tpsample_", "tp_"))

def fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", help="DxV,... (default 8192x128256,4096x151936; CPU 256x8192)")
    p.add_argument("--batches", help="B,... (default 1,16,64,256; CPU 1,4,16)")
    p.add_argument("--iters", type=int, help="timed calls (default 100; CPU 20)")
    p.add_argument("--out", default="bench_tp_out")
    p.add_argument("--transports", help="default symm_mem,nccl (CPU: gloo)")
    p.add_argument("--no-graph", action="store_true")
    p.add_argument("--merge", default="max", choices=["max", "logmass", "cdf"],
                   help="the merge the samplers use")
    p.add_argument("--profile", action="store_true", help="per-kernel device time of tpsample calls")
    p.add_argument("--cpu", action="store_true", help="gloo + CPU tensors even where CUDA exists")
    p.add_argument("--plot", nargs="+", metavar="JSON", help="plot tp*.json files (no torchrun)")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.cpu
    a.shapes = [tuple(map(int, s.split("x"))) for s in
                (a.shapes or ("8192x128256,4096x151936" if cuda else "256x8192")).split(",")]
    a.batches = [int(b) for b in (a.batches or ("1,16,64,256" if cuda else "1,4,16")).split(",")]
    a.iters = a.iters or (100 if cuda else 20)
    a.transports = (a.transports or ("symm_mem,nccl" if cuda else "gloo")).split(",")
    a.mode, a.graph = "cuda" if cuda else "cpu", cuda and not a.no_graph
    return a

def init_dist(cuda: bool) -> torch.device:
    if not cuda:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        return torch.device("cpu")
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    return dev

def all_ranks(x, dev, op=dist.ReduceOp.MAX, dtype=torch.float64):
    t = torch.tensor([x], dtype=dtype, device=dev)
    dist.all_reduce(t, op=op)
    return t.item()

def gather_rows(t: torch.Tensor) -> torch.Tensor:
    """all_gather_into_tensor of t [n, ...] → [world, n, ...] (gloo wants dim 0 concatenated)."""
    out = torch.empty(dist.get_world_size() * t.shape[0], *t.shape[1:], dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, t.contiguous())
    return out.view(-1, *t.shape)

def time_calls(fn, dev, iters: int, warmup: int = 10, align: bool = False) -> float:
    """Median ms per call (CUDA events + host sync, or barrier + perf_counter), max over ranks.
    align (CUDA): a one-element all-reduce before each call, outside the timed span, lines the
    ranks' GPU timelines up as the model's last collective does in a decode step; otherwise a
    rank's call also waits for peers whose hosts started the iteration later."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if dev.type == "cuda" else None
    token = torch.zeros(1, device=dev)
    ms = []
    for _ in range(warmup + iters):
        if events is None:
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            ms.append((time.perf_counter() - t0) * 1e3)
            continue
        if align:
            dist.all_reduce(token)
        events[0].record()
        fn()
        events[1].record()
        torch.cuda.synchronize()
        ms.append(events[0].elapsed_time(events[1]))
    return all_ranks(statistics.median(ms[warmup:]), dev)

def host_us(fn, dev, iters: int = 50) -> float:
    """Median host µs per call: Python entry to return, the device drained before each call
    (the GPU never holds the host back), max over ranks."""
    us = []
    for _ in range(iters + 5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        us.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return all_ranks(statistics.median(us[5:]), dev)

def host_ops(fn, iters: int = 20, top: int = 8) -> dict[str, float]:
    """{op: host µs per call} of the most expensive host-side ops (self CPU time)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return {e.key[:60]: e.self_cpu_time_total / iters for e in ops}

def kernel_times(fn, iters: int = 20) -> dict[str, float]:
    """{kernel name: device ms per call} over `iters` calls, largest first (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per = {e.key[:80]: e.device_time_total / iters / 1e3 for e in prof.key_averages()
           if e.device_time_total > 0}
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))

def capture(fn, dev):
    """CUDA graph of one call → (graph, its output) or (None, reason); all ranks agree."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up on a side stream, as the torch docs ask
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        torch.cuda.synchronize()
        why = ""
    except Exception as e:  # noqa: BLE001 - a failed capture is a result, not a crash
        why = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    if all_ranks(int(not why), dev, dist.ReduceOp.MIN, torch.int32):
        return graph, out
    return None, why or "capture failed on another rank"

def split_rows(V: int, world: int) -> list[int]:
    return [V // world + (r < V % world) for r in range(world)]

def make_shard(D, V, rank, world, dev) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(1000 + rank)
    return torch.randn(split_rows(V, world)[rank], D, generator=g, device=dev, dtype=torch.bfloat16).mul_(D ** -0.5)

def make_samplers(W, V, transports, max_batch, dev, merge="max") -> dict:
    """{variant: sampler}; a transport that fails on any rank is skipped on all of them."""
    import tpsample
    out, backend = {}, "auto" if dev.type == "cuda" else "torch"
    for t in transports:
        s, why = None, "failed on another rank"
        try:
            # tokens only, like the baselines: no log-probs (stage 1 skips the log-masses where
            # the merge allows it)
            s = tpsample.VocabParallelSampler(W, vocab_size=V, transport=t, check_inputs=False,
                                              max_batch=max_batch, backend=backend, merge=merge,
                                              logprobs=merge != "max")
        except Exception as e:  # noqa: BLE001 - report the reason and go on
            why = f"{type(e).__name__}: {e}"
        if all_ranks(int(s is not None), dev, dist.ReduceOp.MIN, torch.int32):
            out[f"tpsample_{t}"] = s
        elif dist.get_rank() == 0:
            log(f"[rank {dist.get_rank()}] skipping transport {t}: {why}")
    return out

def make_variants(h, W, V, samplers, seed, step) -> dict:
    rows = split_rows(V, dist.get_world_size())
    def gather_logits():
        local = h @ W.T
        if W.shape[0] < max(rows):  # uneven split: pad to the largest shard
            local = torch.nn.functional.pad(local, (0, max(rows) - W.shape[0]))
        full = gather_rows(local)  # [N, B, max V_r]
        return torch.cat([full[r, :, :n] for r, n in enumerate(rows)], dim=1)
    def multinomial():
        return torch.multinomial(torch.softmax(gather_logits().float(), dim=-1), 1)
    def gumbel():
        logits = gather_logits().float()
        return (logits - torch.empty_like(logits).exponential_().log()).argmax(dim=-1)
    fns = {"mm_local": lambda: h @ W.T, BASE: multinomial, "allgather_gumbel": gumbel}
    for name, s in samplers.items():
        fns[name] = lambda s=s: s(h, seed=seed, offset=step)
    return fns

def check_tokens(name, fn, graph, graph_out, dev) -> list[str]:
    """Warnings unless graph replay == an eager call (same seed/offset) and all ranks agree."""
    eager = fn()
    if graph is not None:
        graph.replay()
    bad = graph is not None and not torch.equal(graph_out, eager)
    notes = ["graph replay tokens differ from the eager call"] if all_ranks(int(bad), dev) else []
    allt = gather_rows(eager)
    if dist.get_rank() == 0 and not bool((allt == allt[0]).all()):
        notes.append("tokens differ across ranks")
    return [f"{name} B={eager.shape[0]}: {n}" for n in notes]

def bench_batch(D, V, B, W, samplers, args, dev):
    g = torch.Generator(device=dev).manual_seed(0)  # the same h on every rank
    h = torch.randn(B, D, generator=g, device=dev, dtype=torch.bfloat16)
    seed, step = (torch.full((B,), v, dtype=torch.int64, device=dev) for v in (1234, 7))  # fixed, on device
    res, warns = {}, []
    for name, fn in make_variants(h, W, V, samplers, seed, step).items():
        r = res[name] = {"eager_ms": time_calls(fn, dev, args.iters)}
        if dev.type == "cuda":
            r["eager_aligned_ms"] = time_calls(fn, dev, args.iters, align=True)
        graph, out = capture(fn, dev) if args.graph else (None, None)
        if graph is not None:
            r["graph_ms"] = time_calls(graph.replay, dev, args.iters)
        elif args.graph:
            r["graph_ms"], r["graph_error"] = None, out
        if name.startswith("tpsample_"):
            warns += check_tokens(name, fn, graph, out, dev)
            if args.profile and dev.type == "cuda":
                r["kernels_ms"] = kernel_times(fn)
                r["host_us"] = host_us(fn, dev)
                r["host_ops_us"] = host_ops(fn)
                if dist.get_rank() == 0:
                    log(f"  {name} B={B} kernels (ms/call): " + ", ".join(
                        f"{k[:40]}={v:.4f}" for k, v in list(r["kernels_ms"].items())[:6]))
                    log(f"  {name} B={B} host {r['host_us']:.0f} µs/call; self CPU µs/call: " + ", ".join(
                        f"{k[:40]}={v:.1f}" for k, v in r["host_ops_us"].items()))
        del graph, out
    return res, warns

def print_table(shape: dict, world: int):
    res = shape["results"]
    names = list(next(iter(res.values())))
    tps = [n for n in names if n.startswith("tpsample_")]
    kinds = [k for k in ("eager_ms", "eager_aligned_ms", "graph_ms") if any(k in v for r in res.values() for v in r.values())]
    tag = "/".join({"eager_ms": "e", "eager_aligned_ms": "a", "graph_ms": "g"}[k] for k in kinds)
    cells = lambda xs: "/".join(fmt(x) for x in xs)  # noqa: E731
    speedup = lambda r, n, k: r[BASE][k] / r[n][k] if r[BASE].get(k) and r[n].get(k) else None  # noqa: E731
    head = ["B"] + [f"{short(n)} {tag} ms" for n in names] + [f"x{short(n)} {tag}" for n in tps]
    rows = [[str(B)] + [cells(r[n].get(k) for k in kinds) for n in names]
            + [cells(speedup(r, n, k) for k in kinds) for n in tps] for B, r in res.items()]
    widths = [max(map(len, col)) for col in zip(head, *rows)]
    print(f"\nTP={world} D={shape['D']} V={shape['V']}  ms: e = eager, a = eager with the ranks aligned "
          f"by an all-reduce before each call, g = CUDA-graph replay; x = {short(BASE)} ms / tpsample ms")
    print("\n".join(" | ".join(c.rjust(w) for c, w in zip(line, widths)) for line in [head] + rows))

def run(args):
    cuda = args.mode == "cuda"
    dev = init_dist(cuda)
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes, warns = [], []
    for D, V in args.shapes:
        W = make_shard(D, V, rank, world, dev)
        samplers = make_samplers(W, V, args.transports, max(args.batches), dev, args.merge)
        shapes.append({"D": D, "V": V, "shard_rows": split_rows(V, world), "results": {}})
        for B in args.batches:
            t0 = time.perf_counter()
            res, w = bench_batch(D, V, B, W, samplers, args, dev)
            shapes[-1]["results"][B], warns = res, warns + w
            if rank == 0:
                cells = " ".join(f"{short(n)}={fmt(r['eager_ms'])}/{fmt(r.get('graph_ms'))}" for n, r in res.items())
                log("".join(f"WARNING: {x}\n" for x in w) + f"[tp{world} {D}x{V} B={B}] {cells} ms "
                    f"({time.perf_counter() - t0:.1f} s)")
        del W, samplers
        gc.collect()
        torch.cuda.empty_cache()  # no-op without CUDA
    if rank == 0:
        for s in shapes:
            print_table(s, world)
        meta = {"world": world, "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
                "torch": torch.__version__, "nccl": str(torch.cuda.nccl.version()) if cuda else None,
                "config": {k: v for k, v in vars(args).items() if k != "plot"}, "shapes": shapes, "warnings": warns}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"tp{world}.json"), "w") as f:
            json.dump(meta, f, indent=1)
        log(f"wrote {f.name}")
    dist.barrier()
    dist.destroy_process_group()

def plot_shape(plt, table, tps, D, V, path):
    """One subplot per B: eager latency vs TP degree, a line per variant (dashed: CUDA-graph
    replay of mm and tpsample)."""
    batches, names = sorted({B for B, _ in table}), list(dict.fromkeys(n for _, n in table))
    cols = min(2, len(batches))
    nrows = math.ceil(len(batches) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 4 * nrows), squeeze=False)
    for ax, B in zip(axes.flat, batches):
        for n in names:
            ys = [table.get((B, n), {}).get(t, (None,))[0] for t in tps]
            line, = ax.plot(tps, [math.nan if y is None else y for y in ys], marker="o", label=short(n))
            if n == "mm_local" or n.startswith("tpsample_"):  # CUDA-graph replay, dashed
                gs = [table.get((B, n), {}).get(t, (None, None))[1] for t in tps]
                ax.plot(tps, [math.nan if y is None else y for y in gs], marker="x", ls="--",
                        color=line.get_color(), label=f"{short(n)} (graph)")
        ax.set(title=f"B={B}", xlabel="TP degree", ylabel="latency ms", xticks=tps, yscale="log")
        ax.yaxis.set_major_formatter(plt.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(plt.FormatStrFormatter("%g"))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, framealpha=0.6)
    for ax in list(axes.flat)[len(batches):]:
        ax.set_visible(False)
    fig.suptitle(f"LM-head sampling latency vs TP degree, D={D} V={V}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"wrote {path}")

def plot(files, out):
    runs = sorted((json.load(open(f)) for f in files), key=lambda r: r["world"])
    tps = [r["world"] for r in runs]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
        log("matplotlib unavailable: tables only, no plot")
    os.makedirs(out, exist_ok=True)
    for D, V in sorted({(s["D"], s["V"]) for r in runs for s in r["shapes"]}):
        table = {}  # {(B, variant): {tp: (eager_ms, graph_ms)}}, variants in file order
        for r, s in ((r, s) for r in runs for s in r["shapes"] if (s["D"], s["V"]) == (D, V)):
            for B, res in s["results"].items():
                for n, v in res.items():
                    table.setdefault((int(B), n), {})[r["world"]] = (v["eager_ms"], v.get("graph_ms"))
        print(f"\nD={D} V={V}  eager/graph ms per TP degree ({runs[0]['device']})")
        print(f"{'B':>5} {'variant':>14} | " + " | ".join(f"{'tp' + str(t):>15}" for t in tps))
        for (B, n), per in sorted(table.items(), key=lambda kv: kv[0][0]):
            cells = ["/".join(fmt(x) for x in per.get(t, (None, None))) for t in tps]
            print(f"{B:>5} {short(n):>14} | " + " | ".join(f"{c:>15}" for c in cells))
        if plt is not None:
            plot_shape(plt, table, tps, D, V, os.path.join(out, f"tp_scaling_{D}x{V}.png"))

def main(argv=None):
    # never use NVLink multicast / NVLS: set before anything initialises NCCL or symmetric memory
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    args = parse_args(argv)
    if args.plot:
        plot(args.plot, args.out)
    else:
        run(args)

if __name__ == "__main__":
    main()
