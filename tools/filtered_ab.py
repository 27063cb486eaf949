"""Same-run A/B of two installs of tpsample on filtered and plain calls (CUDA only).

    python -m tools.filtered_ab --arm old:DIR_A --arm new:DIR_B [--rounds 2] [--out ab.json]

Each arm runs in a process of its own with PYTHONPATH=DIR (a `pip install --target DIR .`
of the code to compare), the rounds alternate the arms' order; each process times, on the
benchmark's typical head (-1.6 ln(rank), a nucleus of ~27 tokens: every row certified),
the plain call and top_k 50 / top_p 0.9 / min_p 0.05 / all three at D = 4096, V = 151936
(triton.testing.do_bench medians, ms). Last, each cell's mean per arm and the ratio to the
first arm.
"""
import argparse
import json
import os
import subprocess
import sys

CELLS = {"plain": {}, "k50": dict(top_k=50), "p0.9": dict(top_p=0.9), "m0.05": dict(min_p=0.05),
         "kpm": dict(top_k=50, top_p=0.9, min_p=0.05)}


def worker(batches):
    import itertools
    import torch
    import triton
    import tpsample
    from tpsample.launch.bench import typical_head
    step = itertools.count()
    out = {}
    for B in batches:
        h, w = typical_head(4096, 151936, B, torch.bfloat16, "cuda")
        for name, kw in CELLS.items():
            fn = lambda kw=kw: tpsample.sample(h, w, seed=3, offset=next(step), **kw)  # noqa: E731
            fn()
            out[f"{name}@{B}"] = triton.testing.do_bench(fn, warmup=50, rep=200,
                                                         return_mode="median")
    print(json.dumps(out))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--arm", action="append", required=True, help="NAME:DIR")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out")
    p.add_argument("--worker", action="store_true")
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    if a.worker:
        return worker(batches)
    arms = [x.split(":", 1) for x in a.arm]
    res = {n: [] for n, _ in arms}
    for r in range(a.rounds):
        for name, path in (arms if r % 2 == 0 else arms[::-1]):
            env = dict(os.environ, PYTHONPATH=path)
            # (run as a file from /: the checkout's own tpsample/ must not shadow the install)
            o = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--arm",
                                "x:x", "--batches", a.batches], env=env, capture_output=True,
                               text=True, check=True, cwd="/")
            res[name].append(json.loads(o.stdout.strip().splitlines()[-1]))
    first = arms[0][0]
    mean = {n: {k: sum(d[k] for d in v) / len(v) for k in v[0]} for n, v in res.items()}
    print("| cell | " + " | ".join(n for n, _ in arms) + " | ratio to " + first + " |")
    print("|---" * (len(arms) + 2) + "|")
    for k in mean[first]:
        print(f"| {k} | " + " | ".join(f"{mean[n][k]:.4f}" for n, _ in arms) + " | "
              + " / ".join(f"{mean[n][k] / mean[first][k]:.3f}" for n, _ in arms[1:]) + " |")
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
