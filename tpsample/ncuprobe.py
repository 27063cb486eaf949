"""One launch of each stage-1 kernel at a given B, for `ncu` (device machine only):

    ncu --clock-control none -k regex:records --launch-skip 2 --launch-count 2 \\
        python -m tpsample.ncuprobe --batch 64
"""
import argparse

import torch

from . import fused
from .api import row_params


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--shape", default="4096x151936")
    args = ap.parse_args()
    D, V = (int(x) for x in args.shape.split("x"))
    B = args.batch
    w = torch.randn(V, D, device="cuda", dtype=torch.bfloat16) * 0.02
    h = torch.randn(B, D, device="cuda", dtype=torch.bfloat16)
    p = row_params(h, 1.0, torch.arange(B, device="cuda"), 0)
    for _ in range(3):
        fused.fused_records(h, w, bias=None, inv_temp=p.inv_temp, seed=p.seed, offset=p.offset,
                            num_samples=1, n_real=V)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
