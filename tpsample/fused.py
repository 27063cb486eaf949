"""Launchers for the Triton kernels: stage 1 (records) and stage 2 (reduce)."""
from __future__ import annotations

import torch
import triton

from .kernels import fused_sample_records_kernel, reduce_records_kernel
from .torch_records import DEFAULT_TILE

BLOCK_V = DEFAULT_TILE  # one record per 128 tokens everywhere: logmass partitions agree


def kernel_config(B: int, D: int, dtype: torch.dtype) -> dict:
    """Block sizes for stage 1 (see docs/perf-notes.md for how they were chosen)."""
    block_b = min(max(16, triton.next_power_of_2(B)), 64)
    block_d = 64 if dtype == torch.float32 else 128
    return dict(BLOCK_V=BLOCK_V, BLOCK_B=block_b, BLOCK_D=block_d, NUM_STAGES=4, num_warps=4)


def num_tiles(rows: int) -> int:
    return triton.cdiv(rows, BLOCK_V)


def fused_records(hidden, weight, *, bias, inv_temp, seed, offset, num_samples, n_real,
                  vocab_start=0, out=None, tiles=None) -> torch.Tensor:
    """Stage 1 on (a shard of) the LM head → records [S, B, T, 4] fp32 (or into `out`,
    any tensor of that shape whose last two dims are contiguous: e.g. this rank's slot
    of a [S, B, world, T, 4] exchange buffer)."""
    B, D = hidden.shape
    V_rows = weight.shape[0]
    T = tiles if tiles is not None else num_tiles(V_rows)
    if out is None:
        out = torch.empty(num_samples, B, T, 4, dtype=torch.float32, device=hidden.device)
    assert out.shape == (num_samples, B, T, 4) and out.stride(3) == 1 and out.stride(2) == 4
    cfg = kernel_config(B, D, hidden.dtype)
    nw = cfg.pop("num_warps")
    grid = (triton.cdiv(B, cfg["BLOCK_B"]), T)
    fused_sample_records_kernel[grid](
        hidden, weight, bias if bias is not None else inv_temp, inv_temp, seed, offset, out,
        B, D, V_rows, n_real, vocab_start, num_samples,
        hidden.stride(0), weight.stride(0), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, EVEN_D=D % cfg["BLOCK_D"] == 0,
        FP32_DOT=hidden.dtype == torch.float32, num_warps=nw, **cfg)
    return out


def reduce_records(records: torch.Tensor, inv_temp, seed, offset, merge: str):
    """Stage 2. records [slots, S, B, T, 4] (any strides with the last two dims contiguous)
    → tokens int64 [B, S], logprobs fp32 [B, S], logz fp32 [B]."""
    slots, S, B, T, _ = records.shape
    assert records.stride(4) == 1 and records.stride(3) == 4
    dev = records.device
    tokens = torch.empty(B, S, dtype=torch.int64, device=dev)
    logprobs = torch.empty(B, S, dtype=torch.float32, device=dev)
    logz = torch.empty(B, dtype=torch.float32, device=dev)
    N = slots * T
    reduce_records_kernel[(B, S)](
        records, inv_temp, seed, offset, tokens, logprobs, logz,
        B, N, T, records.stride(0), records.stride(1), records.stride(2),
        LOGMASS=merge == "logmass", BLOCK_N=min(1024, triton.next_power_of_2(N)), num_warps=4)
    return tokens, logprobs, logz
