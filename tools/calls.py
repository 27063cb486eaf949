"""Stage 1 and stage 2 called directly (plan + launchers), with the tools' switches: PDL
on or off, the ping-pong kernel's per-tile clock trace. What the tools time and count."""
from __future__ import annotations

import torch

from tpsample import launchers, records
from tpsample.params import RowParams
from tpsample.plan import (DeviceKind, Layout, default_config, load_table, make_plan,
                           table_config, with_options)

PDL = True      # stage 2 as a programmatic dependent launch (off: the A/B of probe --ab)
TRACE = None    # int64 CUDA tensor [tiles, 4]: the pp kernel's per-tile clocks (probe --pp-trace)


def kernel_config(B: int, D: int, dtype: torch.dtype) -> dict:
    """The table's (or the default) stage-1 config for this shape on the current CUDA
    device, before the plan's fallbacks and derived values: what `config=` takes."""
    kind = DeviceKind.of(torch.device("cuda"))
    if kind.table and dtype != torch.float32:
        return table_config(*load_table(kind.table), B, D)[0]
    return default_config(kind, B, dtype)[0]


def fused_records(h, w, *, bias, inv_temp, seed, offset, num_samples, n_real, vocab_start=0,
                  out=None, config=None, need_mass=True, cdf=False):
    """Records [S, B, T, 4] by the plan's (or `config`'s) stage-1 kernel."""
    T = records.num_tiles(w.shape[0])
    config = dict(config) if config is not None else None
    trim = config.pop("TRIM", True) if config else True  # False: no padding-column trim
    plan = make_plan(DeviceKind.of(h.device), B=h.shape[0], D=h.shape[1], V=w.shape[0],
                     dtype=h.dtype, merge="cdf" if cdf else "max", num_samples=num_samples,
                     need_mass=need_mass, layout=Layout.of(h, w, vocab_start), tiles=T,
                     config=config)
    plan = with_options(plan, pdl=plan.pdl and PDL, trace=TRACE is not None and plan.strategy == "pp")
    if not trim:
        plan = with_options(plan, config=tuple((k, 0 if k == "HALVINGS" else v) for k, v in plan.config))
    if out is None:
        out = torch.empty(num_samples, h.shape[0], T, 4, dtype=torch.float32, device=h.device)
    return launchers.stage1(plan, h, w, bias, RowParams(inv_temp, seed, offset), out,
                            n_real=n_real, vocab_start=vocab_start, trace=TRACE)


def reduce_records(recs, inv_temp, seed, offset, merge, launch=None):
    """Stage 2 of records [slots, S, B, T, 4] → tokens [B, S], logprobs [B, S], logz [B]."""
    slots, S, B, T, _ = recs.shape
    plan = make_plan(DeviceKind.of(recs.device), B=B, D=1, V=T * records.TILE,
                     dtype=torch.float32, merge=merge, num_samples=S, slots=slots, tiles=T,
                     config=dict(strategy="fused", BLOCK_B=16, BLOCK_D=16, NUM_STAGES=1, num_warps=4))
    plan = with_options(plan, pdl=plan.pdl and PDL)
    if launch is not None:
        plan = with_options(plan, reduce=tuple(launch))
    return launchers.stage2(plan, recs, RowParams(inv_temp, seed, offset))
