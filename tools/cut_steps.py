"""Each launch of one filtered call timed alone, and the fast path's steps under other
launch shapes (programs, warps, block): where the exact fallback's time goes.

    python -m tools.cut_steps [--D 4096 --V 151936] [--heads gauss1] [--batches 16,64,256]
        [--filter p0.9,p0.9+lp] [--out DIR]

Each launch is replayed alone in a CUDA graph after the launches before it (no host time;
its programmatic-dependent wait returns at once), so the durations add up to the call's GPU
time less the gaps between launches; the tensors are then restored (SELECT's list, COMPACT's
slots and FINAL's count grow with every timed run). Variants are timed on the captured
arguments the same way, so the final replay must give the call's tokens (checked). The
calls here take no CUDA graph and no call memo (a call served by its graph makes no launch to
capture).

--ncu: no timing; each (filter, head, batch) call runs twice to compile, then once inside
torch.cuda.profiler.start() / stop(), for Nsight Compute (its hardware counters: stall
reasons, occupancy, issue slots, which the durations above cannot show):

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats \
        --section SchedulerStats -o cut python -m tools.cut_steps --ncu --filter p0.9+lp
"""
import argparse
import json
import os

import torch
from triton.testing import do_bench, do_bench_cudagraph

import tpsample
from tpsample import replay as replay_mod
from tpsample.filters import cut_list
from tpsample.kernels import filter_cut
from tpsample.launch.sweep import hidden, row_seeds, sort_top_p, sweep_head

FILTERS = {"p0.9": dict(top_p=0.9), "m0.1": dict(min_p=0.1), "p0.95": dict(top_p=0.95),
           "p0.99": dict(top_p=0.99), "k50": dict(top_k=50),
           "m0.02": dict(min_p=0.02), "p0.9+lp": dict(top_p=0.9, return_logprobs=True),
           "pm+lp": dict(top_p=0.9, min_p=0.05, return_logprobs=True)}


def tokens(out):
    """The tokens of a call's output (a tensor, or an output with log-probs)."""
    return getattr(out, "tokens", out)


def capture(fn):
    """fn's result and [(kernel, grid, args, constexprs, options)] of the launches it makes."""
    log = []
    orig = replay_mod.run_kernel

    def spy(k, grid, args, const, opts):
        log.append((k, grid, args, dict(const), dict(opts)))
        return orig(k, grid, args, const, opts)
    replay_mod.run_kernel = spy  # (every launch: run_named calls it)
    enabled, replay_mod.ENABLED = replay_mod.ENABLED, False  # launch, don't replay a list
    try:
        out = fn()
    finally:
        replay_mod.run_kernel = orig
        replay_mod.ENABLED = enabled
    torch.cuda.synchronize()
    return out, log


def replay(log, upto):
    """The call's launches before position upto, in order (the state a launch starts from)."""
    for k, grid, args, const, opts in log[:upto]:
        k[grid](*args, **const, **opts)


def state(log):
    """Every CUDA tensor the call's launches take, for timing a launch without keeping what
    its repeated runs leave (SELECT's list, COMPACT's slots and FINAL's count grow with
    each run)."""
    seen = {}
    for _, _, args, _, _ in log:
        for a in args:
            if isinstance(a, torch.Tensor) and a.is_cuda:
                seen.setdefault(id(a), a)
    return list(seen.values())


def timed_alone(log, i, fn, rep):
    """fn (a launch of log[i] or a variant of it) timed in a CUDA graph after the launches
    before it, the tensors then restored to what those left."""
    replay(log, i)
    # (do_bench_cudagraph captures and replays on a stream of its own, which does not wait
    # for the launches just made on this one: without the sync the timed launch can read a
    # cut list SELECT is still writing, an illegal address)
    torch.cuda.synchronize()
    tensors = state(log)
    saved = [t.clone() for t in tensors]
    t = do_bench_cudagraph(fn, rep=rep)
    for x, y in zip(tensors, saved):
        x.copy_(y)
    return t


