"""Filtered sampling across the distributions users send: cost / plain call per filter, head,
temperature and batch, with the worst cell beside the typical one.

    python -m tpsample.launch.sweep [--shapes 4096x151936,8192x128256] [--batches 1,16,64,256]
        [--temps 0.7,1.0,1.5] [--heads zipf2.0,...,mixed] [--warm 8] [--out DIR]
        [--doc docs/performance.md --label NAME]

One W per shape carries every head's logit profile along its own direction of the hidden
space, so a head is a hidden state: Zipf heads -a·ln(rank) (random placement) for a in
{2.0, 1.6, 1.3, 1.1, 1.0}, Gaussian logits with std 4, 2, 1, and a batch whose rows alternate
between the flattest (Gaussian std 1) and the most peaked (a = 2.0) head. Per (head, T, B)
the same run times the plain call, cuBLAS's matmul alone, matmul + torch sort + top-p 0.9 +
multinomial, and tpsample with each filter set (one of them, top-p 0.9, also returning
log-probs: its log Z needs every row's cut, not only the rows whose winner is dropped); where
`import flashinfer.sampling` works (tools/flashinfer_carry.sh) also matmul + FlashInfer's
sorting-free sampling kernel for each filter set it has (fi_<set>: top-k and top-p together by
top_k_top_p_sampling_from_logits with filter_apply_order="joint", one filter by its
*_sampling_from_probs after a softmax, on the fp32 logits / T); it prints each head's entropy
and nucleus sizes at T. Writes OUT/sweep.json after every cell row (a cut-off run keeps what it timed);
the summary line gives the worst cell per batch range next to the typical one (a = 1.6,
T = 1). --warm N first compiles every kernel of the run in N processes at once (a fresh
machine otherwise compiles each (B, filter set) in turn, minutes per row).

Every tpsample cell starts from a fresh fallback choice (tpsample/fallback_choice.py), so
it is timed in its own steady state: a process that kept flagging rows writes the side
output, one whose calls flag none stops writing it after a few dozen calls (within the
timing's warm-up). Without the reset, the cells timed after flat rows would inherit their
choice.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import shlex
import sys
import time

import torch

import tpsample
from tpsample import knobs

from .bench import (DTYPES, log, measure_bandwidth, render_report, run_meta, save_beside_doc,
                    time_fn)

HEADS = {"zipf2.0": ("zipf", 2.0), "zipf1.6": ("zipf", 1.6), "zipf1.3": ("zipf", 1.3),
         "zipf1.1": ("zipf", 1.1), "zipf1.0": ("zipf", 1.0), "gauss4": ("gauss", 4.0),
         "gauss2": ("gauss", 2.0), "gauss1": ("gauss", 1.0)}
MIXED = ("gauss1", "zipf2.0")  # the mixed batch's two kinds of rows
FILTERS = {"k50": dict(top_k=50), "p0.9": dict(top_p=0.9), "p0.95": dict(top_p=0.95),
           "p0.99": dict(top_p=0.99), "m0.02": dict(min_p=0.02), "m0.1": dict(min_p=0.1),
           "k50p0.95": dict(top_k=50, top_p=0.95),
           "k50p0.95m0.05": dict(top_k=50, top_p=0.95, min_p=0.05),
           "p0.9+lp": dict(top_p=0.9, return_logprobs=True),  # (log Z needs every row's cut)
           "k50/2p0.9": dict(top_k=50, top_p=0.9, every_other="top_k"),
           "p0.9+t5": dict(top_p=0.9, top_logprobs=5)}  # (an API's logprobs: top 5 too)
# every_other: that filter on every other row only, as a per-row tensor (the others off): a
# serving batch whose requests use it or not (call_kwargs)
TYPICAL = ("zipf1.6", 1.0)
FI_FILTERS = [f for f in FILTERS if f not in ("k50p0.95m0.05", "p0.9+lp", "k50/2p0.9",
                                              "p0.9+t5")]  # FlashInfer has these
_OFF = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}


def call_kwargs(kw: dict, B: int, device) -> dict:
    """A FILTERS entry as tpsample.sample's keywords for B rows (every_other: that filter as
    a per-row tensor, on the even rows only)."""
    kw = dict(kw)
    name = kw.pop("every_other", None)
    if name is not None:
        on = torch.arange(B, device=device) % 2 == 0
        kw[name] = torch.where(on, torch.tensor(kw[name], device=device),
                               torch.tensor(_OFF[name], device=device))
    return kw


def profiles(V: int) -> torch.Tensor:
    """[heads, V] logit profiles in HEADS' order (seeded)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for kind, a in HEADS.values():
        if kind == "zipf":
            p = -a * torch.log(torch.arange(1, V + 1, dtype=torch.float64))
            rows.append(p[torch.randperm(V, generator=g)])
        else:
            rows.append(a * torch.randn(V, generator=g, dtype=torch.float64))
    return torch.stack(rows)


