"""Where a filtered call's time goes: per-kernel GPU times of one call (torch.profiler), the
fast path's bracket sizes, and do_bench medians of plain / filtered / sort, for the sweep's
heads at one shape.

    python -m tools.cut_profile [--D 4096 --V 151936] [--heads gauss1,zipf1.0,zipf1.3]
        [--batches 1,16,64,256] [--filters p0.9,m0.1] [--out DIR]

The kernels are programmatic dependents of the one before: a kernel's duration includes its
wait for that one, so the durations overlap and add up to more than the call.
"""
import argparse
import json
import os
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

import tpsample
from tpsample import replay
from tpsample.kernels import filter_cut
from tpsample.launch.sweep import hidden, row_seeds, sort_top_p, sweep_head


def kernel_times(fn):
    """[(position in the call, kernel name, mean µs)] over five calls (profiled)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per = defaultdict(float)
    seq = [(e.name[:40], e.device_time) for e in ev]
    n = len(seq) // 5
    for i in range(5):
        for j, (name, t) in enumerate(seq[i * n:(i + 1) * n]):
            per[(j, name)] += t / 5
    return [(j, name, round(t, 1)) for (j, name), t in sorted(per.items())]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--D", type=int, default=4096)
    ap.add_argument("--V", type=int, default=151936)
    ap.add_argument("--heads", default="gauss1,zipf1.0,zipf1.3")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--filters", default="p0.9,m0.1")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    F = {"p0.9": dict(top_p=0.9), "m0.1": dict(min_p=0.1),
         "p0.95m0.05": dict(top_p=0.95, min_p=0.05)}
    w, U = sweep_head(a.D, a.V, torch.bfloat16, "cuda")
    keys_seen = []
    orig = replay.run_kernel

    def spy(k, grid, args, const, opts):
        r = orig(k, grid, args, const, opts)
        if getattr(k, "fn", None) is not None and k.fn.__name__ == "cut_step_kernel" \
                and const.get("STEP") == filter_cut.FINISH.value:
            keys_seen.append(args[16][:, filter_cut.CAP.value].clone())
        return r
    replay.run_kernel = spy  # (every launch: run_named calls it)
    res = []
    for head in a.heads.split(","):
        for B in map(int, a.batches.split(",")):
            h = hidden(U, head, B, torch.bfloat16)
            seed = row_seeds(B, h.device)
            row = {"head": head, "B": B}
            row["plain"] = do_bench(lambda: tpsample.sample(h, w, seed=seed), rep=200)
            row["sort"] = do_bench(lambda: sort_top_p(h, w, 1.0), rep=200)
            for fname in a.filters.split(","):
                kw = F[fname]
                keys_seen.clear()
                tpsample.sample(h, w, seed=seed, **kw)
                torch.cuda.synchronize()
                if keys_seen:
                    n = keys_seen[0].float()
                    row[fname + "_bracket"] = [float(n.min()), float(n.median()), float(n.max())]
                row[fname] = do_bench(lambda kw=kw: tpsample.sample(h, w, seed=seed, **kw), rep=200)
                row[fname + "_kernels"] = kernel_times(
                    lambda kw=kw: tpsample.sample(h, w, seed=seed, **kw))
            res.append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("_kernels")}), flush=True)
            for fname in a.filters.split(","):
                print("  ", fname, row[fname + "_kernels"], flush=True)
    with open(os.path.join(a.out, "cut_profile.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
