"""Same-run A/B of kernel variants that environment variables choose (CUDA only).

    python -m tools.ab --arm wide:TPSAMPLE_PHILOX_MUL=wide \\
        --arm split16:TPSAMPLE_PHILOX_MUL=split16 [--shapes 4096x151936,8192x128256] \\
        [--batches 128,256] [--rounds 3] [--out ab.jsonl]

The kernels read their knobs (kernels/fused_sample.py) at import, so every arm runs in a
process of its own, with a Triton cache of its own, and the rounds alternate the arms'
order (forward, reverse, ...): under the power cap whatever runs later runs hotter (perf
notes v2.0). Each process times stage 1 + stage 2 with the shipped tables as a CUDA-graph
replay (tune.device_ms) and checksums the tokens and records, so an arm that changes the
samples shows. Last, a table of each arm's mean time over the rounds and its ratio to the
first arm.

Two variables belong to the worker, not the kernels: AB_MERGE (max | logmass | cdf,
default max) is the merge it samples with, AB_MASS=0 drops the log-masses (the max
merge's default in tpsample.sample) where the merge allows it. E.g. the cdf records in pp
against the default path:

    python -m tools.ab --arm max:AB_MASS=0 --arm cdf:AB_MERGE=cdf \
        --batches 64,128,256

AB_BUCKETS=192:256 gives the shipped tables' bucket 192 the config of their bucket 256 (a
plan-table change measured before it is shipped), e.g. the 129-192-row bucket:

    python -m tools.ab --arm table: --arm 192as256:AB_BUCKETS=192:256 --batches 129,160,192

AB_CALL=sample times the whole public call instead (tpsample.sample, eager, the median of
triton.testing.do_bench) next to cuBLAS's matmul alone (column mm), e.g. two Tritons on
one GPU (tools/triton_carry.sh unpacks the second into t39):

    python -m tools.ab --rounds 2 --batches 1,16,64,128,256 --arm 3.6:AB_CALL=sample \
        --arm "3.9:AB_CALL=sample,$(tools/triton_carry.sh arm t39)"
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def override_buckets(text: str) -> None:
    """AB_BUCKETS "DST:SRC[,DST:SRC...]": in every shipped table (tpsample/configs), bucket
    DST takes bucket SRC's config (the base table, not the by-D overrides)."""
    from tpsample import plan
    for pair in filter(None, text.split(",")):
        dst, _, src = pair.partition(":")
        if not (dst.isdigit() and src.isdigit()):
            sys.exit(f"AB_BUCKETS must be DST:SRC[,DST:SRC...], got {text!r}")
        for name in ("h100", "h200"):
            buckets = plan.load_table(name)[0]
            buckets[int(dst)] = dict(buckets[int(src)])


def worker(shapes, batches, reps_ms: int):
    import torch
    override_buckets(os.environ.get("AB_BUCKETS", ""))
    call = os.environ.get("AB_CALL", "stages")
    if call not in ("stages", "sample"):
        sys.exit(f"AB_CALL must be stages or sample, got {call!r}")
    if call == "sample":
        return sample_worker(shapes, batches, reps_ms)

    import tpsample
    from tools import calls
    from tpsample.params import row_params
    from tools.tune import device_ms
    merge = os.environ.get("AB_MERGE", "max")
    if merge not in ("max", "logmass", "cdf"):
        sys.exit(f"AB_MERGE must be max, logmass or cdf, got {merge!r}")
    need_mass = merge != "max" or os.environ.get("AB_MASS", "1") != "0"
    for D, V in shapes:
        w = torch.randn(V, D, device="cuda", dtype=torch.bfloat16,
                        generator=torch.Generator(device="cuda").manual_seed(D)) * 0.02
        for B in batches:
            h = torch.randn(B, D, device="cuda", dtype=torch.bfloat16,
                            generator=torch.Generator(device="cuda").manual_seed(B))
            p = row_params(h, 1.0, torch.arange(B, device="cuda") + 7, 3)

            def run():
                rec = calls.fused_records(h, w, bias=None, inv_temp=p.inv_temp, seed=p.seed,
                                          offset=p.offset, num_samples=1, n_real=V,
                                          need_mass=need_mass, cdf=merge == "cdf")
                return rec, calls.reduce_records(rec[None], p.inv_temp, p.seed, p.offset, merge)[0]

            rec, tokens = run()
            ms = device_ms(lambda: run(), reps_ms)
            print(json.dumps(dict(D=D, V=V, B=B, ms=ms, tokens=int(tokens.sum()),
                                  records=float(rec.double().nan_to_num(0, 0, 0).sum()),
                                  strategy=tpsample.explain(B, D, V).strategy)),
                  flush=True)