def sweep_head(D: int, V: int, dtype, device):
    """W [V, D] with profile i along orthonormal direction u_i, and U [heads, D]."""
    g = torch.Generator().manual_seed(1)
    prof = profiles(V)
    U = torch.linalg.qr(torch.randn(D, prof.shape[0], generator=g, dtype=torch.float64))[0].T
    w = torch.randn(V, D, generator=g) * (0.05 / D ** 0.5)
    w += (prof.T @ U).float()
    return w.to(device, dtype), U.float().to(device)


def hidden(U: torch.Tensor, head: str, B: int, dtype) -> torch.Tensor:
    """[B, D] hidden states of `head`'s rows: its direction in U plus a seeded random part
    of the same norm orthogonal to every head's direction, so each row is a distinct vector
    (as in a real batch: identical rows made the matmul draw less power, and the plain call
    at B = 256 ran ~20 % faster than on distinct rows) whose logits move by ~0.05 / sqrt(D)
    (W's random part), keeping the head's profile."""
    names = list(HEADS)
    if head == "mixed":
        idx = [names.index(MIXED[b % 2]) for b in range(B)]
    else:
        idx = [names.index(head)] * B
    g = torch.Generator().manual_seed(2)
    r = torch.randn(B, U.shape[1], generator=g, dtype=torch.float64)
    u = U.double().cpu()
    r -= (r @ u.T) @ u
    r /= r.norm(dim=1, keepdim=True)
    return (U[idx] + r.to(U.device, U.dtype)).to(dtype).contiguous()


def kept_sizes(l: torch.Tensor) -> dict:
    """Tokens each filter set keeps on one row of logits (float64, tpsample's semantics)."""
    from tpsample.filters import kept_prefix
    xs = l.double().sort(descending=True).values[None]
    logz = torch.logsumexp(xs, -1)
    out = {}
    for name, kw in FILTERS.items():  # (every_other: the larger of its two kinds of rows)
        kinds = [kw] + ([dict(kw, **{kw["every_other"]: _OFF[kw["every_other"]]})]
                        if "every_other" in kw else [])
        for one in kinds:
            k, p, m = (torch.tensor([v]) for v in (one.get("top_k", 0), one.get("top_p", 1.0),
                                                   one.get("min_p", 0.0)))
            kept, _ = kept_prefix(xs, torch.ones_like(xs, dtype=torch.bool), k, p, m, logz)
            out[name] = max(out.get(name, 0), int(kept.sum()))
    return out


@functools.lru_cache(maxsize=None)  # (a second per (head, T) on the CPU; the same for every B)
def head_kept(head: str, T: float, V: int) -> dict:
    """kept_sizes of a head's logit profile at T (the mixed batch: its larger row's)."""
    prof = profiles(V)
    names = list(HEADS)
    kinds = MIXED if head == "mixed" else (head,)
    per = [kept_sizes(prof[names.index(h)] / T) for h in kinds]
    return {f: max(d[f] for d in per) for f in FILTERS}


def row_stats(l: torch.Tensor) -> dict:
    """Entropy (nats) and the 0.9 / 0.99 nucleus sizes of one row of logits (float64)."""
    p = torch.softmax(l.double(), -1)
    ent = float(-(p * torch.log(p.clamp_min(1e-300))).sum())
    s = p.sort(descending=True).values.cumsum(-1)
    return {"entropy": ent, "n90": int((s < 0.9).sum()) + 1, "n99": int((s < 0.99).sum()) + 1}


def sort_top_p(h, w, T: float, p: float = 0.9):
    """The unfused baseline: matmul, full sort, top-p, multinomial."""
    s, idx = ((h @ w.T).float() / T).sort(dim=-1, descending=True)
    probs = s.softmax(-1)
    s = s.masked_fill(probs.cumsum(-1) - probs >= p, float("-inf"))
    return idx.gather(1, torch.multinomial(s.softmax(-1), 1))


