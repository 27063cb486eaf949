"""Host (Python) time per call, GPU kept idle-fast: `python -m tpsample.hostprobe`.

Tiny shapes so the GPU never becomes the bottleneck; each line is the median host time of
one piece of the call path in µs (no synchronisation inside the timed loop).
"""
import statistics
import time

import torch

from . import fused
from .api import row_params, sample


def host_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6


def main():
    h = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16)
    seeds = torch.ones(1, dtype=torch.int64, device="cuda")
    p = row_params(h, 1.0, seeds, 0)
    rec = fused.fused_records(h, w, bias=None, inv_temp=p.inv_temp, seed=p.seed, offset=p.offset,
                              num_samples=1, n_real=4096)
    parts = {
        "torch.full": lambda: torch.full((1,), 1.0, device="cuda"),
        "torch.empty": lambda: torch.empty(1, device="cuda"),
        "row_params(float T, int seed, int offset)": lambda: row_params(h, 1.0, 1, 0),
        "row_params(float T, tensor seed, int offset)": lambda: row_params(h, 1.0, seeds, 0),
        "fused_records": lambda: fused.fused_records(h, w, bias=None, inv_temp=p.inv_temp, seed=p.seed,
                                                     offset=p.offset, num_samples=1, n_real=4096),
        "reduce_records": lambda: fused.reduce_records(rec[None], p.inv_temp, p.seed, p.offset, "max"),
        "sample()": lambda: sample(h, w, seed=seeds, offset=0),
    }
    for name, fn in parts.items():
        print(f"{host_us(fn):8.1f} us  {name}", flush=True)


if __name__ == "__main__":
    main()