def sample_worker(shapes, batches, reps_ms: int):
    """tpsample.sample as a user calls it (eager, default plan) and torch.mm alone."""
    import torch
    import triton

    import tpsample
    from tpsample.launch.bench import typical_head
    for D, V in shapes:
        for B in batches:
            h, w = typical_head(D, V, B, torch.bfloat16, "cuda")
            seed = torch.arange(B, device="cuda") + 7
            tokens = tpsample.sample(h, w, seed=seed)
            ms = triton.testing.do_bench(lambda: tpsample.sample(h, w, seed=seed), warmup=25,
                                         rep=reps_ms, return_mode="median")
            mm = triton.testing.do_bench(lambda: torch.mm(h, w.T), warmup=25, rep=reps_ms,
                                         return_mode="median")
            weights = torch.arange(1, B + 1, device="cuda")
            print(json.dumps(dict(D=D, V=V, B=B, ms=ms, mm=mm,
                                  tokens=int((tokens.long() * weights).sum()),
                                  strategy=tpsample.explain(B, D, V).strategy)), flush=True)


def parse_shapes(text):
    return [tuple(int(x) for x in s.split("x")) for s in text.split(",")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", action="append", default=[],
                    help="NAME:VAR=VALUE[,VAR=VALUE...] (an empty list of variables: the defaults)")
    ap.add_argument("--shapes", default="4096x151936,8192x128256", help="DxV,...")
    ap.add_argument("--batches", default="128,256")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps-ms", type=int, default=200)
    ap.add_argument("--out")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    shapes, batches = parse_shapes(a.shapes), [int(b) for b in a.batches.split(",")]
    if a.worker:
        return worker(shapes, batches, a.reps_ms)
    if len(a.arm) < 2:
        ap.error("give at least two --arm")
    arms = []
    for spec in a.arm:
        name, _, env = spec.partition(":")
        pairs = [kv.split("=", 1) for kv in env.split(",") if kv]
        if not name or "=" in name or any(len(kv) != 2 for kv in pairs):
            ap.error(f"--arm must be NAME:VAR=VALUE[,VAR=VALUE...], got {spec!r}")
        arms.append((name, dict(pairs)))
    cache_root = tempfile.mkdtemp(prefix="tpsample-ab-")
    rows = []
    for r in range(a.rounds):
        order = arms if r % 2 == 0 else arms[::-1]
        for name, env in order:
            cmd = [sys.executable, "-m", "tools.ab", "--worker", "--shapes", a.shapes,
                   "--batches", a.batches, "--reps-ms", str(a.reps_ms)]
            full_env = dict(os.environ, **env, TRITON_CACHE_DIR=os.path.join(cache_root, name))
            out = subprocess.run(cmd, env=full_env, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"arm {name} failed:\n{out.stderr[-3000:]}")
            for line in out.stdout.splitlines():
                row = dict(json.loads(line), arm=name, round=r)
                rows.append(row)
                extra = (f", mm {row['mm']:.4f} ms" if "mm" in row else "") + f", {row['strategy']}"
                print(f"round {r} {name:>10s} D={row['D']} B={row['B']}: {row['ms']:.4f} ms "
                      f"(tokens {row['tokens']}{extra})", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    base = arms[0][0]
    print(f"\nmean ms over {a.rounds} rounds (ratio to {base}); tokens equal across arms?")
    for D, V in shapes:
        for B in batches:
            cell = [x for x in rows if x["D"] == D and x["B"] == B]
            mean = {n: sum(x["ms"] for x in cell if x["arm"] == n) / a.rounds for n, _ in arms}
            same = len({x["tokens"] for x in cell}) == 1
            mm = [x["mm"] for x in cell if "mm" in x]
            vs_mm = f"  mm {sum(mm) / len(mm):.4f}" if mm else ""
            print(f"D={D} B={B}: " + "  ".join(f"{n} {mean[n]:.4f} ({mean[n] / mean[base]:.3f})"
                                                for n, _ in arms) + vs_mm
                  + f"  tokens equal: {same}")


if __name__ == "__main__":
    main()