@functools.lru_cache(maxsize=None)  # (one import attempt and one log line per process)
def _flashinfer():
    try:
        import flashinfer.sampling as fs
        return fs
    except Exception as e:  # noqa: BLE001 - any import failure just skips the baseline
        log(f"no FlashInfer baseline: {type(e).__name__}: {e}")
        return None


def flashinfer_variants(h, w, T: float) -> dict:
    """"fi_<set>" -> matmul + FlashInfer's sampling kernel for FI_FILTERS' sets (the fp32 logits
    / T, as a serving engine hands them over), or {} where `import flashinfer.sampling` fails
    (no CUDA, or FlashInfer not installed)."""
    fs = _flashinfer() if h.is_cuda else None
    if fs is None:
        return {}

    def logits():
        x = (h @ w.T).float()
        return x if T == 1.0 else x.div_(T)

    def one(kw):
        k, p, m = kw.get("top_k"), kw.get("top_p"), kw.get("min_p")
        if k and p:
            return lambda: fs.top_k_top_p_sampling_from_logits(logits(), k, p,
                                                               filter_apply_order="joint")
        if k:
            return lambda: fs.top_k_sampling_from_probs(torch.softmax(logits(), -1), k)
        if p:
            return lambda: fs.top_p_sampling_from_probs(torch.softmax(logits(), -1), p)
        return lambda: fs.min_p_sampling_from_probs(torch.softmax(logits(), -1), m)

    return {f"fi_{f}": one(FILTERS[f]) for f in FI_FILTERS}


_WARM_W: dict = {}  # a warm-up worker's weight per (D, V)


def _warm_one(task) -> str:
    """One warm-up task in a worker process: one call (name: "plain" or a FILTERS key) on
    random [B, D] × [V, D] tensors (the values do not matter: the kernels compile for the
    shapes, dtypes, B and the filters), so the run's own calls find them in Triton's disk
    cache; "flashinfer" builds FlashInfer's sampling module where it is importable. A failure
    is reported, not raised: the run then compiles that call itself."""
    D, V, B, name, dtype_name, cuda = task
    t0 = time.perf_counter()
    try:
        device = torch.device("cuda" if cuda else "cpu")
        dtype = DTYPES[dtype_name]
        w = _WARM_W.get((D, V))
        if w is None:
            _WARM_W.clear()  # (one W per worker; made in dtype: no fp32 copy on the device)
            w = _WARM_W[(D, V)] = torch.randn(V, D, device=device, dtype=dtype).mul_(D ** -0.5)
        h = torch.randn(B, D, device=device, dtype=dtype)
        if name == "flashinfer":  # its JIT build (minutes), beside Triton's compiles
            for fn in flashinfer_variants(h, w, 1.0).values():
                fn()
        else:
            tpsample.sample(h, w, seed=1, **({} if name == "plain" else
                                             call_kwargs(FILTERS[name], B, device)))
        if cuda:
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the timed call compiles (or fails) itself
        return (f"D={D} V={V} B={B} {name} FAILED after {time.perf_counter() - t0:.0f} s: "
                f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}")
    return f"D={D} V={V} B={B} {name} ({time.perf_counter() - t0:.0f} s)"


def row_seeds(B: int, device) -> torch.Tensor:
    """int64 [B]: the timed calls' seeds, one per row."""
    return torch.arange(B, device=device, dtype=torch.int64) * 7919 + 1


def warm(args, calls=None) -> None:
    """Compile every kernel the run will launch in args.warm worker processes at once (on a
    fresh machine each (B, filter set) otherwise compiles in turn inside the timed loop's
    first call: minutes per row). calls: (D, V, B, "plain" or a filter set) each (default:
    the sweep's, every shape, batch and filter set), one task each. Each worker holds one W
    on the device. A worker that dies ends the warm-up, not the run."""
    if args.warm <= 0:
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool
    if calls is None:
        calls = [(D, V, B, name) for D, V in args.shapes for B in args.batches
                 for name in ["plain"] + list(FILTERS)]
        if args.cuda:  # first: the longest single task
            calls.insert(0, (*args.shapes[0], 2, "flashinfer"))
    tasks = [(*c, args.dtype, args.cuda) for c in calls]
    t0 = time.perf_counter()
    try:  # (a Pool would wait forever for the task of a worker that died)
        with ProcessPoolExecutor(min(args.warm, len(tasks)),
                                 mp_context=mp.get_context("spawn")) as pool:
            for done in as_completed([pool.submit(_warm_one, t) for t in tasks]):
                log(f"[warm] {done.result()}")
    except BrokenProcessPool as e:
        log(f"[warm] a worker died ({e}): the timed calls compile what is left")
    log(f"[warm] {len(tasks)} calls in {time.perf_counter() - t0:.0f} s")