def name(k, const):
    n = getattr(getattr(k, "fn", k), "__name__", str(k))
    return f"{n}[{const['STEP']}]" if "STEP" in const else n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--D", type=int, default=4096)
    ap.add_argument("--V", type=int, default=151936)
    ap.add_argument("--heads", default="gauss1")
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--filter", default="p0.9", help=",".join(FILTERS))
    ap.add_argument("--variants", default="1,2,4:4,8:1024,2048")
    ap.add_argument("--out", default=".")
    ap.add_argument("--early-from-b", type=int, help="launchers.EARLY_FROM_B for this run")
    ap.add_argument("--ncu", action="store_true", help="one call per cell in a profiler range")
    a = ap.parse_args()
    from tpsample import knobs
    knobs.GRAPHS = knobs.GRAPHS_FILTERED = knobs.MEMO = False  # (launches to capture)
    if a.early_from_b is not None:
        from tpsample import launchers
        launchers.EARLY_FROM_B = a.early_from_b
    mults, warps, blocks = ([float(x) if i == 0 else int(x) for x in s.split(",")]
                           for i, s in enumerate(a.variants.split(":")))
    w, U = sweep_head(a.D, a.V, torch.bfloat16, "cuda")
    names = list(replay_mod._signature(filter_cut.cut_step_kernel)[0])
    res = []
    for filt, head in ((f, hd) for f in a.filter.split(",") for hd in a.heads.split(",")):
        kw = FILTERS[filt]
        for B in map(int, a.batches.split(",")):
            h = hidden(U, head, B, torch.bfloat16)
            seed = row_seeds(B, h.device)
            if a.ncu:
                for _ in range(2):
                    tpsample.sample(h, w, seed=seed, **kw)
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
                tpsample.sample(h, w, seed=seed, **kw)
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
                continue
            row = {"head": head, "B": B, "filter": filt}
            row["plain"] = do_bench(lambda: tpsample.sample(h, w, seed=seed), rep=100)
            row["call"] = do_bench(lambda: tpsample.sample(h, w, seed=seed, **kw), rep=100)
            row["sort"] = do_bench(lambda: sort_top_p(h, w, 1.0), rep=100)
            ref = tokens(tpsample.sample(h, w, seed=seed, **kw)).clone()
            out, log = capture(lambda: tpsample.sample(h, w, seed=seed, **kw))
            steps = []
            for i, (k, grid, args, const, opts) in enumerate(log):
                t = timed_alone(log, i, lambda: k[grid](*args, **const, **opts), 20)
                steps.append({"kernel": name(k, const), "grid": list(grid), "us": t * 1e3})
            row["launches"] = steps
            # variants of the fast path's steps (cut_step_kernel)
            var = {}
            for i, (k, grid, args, const, opts) in enumerate(log):
                if "STEP" not in const:
                    continue
                for m in mults:
                    for nw in warps:
                        for blk in blocks:
                            c = dict(const, BLOCK=blk, SUB=min(blk, const["SUB"]))
                            o = dict(opts, num_warps=nw)
                            g = (max(1, round(grid[0] * m)),)
                            try:
                                t = timed_alone(log, i, lambda: k[g](*args, **c, **o), 10)
                            except Exception as e:  # noqa: BLE001 - report, go on
                                t = float("nan")
                                print("variant failed", name(k, const), m, nw, blk, repr(e)[:200])
                            var.setdefault(f"x{m} w{nw} b{blk}", {})[name(k, const)] = t * 1e3
            # the last variant ran every step in order: the tokens must be the call's
            replay(log, len(log))
            torch.cuda.synchronize()
            row["same_tokens"] = bool(torch.equal(tokens(out), ref))
            for k, grid, args, const, opts in log:  # the brackets FINISH sorted (listed rows)
                if const.get("STEP") == filter_cut.FINISH.value:
                    lst = cut_list(args[names.index("win_ptr")], args[names.index("B")])
                    rows = lst[1:1 + int(lst[0])].long()
                    n = args[names.index("keys_ptr")][rows, filter_cut.CAP.value].float()
                    if n.numel():
                        row["bracket"] = [float(n.min()), float(n.median()), float(n.max())]
                        print(f"   bracket sizes min / median / max {row['bracket']}",
                              flush=True)
            row["variants"] = var
            res.append(row)
            tot = sum(s["us"] for s in steps)
            print(f"{filt} {head} B={B}: plain {row['plain']*1e3:.1f} call {row['call']*1e3:.1f} "
                  f"sort {row['sort']*1e3:.1f} us; launches sum {tot:.1f}; same tokens {row['same_tokens']}", flush=True)
            for s in steps:
                print(f"   {s['kernel']:32s} grid {s['grid'][0]:6d} {s['us']:8.1f}", flush=True)
            for v, d in var.items():
                print(f"   {v:14s} " + " ".join(f"{n.split('[')[1][:-1]}:{t:6.1f}"
                                               for n, t in d.items())
                      + f"  sum {sum(d.values()):7.1f}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "cut_steps.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
