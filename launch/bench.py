"""The benchmark: tpsample against unfused LM-head sampling, on one device or under TP.

    python -m tpsample.launch.bench [--shapes 2048x151936,4096x151936,8192x128256]
        [--batches 1,2,4,...,224,256] [--merge max|logmass|cdf] [--out DIR] [--passes N]
        [--no-compile] [--variants mm,tpsample,...] [--doc docs/performance.md --label H100]
    torchrun --nproc-per-node=N -m tpsample.launch.bench [--shapes 8192x128256,4096x151936]
        [--batches 1,16,64,256] [--iters 100] [--transports symm_mem,nccl] [--no-graph]
        [--profile] [--doc PATH --label TP2]
    python -m tpsample.launch.bench --report DIR/tp1.json DIR/tp2.json [--doc PATH --label NAME]

One device (no torchrun; --mode single): on CUDA it first measures the copy bandwidth (a 2
GiB bf16 device-to-device copy, bytes read + written / median time), then for each LM-head
shape D x V and batch B times, with triton.testing.do_bench (median ms; every variant timed
--passes times, alternately in forward and reverse order, and the mean reported: at B >= 64
the GPUs run at their power cap and slow down as they heat, which would otherwise penalise
the variants timed last), on random bf16 h [B, D] and W [V, D]:

    mm                    h @ W.T (cuBLAS) alone: the matmul every unfused sampler pays
    multinomial           matmul, fp32 softmax, torch.multinomial
    multinomial_compiled  the same function under torch.compile (skipped with --no-compile)
    gumbel_torch          matmul, argmax(logits - log(Exp(1) noise))
    flashinfer            matmul, flashinfer.sampling.sampling_from_logits (bf16 logits)
    flashinfer_topk_topp  matmul, top_k_top_p_sampling_from_logits(top_k=-1, top_p=1.0)
                          (both only if `import flashinfer` works)
    tpsample              tpsample.sample(h, W, seed=1234, offset=step, merge=--merge)

floor = V·D·bytes / bandwidth, the time to read W once. Writes OUT/single.json and a plot per
shape. Without CUDA: D=256 V=8192, B=1,4,16, perf_counter medians (indicative only).

Tensor parallel (under torchrun; --mode tp; N may be 1): each rank holds a random bf16
shard of a D x V head (the first V % N ranks one row more); h is equal on all ranks.
Variants: mm_local, allgather_multinomial, allgather_gumbel (all-gathered logits, then
sampling) and tpsample_<transport> (VocabParallelSampler); with --filters also
tpsample_<transport>_kpm: top_k=50, top_p=0.9, min_p=0.05 on a shard of the --filters typical
head (its own h), with the share of rows that took the exact fallback. Latency: CUDA events around each
call + host sync, median per rank, max over ranks: eager; eager with the ranks' GPUs lined
up by a one-element all-reduce before each call (as the model's last collective does);
CUDA-graph replay of one captured call. Writes OUT/tp<N>.json (rank 0). --profile: device
time per kernel and host µs per call of the tpsample calls. Without CUDA (or --cpu): gloo,
D=256 V=8192, B=1,4,16, 20 iterations, transport gloo, no graphs.

--filters (one device): filtered sampling on an LM head whose logits follow -1.6 ln(rank)
(random placement; ~2.7 nats, typical of LM next-token distributions): tpsample with top_k=50
(tps_k), top_p=0.9 (tps_p), min_p=0.05 (tps_m) and all three (tps_kpm) against the plain call,
mm, matmul + a full torch sort then the three filters and multinomial (sort_kpm, as serving
engines' torch fallbacks do), matmul + torch.topk(50) then top-p / min-p (topk_kpm), and
FlashInfer's top_k_top_p_sampling_from_logits (fi_k50p09, filter_apply_order="joint", if importable); plus the rows that took
the exact fallback. Writes OUT/filters.json.

--constraints (one device): constrained decoding on the same head: a random-half allowed mask
(tps_mask), 64 listed logit adjustments per row (tps_adj64; tps_adj64_nc without the host
check of their contents, TPSAMPLE_CHECK_TENSORS=0), both with a repetition penalty
(tps_mask_adj), the mask with the three filters (tps_mask_kpm), against the plain call, mm,
and matmul + the mask applied in torch + softmax/multinomial or a Gumbel argmax (FlashInfer's
sampling_from_logits if importable). Writes OUT/constraints.json.

--doc PATH --label NAME: (re)writes the section of PATH between `<!-- bench:NAME -->` and
`<!-- /bench:NAME -->` (appended if absent) with this run's tables, the command, device and
versions, and the plots in docs/img/ beside it. --report renders TP runs (several tp<N>.json:
the scaling table and plot; or one single.json; or filters.json files of one device, one run
per shape, as one section) without measuring.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import math
import os
import platform
import re
import shlex
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import triton
import triton.testing

import tpsample
from tpsample.transport import all_gather_flat

BASE = "allgather_multinomial"
SHORT = {"mm_local": "mm", BASE: "ag_multi", "allgather_gumbel": "ag_gumbel",
         "multinomial": "multi", "multinomial_compiled": "multi_c", "gumbel_torch": "gumbel",
         "flashinfer": "fi", "flashinfer_topk_topp": "fi_kp"}
SINGLE_SHAPES = "2048x151936,4096x151936,5120x151936,8192x128256"
TP_SHAPES = "8192x128256,4096x151936"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def short(name: str) -> str:
    return SHORT.get(name, name.replace("tpsample_", "tp_"))


def fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def run_meta(args, cuda: bool) -> dict:
    return {"device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": triton.__version__,
            "tpsample": tpsample.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": "python -m tpsample.launch.bench " + " ".join(map(shlex.quote, args.argv)),
            "config": {k: v for k, v in vars(args).items() if k not in ("argv",)}}


# ---------------------------------------------------------------------------- one device
def time_fn(fn, cuda: bool) -> float:
    """Median milliseconds of fn() (do_bench on CUDA, perf_counter on CPU)."""
    if cuda:
        fn()  # compile / autotune outside the timed region
        return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure_bandwidth(device: torch.device) -> float:
    """Copy bandwidth in bytes/s: (bytes read + bytes written) / median copy time."""
    n = (1 << 30) if device.type == "cuda" else (1 << 26)  # 2 GiB / 128 MiB of bf16
    src = torch.empty(n, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = time_fn(lambda: dst.copy_(src), device.type == "cuda")
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * n * 2 / (ms * 1e-3)


def single_variants(h, w, *, merge="max", compile_=True, skipped=None) -> dict:
    """name -> zero-argument callable that samples one token per row of h."""
    skipped = {} if skipped is None else skipped

    def multinomial():
        probs = torch.softmax((h @ w.T).float(), dim=-1)
        return torch.multinomial(probs, 1)

    def gumbel_torch():
        logits = (h @ w.T).float()
        return (logits - torch.empty_like(logits).exponential_().log()).argmax(-1)

    variants = {"mm": lambda: h @ w.T, "multinomial": multinomial}
    if h.is_cuda and compile_ and "multinomial_compiled" not in skipped:
        torch._dynamo.reset()  # one static-shape graph per (shape, B), no recompile limit
        variants["multinomial_compiled"] = torch.compile(multinomial, dynamic=False)
    variants["gumbel_torch"] = gumbel_torch
    if h.is_cuda and "flashinfer" not in skipped:
        try:
            import flashinfer.sampling as fs
            # flashinfer takes the bf16 logits as they come out of the matmul (it reads them
            # as fp32 inside); top_k=-1, top_p=1.0 are no-op filters: the same distribution
            variants["flashinfer"] = lambda: fs.sampling_from_logits(h @ w.T)
            variants["flashinfer_topk_topp"] = lambda: fs.top_k_top_p_sampling_from_logits(
                h @ w.T, -1, 1.0)
        except Exception as e:  # noqa: BLE001 - any import failure just skips the baseline
            skipped["flashinfer"] = f"import flashinfer failed: {type(e).__name__}: {e}"
            log(f"skipping flashinfer baselines ({skipped['flashinfer']})")
    step = itertools.count()
    variants["tpsample"] = lambda: tpsample.sample(h, w, seed=1234, offset=next(step), merge=merge)
    return variants


def run_shape(D, V, batches, *, device, dtype, bandwidth, merge, compile_, skipped,
              only=None, passes: int = 1) -> dict:
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    w = torch.randn(V, D, device=device, dtype=dtype).mul_(0.02)
    weight_bytes = V * D * w.element_size()
    floor_ms = weight_bytes / bandwidth * 1e3
    rows = []
    for B in batches:
        h = torch.randn(B, D, device=device, dtype=dtype)
        runs = {}
        variants = single_variants(h, w, merge=merge, compile_=compile_, skipped=skipped)
        for p in range(passes):  # odd passes in reverse order: a GPU that heats up (clocks
            # fall at the power cap) does not always penalise the variants timed last
            for name, fn in (list if p % 2 == 0 else reversed)(list(variants.items())):
                if name in skipped or (only and name not in only):  # failed before: don't retry
                    continue
                try:
                    runs.setdefault(name, []).append(time_fn(fn, cuda))
                except Exception as e:  # noqa: BLE001 - report and go on with the others
                    while e.__cause__ is not None:  # Triton chains the real error as the cause
                        e = e.__cause__
                    reason = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"[:300]
                    skipped.setdefault(name, reason)
                    runs.pop(name, None)
                    log(f"  {name} failed at D={D} V={V} B={B}: {reason}")
                    if cuda:
                        torch.cuda.empty_cache()
        ms = {n: statistics.fmean(v) for n, v in runs.items() if n not in skipped}
        t = ms.get("tpsample")
        row = {"B": B, "ms": ms, "ms_per_pass": {n: runs[n] for n in ms},
               "speedup": {k: v / t for k, v in ms.items() if k != "tpsample" and t},
               "tpsample_pct_of_floor": 100 * t / floor_ms if t else None}
        rows.append(row)
        log(f"[D={D} V={V} B={B}] " + " ".join(f"{k}={v:.3f}ms" for k, v in ms.items()))
        del h, variants, fn  # the closures hold h and W
    del w
    torch._dynamo.reset()  # compiled graphs may keep references too
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return {"D": D, "V": V, "weight_bytes": weight_bytes, "floor_ms": floor_ms, "rows": rows}



def single_markdown(meta: dict, doc: str, label: str) -> str:
    """The section of one single-device run: a table per shape and its plot."""
    lines = [f"`{meta['command']}` — {meta['device']}, torch {meta['torch']}, Triton "
             f"{meta['triton']}, {meta['date']}; copy bandwidth "
             f"{meta['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s; median ms "
             f"({meta['timing']}); xNAME = NAME ms / tpsample ms; floor = time to read W once.", ""]
    for res in meta["shapes"]:
        names = list(dict.fromkeys(k for r in res["rows"] for k in r["ms"]))
        base = [n for n in names if n != "tpsample"]
        lines += [f"**D={res['D']}, V={res['V']}** (W {res['weight_bytes'] / 1e9:.2f} GB, floor "
                  f"{res['floor_ms']:.3f} ms)", "",
                  "| B | " + " | ".join(short(n) for n in names) + " | "
                  + " | ".join(f"x{short(n)}" for n in base) + " | tpsample / floor |",
                  "|---" * (len(names) + len(base) + 2) + "|"]
        for r in res["rows"]:
            cells = [fmt(r["ms"].get(n)) for n in names]
            cells += [f"{r['speedup'][n]:.2f}" if n in r["speedup"] else "-" for n in base]
            pct = r["tpsample_pct_of_floor"]
            cells.append("-" if pct is None else f"{pct / 100:.3f}")
            lines.append(f"| {r['B']} | " + " | ".join(cells) + " |")
        png = plot_single(res, doc, label, f"{label} {meta['config']['dtype']}")
        if png:
            lines += ["", f"![{label} D={res['D']} V={res['V']}]({png})"]
        lines.append("")
    return "\n".join(lines)


def single_summary(meta: dict) -> str:
    """One line: cells, against how many baselines tpsample was faster, worst ratios."""
    cells = [r for res in meta["shapes"] for r in res["rows"] if "tpsample" in r["ms"]]
    ratios = [v for r in cells for k, v in r["speedup"].items() if k != "mm"]
    won = sum(all(v > 1 for k, v in r["speedup"].items() if k != "mm") for r in cells)
    vs_mm = [1 / r["speedup"]["mm"] for r in cells if "mm" in r["speedup"]]
    return (f"bench: {len(cells)} cells; tpsample faster than every sampling baseline in "
            f"{won}/{len(cells)}; smallest speedup over a sampling baseline "
            f"{min(ratios, default=float('nan')):.2f}x; tpsample / mm alone "
            f"{min(vs_mm, default=float('nan')):.3f}-{max(vs_mm, default=float('nan')):.3f}")


def plot_single(res: dict, doc: str, label: str, title: str, main: str = "tpsample") -> str | None:
    """Plot of one shape next to the doc (docs/img/), the variant `main` drawn bold; returns
    its path relative to the doc."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot")
        return None
    rel = f"img/{slug(label)}_{res['D']}x{res['V']}.png"
    path = os.path.join(os.path.dirname(os.path.abspath(doc)), rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Bs = [r["B"] for r in res["rows"]]
    names = list(dict.fromkeys(k for r in res["rows"] for k in r["ms"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in names:
        pts = [(r["B"], r["ms"][n]) for r in res["rows"] if r["ms"].get(n) is not None]
        ax.plot(*zip(*pts), marker="o", label=n, lw=2.5 if n == main else 1.5)
    ax.axhline(res["floor_ms"], ls="--", color="k", label=f"floor ({res['floor_ms']:.3f} ms)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(Bs, [str(b) for b in Bs], fontsize=8, rotation=90)  # (sizes between powers of 2)
    ax.set_ylim(bottom=0)
    ax.set(xlabel="batch size B", ylabel="median time (ms)", title=f"{title}: D={res['D']}, V={res['V']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return rel


def tp_markdown(runs: list, doc: str | None, label: str) -> str:
    """The section of TP runs: per run a table per shape (eager / aligned / graph ms, speedup
    over all-gather + multinomial); with several degrees the scaling table and plot."""
    lines = []
    for meta in sorted(runs, key=lambda r: r["world"]):
        lines.append(f"`{meta['command']}` — TP{meta['world']}, {meta['device']}, torch "
                     f"{meta['torch']}, Triton {meta.get('triton', '?')}, {meta['date']}; ms per call "
                     "(eager / eager with the ranks aligned / CUDA-graph replay); "
                     f"x = {short(BASE)} / tpsample (eager).")
        lines.append("")
        for s in meta["shapes"]:
            names = list(next(iter(s["results"].values())))
            tps = [n for n in names if n.startswith("tpsample_")]
            lines += [f"**TP{meta['world']}, D={s['D']}, V={s['V']}**", "",
                      "| B | " + " | ".join(short(n) for n in names) + " | "
                      + " | ".join(f"x {short(n)}" for n in tps) + " |",
                      "|---" * (len(names) + len(tps) + 1) + "|"]
            for B, r in s["results"].items():
                cells = ["/".join(fmt(r[n].get(k)) for k in ("eager_ms", "eager_aligned_ms", "graph_ms")
                                  if k in r[n]) for n in names]
                cells += [f"{r[BASE]['eager_ms'] / r[n]['eager_ms']:.2f}" for n in tps]
                lines.append(f"| {B} | " + " | ".join(cells) + " |")
            shares = [r[n]["fallback_share"] for r in s["results"].values() for n in tps
                      if "fallback_share" in r[n]]
            if shares:
                took = (f"{min(shares):.3f}–{max(shares):.3f} of their rows" if max(shares) > 0
                        else "none of their rows")
                lines += ["", f"Filtered calls (typical-entropy head): {took} took the exact "
                              "fallback."]
            lines.append("")
    if len(runs) > 1:
        tps = sorted(r["world"] for r in runs)
        for (D, V), table in tp_scaling(runs).items():
            lines += [f"**Scaling, D={D}, V={V}** (eager / graph ms per TP degree)", "",
                      "| B | variant | " + " | ".join(f"TP{t}" for t in tps) + " |",
                      "|---" * (len(tps) + 2) + "|"]
            for (B, n), per in sorted(table.items(), key=lambda kv: kv[0][0]):
                lines.append(f"| {B} | {short(n)} | " + " | ".join(
                    "/".join(fmt(x) for x in per.get(t, (None, None))) for t in tps) + " |")
            png = plot_tp(table, tps, D, V, doc, label) if doc else None
            if png:
                lines += ["", f"![{label} scaling D={D} V={V}]({png})"]
            lines.append("")
    return "\n".join(lines)


def tp_summary(meta: dict) -> str:
    cells = [(B, n, r) for s in meta["shapes"] for B, r in s["results"].items()
             for n in r if n.startswith("tpsample_")]
    x = [r[BASE]["eager_ms"] / r[n]["eager_ms"] for _, n, r in cells]
    vs_mm = [r[n]["eager_ms"] / r["mm_local"]["eager_ms"] for _, n, r in cells]
    return (f"bench: TP{meta['world']}, {len(cells)} tpsample cells; speedup over all-gather + "
            f"multinomial (eager) {min(x, default=float('nan')):.2f}-{max(x, default=float('nan')):.2f}x; "
            f"tpsample / local mm {min(vs_mm, default=float('nan')):.2f}-{max(vs_mm, default=float('nan')):.2f}")


def plot_tp(table: dict, tps: list, D: int, V: int, doc: str, label: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rel = f"img/{slug(label)}_scaling_{D}x{V}.png"
    path = os.path.join(os.path.dirname(os.path.abspath(doc)), rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    plot_tp_shape(plt, table, tps, D, V, path)
    return rel


def slug(label: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_")


def write_doc(path: str, label: str, body: str) -> None:
    """Replace the doc's section for `label` (markers `<!-- bench:label -->` ... `<!--
    /bench:label -->`) with body; append it if absent; create the file if missing."""
    start, end = f"<!-- bench:{label} -->", f"<!-- /bench:{label} -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    text = open(path).read() if os.path.exists(path) else ""
    if start in text and end in text:
        a, b = text.index(start), text.index(end) + len(end)
        text = text[:a] + block + text[b:]
    else:
        text = text.rstrip() + ("\n\n" if text.strip() else "") + block + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    log(f"wrote section {label} of {path}")


def save_beside_doc(fig, doc: str, name: str) -> str:
    """Save a matplotlib figure as img/NAME.png next to the doc (closing it); returns the
    doc-relative path for its markdown link."""
    import matplotlib.pyplot as plt
    folder = os.path.join(os.path.dirname(os.path.abspath(doc)), "img")
    os.makedirs(folder, exist_ok=True)
    fig.savefig(os.path.join(folder, f"{name}.png"), dpi=110, bbox_inches="tight")
    plt.close(fig)
    return f"img/{name}.png"


def render_report(args, meta: dict, markdown, summary) -> None:
    """Print a run's (or --report's) markdown and summary lines; with --doc, rewrite its
    section --label (the sweep-style benchmarks' common ending)."""
    text = markdown(meta, args.doc or os.devnull, args.label)
    print(text)
    for s in summary(meta):
        print("summary:", s)
    if args.doc:
        write_doc(args.doc, args.label, text)


FILTER_SETS = {"tps_k": dict(top_k=50), "tps_p": dict(top_p=0.9), "tps_m": dict(min_p=0.05),
               "tps_kpm": dict(top_k=50, top_p=0.9, min_p=0.05), "tps_lp20": dict(top_logprobs=20)}


def typical_head(D: int, V: int, B: int, dtype, device, slope: float = 1.6):
    """W [V, D] and h [B, D] whose logits follow -slope * ln(rank) (+ small noise per row)."""
    g = torch.Generator().manual_seed(0)
    profile = -slope * torch.log(torch.arange(1, V + 1, dtype=torch.float32))
    profile = profile[torch.randperm(V, generator=g)]
    w = torch.randn(V, D, generator=g) * (0.1 / D ** 0.5)
    u = torch.randn(D, generator=g)
    u /= u.norm()
    w += profile[:, None] * u[None, :]
    h = u[None, :] + torch.randn(B, D, generator=g) * (0.05 / D ** 0.5)
    return h.to(device, dtype), w.to(device, dtype)


def filter_variants(h, w) -> dict:
    V = w.shape[0]
    K, TOP_P, MIN_P = 50, 0.9, 0.05

    def sort_kpm():
        s, idx = (h @ w.T).float().sort(dim=-1, descending=True)
        s[:, K:] = float("-inf")
        probs = s.softmax(-1)
        s = s.masked_fill(probs.cumsum(-1) - probs >= TOP_P, float("-inf"))
        probs = s.softmax(-1)
        probs = probs.masked_fill(probs < MIN_P * probs[:, :1], 0.0)
        return idx.gather(1, torch.multinomial(probs, 1))

    def topk_kpm():
        s, idx = (h @ w.T).float().topk(K, dim=-1)
        probs = s.softmax(-1)
        s = s.masked_fill(probs.cumsum(-1) - probs >= TOP_P, float("-inf"))
        probs = s.softmax(-1)
        probs = probs.masked_fill(probs < MIN_P * probs[:, :1], 0.0)
        return idx.gather(1, torch.multinomial(probs, 1))

    step = itertools.count()
    variants = {"mm": lambda: h @ w.T,
                "tpsample": lambda: tpsample.sample(h, w, seed=1234, offset=next(step))}
    for name, kw in FILTER_SETS.items():
        variants[name] = (lambda kw=kw: tpsample.sample(h, w, seed=1234, offset=next(step), **kw))
    variants["sort_kpm"] = sort_kpm
    variants["topk_kpm"] = topk_kpm
    try:
        import flashinfer.sampling as fs
        # "joint": FlashInfer's sorting-free rejection kernel (its sampling module). The default
        # "top_k_first" selects the k first with its top-k module, whose JIT build (cub_topk.cu)
        # did not finish in 15 minutes with nvcc 13.0 on the benchmark machines.
        variants["fi_k50p09"] = lambda: fs.top_k_top_p_sampling_from_logits(
            h @ w.T, K, TOP_P, filter_apply_order="joint")
    except Exception as e:  # noqa: BLE001
        log(f"skipping FlashInfer (import failed: {type(e).__name__}: {e})")
    return variants


def constraint_variants(h, w) -> dict:
    """--constraints: the plain call, a random-half allowed mask, 64 listed adjustments per
    row, both with a repetition penalty, the mask with the three filters; baselines: matmul,
    matmul + the mask applied in torch + softmax / multinomial (mm_mask_mult) or + a Gumbel
    argmax (mm_mask_gumbel)."""
    B, V = h.shape[0], w.shape[0]
    g = torch.Generator(device=h.device).manual_seed(7)
    words = -(-V // 32)
    mask = torch.randint(-2 ** 31, 2 ** 31, (B, words), dtype=torch.int64, device=h.device,
                         generator=g).to(torch.int32)
    ids = torch.randint(0, V, (B, 64), device=h.device, generator=g)
    values = torch.randn(B, 64, device=h.device, generator=g)
    col = torch.arange(V, device=h.device)
    word_of, bit_of = col >> 5, (col & 31).to(torch.int32)
    step = itertools.count()

    def call(check=True, **kw):
        def run():  # (TPSAMPLE_CHECK_TENSORS per variant)
            with tpsample.knobs.overridden(CHECK_TENSORS=check):
                return tpsample.sample(h, w, seed=1234, offset=next(step), **kw)
        return run

    def masked_logits():
        l = (h @ w.T).float()
        allowed = ((mask[:, word_of] >> bit_of) & 1).bool()
        return l.masked_fill_(~allowed, float("-inf"))

    variants = {"mm": lambda: h @ w.T, "tpsample": call(),
                "tps_mask": call(allowed_mask=mask), "tps_adj64": call(logit_adjust=(ids, values)),
                "tps_adj64_nc": call(False, logit_adjust=(ids, values)),
                "tps_mask_adj": call(allowed_mask=mask, logit_adjust=(ids, values),
                                     repetition_penalty=1.2),
                "tps_mask_kpm": call(allowed_mask=mask, top_k=50, top_p=0.9, min_p=0.05),
                "mm_mask_mult": lambda: torch.multinomial(masked_logits().softmax(-1), 1),
                "mm_mask_gumbel": lambda: (masked_logits()
                                           - torch.empty(B, V, device=h.device).exponential_().log()
                                           ).argmax(-1)}
    try:
        import flashinfer.sampling as fs
        variants["fi_mask"] = lambda: fs.sampling_from_logits(masked_logits())
    except Exception as e:  # noqa: BLE001
        log(f"skipping FlashInfer (import failed: {type(e).__name__}: {e})")
    return variants


def run_constraints(args):
    return run_filters(args, constraint_variants, "constraints.json", constraints_markdown)


def run_filters(args, make_variants=None, json_name="filters.json", markdown=None):
    from tpsample import api
    make_variants = make_variants or filter_variants
    markdown = markdown or filters_markdown
    cuda = args.cuda
    device = torch.device("cuda" if cuda else "cpu")
    os.makedirs(args.out, exist_ok=True)
    bandwidth = measure_bandwidth(device)
    meta = dict(run_meta(args, cuda), bandwidth_bytes_per_s=bandwidth, shapes=[])
    for D, V in args.shapes:
        floor_ms = V * D * 2 / bandwidth * 1e3
        rows = []
        meta["shapes"].append({"D": D, "V": V, "floor_ms": floor_ms, "rows": rows})
        for B in args.batches:
            h, w = typical_head(D, V, B, DTYPES[args.dtype], device)
            runs, fallback = {}, {}
            variants = make_variants(h, w)
            for p in range(args.passes):
                for name, fn in (list if p % 2 == 0 else reversed)(list(variants.items())):
                    pipes = list(api._PIPELINES.values())
                    before = sum(q.fallback_rows for q in pipes), sum(q.candidate_rows for q in pipes)
                    runs.setdefault(name, []).append(time_fn(fn, cuda))
                    pipes = list(api._PIPELINES.values())
                    after = sum(q.fallback_rows for q in pipes), sum(q.candidate_rows for q in pipes)
                    if after[1] > before[1]:
                        fallback[name] = (after[0] - before[0]) / (after[1] - before[1])
            ms = {n: statistics.fmean(v) for n, v in runs.items()}
            rows.append({"B": B, "ms": ms, "fallback_share": fallback})
            log(f"[D={D} V={V} B={B}] " + " ".join(f"{k}={v:.3f}" for k, v in ms.items())
                + " fallback " + " ".join(f"{k}={v:.2f}" for k, v in fallback.items()))
            del h, w, variants
            with open(os.path.join(args.out, json_name), "w") as f:  # a cut-off run keeps its rows
                json.dump(meta, f, indent=1)
    text = markdown(meta, args.doc or os.devnull, args.label or json_name[:-5])
    print(text)
    if args.doc:
        write_doc(args.doc, args.label or json_name[:-5], text)


def shape_plot(res: dict, doc: str, label: str, main: str) -> list[str]:
    """The markdown lines closing one shape's table: its plot (when one was drawn), a blank."""
    png = plot_single(res, doc, label, label, main=main)
    return (["", f"![{label} D={res['D']} V={res['V']}]({png})"] if png else []) + [""]


def merge_runs(runs: list[dict]) -> dict:
    """Several single-device runs (one per shape, e.g. where one run would not fit a time
    limit) as one: their shapes in order, each run's command, date and copy bandwidth."""
    if len(runs) == 1:
        return runs[0]
    meta = dict(runs[0], shapes=[s for r in runs for s in r["shapes"]])
    meta["command"] = [r["command"] for r in runs]
    meta["date"] = " / ".join(r["date"] for r in runs)
    meta["bandwidth_bytes_per_s"] = [r["bandwidth_bytes_per_s"] for r in runs]
    return meta


def filters_markdown(meta: dict, doc: str, label: str) -> str:
    """The section of one filtered run (or merge_runs' runs): a table per shape, its plot."""
    commands = meta["command"] if isinstance(meta["command"], list) else [meta["command"]]
    bw = meta["bandwidth_bytes_per_s"]
    bw = "/".join(f"{b / 1e9:.0f}" for b in (bw if isinstance(bw, list) else [bw]))
    lines = [" and ".join(f"`{c}`" for c in commands)
             + f" — {meta['device']}, torch {meta['torch']}, Triton "
             f"{meta['triton']}, {meta['date']}; copy bandwidth {bw} GB/s; median ms; logits "
             "-1.6 ln(rank) (~2.7 nats); k = top_k 50, p = top_p 0.9, m = min_p 0.05.", ""]
    for res in meta["shapes"]:
        names = list(dict.fromkeys(k for r in res["rows"] for k in r["ms"]))
        lines += [f"**D={res['D']}, V={res['V']}** (floor {res['floor_ms']:.3f} ms)", "",
                  "| B | " + " | ".join(short(n) for n in names)
                  + " | kpm / floor | kpm / mm | kpm / plain | sort_kpm / kpm | topk_kpm / kpm"
                  + (" | fi_k50p09 / kpm" if "fi_k50p09" in names else "") + " | fallback rows |",
                  "|---" * (len(names) + 7 + ("fi_k50p09" in names)) + "|"]
        for r in res["rows"]:
            ms = r["ms"]
            k = ms.get("tps_kpm")
            cells = [fmt(ms.get(n)) for n in names]
            cells += [f"{k / res['floor_ms']:.3f}", f"{k / ms['mm']:.3f}",
                      f"{k / ms['tpsample']:.3f}", f"{ms['sort_kpm'] / k:.2f}",
                      f"{ms['topk_kpm'] / k:.2f}"]
            if "fi_k50p09" in names:
                cells.append(f"{ms['fi_k50p09'] / k:.2f}")
            fb = r["fallback_share"]
            cells.append(", ".join(f"{short(n)} {v:.2f}" for n, v in fb.items() if v) or "0")
            lines.append(f"| {r['B']} | " + " | ".join(cells) + " |")
        lines += shape_plot(res, doc, label, "tps_kpm")
    return "\n".join(lines)


def constraints_markdown(meta: dict, doc: str, label: str) -> str:
    """The section of one --constraints run: a table per shape (the costs as ratios to the
    plain call, the baselines as ratios to the constrained call) and its plot."""
    lines = [f"`{meta['command']}` — {meta['device']}, torch {meta['torch']}, Triton "
             f"{meta['triton']}, {meta['date']}; median ms; mask = a random half of the "
             "vocabulary allowed per row; adj64 = 64 listed tokens per row (logit_adjust); "
             "mask_adj = both + repetition_penalty 1.2; mask_kpm = the mask + top_k 50, "
             "top_p 0.9, min_p 0.05; mm_mask_* = matmul, the mask in torch, then softmax + "
             "multinomial or a Gumbel argmax.", ""]
    for res in meta["shapes"]:
        names = list(dict.fromkeys(k for r in res["rows"] for k in r["ms"]))
        base = "fi_mask" if "fi_mask" in names else "mm_mask_gumbel"
        lines += [f"**D={res['D']}, V={res['V']}** (floor {res['floor_ms']:.3f} ms)", "",
                  "| B | " + " | ".join(short(n) for n in names)
                  + " | mask / plain | adj64 / plain | adj64_nc / plain | mask_adj / plain"
                  " | mm_mask_mult / mask"
                  f" | {short(base)} / mask |",
                  "|---" * (len(names) + 7) + "|"]
        for r in res["rows"]:
            ms = r["ms"]
            plain, mask = ms["tpsample"], ms["tps_mask"]
            cells = [fmt(ms.get(n)) for n in names]
            cells += [f"{mask / plain:.3f}", f"{ms['tps_adj64'] / plain:.3f}",
                      f"{ms['tps_adj64_nc'] / plain:.3f}",
                      f"{ms['tps_mask_adj'] / plain:.3f}", f"{ms['mm_mask_mult'] / mask:.2f}",
                      f"{ms[base] / mask:.2f}"]
            lines.append(f"| {r['B']} | " + " | ".join(cells) + " |")
        lines += shape_plot(res, doc, label, "tps_mask")
    return "\n".join(lines)


def run_single(args):
    if args.constraints:
        return run_constraints(args)
    if args.filters:
        return run_filters(args)
    cuda = args.cuda
    device = torch.device("cuda" if cuda else "cpu")
    warnings.filterwarnings("ignore", message=r"\s*Online softmax")  # inductor chatter
    os.makedirs(args.out, exist_ok=True)
    log("measuring copy bandwidth ...")
    bandwidth = measure_bandwidth(device)
    meta = dict(run_meta(args, cuda), bandwidth_bytes_per_s=bandwidth, skipped={},
                timing="mean over passes of the do_bench median" if cuda else "perf_counter median of 5")
    meta["shapes"] = []
    for D, V in args.shapes:
        log(f"shape D={D} V={V}")
        meta["shapes"].append(run_shape(
            D, V, args.batches, device=device, dtype=DTYPES[args.dtype], bandwidth=bandwidth,
            merge=args.merge, compile_=not args.no_compile, skipped=meta["skipped"],
            only=set(args.variants.split(",")) if args.variants else None, passes=args.passes))
        with open(os.path.join(args.out, "single.json"), "w") as f:  # after every shape
            json.dump(meta, f, indent=1)
    print(single_markdown(meta, args.doc or os.path.join(args.out, "bench.md"), args.label or "bench")
          if args.doc else single_markdown_plain(meta))
    for name, reason in meta["skipped"].items():
        print(f"skipped {name}: {reason}")
    if args.doc:
        write_doc(args.doc, args.label or "single", single_markdown(meta, args.doc, args.label or "single"))
    print(single_summary(meta))


def single_markdown_plain(meta: dict) -> str:
    """The tables without plots (a run without --doc)."""
    keep = meta["shapes"]
    return "\n".join(line for line in single_markdown(
        dict(meta, shapes=keep), os.devnull, "none").splitlines() if not line.startswith("!["))


# ---------------------------------------------------------------------------- tensor parallel
def init_dist(cuda: bool) -> torch.device:
    if not cuda:
        torch.set_num_threads(1)
        # the sampler's timeout_s (300 s): a timed-out gloo all-gather ends with it
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
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
    """One all-gather of t [n, ...] → [world, n, ...] (gloo wants dim 0 concatenated; torch
    2.13 renamed all_gather_into_tensor all_gather_single: transport.all_gather_flat)."""
    out = torch.empty(dist.get_world_size() * t.shape[0], *t.shape[1:], dtype=t.dtype, device=t.device)
    all_gather_flat(out, t.contiguous())
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


def profile_cuda(fn, iters: int, warmup: int = 1):
    """The torch profiler (CUDA activity only) of `iters` calls of fn, after `warmup` calls."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return prof


def kernel_times(fn, iters: int = 20) -> dict[str, float]:
    """{kernel name: device ms per call} over `iters` calls, largest first (CUDA only)."""
    prof = profile_cuda(fn, iters)
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


def make_samplers(W, V, transports, max_batch, dev, merge="max", filters=False,
                  filter_weight=None) -> dict:
    """{variant: sampler}; a transport that fails on any rank is skipped on all of them. With
    filters, each transport also gets a sampler with the tile log-masses (`tpsample_<t>_kpm`),
    which filtered calls need, on filter_weight when given (else W); the plain one stays
    tokens-only."""
    import tpsample
    out, backend = {}, "auto" if dev.type == "cuda" else "torch"
    # plain calls: tokens only, like the baselines (stage 1 skips the log-masses where the
    # merge allows it)
    kinds = [("", merge != "max")] + ([("_kpm", True)] if filters else [])
    for t in transports:
        for suffix, logprobs in kinds:
            s, why = None, "failed on another rank"
            try:
                shard = filter_weight if suffix and filter_weight is not None else W
                s = tpsample.VocabParallelSampler(shard, vocab_size=V, transport=t, check_inputs=False,
                                                  max_batch=max_batch, backend=backend, merge=merge,
                                                  logprobs=logprobs)
            except Exception as e:  # noqa: BLE001 - report the reason and go on
                why = f"{type(e).__name__}: {e}"
            if all_ranks(int(s is not None), dev, dist.ReduceOp.MIN, torch.int32):
                out[f"tpsample_{t}{suffix}"] = s
            elif dist.get_rank() == 0:
                log(f"[rank {dist.get_rank()}] skipping transport {t}{suffix}: {why}")
    return out


def typical_shard(D: int, V: int, B: int, rank: int, world: int, dev):
    """This rank's rows of typical_head's W (the one-device --filters head, whose logits have
    the entropy of LM next-token distributions) and its h [B, D]: filtered TP calls on random
    heads would measure the exact fallback, which realistic rows rarely take."""
    h, w = typical_head(D, V, B, torch.bfloat16, "cpu")
    start = sum(split_rows(V, world)[:rank])
    return h.to(dev), w[start:start + split_rows(V, world)[rank]].to(dev)


def tp_variants(h, W, V, samplers, seed, step, h_filtered=None) -> dict:
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
        if name.endswith("_kpm"):  # on the typical head (h_filtered)
            hf = h if h_filtered is None else h_filtered
            fns[name] = lambda s=s, hf=hf: s(hf, seed=seed, offset=step, top_k=50, top_p=0.9,
                                             min_p=0.05)
        else:
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


def bench_batch(D, V, B, W, samplers, args, dev, h_filtered=None):
    g = torch.Generator(device=dev).manual_seed(0)  # the same h on every rank
    h = torch.randn(B, D, generator=g, device=dev, dtype=torch.bfloat16)
    seed, step = (torch.full((B,), v, dtype=torch.int64, device=dev) for v in (1234, 7))  # fixed, on device
    res, warns = {}, []
    for name, fn in tp_variants(h, W, V, samplers, seed, step, h_filtered).items():
        pipe = samplers[name].pipeline if name in samplers else None
        before = (pipe.fallback_rows, pipe.candidate_rows) if pipe is not None else None
        r = res[name] = {"eager_ms": time_calls(fn, dev, args.iters)}
        if pipe is not None and pipe.candidate_rows > before[1]:
            r["fallback_share"] = ((pipe.fallback_rows - before[0])
                                   / (pipe.candidate_rows - before[1]))
        if dev.type == "cuda":
            r["eager_aligned_ms"] = time_calls(fn, dev, args.iters, align=True)
        # filtered calls read a flag back per call unless the exact fallback stays on the
        # device (symm_mem): only those are capturable
        filtered = name.endswith("_kpm") and not pipe.gather_fallback
        graph, out = capture(fn, dev) if args.graph and not filtered else (None, None)
        if filtered and args.graph:
            out = "filtered calls over this transport synchronise with the host"
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


def print_tp_table(shape: dict, world: int):
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


def run_tp(args):
    cuda = args.cuda
    dev = init_dist(cuda)
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes, warns = [], []
    for D, V in args.shapes:
        W = make_shard(D, V, rank, world, dev)
        h_typ, W_typ = (typical_shard(D, V, max(args.batches), rank, world, dev) if args.filters
                        else (None, None))
        samplers = make_samplers(W, V, args.transports, max(args.batches), dev, args.merge,
                                 args.filters, W_typ)
        shapes.append({"D": D, "V": V, "shard_rows": split_rows(V, world), "results": {}})
        for B in args.batches:
            t0 = time.perf_counter()
            res, w = bench_batch(D, V, B, W, samplers, args, dev,
                                 None if h_typ is None else h_typ[:B].contiguous())
            shapes[-1]["results"][B], warns = res, warns + w
            if rank == 0:
                cells = " ".join(f"{short(n)}={fmt(r['eager_ms'])}/{fmt(r.get('graph_ms'))}" for n, r in res.items())
                log("".join(f"WARNING: {x}\n" for x in w) + f"[tp{world} {D}x{V} B={B}] {cells} ms "
                    f"({time.perf_counter() - t0:.1f} s)")
                # after every batch: a run cut off by a time limit keeps what it timed
                write_tp_json(args, cuda, world, shapes, warns)
        del W, W_typ, h_typ, samplers
        gc.collect()
        torch.cuda.empty_cache()  # no-op without CUDA
    if rank == 0:
        for s in shapes:
            print_tp_table(s, world)
        meta, path = write_tp_json(args, cuda, world, shapes, warns)
        log(f"wrote {path}")
        print(tp_summary(meta))
        if args.doc:
            write_doc(args.doc, args.label or f"TP{world}", tp_markdown([meta], args.doc, args.label or f"TP{world}"))
    dist.barrier()
    dist.destroy_process_group()


def write_tp_json(args, cuda: bool, world: int, shapes: list, warns: list) -> tuple[dict, str]:
    """The TP run's results so far as OUT/tp{world}.json: (its contents, its path)."""
    meta = dict(run_meta(args, cuda), world=world,
                nccl=str(torch.cuda.nccl.version()) if cuda else None, shapes=shapes, warnings=warns)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"tp{world}.json")
    with open(path, "w") as f:
        json.dump(meta, f, indent=1)
    return meta, path


def plot_tp_shape(plt, table, tps, D, V, path):
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


def tp_scaling(runs: list) -> dict:
    """{(D, V): {(B, variant): {tp: (eager_ms, graph_ms)}}} from tp<N>.json results."""
    out = {}
    for r in sorted(runs, key=lambda r: r["world"]):
        for s in r["shapes"]:
            table = out.setdefault((s["D"], s["V"]), {})
            for B, res in s["results"].items():
                for n, v in res.items():
                    table.setdefault((int(B), n), {})[r["world"]] = (v["eager_ms"], v.get("graph_ms"))
    return out


# ---------------------------------------------------------------------------- the command
def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m tpsample.launch.bench",
                                description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["single", "tp"],
                   help="default: tp under torchrun (WORLD_SIZE set), else single")
    p.add_argument("--shapes", help=f"DxV,... (single: {SINGLE_SHAPES}; tp: {TP_SHAPES}; CPU 256x8192)")
    p.add_argument("--batches", help="B,... (single: 1,2,4,8,16,24,...,224,256; tp: 1,16,64,256; CPU 1,4,16)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--merge", default="max", choices=["max", "logmass", "cdf"],
                   help="the merge tpsample samples with")
    p.add_argument("--out", default="bench_out")
    p.add_argument("--doc", help="markdown file whose section --label this run rewrites")
    p.add_argument("--label", help="the section's name (default: single or TP<N>)")
    p.add_argument("--report", nargs="+", metavar="JSON", help="render tp<N>.json files (or a single.json, constraints.json, "
                   "filters.json files of one device), no run")
    p.add_argument("--cpu", action="store_true", help="CPU tensors (gloo) even where CUDA exists")
    g = p.add_argument_group("one device")
    g.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    g.add_argument("--variants", help="comma list: only these variants (e.g. mm,tpsample)")
    g.add_argument("--passes", type=int, help="timings per variant, alternating order (default 2 on CUDA)")
    g.add_argument("--filters", action="store_true",
                   help="the filtered-sampling benchmark (tp: also top_k 50 + top_p 0.9 + "
                        "min_p 0.05 calls of each transport)")
    g.add_argument("--constraints", action="store_true",
                   help="the constrained-decoding benchmark: allowed mask, listed adjustments, "
                        "repetition penalty (writes OUT/constraints.json)")
    g = p.add_argument_group("tensor parallel")
    g.add_argument("--iters", type=int, help="timed calls (default 100; CPU 20)")
    g.add_argument("--transports", help="default symm_mem,nccl (CPU: gloo)")
    g.add_argument("--no-graph", action="store_true", help="no CUDA-graph timings")
    g.add_argument("--profile", action="store_true", help="per-kernel device time of tpsample calls")
    a = p.parse_args(argv)
    a.argv = argv
    a.cuda = torch.cuda.is_available() and not a.cpu
    a.mode = a.mode or ("tp" if "WORLD_SIZE" in os.environ else "single")
    tp = a.mode == "tp"
    default_shapes = (TP_SHAPES if tp else SINGLE_SHAPES) if a.cuda else "256x8192"
    a.shapes = [tuple(int(x) for x in s.lower().split("x")) for s in (a.shapes or default_shapes).split(",")]
    # (single: the powers of two, and sizes between the kernels' row blocks, where a block
    # reaches past the batch, docs/design.md)
    default_b = ("1,16,64,256" if tp else "1,2,4,8,16,24,32,48,64,96,128,144,160,176,192,224,256"
                 ) if a.cuda else "1,4,16"
    a.batches = [int(b) for b in (a.batches or default_b).split(",")]
    a.iters = a.iters or (100 if a.cuda else 20)
    a.passes = a.passes or (2 if a.cuda else 1)
    if a.passes < 1 or a.iters < 1:
        p.error("--passes and --iters must be >= 1")
    a.transports = (a.transports or ("symm_mem,nccl" if a.cuda else "gloo")).split(",")
    a.graph = a.cuda and not a.no_graph
    return a


def main(argv=None):
    # never NVLink multicast / NVLS on shared hosts: set before NCCL or symmetric memory start
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    args = parse_args(argv)
    if args.report:
        runs = [json.load(open(f)) for f in args.report]
        label = args.label or ("TP" if "world" in runs[0] else "single")
        if all("world" in r for r in runs):
            text = tp_markdown(runs, args.doc, label)
        elif len(runs) == 1 and "tps_mask" in runs[0]["shapes"][0]["rows"][0]["ms"]:
            text = constraints_markdown(runs[0], args.doc or os.devnull, label)
        elif all("fallback_share" in r["shapes"][0]["rows"][0] for r in runs) and \
                len({r["device"] for r in runs}) == 1:
            text = filters_markdown(merge_runs(runs), args.doc or os.devnull, label)
        elif len(runs) == 1:
            text = single_markdown(runs[0], args.doc or os.devnull, label)
        else:
            sys.exit("--report takes one single.json, filters.json files of one device (one "
                     "run per shape) or several tp<N>.json files")
        print(text)
        if args.doc:
            write_doc(args.doc, label, text)
    elif args.mode == "tp":
        run_tp(args)
    else:
        run_single(args)


if __name__ == "__main__":
    main()