def fresh_fallback_choice() -> None:
    """Forget what earlier calls taught the process's pipelines about flagged rows (the side
    output's choice, the host-path switch): the next cell is timed in its own steady state."""
    from tpsample.api import _PIPELINES
    for pipe in _PIPELINES.values():
        pipe.fallback.forget()


def run(args) -> dict:
    device = torch.device("cuda" if args.cuda else "cpu")
    dtype = DTYPES[args.dtype]
    os.makedirs(args.out, exist_ok=True)
    warm(args)
    meta = dict(run_meta(args, args.cuda), bandwidth_bytes_per_s=measure_bandwidth(device),
                filters=FILTERS, shapes=[])
    meta["command"] = "python -m tpsample.launch.sweep " + " ".join(map(shlex.quote, args.argv))
    step = itertools.count()
    for D, V in args.shapes:
        w, U = sweep_head(D, V, dtype, device)
        rows: list = []
        meta["shapes"].append({"D": D, "V": V, "rows": rows})
        for head, T, B in itertools.product(args.heads, args.temps, args.batches):
            h = hidden(U, head, B, dtype)
            # a seed per row: with one seed every row draws the same noise, so a head's rows
            # (logits ~0.001 apart) would be certified or fall back together, never in their
            # proportions
            seed = row_seeds(B, device)
            stats_ = row_stats((h[:1].float() @ w.float().T)[0] / T) if head != "mixed" else {}
            fresh_fallback_choice()
            ms = {"plain": time_fn(lambda: tpsample.sample(h, w, temperature=T, seed=seed,
                                                           offset=next(step)), args.cuda),
                  "mm": time_fn(lambda: h @ w.T, args.cuda),
                  "sort_p0.9": time_fn(lambda: sort_top_p(h, w, T), args.cuda)}
            for name, kw in FILTERS.items():
                fresh_fallback_choice()
                checks = "every_other" not in kw  # (a per-row filter tensor's range check
                kw = call_kwargs(kw, B, device)  # is one host synchronisation per call, which
                with knobs.overridden(CHECK_TENSORS=checks):  # an engine turns off: timed off)
                    ms[name] = time_fn(lambda kw=kw: tpsample.sample(
                        h, w, temperature=T, seed=seed, offset=next(step), **kw), args.cuda)
            for name, fn in flashinfer_variants(h, w, T).items():
                ms[name] = time_fn(fn, args.cuda)
            rows.append(dict(head=head, T=T, B=B, ms=ms, kept=head_kept(head, T, V), **stats_))
            log(f"[D={D} {head} T={T} B={B}] " + " ".join(f"{k}={v:.3f}" for k, v in ms.items())
                + (f" | H={stats_['entropy']:.2f} n90={stats_['n90']}" if stats_ else ""))
            with open(os.path.join(args.out, "sweep.json"), "w") as f:
                json.dump(meta, f, indent=1)
        del w, U
    return meta


def worst(rows: list, pick) -> tuple[float, dict, str] | None:
    cells = [(r["ms"][f] / r["ms"]["plain"], r, f) for r in rows if pick(r) for f in FILTERS
             if f in r["ms"]]  # (a report of an older run may lack a set)
    return max(cells, key=lambda c: c[0]) if cells else None


def small_cells(rows: list, V: int, limit: int = 256) -> list:
    """(row, filter) cells whose kept set holds at most `limit` tokens."""
    cache = {}
    cells = []
    for r in rows:
        kept = r.get("kept") or cache.setdefault((r["head"], r["T"]),
                                                 head_kept(r["head"], r["T"], V))
        cells += [(r, f) for f in FILTERS if f in r["ms"] and kept.get(f, limit + 1) <= limit]
    return cells


