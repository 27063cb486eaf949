"""Where the time of one call goes (CUDA): `python -m tpsample.probe [--shape 4096x151936]`.

Times with triton.testing.do_bench (median ms), for a few batch sizes: stage 1 with
num_samples = 0 (matmul + log-mass, no noise), 1 and 2 (each sample adds one noise pass),
the per-token noise path (vocab_start % 4 != 0) against the 4-lane one, stage 2 alone, and
the whole tpsample.sample call (API overhead = call - stage 1 - stage 2).
"""
import argparse
import json
import os

import torch
import triton

from . import fused
from .api import row_params, sample


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4096x151936")
    ap.add_argument("--batches", default="1,16,32,64,128,256")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    D, V = (int(x) for x in args.shape.split("x"))
    w = torch.randn(V, D, device="cuda", dtype=torch.bfloat16) * 0.02
    bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")  # noqa: E731
    rows = []
    for B in (int(b) for b in args.batches.split(",")):
        h = torch.randn(B, D, device="cuda", dtype=torch.bfloat16)
        p = row_params(h, 1.0, torch.arange(B, device="cuda"), 0)
        cfg = fused.kernel_config(B, D, h.dtype)

        def stage1(S, start=0, config=cfg):
            return fused.fused_records(h, w, bias=None, inv_temp=p.inv_temp, seed=p.seed,
                                       offset=p.offset, num_samples=S, n_real=V, vocab_start=start,
                                       config=config)
        rec = stage1(1)
        r = dict(B=B, config=cfg, s0=bench(lambda: stage1(0)), s1=bench(lambda: stage1(1)),
                 s2=bench(lambda: stage1(2)), s1_per_token_noise=bench(lambda: stage1(1, start=2)),
                 reduce=bench(lambda: fused.reduce_records(rec[None], p.inv_temp, p.seed, p.offset, "max")),
                 call=bench(lambda: sample(h, w, seed=1, offset=0)))
        if cfg["strategy"] == "logits":
            r["mm_fp32"] = bench(lambda: fused.logits_fp32(h, w))
        r["api_overhead"] = r["call"] - r["s1"] - r["reduce"]
        rows.append(r)
        print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), shape=args.shape, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
