"""Same-run A/B of two installs of tpsample on filtered and plain calls (CUDA only).

    python -m tools.filtered_ab --arm old:DIR_A --arm new:DIR_B[:VAR=VALUE,...] [--rounds 2]
        [--heads typical,gauss1,zipf1.3] [--batches 1,16,64,256] [--cells plain,p0.9+lp]
        [--budget SECONDS] [--out ab.json]

Each arm runs in a process of its own with PYTHONPATH=DIR (a `pip install --target DIR .`
of the code to compare, into a fresh DIR: pip keeps a package already there unless given
--upgrade), with the arm's VAR=VALUE in its environment (e.g. two settings of a knob on one
install), the rounds alternate the arms' order; each process times, per
head and batch, the plain call and top_k 50 / top_p 0.9, 0.95, 0.99 / min_p 0.05 / min_p 0.1 / all
three / top_p 0.9 with log-probs / top_p 0.9 + min_p 0.05 with log-probs at D = 4096,
V = 151936 (triton.testing.do_bench medians, ms). Heads: the benchmark's typical head
(-1.6 ln(rank), a nucleus of ~27 tokens: every row certified) and the sweep's
(tpsample.launch.sweep: gauss1 and zipf1.3 are flat, every top-p row falls back). Last,
each cell's mean per arm, the ratio to the first arm, and whether every arm drew the same
tokens (a call at offset 0 per cell, one seed per row). Run it from the checkout with the
checkout on PYTHONPATH where PYTHONSAFEPATH is set (`python -m` then does not add the
working directory).

A fresh GPU machine compiles every kernel of every cell in each arm's first process (about
two minutes an arm for all eight cells at D = 4096): `--cells` keeps the cells a change
touches, `--budget` starts no round that would end past it (the first always runs), and
each arm's result is printed as a line and written to --out as it lands, with the table
after every round, so a run cut short keeps what it measured.
"""
import argparse
import json
import os
import subprocess
import sys
import time

CELLS = {"plain": {}, "k50": dict(top_k=50), "p0.9": dict(top_p=0.9), "p0.95": dict(top_p=0.95),
         "p0.99": dict(top_p=0.99), "m0.05": dict(min_p=0.05),
         "m0.1": dict(min_p=0.1), "kpm": dict(top_k=50, top_p=0.9, min_p=0.05),
         "p0.9+lp": dict(top_p=0.9, return_logprobs=True),
         "pm+lp": dict(top_p=0.9, min_p=0.05, return_logprobs=True)}


def worker(batches, heads, cells):
    import itertools
    import torch
    import triton
    import tpsample
    from tpsample.launch.bench import typical_head
    from tpsample.launch.sweep import hidden, sweep_head
    step = itertools.count()
    out, tokens = {}, {}
    sweep = None
    for head, B in itertools.product(heads, batches):
        if head == "typical":
            h, w = typical_head(4096, 151936, B, torch.bfloat16, "cuda")
        else:
            if sweep is None:
                sweep = sweep_head(4096, 151936, torch.bfloat16, "cuda")
            w, U = sweep
            h = hidden(U, head, B, torch.bfloat16)
        # a seed per row (as the sweep's row_seeds, written here: an arm may predate it): with
        # one int seed every row draws the same noise, and a head's rows the same token
        seed = torch.arange(B, device="cuda") * 7919 + 3
        for name, kw in ((n, CELLS[n]) for n in cells):
            fn = lambda kw=kw: tpsample.sample(h, w, seed=seed, offset=next(step), **kw)  # noqa: E731
            fn()
            cell = f"{name}@{head}@{B}"
            out[cell] = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
            got = tpsample.sample(h, w, seed=seed, offset=0, **kw)
            tokens[cell] = (got.tokens if kw.get("return_logprobs") else got).view(-1).tolist()
    print(json.dumps({"ms": out, "tokens": tokens}))


