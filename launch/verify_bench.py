"""Speculative-draft verification: tpsample.verify_drafts against the plain fused call on the
same rows and against matmul + softmax + a torch rejection sampler.

    python -m tpsample.launch.verify_bench [--shapes 4096x151936,8192x128256]
        [--batches 1,8,32] [--drafts 1,4,7] [--warm 8] [--out DIR]
        [--doc docs/performance.md --label NAME]

Per shape D x V, B requests and S drafts (bf16 h [B, S + 1, D] and W [V, D], random), the
same run times (median ms, do_bench on CUDA):

    plain         tpsample.sample on the B·(S + 1) rows (what one-hot verification costs at best)
    onehot        tpsample.verify_drafts, one-hot drafts
    probs         tpsample.verify_drafts with draft_probs [B, S, V] (the rows' logits from one
                  matmul, not fused)
    mm            h @ W.T on the B·(S + 1) rows alone
    torch_onehot  matmul, fp32 softmax, then a batched rejection sampler in torch (as vLLM's:
                  accept u < p(x), residual p without x renormalised, sampled as argmax(r / E)
                  with E ~ Exp(1), bonus likewise; no host synchronisation)
    torch_probs   the same with the draft distributions (u·q(x) < p(x), max(0, p - q))
    fi_onehot, fi_probs  matmul, fp32 softmax, FlashInfer's chain_speculative_sampling (one-hot
                  drafts as one-hot distributions), where `import flashinfer.sampling` works

verify_drafts runs with its checks of tensor contents off (TPSAMPLE_CHECK_TENSORS=0: they cost
one host synchronisation per call, which the other variants do not pay). --warm N first
compiles the plain call at every B·(S + 1) in N processes (launch/sweep.py's warm-up). Writes
OUT/verify.json after every cell; the summary line gives onehot / plain (worst) and torch /
tpsample at B·(S + 1) >= 32. Without CUDA: D=64 V=1000, B=1,4, S=1,2 (indicative).

Under torchrun (WORLD_SIZE set) each rank holds a vocabulary shard of W and times
VocabParallelSampler.verify_drafts (onehot, probs) against its local matmul on the same rows
(mm_local), eager with the ranks aligned by an all-reduce before each call and a host sync
after it, the maximum over ranks; bound = 1.3 × mm_local + 30 µs. On GPUs also onehot_graph:
the one-hot call captured in a CUDA graph, its replay timed the same way. Writes
OUT/verify_tp<N>.json (rank 0); `--report` renders either kind.

    torchrun --nproc-per-node 4 -m tpsample.launch.verify_bench [--shapes ...] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import torch
import torch.distributed as dist

import tpsample
from tpsample import knobs

from . import bench
from .bench import DTYPES, log, render_report, run_meta, save_beside_doc, time_fn
from .sweep import warm


def exp_race(probs, gen):
    """One index per row of probs [..., V] (unnormalised is fine): argmax(probs / E),
    E ~ Exp(1), as vLLM's samplers draw; torch.multinomial would check its input with two
    host synchronisations per call."""
    return (probs / torch.empty_like(probs).exponential_(generator=gen)).argmax(-1)


def torch_verify(h, w, draft, q, gen):
    """matmul + softmax + a batched rejection sampler in torch (T = 1), all on the device
    and without a host synchronisation: tokens [B, S + 1]."""
    B, S1, D = h.shape
    S = S1 - 1
    p = torch.softmax((h.reshape(-1, D) @ w.T).float(), -1).view(B, S1, -1)
    pd = p[:, :S]
    px = pd.gather(-1, draft[..., None])[..., 0]
    u = torch.rand(B, S, device=h.device, generator=gen)
    if q is None:  # one-hot drafts: accept u < p(x); the residual is p without x
        acc = torch.cumprod((u < px).long(), 1).sum(1)
        resid = pd.scatter(-1, draft[..., None], 0.0)
    else:
        qx = q.gather(-1, draft[..., None])[..., 0]
        acc = torch.cumprod((u * qx < px).long(), 1).sum(1)
        resid = (pd - q).clamp(min=0)
    resid = resid / resid.sum(-1, keepdim=True).clamp(min=1e-30)
    resid_tok = exp_race(resid, gen)  # [B, S]
    bonus = exp_race(p[:, S], gen)  # [B]
    pos = torch.arange(S1, device=h.device)[None, :]
    emitted = torch.where(acc < S, resid_tok.gather(1, acc.clamp(max=S - 1)[:, None])[:, 0],
                          bonus)
    tokens = torch.where(pos < acc[:, None], torch.cat([draft, bonus[:, None]], 1), -1)
    return torch.where(pos == acc[:, None], emitted[:, None], tokens)


def unchecked(fn):
    """fn with tpsample's checks of tensor contents off (TPSAMPLE_CHECK_TENSORS=0):
    verify_drafts checks the drafts with one host synchronisation per call, which do_bench
    would time as an idle GPU beside the plain call and the baselines, which check nothing."""
    def call():
        with knobs.overridden(CHECK_TENSORS=False):
            return fn()
    return call


VARIANTS = ("plain", "onehot", "probs", "mm", "torch_onehot", "torch_probs", "fi_onehot",
            "fi_probs")


def flashinfer_variants(h, w, draft, q) -> dict:
    """matmul + fp32 softmax + FlashInfer's chain_speculative_sampling (draft distributions;
    one-hot drafts as materialised one-hot distributions), where `import flashinfer.sampling`
    works (tools/flashinfer_carry.sh); {} otherwise."""
    if not h.is_cuda:
        return {}
    try:
        import flashinfer.sampling as fs
    except Exception as e:  # noqa: BLE001 - the baseline is optional
        log(f"no FlashInfer baseline: {type(e).__name__}: {e}")
        return {}
    B, S1, D = h.shape
    rows = h.reshape(-1, D)
    one_hot = torch.zeros_like(q).scatter_(-1, draft[..., None], 1.0)
    ids = draft.int()

    def run(qq):
        p = torch.softmax((rows @ w.T).float(), -1).view(B, S1, -1)
        return fs.chain_speculative_sampling(qq, ids, p)
    return {"fi_onehot": lambda: run(one_hot), "fi_probs": lambda: run(q)}


def variants(h, w, draft, q, gen) -> dict:
    B, S1, D = h.shape
    rows = h.reshape(-1, D)
    step = iter(range(1 << 40))
    return {
        "plain": lambda: tpsample.sample(rows, w, seed=1, offset=next(step)),
        "onehot": unchecked(lambda: tpsample.verify_drafts(h, w, draft, seed=1,
                                                           offset=next(step))),
        "probs": unchecked(lambda: tpsample.verify_drafts(h, w, draft, draft_probs=q, seed=1,
                                                          offset=next(step))),
        "mm": lambda: rows @ w.T,
        "torch_onehot": lambda: torch_verify(h, w, draft, None, gen),
        "torch_probs": lambda: torch_verify(h, w, draft, q, gen),
        **flashinfer_variants(h, w, draft, q),
    }


def run(args) -> dict:
    device = torch.device("cuda" if args.cuda else "cpu")
    dtype = DTYPES[args.dtype]
    meta = dict(run_meta(args, args.cuda), shapes=[])
    meta["command"] = ("python -m tpsample.launch.verify_bench "
                       + " ".join(map(shlex.quote, args.argv)))
    os.makedirs(args.out, exist_ok=True)
    warm(args, [(D, V, R, "plain") for D, V in args.shapes
                for R in sorted({B * (S + 1) for B in args.batches for S in args.drafts})])
    gen = torch.Generator(device=device).manual_seed(0)
    for D, V in args.shapes:
        g = torch.Generator(device=device).manual_seed(1)
        w = (torch.randn(V, D, device=device, generator=g) / D ** 0.5).to(dtype)
        rows: list = []
        meta["shapes"].append({"D": D, "V": V, "rows": rows})
        for B in args.batches:
            for S in args.drafts:
                h = torch.randn(B, S + 1, D, device=device, generator=g).to(dtype)
                draft = torch.randint(0, V, (B, S), device=device, generator=g)
                q = torch.softmax(torch.randn(B, S, V, device=device, generator=g), -1)
                ms = {n: time_fn(fn, args.cuda) for n, fn in variants(h, w, draft, q, gen).items()}
                rows.append(dict(B=B, S=S, rows=B * (S + 1), ms=ms))
                log(f"[D={D} V={V} B={B} S={S}] " + " ".join(f"{k}={v:.3f}" for k, v in ms.items()))
                with open(os.path.join(args.out, "verify.json"), "w") as f:
                    json.dump(meta, f, indent=1)
        del w
    return meta


def run_tp(args) -> dict | None:
    """verify_drafts through VocabParallelSampler on this rank's shard against the local
    matmul (module docstring); rank 0 returns the run's results, the others None."""
    dev = bench.init_dist(args.cuda)
    rank, world = dist.get_rank(), dist.get_world_size()
    meta = dict(run_meta(args, args.cuda), world=world, shapes=[])
    meta["command"] = (f"torchrun --nproc-per-node {world} -m tpsample.launch.verify_bench "
                       + " ".join(map(shlex.quote, args.argv)))
    max_rows = max(B * (S + 1) for B in args.batches for S in args.drafts)
    for D, V in args.shapes:
        w = bench.make_shard(D, V, rank, world, dev).to(DTYPES[args.dtype])
        sampler = tpsample.VocabParallelSampler(
            w, vocab_size=V, max_batch=max_rows, check_inputs=False, logprobs=False,
            backend="auto" if args.cuda else "torch")
        rows: list = []
        meta["shapes"].append({"D": D, "V": V, "rows": rows})
        for B in args.batches:
            for S in args.drafts:
                g = torch.Generator(device=dev).manual_seed(B * 100 + S)  # the same on every rank
                h = torch.randn(B, S + 1, D, device=dev, generator=g).to(w.dtype)
                draft = torch.randint(0, V, (B, S), device=dev, generator=g)
                q = torch.softmax(torch.randn(B, S, V, device=dev, generator=g), -1)
                flat = h.reshape(-1, D)
                step = iter(range(1 << 40))
                fns = {"mm_local": lambda: flat @ w.T,
                       "onehot": unchecked(lambda: sampler.verify_drafts(
                           h, draft, seed=1, offset=next(step))),
                       "probs": unchecked(lambda: sampler.verify_drafts(
                           h, draft, draft_probs=q, seed=1, offset=next(step)))}
                ms = {n: bench.time_calls(fn, dev, args.iters, align=args.cuda)
                      for n, fn in fns.items()}
                if args.cuda:  # one-hot verification captured as a decode step would be
                    offsets = torch.zeros(B, dtype=torch.int64, device=dev)
                    graph, _ = bench.capture(lambda: sampler.verify_drafts(
                        h, draft, seed=1, offset=offsets), dev)
                    if graph is not None:
                        ms["onehot_graph"] = bench.time_calls(graph.replay, dev, args.iters,
                                                              align=True)
                    del graph
                rows.append(dict(B=B, S=S, rows=B * (S + 1), ms=ms,
                                 bound=1.3 * ms["mm_local"] + 0.030))
                if rank == 0:
                    log(f"[tp{world} D={D} V={V} B={B} S={S}] "
                        + " ".join(f"{k}={v:.3f}" for k, v in ms.items()))
                    os.makedirs(args.out, exist_ok=True)
                    with open(os.path.join(args.out, f"verify_tp{world}.json"), "w") as f:
                        json.dump(meta, f, indent=1)
        w = sampler = None  # (freed before the next shape's shard)
    dist.barrier()
    dist.destroy_process_group()
    return meta if rank == 0 else None