def summary(meta: dict) -> list[str]:
    """The worst cell per batch range beside the typical head's, per shape; "kept<=256": the
    cells whose filter keeps at most 256 tokens of the row."""
    out = []
    for res in meta["shapes"]:
        rows = res["rows"]
        parts = []
        for name, pick in (("B<=64", lambda r: r["B"] <= 64), ("B=256", lambda r: r["B"] == 256)):
            w_ = worst(rows, pick)
            if w_:
                ratio, r, f = w_
                parts.append(f"worst {name}: {ratio:.3f} x plain ({f}, {r['head']}, T={r['T']}, "
                             f"B={r['B']})")
        for name, lo, hi in (("B<=64", 0, 64), ("B=256", 65, 1 << 30)):
            cells = [(r["ms"][f] / r["ms"]["plain"], r, f) for r, f in small_cells(rows, res["V"])
                     if lo <= r["B"] <= hi]
            if cells:
                ratio, r, f = max(cells, key=lambda c: c[0])
                parts.append(f"worst kept<=256 {name}: {ratio:.3f} x plain ({f}, {r['head']}, "
                             f"T={r['T']}, B={r['B']})")
        typ = worst(rows, lambda r: (r["head"], r["T"]) == TYPICAL)
        if typ:
            parts.append(f"typical ({TYPICAL[0]}, T=1) worst {typ[0]:.3f} x plain")
        beat = [r["ms"]["sort_p0.9"] / r["ms"]["p0.9"] for r in rows if r["B"] >= 16]
        if beat:
            parts.append(f"sort_p0.9 / p0.9 at B>=16: min {min(beat):.2f}")
        fi = [(r["ms"][f"fi_{f}"] / r["ms"][f], r, f) for r in rows for f in FI_FILTERS
              if f"fi_{f}" in r["ms"]]
        if fi:
            ratio, r, f = min(fi, key=lambda c: c[0])
            parts.append(f"FlashInfer / tpsample, same filters: min {ratio:.2f} ({f}, "
                         f"{r['head']}, T={r['T']}, B={r['B']})")
        out.append(f"D={res['D']} V={res['V']}: " + "; ".join(parts))
    return out


def markdown(meta: dict, doc: str, label: str) -> str:
    lines = [f"`{meta['command']}` — {meta['device']}, torch {meta['torch']}, Triton "
             f"{meta['triton']}, {meta['date']}; median ms of the plain call, cost of each "
             "filter set as a ratio to it (same run); H = entropy (nats) of a row at T, n90 = "
             "tokens in its 0.9 nucleus; sort = matmul + torch sort + top-p 0.9 + multinomial; "
             "k50/2p0.9 = top-p 0.9 on every row and top-k 50 on every other row (a per-row "
             "tensor; timed with TPSAMPLE_CHECK_TENSORS=0, as its range check synchronises); "
             "p0.9+t5 = top-p 0.9 with the top 5 log-probs.",
             ""] + [f"- {s}" for s in summary(meta)] + [""]
    names = list(FILTERS)
    for res in meta["shapes"]:
        lines += [f"**D={res['D']}, V={res['V']}**", "",
                  "| head | T | B | H | n90 | plain | mm / plain | sort / plain | "
                  + " | ".join(names) + " |", "|---" * (8 + len(names)) + "|"]
        for r in res["rows"]:
            ms = r["ms"]
            lines.append(f"| {r['head']} | {r['T']} | {r['B']} | "
                         f"{r['entropy']:.2f} | {r['n90']} | " if "entropy" in r else
                         f"| {r['head']} | {r['T']} | {r['B']} | – | – | ")
            lines[-1] += (f"{ms['plain']:.3f} | {ms['mm'] / ms['plain']:.2f} | "
                          f"{ms['sort_p0.9'] / ms['plain']:.2f} | "
                          + " | ".join(f"{ms[n] / ms['plain']:.2f}" if n in ms else "–"
                                       for n in names) + " |")
        lines += fi_table(res)
        img = plot(res, doc, label)
        if img:
            lines += ["", f"![{label} D={res['D']} V={res['V']}]({img})"]
        lines.append("")
    return "\n".join(lines)


def fi_table(res: dict) -> list[str]:
    """matmul + FlashInfer's kernel over tpsample's call with the same filters, per cell (> 1:
    tpsample is faster); [] where the run had no FlashInfer."""
    rows = [r for r in res["rows"] if any(f"fi_{f}" in r["ms"] for f in FI_FILTERS)]
    if not rows:
        return []
    lines = ["", f"FlashInfer (matmul + its sampling kernel, fi_<set>) / tpsample, the same "
             f"filter set, D={res['D']}:", "",
             "| head | T | B | " + " | ".join(FI_FILTERS) + " |", "|---" * (3 + len(FI_FILTERS)) + "|"]
    for r in rows:
        ms = r["ms"]
        lines.append(f"| {r['head']} | {r['T']} | {r['B']} | " + " | ".join(
            f"{ms[f'fi_{f}'] / ms[f]:.2f}" if f"fi_{f}" in ms else "–" for f in FI_FILTERS) + " |")
    return lines