def parse_arms(specs: list) -> tuple[list, dict]:
    """--arm values NAME:DIR[:VAR=VALUE,...] -> ([[name, dir], ...], {name: {VAR: VALUE}})."""
    arms, env = [], {}
    for spec in specs:
        name, path, *extra = spec.split(":", 2)
        arms.append([name, path])
        env[name] = dict(kv.split("=", 1) for kv in extra[0].split(",")) if extra else {}
    return arms, env


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--arm", action="append", required=True,
                   help="NAME:DIR[:VAR=VALUE,...] (environment variables of that arm's process)")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--heads", default="typical", help="typical and / or tpsample.launch.sweep "
                   "heads (gauss1, zipf1.3, ...), comma-separated")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cells", default=",".join(CELLS),
                   help="comma-separated, of " + ", ".join(CELLS))
    p.add_argument("--budget", type=float, help="seconds: no round starts that would end past it")
    p.add_argument("--out")
    p.add_argument("--worker", action="store_true")
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    cells = a.cells.split(",")
    unknown = [c for c in cells if c not in CELLS]
    if unknown:
        p.error(f"--cells: unknown {unknown}; known: {', '.join(CELLS)}")
    if a.worker:
        return worker(batches, a.heads.split(","), cells)
    arms, arm_env = parse_arms(a.arm)
    res = {n: [] for n, _ in arms}
    start = time.time()
    last = 0.0
    for r in range(a.rounds):
        if r and a.budget is not None and time.time() - start + last > a.budget:
            print(f"budget: round {r} would end past {a.budget:.0f} s; stopping", flush=True)
            break
        t_round = time.time()
        for name, path in (arms if r % 2 == 0 else arms[::-1]):
            t = time.time()
            env = dict(os.environ, PYTHONPATH=path, **arm_env[name])
            # (run as a file from /: the checkout's own tpsample/ must not shadow the install)
            o = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--arm",
                                "x:x", "--batches", a.batches, "--heads", a.heads, "--cells",
                                a.cells], env=env, capture_output=True, text=True, check=True,
                               cwd="/")
            res[name].append(json.loads(o.stdout.strip().splitlines()[-1]))
            print(f"round {r} arm {name}: {len(res[name][-1]['ms'])} cells in "
                  f"{time.time() - t:.0f} s " + json.dumps(res[name][-1]["ms"]), flush=True)
            if a.out:
                json.dump(res, open(a.out, "w"), indent=1)
        last = time.time() - t_round
        print(table(arms, res), flush=True)


def table(arms: list, res: dict) -> str:
    """Markdown: each cell's mean ms per arm, the ratios to the first arm, and whether every
    run of every arm drew the same tokens; then a line with the worst ratio and the count of
    cells whose tokens differ."""
    first = arms[0][0]
    mean = {n: {k: sum(d["ms"][k] for d in v) / len(v) for k in v[0]["ms"]}
            for n, v in res.items()}
    same = {k: all(d["tokens"][k] == res[first][0]["tokens"][k] for v in res.values() for d in v)
            for k in mean[first]}
    lines = ["| cell | " + " | ".join(n for n, _ in arms) + f" | ratio to {first} | same tokens |",
             "|---" * (len(arms) + 3) + "|"]
    for k in mean[first]:
        lines.append(f"| {k} | " + " | ".join(f"{mean[n][k]:.4f}" for n, _ in arms) + " | "
                     + " / ".join(f"{mean[n][k] / mean[first][k]:.3f}" for n, _ in arms[1:])
                     + f" | {same[k]} |")
    ratios = [(mean[n][k] / mean[first][k], k, n) for n, _ in arms[1:] for k in mean[first]]
    if ratios:
        hi, lo = max(ratios), min(ratios)
        lines.append(f"worst {hi[0]:.3f} ({hi[2]}, {hi[1]}), best {lo[0]:.3f} ({lo[2]}, "
                     f"{lo[1]}); tokens differ in {sum(not v for v in same.values())} of "
                     f"{len(same)} cells")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