def tp_summary(meta: dict) -> list[str]:
    out = []
    for res in meta["shapes"]:
        rows = res["rows"]
        if rows:
            worst = {n: max(r["ms"][n] / r["bound"] for r in rows) for n in ("onehot", "probs")}
            graphs = [r["ms"]["onehot_graph"] / r["bound"] for r in rows
                      if "onehot_graph" in r["ms"]]
            out.append(f"TP{meta['world']} D={res['D']} V={res['V']}: worst / (1.3 x mm_local + "
                       f"30 us): onehot {worst['onehot']:.2f}, probs {worst['probs']:.2f}"
                       + (f", onehot graph replay {max(graphs):.2f}" if graphs else ""))
    return out


def tp_markdown(meta: dict, doc: str, label: str) -> str:
    lines = [f"`{meta['command']}` — {meta['device']}, torch {meta['torch']}, Triton "
             f"{meta['triton']}, {meta['date']}; median ms per eager call with a host sync, "
             "the ranks aligned before each call, maximum over ranks; bound = 1.3 × mm_local "
             "+ 30 µs; verify_drafts without its host-synchronising input checks; onehot graph: "
             "one-hot verification captured in a CUDA graph, its replay.", ""]
    lines += [f"- {s}" for s in tp_summary(meta)] + [""]
    for res in meta["shapes"]:
        lines += [f"**TP{meta['world']}, D={res['D']}, V={res['V']}**", "",
                  "| B | S | rows | mm_local | onehot | probs | bound | onehot / bound "
                  "| probs / bound | onehot graph | onehot graph / bound |", "|---" * 11 + "|"]
        for r in res["rows"]:
            ms = r["ms"]
            g = ms.get("onehot_graph")
            cells = [f"{g:.3f}", f"{g / r['bound']:.2f}"] if g is not None else ["–", "–"]
            lines.append(f"| {r['B']} | {r['S']} | {r['rows']} | {ms['mm_local']:.3f} | "
                         f"{ms['onehot']:.3f} | {ms['probs']:.3f} | {r['bound']:.3f} | "
                         f"{ms['onehot'] / r['bound']:.2f} | {ms['probs'] / r['bound']:.2f} | "
                         + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def summary(meta: dict) -> list[str]:
    if "world" in meta:
        return tp_summary(meta)
    out = []
    for res in meta["shapes"]:
        rows = res["rows"]
        if not rows:
            continue
        worst = max(rows, key=lambda r: r["ms"]["onehot"] / r["ms"]["plain"])
        big = [r for r in rows if r["rows"] >= 32]
        part = (f"D={res['D']} V={res['V']}: onehot / plain worst "
                f"{worst['ms']['onehot'] / worst['ms']['plain']:.3f} (B={worst['B']}, "
                f"S={worst['S']})")
        if big:
            part += (f"; torch_onehot / onehot at B·(S+1) >= 32: min "
                     f"{min(r['ms']['torch_onehot'] / r['ms']['onehot'] for r in big):.2f}")
        probs = [r["ms"]["torch_probs"] / r["ms"]["probs"] for r in rows]
        part += f"; torch_probs / probs: {min(probs):.2f} - {max(probs):.2f}"
        out.append(part)
    return out


def markdown(meta: dict, doc: str, label: str) -> str:
    if "world" in meta:
        return tp_markdown(meta, doc, label)
    lines = [f"`{meta['command']}` — {meta['device']}, torch {meta['torch']}, Triton "
             f"{meta['triton']}, {meta['date']}; median ms of tpsample.sample on the B·(S + 1) "
             "rows (plain), every other column as a ratio to it (same run); verify_drafts "
             "without its host-synchronising input checks (TPSAMPLE_CHECK_TENSORS=0).", ""]
    lines += [f"- {s}" for s in summary(meta)] + [""]
    for res in meta["shapes"]:
        names = [n for n in VARIANTS if n != "plain" and res["rows"]
                 and all(n in r["ms"] for r in res["rows"])]
        lines += [f"**D={res['D']}, V={res['V']}**", "",
                  "| B | S | rows | plain | " + " | ".join(names) + " |",
                  "|---" * (4 + len(names)) + "|"]
        for r in res["rows"]:
            ms = r["ms"]
            lines.append(f"| {r['B']} | {r['S']} | {r['rows']} | {ms['plain']:.3f} | "
                         + " | ".join(f"{ms[n] / ms['plain']:.2f}" for n in names) + " |")
        img = plot(res, doc, label)
        if img:
            lines += ["", f"![{label} D={res['D']} V={res['V']}]({img})"]
        lines.append("")
    return "\n".join(lines)


def plot(res: dict, doc: str, label: str) -> str | None:
    """Each variant's time / the plain call's against the rows B·(S + 1)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = sorted(res["rows"], key=lambda r: r["rows"])
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for n in (n for n in VARIANTS if n != "plain" and all(n in r["ms"] for r in rows)):
        ax.plot([r["rows"] for r in rows], [r["ms"][n] / r["ms"]["plain"] for r in rows],
                marker="o", label=n)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows B·(S + 1)")
    ax.set_ylabel("time / tpsample.sample on the same rows")
    ax.set_title(f"{label}: D={res['D']} V={res['V']}")
    ax.legend(fontsize=7)
    return save_beside_doc(fig, doc, f"{label.lower().replace(' ', '_')}_{res['D']}x{res['V']}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m tpsample.launch.verify_bench",
                                description=__doc__.splitlines()[0])
    p.add_argument("--shapes", help="DxV,... (default 4096x151936,8192x128256; CPU 64x1000)")
    p.add_argument("--batches", help="B,... (default 1,8,32; CPU 1,4)")
    p.add_argument("--drafts", help="S,... (default 1,4,7; CPU 1,2)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--out", default="bench_out")
    p.add_argument("--doc", help="markdown file whose section --label this run rewrites")
    p.add_argument("--label", default="verify")
    p.add_argument("--report", metavar="JSON", help="render a verify.json, no run")
    p.add_argument("--cpu", action="store_true", help="CPU tensors even where CUDA exists")
    p.add_argument("--iters", type=int, default=50, help="timed calls per cell under torchrun")
    p.add_argument("--warm", type=int, default=None,
                   help="compile in this many processes first (default: 8 on CUDA, 0 on CPU)")
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    a.cuda = torch.cuda.is_available() and not a.cpu
    if a.warm is None:
        a.warm = min(8, os.cpu_count() or 1) if a.cuda else 0
    shapes = a.shapes or ("4096x151936,8192x128256" if a.cuda else "64x1000")
    a.shapes = [tuple(int(x) for x in s.lower().split("x")) for s in shapes.split(",")]
    a.batches = [int(b) for b in (a.batches or ("1,8,32" if a.cuda else "1,4")).split(",")]
    a.drafts = [int(s) for s in (a.drafts or ("1,4,7" if a.cuda else "1,2")).split(",")]
    if any(s < 1 for s in a.drafts):
        p.error("--drafts: S >= 1")
    return a


def main(argv=None):
    args = parse_args(argv)
    if args.report:
        meta = json.load(open(args.report))
    elif "WORLD_SIZE" in os.environ:
        meta = run_tp(args)
        if meta is None:  # (not rank 0)
            return
    else:
        meta = run(args)
    render_report(args, meta, markdown, summary)


if __name__ == "__main__":
    main()