def plot(res: dict, doc: str, label: str) -> str | None:
    """cost / plain against entropy, one line per filter set (T = 1, the largest B <= 64);
    beside it, where the run had FlashInfer, matmul + FlashInfer's kernel on the same axes."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in res["rows"] if "entropy" in r and r["T"] == 1.0 and r["B"] <= 64]
    if not rows:
        return None
    B = max(r["B"] for r in rows)
    rows = sorted((r for r in rows if r["B"] == B), key=lambda r: r["entropy"])
    fi = [f for f in FI_FILTERS if all(f"fi_{f}" in r["ms"] for r in rows)]
    fig, axes = plt.subplots(1, 2 if fi else 1, figsize=(12 if fi else 7, 4), sharey=True,
                             squeeze=False)
    panels = [(axes[0][0], list(FILTERS), "", f"tpsample: D={res['D']} V={res['V']} B={B} T=1")]
    if fi:
        panels.append((axes[0][1], fi, "fi_", "matmul + FlashInfer, the same filter sets"))
    colors = {f: plt.get_cmap("tab20")(i) for i, f in enumerate(FILTERS)}  # (> 10 sets)
    for ax, names, prefix, title in panels:
        for f in (f for f in names if all(prefix + f in r["ms"] for r in rows)):
            ax.plot([r["entropy"] for r in rows],
                    [r["ms"][prefix + f] / r["ms"]["plain"] for r in rows], marker="o",
                    color=colors[f], label=prefix + f)
        ax.axhline(1.3, color="grey", ls="--", lw=0.8)
        ax.set_xlabel("entropy of a row (nats)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7, ncol=2)
    axes[0][0].set_ylabel("call / tpsample's plain call")
    fig.suptitle(label, fontsize=10)
    return save_beside_doc(fig, doc, f"{label.lower().replace(' ', '_')}_{res['D']}x{res['V']}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m tpsample.launch.sweep",
                                description=__doc__.splitlines()[0])
    p.add_argument("--shapes", help="DxV,... (default 4096x151936,8192x128256; CPU 64x4096)")
    p.add_argument("--batches", help="B,... (default 1,16,64,256; CPU 1,4)")
    p.add_argument("--temps", default="0.7,1.0,1.5")
    p.add_argument("--heads", default=",".join(list(HEADS) + ["mixed"]),
                   help="a subset of " + ",".join(list(HEADS) + ["mixed"]))
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--out", default="bench_out")
    p.add_argument("--doc", help="markdown file whose section --label this run rewrites")
    p.add_argument("--label", default="sweep")
    p.add_argument("--report", metavar="JSON[,JSON]",
                   help="render sweep.json files (several: one report), no run")
    p.add_argument("--cpu", action="store_true", help="CPU tensors even where CUDA exists")
    p.add_argument("--warm", type=int, default=None,
                   help="compile in this many processes first (default: 8 on CUDA, 0 on CPU)")
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    a.cuda = torch.cuda.is_available() and not a.cpu
    shapes = a.shapes or ("4096x151936,8192x128256" if a.cuda else "64x4096")
    a.shapes = [tuple(int(x) for x in s.lower().split("x")) for s in shapes.split(",")]
    a.batches = [int(b) for b in (a.batches or ("1,16,64,256" if a.cuda else "1,4")).split(",")]
    a.temps = [float(t) for t in a.temps.split(",")]
    a.heads = a.heads.split(",")
    if a.warm is None:
        a.warm = min(8, os.cpu_count() or 1) if a.cuda else 0
    if not set(a.heads) <= set(HEADS) | {"mixed"}:
        p.error(f"--heads: a subset of {','.join(list(HEADS) + ['mixed'])}")
    if any(t <= 0 or not math.isfinite(t) for t in a.temps):
        p.error("--temps: positive temperatures")
    return a


def main(argv=None):
    args = parse_args(argv)
    meta = merged([json.load(open(f)) for f in args.report.split(",")]) if args.report \
        else run(args)
    render_report(args, meta, markdown, summary)


def merged(metas: list) -> dict:
    """One report of several runs' sweep.json (e.g. one per shape, when a run per shape fits
    a time limit better): their shapes in order, their commands and dates side by side."""
    meta = dict(metas[0], shapes=[s for m in metas for s in m["shapes"]])
    if len(metas) > 1:
        meta["command"] = "` and `".join(m["command"] for m in metas)
        meta["date"] = " / ".join(m["date"] for m in metas)
    return meta


if __name__ == "__main__":
    main()
