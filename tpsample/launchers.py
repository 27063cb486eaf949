"""Triton launches of stage 1 (records) and stage 2 (reduce) for a Plan.

The plan (tpsample/plan.py) has already chosen the strategy and its parameters; this module
only turns them into kernel arguments. Every launch goes through replay.run_named (every
runtime argument by name; it calls replay.run_kernel) and the hybrid's GEMM through
replay.run_step, so the pipeline can record and re-issue it.

Fan-out (tensor parallelism over symmetric memory): `fanout` = (peer_ptrs, parity), where
peer_ptrs is an int64 CUDA tensor [2, P] of the addresses of this rank's slot in every
peer's buffer for two alternating buffers, and parity an int32 CUDA tensor [2] whose first
element selects the buffer; stage 1 then stores each record into all P peers instead of
`out` (whose strides still address the slot), and stage 2 reads the buffer parity[0]
selects and flips it once all its programs are done (so a captured CUDA graph alternates
buffers too).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from . import fallback_gate, records
from . import filters as F
from .kernels import (filter_cut, filter_fallback, filter_records, fused_sample, gluon_pingpong, gluon_sample,
                      listed_records as listed_records_kernel, reduce_records)
from .params import Filters, RowParams
from .plan import Plan, cdiv
from .replay import run_named, run_step

BLOCK_V = records.TILE
WS_LOADER_REGS = 24
PP_LOADER_REGS, PP_CONSUMER_REGS, PP_MAXNREG = 24, 240, 168


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _smem_per_block(index: int) -> int:
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


def _smem_of(device: torch.device) -> int:
    """Shared memory per block (opt-in) of a CUDA device, bytes."""
    return _smem_per_block(device.index if device.index is not None
                           else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _mm_out_fp32_supported() -> bool:
    try:
        a = torch.ones(16, 16, dtype=torch.bfloat16, device="cuda")
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError):
        return False


def logits_fp32(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[B, V] fp32 logits with fp32 accumulation (cuBLAS on CUDA)."""
    if hidden.is_cuda and hidden.dtype != torch.float32 and _mm_out_fp32_supported():
        return torch.mm(hidden, weight.T, out_dtype=torch.float32)
    return hidden.float() @ weight.float().T


def stage1(plan: Plan, hidden: torch.Tensor, weight: torch.Tensor, bias, params: RowParams,
           out: torch.Tensor, *, n_real: int, vocab_start: int = 0, fanout=None, trace=None,
           mask: torch.Tensor | None = None, tiles: int | None = None, held=None,
           side: torch.Tensor | None = None):
    """Records [S, B, T, 4] of (a shard of) the LM head into `out` (any strides that
    records.check_layout accepts), by the plan's strategy.

    hidden [B, D] and weight [V_rows, D] (16-bit or fp32, rows contiguous); bias fp32
    [V_rows] or None; params: per-row (inv_temp, seed, offset); rows [n_real, V_rows) are
    padding; fanout: see the module docstring; trace: the pp kernel's int64 [tiles, 4]
    clock buffer when plan.trace (tools/probe.py); mask: int32 [B, W], bit i of a row allows
    global id i (tpsample/constraints.py; every strategy but pp); tiles:
    write only the first `tiles` tiles of `out` (its last one is then the extra tile of
    constrained decoding: `out` stays the tensor a replay substitutes); held: (first, held)
    of a ListedScratch, with its eff as the mask: the listed tokens' logits are kept there;
    with plan.pdl the fused kernel is then a programmatic dependent of listed_prep, the
    launch just before (it waits for it before its epilogue; ws is not: docs/design.md);
    side: fp32 [B, T * TILE] (rows contiguous), where the kernel also writes the transformed
    logits (a filtered call's fallback reads them; not the pp kernel)."""
    S, B, T = plan.num_samples, hidden.shape[0], out.shape[2]
    records.check_layout(out, (records.planes(S, plan.candidates), B, T, records.WIDTH))
    cfg = plan.cfg
    peers, parity = fanout if fanout is not None else (None, None)
    common = dict(bias=bias, params=params, out=out, n_real=n_real, vocab_start=vocab_start,
                  peers=peers, parity=parity, side=side)
    if held is not None and mask is None:
        raise ValueError("held needs the mask (the listed tokens' bits cleared)")
    if plan.strategy == "pp" and mask is not None:
        raise ValueError("the pp kernel has no mask epilogue (the plan avoids it for "
                         "constrained calls)")
    if plan.strategy == "pp":
        if side is not None:
            raise ValueError("side: the pp kernel does not write the logits")
        common.pop("side")
        return _pp(plan, cfg, hidden, weight, trace=trace, **common)
    if plan.strategy == "ws":
        return _ws(plan, cfg, hidden, weight, mask=mask, tiles=tiles, held=held, **common)
    if tiles is not None and plan.strategy == "pp":
        raise ValueError("tiles: not the pp kernel")
    return _triton(plan, cfg, hidden, weight, mask=mask, tiles=tiles, held=held, **common)


def _mask_args(mask, held, dummy) -> dict:
    """The kernels' mask_ptr, stride_mask, first_ptr, held_ptr (dummies where unused)."""
    if mask is None:
        return dict(mask_ptr=dummy, stride_mask=0, first_ptr=dummy, held_ptr=dummy)
    first, held = held if held is not None else (dummy, dummy)
    return dict(mask_ptr=mask, stride_mask=mask.stride(0), first_ptr=first, held_ptr=held)


def _side_args(side, dummy) -> dict:
    """The kernels' side_ptr, stride_side (a dummy where unused)."""
    return dict(side_ptr=dummy, stride_side=0) if side is None else \
        dict(side_ptr=side, stride_side=side.stride(0))


def _records_args(plan, bias, params: RowParams, out, *, n_real, vocab_start, peers,
                  parity) -> dict:
    """The arguments every stage-1 kernel takes by the same names: the per-row parameters,
    the records `out` and their strides, the padding and id offset, the TP fan-out's peers
    and parity (the seed tensor where unused: never read then), the bias (1/T where none:
    never read without HAS_BIAS)."""
    seed = params.seed
    s, b, t = out.stride()[:3]
    return dict(bias_ptr=bias if bias is not None else params.inv_temp,
                inv_temp_ptr=params.inv_temp, seed_ptr=seed, offset_ptr=params.offset,
                rec_ptr=out, B=seed.shape[0], n_real=n_real, vocab_start=vocab_start,
                num_samples=plan.num_samples, rec_stride_s=s, rec_stride_b=b, rec_stride_t=t,
                peer_ptrs=peers if peers is not None else seed,
                parity_ptr=parity if parity is not None else seed)


def _triton(plan, cfg, hidden, weight, *, bias, params, out, n_real, vocab_start, peers, parity,
            mask=None, tiles=None, held=None, side=None):
    """The fused kernel or the records pass over cuBLAS logits ("logits")."""
    B, D = hidden.shape
    V_rows, T = weight.shape[0], out.shape[2] if tiles is None else tiles
    seed = params.seed
    consts = dict(HAS_BIAS=bias is not None, ALIGNED4=vocab_start % 4 == 0, BLOCK_V=BLOCK_V,
                  BLOCK_B=cfg["BLOCK_B"], NUM_PEERS=0 if peers is None else peers.shape[-1],
                  HALVINGS=cfg["HALVINGS"], TILE_MASS=plan.need_mass, PDL=plan.pdl,
                  CDF=plan.cdf and plan.replacement)
    if plan.candidates or not plan.replacement:
        consts.update(CANDIDATES=records.CANDIDATES if plan.candidates else 0,
                      NO_REPLACE=not plan.replacement, RAW_MASS=plan.raw_mass)
    tail = dict(_mask_args(mask, held, seed), **_side_args(side, seed))  # (read only when on)
    if side is not None:
        consts.update(SIDE=True)
    if mask is not None:
        consts.update(CANDIDATES=records.CANDIDATES if plan.candidates else 0,
                      NO_REPLACE=not plan.replacement, RAW_MASS=plan.raw_mass, HAS_MASK=True,
                      HELD=held is not None)
    options = dict(num_warps=cfg["num_warps"])
    grid = (cdiv(B, cfg["BLOCK_B"]), T)
    common = _records_args(plan, bias, params, out, n_real=n_real, vocab_start=vocab_start,
                           peers=peers, parity=parity)
    if plan.strategy == "logits":
        logits = run_step(logits_fp32, (hidden, weight))
        run_named(fused_sample.logits_records_kernel, grid, options, logits_ptr=logits,
                  V_rows=V_rows, stride_lb=logits.stride(0), **common, **tail, **consts)
        return out
    w_arg = weight
    if cfg["W_DESC"]:  # W through the tensor-memory accelerator (host-built descriptor)
        w_arg = TensorDescriptor.from_tensor(weight, block_shape=[BLOCK_V, cfg["BLOCK_D"]])
    consts.update(EVEN_D=cfg["EVEN_D"], BLOCK_D=cfg["BLOCK_D"], FP32_DOT=cfg["FP32_DOT"],
                  NUM_STAGES=cfg["NUM_STAGES"], W_DESC=cfg["W_DESC"])
    if held is not None and plan.pdl:  # (the records pass has cuBLAS between it and prep)
        consts.update(AFTER_PREP=True)
        options.update(launch_pdl=True)
    if "NOISE_AT" in cfg:
        consts.update(NOISE_AT=cfg["NOISE_AT"], NOISE_CHUNKS=cfg["NOISE_CHUNKS"],
                      NOISE_EVERY=cfg["NOISE_EVERY"])
    run_named(fused_sample.fused_sample_records_kernel, grid, options, h_ptr=hidden, w_ptr=w_arg,
              D=D, V_rows=V_rows, stride_hb=hidden.stride(0), stride_wv=weight.stride(0),
              **common, **tail, **consts)
    return out


# listed_prep_kernel's dot products: ids and hidden dims per program. Most programs find no id
# to compute (the tile pass keeps the words' first listed tokens), so few, large programs, all
# in one wave at B = 256: the kernel took 10.5 / 22.0 µs at B = 64 / 256 with 64 ids × 1024
# dims in [64, 128] blocks, 7.5 / 11.9 with one row load per id over 4096 dims (D = 4096,
# H100). Its mask rows: words per step (two steps at V = 151936, one at 128256)
LISTED_CHUNK_K = 64
LISTED_MAX_SPLIT_D = 4096
LISTED_BLOCK_W = 4096


def listed_split_d(D: int) -> int:
    """Hidden dims per dot-product program of listed_prep_kernel (a power of 2)."""
    return min(LISTED_MAX_SPLIT_D, 1 << (D - 1).bit_length())


class ListedScratch(NamedTuple):
    """The per-call tensors of a call with listed tokens (kernels/listed_records.py): eff and
    first int32 [B, W] (the mask the tile pass reads; the bits of the words' first listed
    tokens), held fp32 [B, W] (those tokens' logits, kept by the tile pass), all three with
    one row stride, and dots fp32 [B, splits, BLOCK_K] (the other listed tokens')."""
    eff: torch.Tensor
    first: torch.Tensor
    held: torch.Tensor
    dots: torch.Tensor


def listed_scratch(hidden: torch.Tensor, c, words: int) -> ListedScratch:
    """Fresh ListedScratch for a call with B = hidden.shape[0] rows and W = words (rows
    padded to 16 bytes, so each plane is aligned as Triton specialises pointers)."""
    B, D = hidden.shape
    planes = torch.empty(3, B, -(-words // 4) * 4, dtype=torch.int32,
                         device=hidden.device)[:, :, :words]
    dots = torch.empty(B, cdiv(D, listed_split_d(D)), _listed_block(c.ids.shape[1]),
                       dtype=torch.float32, device=hidden.device)
    return ListedScratch(planes[0], planes[1], planes[2].view(torch.float32), dots)


def _listed_block(K: int) -> int:
    return max(16, 1 << (K - 1).bit_length())


def listed_prep(hidden: torch.Tensor, weight: torch.Tensor, c, scratch: ListedScratch, *,
                n_real: int, vocab_start: int = 0, pdl: bool = False) -> None:
    """Before stage 1 of a call with listed tokens, one launch (listed_prep_kernel):
    scratch.eff, the allowed mask (all ones without one) with this slot's listed ids' bits
    cleared, which stage 1 reads; scratch.first, the bits of those that are their word's
    first listed token (stage 1 keeps their logits in scratch.held); scratch.dots, the
    others' dot products. pdl (plan.pdl): stage 1 may launch at once (stage1 with held)."""
    B, D = hidden.shape
    K = c.ids.shape[1]
    block_k = _listed_block(K)
    chunk = min(LISTED_CHUNK_K, block_k)
    splits = scratch.dots.shape[1]
    eff = scratch.eff
    allowed = c.mask if c.mask is not None else eff
    run_named(listed_records_kernel.listed_prep_kernel, (B, 1 + cdiv(K, chunk) * splits),
              dict(num_warps=4), mask_ptr=allowed, eff_ptr=eff, first_ptr=scratch.first,
              ids_ptr=c.ids, h_ptr=hidden, w_ptr=weight, dots_ptr=scratch.dots, K=K,
              W=eff.shape[1], D=D, n_real=n_real, vocab_start=vocab_start,
              stride_mask=allowed.stride(0), stride_eff=eff.stride(0),
              stride_ids=c.ids.stride(0), stride_hb=hidden.stride(0),
              stride_wv=weight.stride(0), splits=splits, HAS_MASK=c.mask is not None,
              BLOCK_W=LISTED_BLOCK_W, BLOCK_K=block_k, SPLIT_D=listed_split_d(D),
              CHUNK_K=chunk, PDL=pdl)


def listed_records(plan: Plan, bias, params: RowParams, c, scratch: ListedScratch,
                   out: torch.Tensor, tile: int, *, n_real: int, vocab_start: int = 0,
                   fanout=None):
    """The extra tile of a call with listed tokens (kernels/listed_records.py), after stage 1
    (which kept the words' first listed tokens' logits in scratch.held; listed_prep computed
    the others'): its records into tile `tile` of `out` [planes, B, T + 1, 4] (every plane,
    or every peer's with fanout). With plan.pdl a programmatic dependent launch."""
    B, K = c.ids.shape
    block_k = _listed_block(K)
    dots = scratch.dots
    splits = dots.shape[1]
    pdl = dict(launch_pdl=True) if plan.pdl else {}
    peers, parity = fanout if fanout is not None else (None, None)
    dummy = params.inv_temp
    allowed = c.mask if c.mask is not None else dummy
    s_, b_, t_ = out.stride()[:3]
    run_named(listed_records_kernel.listed_records_kernel, (B,), dict(num_warps=4, **pdl),
              dots_ptr=dots, held_ptr=scratch.held,
              bias_ptr=bias if bias is not None else dummy, ids_ptr=c.ids,
              values_ptr=c.values,
              penalty_ptr=c.penalty if c.penalty is not None else dummy, mask_ptr=allowed,
              inv_temp_ptr=params.inv_temp, seed_ptr=params.seed, offset_ptr=params.offset,
              rec_ptr=out, peer_ptrs=peers if peers is not None else params.seed,
              parity_ptr=parity if parity is not None else params.seed, K=K, SPLITS=splits,
              n_real=n_real, vocab_start=vocab_start, num_samples=plan.num_samples,
              stride_ids=c.ids.stride(0),
              stride_mask=c.mask.stride(0) if c.mask is not None else 0,
              stride_held=scratch.held.stride(0), rec_stride_s=s_, rec_stride_b=b_,
              rec_stride_t=t_, tile=tile, HAS_BIAS=bias is not None,
              HAS_PENALTY=c.penalty is not None, HAS_MASK=c.mask is not None,
              BLOCK_K=block_k, NUM_PEERS=0 if peers is None else peers.shape[-1],
              CANDIDATES=records.CANDIDATES if plan.candidates else 0,
              NO_REPLACE=not plan.replacement, RAW_MASS=plan.raw_mass, PDL=plan.pdl)


# the ws side output stored along its rows through shared memory (gluon_sample._store_side;
# its scratch may cost a stage: _ws_stages) where the tile's D loop has at most this many
# steps. H200, eager calls, same run, top-p 0.9: D = 4096 -2 % (B = 64) and -6 / -7 % (B =
# 256); D = 8192 -2 % at B = 64 but +6 / +7 % at B = 256 (its stage 1 alone was faster)
WS_SIDE_ROWS_MAX_K_STEPS = 64
WS_SIDE_ROWS = True  # (False: the stores from the lanes' layout; A/B)
SMEM_SLACK = 1024  # the ws kernel's barriers and alignment, bytes


def _ws_stages(cfg: dict, block_b: int, block_k: int, limit: int) -> int:
    """The config's pipeline stages with the side output's transpose scratch ([BLOCK_V,
    EPI_B, 4] fp32 lanes): fewer where they would not fit in `limit` bytes of shared memory."""
    per_stage = (BLOCK_V + block_b) * block_k * 2
    fixed = BLOCK_V * block_b * 4 + SMEM_SLACK + BLOCK_V * cfg["EPI_B"] * 4
    return max(2, min(cfg["NUM_STAGES"], (limit - fixed) // per_stage))


@functools.lru_cache(maxsize=64)
def _ws_layouts(dtype: torch.dtype, block_b: int, block_k: int):
    from triton.experimental.gluon import language as gl
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return (gl.NVMMASharedLayout.get_default_for([4, BLOCK_V // 4, block_k], gdt),
            gl.NVMMASharedLayout.get_default_for([block_b, block_k], gdt))


def _ws(plan, cfg, hidden, weight, *, bias, params, out, n_real, vocab_start, peers, parity,
        mask=None, tiles=None, held=None, side=None):
    """The warp-specialized Hopper kernel (kernels/gluon_sample.py): a persistent grid of one
    program per SM over [BLOCK_V, BLOCK_B] tiles. W [V_rows, D] is handed to TMA as the view
    [4, V_rows / 4, D] (row 4q + a at [a, q]), so each tile lands in shared memory in lane
    order. The descriptors' base is the tensor itself (TMA reads only the base address), so
    a replay can rebase them on another call's hidden and weight."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    B, D = hidden.shape
    V_rows = weight.shape[0]
    block_b, block_k, num_warps = cfg["BLOCK_B"], cfg["BLOCK_K"], cfg["num_warps"]
    mma_warps = 8 if block_b > 128 else 4  # one warpgroup holds at most a [128, 128] fp32 tile
    w_layout, h_layout = _ws_layouts(hidden.dtype, block_b, block_k)
    row = weight.stride(0)
    w_desc = GluonDescriptor(weight, [4, V_rows // 4, D], [row, 4 * row, 1],
                             [4, BLOCK_V // 4, block_k], w_layout)
    h_desc = GluonDescriptor(hidden, list(hidden.shape), list(hidden.stride()),
                             [block_b, block_k], h_layout)
    nb = cdiv(B, block_b)
    tiles = (out.shape[2] if tiles is None else tiles) * nb
    grid = (min(tiles, _num_sms(hidden.device)),)
    k_steps = cdiv(D, block_k)
    side_rows = side is not None and WS_SIDE_ROWS and k_steps <= WS_SIDE_ROWS_MAX_K_STEPS
    stages = cfg["NUM_STAGES"]
    if side_rows:
        stages = _ws_stages(cfg, block_b, block_k, _smem_of(hidden.device))
    constexprs = dict(
        HAS_BIAS=bias is not None, TILE_MASS=plan.need_mass, STAGES=stages,
        EPI_B=cfg["EPI_B"], LOADER_REGS=WS_LOADER_REGS, MMA_REGS=168 if mma_warps == 4 else 160,
        MMA_WARPS=mma_warps, NUM_PEERS=0 if peers is None else peers.shape[-1],
        HAS_MASK=mask is not None, CANDIDATES=records.CANDIDATES if plan.candidates else 0,
        RAW_MASS=plan.candidates and plan.raw_mass, HELD=held is not None,
        SIDE=side is not None, SIDE_ROWS=side_rows)
    if not plan.replacement:
        raise ValueError("the ws kernel has no without-replacement epilogue (the plan takes the "
                         "records pass)")
    # the register file split evenly over all warps (epilogue + mma + 4 for the loader)
    # before setmaxnreg moves registers from the loader to the others
    options = dict(num_warps=num_warps,
                   maxnreg=65536 // (32 * (num_warps + mma_warps + 4)) // 8 * 8)
    seed = params.seed
    run_named(gluon_sample.ws_records_kernel, grid, options, w_desc=w_desc, h_desc=h_desc,
              num_tiles=tiles, num_b_tiles=nb, k_steps=k_steps,
              **_records_args(plan, bias, params, out, n_real=n_real, vocab_start=vocab_start,
                              peers=peers, parity=parity),
              **_mask_args(mask, held, seed), **_side_args(side, seed), **constexprs)
    return out


@functools.lru_cache(maxsize=64)
def _pp_layouts(dtype: torch.dtype, block_k: int, extra_b: int = 0):
    from triton.experimental.gluon import language as gl
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return (gl.NVMMASharedLayout.get_default_for([2, 4, 2, 8, block_k], gdt),
            gl.NVMMASharedLayout.get_default_for([128, block_k], gdt),
            gl.NVMMASharedLayout.get_default_for([extra_b, block_k], gdt) if extra_b else None)


def pp_stages(cfg: dict, block_k: int, limit: int, cdf: bool = False) -> int:
    """The config's pipeline stages, fewer where a stage with the second row tile's
    [EXTRA_B, BLOCK_K] would not fit in `limit` bytes of shared memory (beside the two
    consumers' partials and parameters)."""
    per_stage = (128 + 128 + cfg.get("EXTRA_B", 0)) * block_k * 2
    fixed = 2 * (8 * 4 * 16 * (2 + 4) * 4 + (128 if cdf else 64) * 16 * 4) + SMEM_SLACK
    return max(2, min(cfg["NUM_STAGES"], (limit - fixed) // per_stage))


def _pp(plan, cfg, hidden, weight, *, bias, params, out, n_real, vocab_start, peers, parity,
        trace=None):
    """The ping-pong Hopper kernel (kernels/gluon_pingpong.py): a persistent grid of one
    program per SM over [128, 128] tiles, two consumer warpgroups taking turns. W [V_rows, D]
    is handed to TMA as the view [2, V_rows / 32, 2, 8, D] (row 32t + 4j + 2r + h at
    [r, t, h, j]), so a thread's accumulator rows are one Philox group. cfg EXTRA_B (129 to
    128 + EXTRA_B rows, plan._resolve): one tile per 128 W rows, the batch's first 128 rows
    and the rest in a second [128, EXTRA_B] accumulator from the same W tile, so W goes from
    L2 to shared memory once instead of once per 128 rows."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    B, D = hidden.shape
    V_rows = weight.shape[0]
    block_k = cfg["BLOCK_K"]
    extra = cfg.get("EXTRA_B", 0)
    if extra and not 128 < B <= 128 + extra:
        raise ValueError(f"a ping-pong plan with EXTRA_B={extra} takes 129 to {128 + extra} "
                         f"rows, got {B}")
    w_layout, h_layout, h2_layout = _pp_layouts(hidden.dtype, block_k, extra)
    row = weight.stride(0)
    w_desc = GluonDescriptor(weight, [2, V_rows // 32, 2, 8, D],
                             [2 * row, 32 * row, row, 4 * row, 1], [2, 4, 2, 8, block_k], w_layout)
    h_desc = GluonDescriptor(hidden, list(hidden.shape), list(hidden.stride()), [128, block_k],
                             h_layout)
    extra_args = {"h2_desc": None}
    stages = cfg["NUM_STAGES"]
    if extra:
        extra_args["h2_desc"] = GluonDescriptor(hidden, list(hidden.shape),
                                                list(hidden.stride()), [extra, block_k], h2_layout)
        stages = pp_stages(cfg, block_k, _smem_of(hidden.device), plan.cdf)
    nb = 1 if extra else cdiv(B, 128)
    tiles = out.shape[2] * nb
    if plan.trace and (trace is None or trace.shape != (tiles, 4) or trace.dtype != torch.int64):
        raise ValueError(f"a plan with trace=True needs trace int64 [{tiles}, 4] for this call")
    grid = (min(tiles, _num_sms(hidden.device)),)
    constexprs = dict(
        HAS_BIAS=bias is not None, TILE_MASS=plan.need_mass, STAGES=stages,
        LOADER_REGS=PP_LOADER_REGS, CONSUMER_REGS=PP_CONSUMER_REGS,
        SINGLE=plan.num_samples == 1, NUM_PEERS=0 if peers is None else peers.shape[-1],
        TRACE=plan.trace, CDF=plan.cdf, EXTRA_B=extra)
    # 4 warps per consumer and 4 for the loader's warpgroup: the register file split evenly
    # before setmaxnreg moves the loader's to the consumers
    run_named(gluon_pingpong.pp_records_kernel, grid, dict(num_warps=4, maxnreg=PP_MAXNREG),
              w_desc=w_desc, h_desc=h_desc, trace_ptr=trace if plan.trace else params.seed,
              num_tiles=tiles, num_b_tiles=nb, k_steps=cdiv(D, block_k),
              **_records_args(plan, bias, params, out, n_real=n_real, vocab_start=vocab_start,
                              peers=peers, parity=parity), **extra_args, **constexprs)
    return out


def stage2(plan: Plan, recs: torch.Tensor, params: RowParams, parity=None,
           parity_stride: int = 0, out: tuple | None = None, dependent: bool = False):
    """records [slots, S, B, T, 4] (any strides, the last dim contiguous) → tokens int64
    [B, S], logprobs fp32 [B, S], logz fp32 [B] by the plan's merge (into `out`'s three when
    given). With `parity` (the fan-out's int32 [2]) the records are read parity[0] *
    parity_stride elements past `recs`, and the kernel flips parity[0] once all its programs
    are done. dependent (with plan.pdl): a programmatic dependent launch follows (the filter
    kernel), which the kernel lets start once the records are visible."""
    slots, S, B, T, _ = recs.shape
    assert recs.stride(4) == 1
    dev = recs.device
    if out is None:
        tokens = torch.empty(B, S, dtype=torch.int64, device=dev)
        logprobs = torch.empty(B, S, dtype=torch.float32, device=dev)
        logz = torch.empty(B, dtype=torch.float32, device=dev)
    else:
        tokens, logprobs, logz = out
    block_r, block_n, num_warps = plan.reduce
    if block_n < 4 or block_n & (block_n - 1):
        raise ValueError(f"plan reduce BLOCK_N must be a power of 2 >= 4, got {block_n}")
    run_named(reduce_records.reduce_records_kernel, (cdiv(B * S, block_r),),
              dict(num_warps=num_warps, **({"launch_pdl": True} if plan.pdl else {})),
              rec_ptr=recs, inv_temp_ptr=params.inv_temp, seed_ptr=params.seed,
              offset_ptr=params.offset, tokens_ptr=tokens, logprobs_ptr=logprobs, logz_ptr=logz,
              B=B, S=S, N=slots * T, tiles_per_slot=T, rec_stride_slot=recs.stride(0),
              rec_stride_s=recs.stride(1), rec_stride_b=recs.stride(2),
              rec_stride_t=recs.stride(3),
              parity_ptr=parity if parity is not None else params.seed,
              parity_stride=parity_stride, LOGMASS=plan.merge in ("logmass", "cdf"),
              BLOCK_R=block_r, BLOCK_N=block_n, USE_PARITY=parity is not None,
              ONE_SLOT=slots == 1, PDL=plan.pdl, DEPENDENT=plan.pdl and dependent)
    return tokens, logprobs, logz


# the filter kernel sorts a row's known prefix in the smallest of these (or KNOWN_CAP) slots
# that holds it: with 1187 tiles (V = 151936) it holds ~450 tokens when the logits' ranks
# are spread over the tiles at random, fewer when high-probability ids cluster
FILTER_SORTS = (256, 512)


def filter_warps(B: int) -> int:
    """The filter kernel's warps: 8 while its B programs fit the SMs once, where its
    latency is the call's; 4 above, where its throughput is (H100, tools.probe --filters)."""
    return 8 if B <= 132 else 4


_NO_TOP: dict = {}  # (B, device) -> the empty top planes of calls without top log-probs


def filtered_outputs(B: int, S: int, n: int, device, flat: bool = False) -> F.FilteredOutput:
    """Fresh outputs of stage2_filtered: tokens int64 [B, S], logprobs fp32 [B, S], logz fp32
    [B], top tokens int64 [B, n], top log-probs fp32 [B, n], fallback flags int32 [B]
    (`fallback`), and the filter kernels' scratch int64 [filters.scratch_words(B)]. With
    n = 0 the top planes hold nothing and are shared between calls (each allocation costs
    host time).
    flat (a replayed call, whose launches take only the addresses): tokens and logprobs
    [B] when S == 1, the shape the caller returns (a slice per call costs host time)."""
    if flat and S == 1:
        tokens = torch.empty(B, dtype=torch.int64, device=device)
        logprobs = torch.empty(B, dtype=torch.float32, device=device)
    else:
        tokens = torch.empty(B, S, dtype=torch.int64, device=device)
        logprobs = torch.empty(B, S, dtype=torch.float32, device=device)
    if n:
        top = (torch.empty(B, n, dtype=torch.int64, device=device),
               torch.empty(B, n, dtype=torch.float32, device=device))
    else:
        top = _NO_TOP.get((B, device))
        if top is None:
            top = _NO_TOP[(B, device)] = (torch.empty(B, 0, dtype=torch.int64, device=device),
                                          torch.empty(B, 0, dtype=torch.float32, device=device))
    return F.FilteredOutput(
        tokens, logprobs, torch.empty(B, dtype=torch.float32, device=device),
        *top,
        torch.empty(B, dtype=torch.int32, device=device),
        torch.empty(F.scratch_words(B), dtype=torch.int64, device=device))


def stage2_filtered(plan: Plan, recs: torch.Tensor, params: RowParams, filters: Filters,
                    parity=None, parity_stride: int = 0, *, head: torch.Tensor | None = None,
                    out: F.FilteredOutput | None = None,
                    tokens_only: bool = False,
                    gate: torch.Tensor | None = None) -> F.FilteredOutput:
    """records [slots, planes, B, T, 4] of a call with candidate planes → stage2 over the
    sample planes (head: recs[:, :S], passed when a replay must know it), then the candidate
    reduce (kernels/filter_records.py) over all planes, into `out` (default: fresh
    filtered_outputs). With merge "max" the filter kernel takes the sample planes' pathwise
    winners itself (one launch: PATHWISE); tokens_only (the call returns no log-probs): with it,
    one sample with replacement and no top-n, the winner certificate (tpsample/filters.py,
    2.) also clears rows whose pathwise winner is known and kept (WINNER_CERT). gate (bool [1],
    tpsample/fallback_gate.py): set when a row is flagged."""
    slots, _, B, T, _ = recs.shape
    S = plan.num_samples
    head = recs[:, :S] if head is None else head
    out = filtered_outputs(B, S, filters.top_n, recs.device) if out is None else out
    tokens, logprobs, logz, top_tok, top_lp, flag, scratch = out
    pathwise = plan.merge == "max"
    if not pathwise:
        stage2(plan, head, params, parity, parity_stride, out=(tokens, logprobs, logz),
               dependent=True)
    n = filters.top_n
    N = slots * T
    block_n = max(4, 1 << (N - 1).bit_length())
    cap = min(F.KNOWN_CAP, block_n * records.CANDIDATES)  # never binds below KNOWN_CAP candidates
    sort_a, sort_b = (min(size, cap) for size in FILTER_SORTS)
    run_named(filter_records.filter_records_kernel, (B,),
              dict(num_warps=filter_warps(B), **({"launch_pdl": True} if plan.pdl else {})),
              rec_ptr=recs, st_slot=recs.stride(0), st_plane=recs.stride(1),
              st_b=recs.stride(2), st_t=recs.stride(3), inv_temp_ptr=params.inv_temp,
              seed_ptr=params.seed, offset_ptr=params.offset, **_filter_ptrs(params, filters),
              tokens_ptr=tokens, logprobs_ptr=logprobs, logz_ptr=logz, top_tok_ptr=top_tok,
              top_lp_ptr=top_lp, flag_ptr=flag, scratch_ptr=scratch, win_at=B * F.KNOWN_CAP,
              S=S, T=T, N=N, n_top=n, parity_ptr=parity if parity is not None else params.seed,
              parity_stride=parity_stride, gate_ptr=gate if gate is not None else flag,
              RAW=filters.raw, REPLACE=filters.replacement, USE_PARITY=parity is not None,
              K=records.CANDIDATES, BLOCK_N=block_n,
              BLOCK_U=min(1024, max(16, 1 << (N - 1).bit_length())), CAP=cap, SORT_A=sort_a,
              SORT_B=sort_b, PDL=plan.pdl, PATHWISE=pathwise,
              WINNER_CERT=winner_certificate(plan.merge, S, filters, tokens_only),
              GATE=gate is not None)
    return out


def winner_certificate(merge: str, S: int, filters: Filters, tokens_only: bool) -> bool:
    """Whether a filtered call's rows may be certified by their pathwise winner
    (tpsample/filters.py, 2.): merge "max", one sample with replacement, no top log-probs,
    tokens only."""
    return merge == "max" and S == 1 and filters.replacement and filters.top_n == 0 \
        and tokens_only


SPLIT_ROWS = True  # (False: every rank gathers and redoes every flagged row; for A/B runs)
SPLIT_MIN_ROWS = 4  # rows per rank from which a call splits its flagged rows


class FallbackGather(NamedTuple):
    """Where a tensor-parallel call's device fallback gathers the flagged rows (a transport
    with rows_gather, tpsample/transport.py): full fp32 [world, B, n] (every rank's shard of
    the rows, n = tiles * TILE), own = full[rank], peers int64 [world] (own's address in every
    rank's buffer), calls int64 [1] (the transport's exchange count, < 0 once one failed),
    starts int64 [world] (each shard's first global id), exchange(flags) (the gather's signal
    and bounded wait, only where some flag is set), rank (this rank: full[rank] is own)."""
    full: torch.Tensor
    own: torch.Tensor
    peers: torch.Tensor
    calls: torch.Tensor
    starts: torch.Tensor
    exchange: Callable[[torch.Tensor], None]
    rank: int


def fallback_programs(t: torch.Tensor) -> int:
    """Programs of the fallback's logits kernel: two per SM on a GPU (the interpreter: no
    bound). A call without a flagged row costs each of them one scan of the flags; the
    grid of one program per tile took 0.9-1.1 us longer after the filter kernel (H100,
    V = 151936: 1187 tiles, B = 1-256)."""
    return 2 * _num_sms(t.device) if t.is_cuda else 1 << 30


def fallback_on_device(hidden: torch.Tensor, weight: torch.Tensor, bias, params: RowParams,
                       filters: Filters, out: F.FilteredOutput, logits: torch.Tensor | None,
                       count: torch.Tensor, *, n_real: int, vocab_start: int = 0,
                       constraints=None, listed: ListedScratch | None = None,
                       pdl: bool = False, gather: FallbackGather | None = None,
                       side: torch.Tensor | None = None, winner: bool = False,
                       logprobs: bool = True,
                       recs: torch.Tensor | None = None, parity=None,
                       parity_stride: int = 0, gate: torch.Tensor | None = None) -> None:
    """The exact fallback of one device's call, after stage2_filtered and with no host
    synchronisation (kernels/filter_fallback.py, kernels/filter_cut.py): the rows flagged in
    out.fallback get their outputs redone in `out` from their logits; count (int32 [2])
    gains the number of such rows: [0] those of the one-program-per-row path
    (filter_fallback.fallback_rows_kernel), [1] those of the cut's fast path (filter_cut.py).
    side: fp32 [B, tiles * TILE], the transformed logits this call's stage 1 wrote (then W is
    not read again; one device: they are the rows' logits), else they are recomputed into
    `logits` (fp32 [B, tiles * TILE], scratch). pdl: its launches are programmatic
    dependents (plan.pdl: stage2_filtered's are too). constraints (tpsample/constraints.py):
    the rows' logits take the mask (listed.eff: the tile pass's, when the call lists tokens)
    and then the listed tokens' adjusted logits (from listed.held and listed.dots, what this
    call's stage 1 and listed_prep kept). gather
    (tensor parallel): the rows' logit shards go to every rank (gather.own in each rank's
    buffer; the listed tokens' after the rest, in stream order) and, after gather.exchange,
    every rank redoes the rows from all shards. winner: the call's filter kernel stored each
    row's winner (merge "max"): one-sample rows take their winner where it is kept (and,
    returning tokens only (logprobs False), skip the cut), and the others draw noise only
    near their tile winners
    (kernels/filter_cut.py, WINNER), which they read from recs ([slots, planes, B, T, 4], as
    stage2_filtered read them; parity, parity_stride: the fan-out's two buffers).
    Split rows (gather and side, every flagged row on the cut's fast path, world > 1, at
    least SPLIT_MIN_ROWS rows per rank): each flagged row is gathered to and redone on one
    rank, b % world, which sends its outputs to the others after the cut; a second exchange
    then makes them visible (the gathered bytes and the cut's work per rank divided by world,
    for one more exchange: at B = 1 that exchange is all it changes). gate (one device,
    tpsample/fallback_gate.py: the gate stage2_filtered set): in a call's CUDA graph these
    launches run only when it is set; the rows kernel clears it."""
    B, D = hidden.shape
    if count.numel() != 2 or count.dtype != torch.int32:
        raise ValueError(f"count must be int32 [2] (the two paths' rows), got "
                         f"{count.dtype} {list(count.shape)}")
    if gather is not None:
        logits = gather.own
    elif side is not None:
        logits = side
    N = logits.shape[1]
    S = out.tokens.shape[1]
    n = filters.top_n
    dummy = params.inv_temp
    c = constraints
    launch = dict(num_warps=4, **({"launch_pdl": True} if pdl else {}))
    mask = None if c is None else (listed.eff if c.listed else c.mask)
    if c is not None and c.listed:
        allowed_or_eff = c.mask if c.mask is not None else listed.eff
    # the fan-out arguments (peer addresses, world, the exchange count); unused without gather
    fan = (count, 1, count) if gather is None else (gather.peers, gather.peers.numel(),
                                                    gather.calls)
    side_ptr, stride_side = _side_args(side, dummy).values()
    tiles = N // records.TILE
    block_f = min(1024, max(16, 1 << (B - 1).bit_length()))
    # (a call whose every row has a top-k launches none of the fast path's steps: no row of
    # it could take them)
    fast = F.cut_rows_possible(filters)
    split = (SPLIT_ROWS and gather is not None and side is not None and fast and fan[1] > 1
             and n == 0  # (the owner's outputs it sends hold no top n)
             and B >= SPLIT_MIN_ROWS * fan[1]
             and filters.top_k is None and (c is None or not c.listed) and 2 * S + 1 <= N)
    workspace = None
    if gate is not None:  # (one device: nothing is allocated inside the node's body)
        if fast:
            workspace = _cut_workspace(hidden, S, N, 1, winner and recs is not None and S == 1,
                                       logprobs)
        run_step(fallback_gate.open_body, (gate,))
    if side is None or gather is not None:  # (one device with side: the logits are there)
        run_named(filter_fallback.fallback_logits_kernel,
                  (min(tiles, fallback_programs(hidden)),), launch,
                  h_ptr=hidden, w_ptr=weight, bias_ptr=bias if bias is not None else dummy,
                  inv_temp_ptr=params.inv_temp, flag_ptr=out.fallback, out_ptr=logits, B=B,
                  V_rows=weight.shape[0], n_real=n_real, D=D, stride_hb=hidden.stride(0),
                  stride_wv=weight.stride(0), stride_ob=logits.stride(0),
                  mask_ptr=mask if mask is not None else out.fallback,
                  stride_mask=mask.stride(0) if mask is not None else 0, vocab_start=vocab_start,
                  peer_ptrs_ptr=fan[0], world=fan[1], calls_ptr=fan[2], n_tiles=tiles,
                  side_ptr=side_ptr, stride_side=stride_side, HAS_BIAS=bias is not None,
                  BLOCK_V=records.TILE, BLOCK_D=64, BLOCK_F=block_f, HAS_MASK=mask is not None,
                  PDL=pdl, FANOUT=gather is not None, FROM_SIDE=side is not None, SPLIT=split,
                  F32_DOT=hidden.dtype == torch.float32 or not hidden.is_cuda)
    if c is not None and c.listed:
        K = c.ids.shape[1]
        allowed = allowed_or_eff
        run_named(listed_records_kernel.listed_fallback_kernel, (B,),
                  launch if gather is None else dict(num_warps=4),  # (after the logits kernel)
                  dots_ptr=listed.dots, held_ptr=listed.held,
                  bias_ptr=bias if bias is not None else dummy, ids_ptr=c.ids,
                  values_ptr=c.values,
                  penalty_ptr=c.penalty if c.penalty is not None else dummy, mask_ptr=allowed,
                  inv_temp_ptr=params.inv_temp, flag_ptr=out.fallback, out_ptr=logits, K=K,
                  SPLITS=listed.dots.shape[1], n_real=n_real, vocab_start=vocab_start,
                  stride_ids=c.ids.stride(0), stride_mask=allowed.stride(0),
                  stride_held=listed.held.stride(0), stride_ob=logits.stride(0),
                  peer_ptrs_ptr=fan[0], world=fan[1], calls_ptr=fan[2],
                  HAS_BIAS=bias is not None, HAS_PENALTY=c.penalty is not None,
                  HAS_MASK=c.mask is not None, BLOCK_K=_listed_block(K),
                  PDL=pdl and gather is None, FANOUT=gather is not None)
    rows = dict(l=logits, stride=logits.stride(0), N=N, starts=count, slot_n=N, slot_stride=0,
                calls=count)
    owners = dict(peer_ptrs_ptr=count, rank=0, split=1)  # (one rank does every row)
    if gather is not None:  # every store of this rank is done: signal, wait for the peers'
        gather.exchange(out.fallback)
        world = gather.full.shape[0]
        rows = dict(l=gather.full, stride=N, N=world * N, starts=gather.starts, slot_n=N,
                    slot_stride=B * N, calls=gather.calls)
        launch = dict(num_warps=4)  # after the exchange in stream order
        if split:
            owners = dict(peer_ptrs_ptr=gather.peers, rank=gather.rank, split=world)
    if fast:
        _cut_steps(hidden, params, filters, out, count, rows, vocab_start, block_f,
                   dict(launch, num_warps=8), aligned=gather is None and vocab_start % 4 == 0,
                   slotted=gather is not None, owners=owners, split=split,
                   winner=(recs, parity, parity_stride) if winner and recs is not None else None,
                   logprobs=logprobs, workspace=workspace)
    if split:  # the owners' outputs, sent after their cut
        gather.exchange(out.fallback)
    run_named(filter_fallback.fallback_rows_kernel, (B,), dict(launch, num_warps=8),
              **_row_source(rows, params, filters, vocab_start),
              tokens_ptr=out.tokens, logprobs_ptr=out.logprobs, logz_ptr=out.logz,
              top_tok_ptr=out.top_tokens, top_lp_ptr=out.top_logprobs, flag_ptr=out.fallback,
              scratch_ptr=out.scratch, count_ptr=count, S=S, n_top=n,
              REPLACE=filters.replacement, BLOCK=min(1024, 1 << (rows["N"] - 1).bit_length()),
              BLOCK_N=max(16, 1 << max(n - 1, 0).bit_length()), CAP=F.KNOWN_CAP,
              rank=owners["rank"], world=owners["split"],
              gate_ptr=gate if gate is not None else count,
              PDL=pdl and gather is None, SLOTTED=gather is not None, FAST=fast, SPLIT=split,
              GATE=gate is not None)
    if gate is not None:
        run_step(fallback_gate.close_body, (gate,))


def _row_source(rows: dict, params: RowParams, filters: Filters, vocab_start: int) -> dict:
    """The keywords the fallback's row kernels share: the rows' logits (rows: one device's
    [B, N], or the ranks' gathered shards), the per-row parameters and the filters."""
    return dict(l_ptr=rows["l"], stride_lb=rows["stride"], N=rows["N"], vocab_start=vocab_start,
                inv_temp_ptr=params.inv_temp, seed_ptr=params.seed, offset_ptr=params.offset,
                starts_ptr=rows["starts"], slot_n=rows["slot_n"], slot_stride=rows["slot_stride"],
                calls_ptr=rows["calls"], RAW=filters.raw, **_filter_ptrs(params, filters))


def _filter_ptrs(params: RowParams, filters: Filters) -> dict:
    """The filter kernels' per-row filter tensors and HAS_* flags (a filter that is off gets
    a dummy tensor, never read)."""
    dummy = params.inv_temp
    return dict(top_k_ptr=filters.top_k if filters.top_k is not None else dummy,
                top_p_ptr=filters.top_p if filters.top_p is not None else dummy,
                min_p_ptr=filters.min_p if filters.min_p is not None else dummy,
                HAS_K=filters.top_k is not None, HAS_P=filters.top_p is not None,
                HAS_M=filters.min_p is not None)


# programs per step of kernels/filter_cut.py, in multiples of fallback_programs: the steps
# over a row's columns hide their loads' latency with more programs in flight (H200, D = 4096,
# B = 256, each launch alone in a CUDA graph, µs: STATS 99 / 50 at 1x / 2x, COMPACT 80 / 59,
# SAMPLE 176 / 158 at 1x / 4x; B = 64 within 1 µs either way)
# (HIST: 6 programs per SM where 3 are resident, two full waves; 4 per SM left a third
# of the second wave idle: H200, B = 256, flat rows, pass 1 143 -> 118 us)
_CUT_PROGRAMS = {filter_cut.STATS.value: 2, filter_cut.COMPACT.value: 4,
                 filter_cut.SAMPLE.value: 4, **{j: 3 for j in range(1, filter_cut.PASSES.value + 1)}}
# columns per HIST / COMPACT item in tokens-only calls, whose cut list holds the ~1 - p of
# the rows whose winner is not kept (a call with log-probs lists every top-p row: its items
# keep the G chunks of the other steps)
CUT_LIST_CHUNK = 8192
# from this batch size on, a HIST bracket that fits the CAP slots ends the passes (its later
# passes cost more than FINISH's longer sort), below it one that fits MID (H200, D = 4096,
# flat rows, top-p 0.9 with log-probs, HIST 1 from the records' window: 1.095 -> 1.013 ms
# at B = 256 and 0.488 -> 0.471 at B = 64 against the even first pass and no early end at
# B = 64; ending at CAP from B = 1 gave 0.471 too; the lists' chunks of 4,096 / 8,192
# columns for log-prob calls were 2-27 % slower)
EARLY_FROM_B = 128
EARLY_SMALL = filter_cut.MID.value


def _cut_workspace(hidden: torch.Tensor, S: int, N: int, split: int, use_winner: bool,
                   logprobs: bool) -> dict:
    """_cut_steps' chunking (G chunks of C columns, GH of CH for HIST and COMPACT, W sums,
    the read's block) and workspace (part, hist, keys) for B = hidden.shape[0] rows of N
    columns, split between `split` ranks."""
    B = hidden.shape[0]
    K = filter_cut
    block = min(2048, 1 << (N - 1).bit_length())  # a read per step: 2048 columns a pass
    G = max(8, cdiv(fallback_programs(hidden), cdiv(B, split))) if hidden.is_cuda else 4
    C = cdiv(cdiv(N, G), block) * block
    G = cdiv(N, C)
    GH, CH = G, C  # HIST and COMPACT over the cut list
    if use_winner and not logprobs:
        GH = max(G, cdiv(N, CUT_LIST_CHUNK))
        CH = cdiv(cdiv(N, GH), block) * block
        GH = cdiv(N, CH)
    W = max(K.NT.value + 2, S + 2, 5)  # (STATS: 5 sums with the winner check)
    dev = hidden.device
    return dict(G=G, C=C, GH=GH, CH=CH, W=W, block=block,
                part=torch.empty(K.SAMPLE.value + 1, B, G, W, dtype=torch.float32, device=dev),
                hist=torch.empty(K.PASSES.value + 1, B, GH, W, dtype=torch.float32, device=dev),
                keys=torch.empty(B, K.CAP.value + 2 + G * S, dtype=torch.int64, device=dev))


def _cut_steps(hidden, params: RowParams, filters: Filters, out: F.FilteredOutput, count,
               rows: dict, vocab_start: int, block_f: int, launch: dict, *, aligned: bool,
               slotted: bool, owners: dict, split: bool, winner: tuple | None = None,
               logprobs: bool = True, workspace: dict | None = None) -> None:
    """kernels/filter_cut.py's steps for the flagged rows with top-p / min-p and no top-k
    (the cut's steps only when the call has top-p). Workspace, per call: fp32 [SAMPLE + 1, B,
    G, W] and [PASSES + 1, B, GH, W] partial sums and int64 [B, CAP + 2 + G·S] keys (G chunks
    per row: at least 8, and two items per program of a full grid at small B; GH: tokens-only
    calls also at most CUT_LIST_CHUNK columns each); the cut list is in out.scratch. winner:
    (records, parity, parity_stride) of a call with merge "max" (kernels/filter_cut.py,
    WINNER); logprobs: the call returns log-probs (LOGPROBS: every top-p row's cut).
    owners: the rows this rank redoes, b = rank + k · split; split: it sends their outputs
    (kernels/filter_cut.py, SPLIT). workspace: _cut_workspace's, allocated before (default:
    here)."""
    B, S, N = out.fallback.shape[0], out.tokens.shape[1], rows["N"]
    K = filter_cut
    use_winner = winner is not None and S == 1
    ws = workspace or _cut_workspace(hidden, S, N, owners["split"], use_winner, logprobs)
    G, C, GH, CH, W, block = ws["G"], ws["C"], ws["GH"], ws["CH"], ws["W"], ws["block"]
    part, hist, keys = ws["part"], ws["hist"], ws["keys"]
    programs = fallback_programs(hidden)
    owned = cdiv(B, owners["split"])
    source = _row_source(rows, params, filters, vocab_start)
    if use_winner:
        recs, parity, parity_stride = winner
        rec = dict(rec_ptr=recs, st_slot=recs.stride(0), st_b=recs.stride(2),
                   st_t=recs.stride(3), T_rec=recs.shape[3], N_rec=recs.shape[0] * recs.shape[3],
                   parity_ptr=parity if parity is not None else count,
                   parity_stride=parity_stride, USE_PARITY=parity is not None,
                   BLOCK_R=max(16, 1 << (recs.shape[0] * recs.shape[3] - 1).bit_length()),
                   BLOCK_TC=max(16, 1 << cdiv(C, records.TILE).bit_length()))
    else:
        rec = dict(rec_ptr=count, st_slot=0, st_b=0, st_t=0, T_rec=1, N_rec=0, parity_ptr=count,
                   parity_stride=0)
    # a call whose rows check their winner needs x_max and Z from STATS only to check it
    # without the cut (top-p, tokens only); otherwise the filter kernel's (from the records)
    # serve, and no STATS is launched
    xmax_known = use_winner and (filters.top_p is None or logprobs)
    steps = [] if xmax_known else [K.STATS.value]
    if filters.top_p is not None:
        steps += list(K.CUT_STEPS)
    steps += [K.SAMPLE.value, K.FINAL.value]
    for step in steps:
        per_row = step in (K.FINISH.value, K.FINAL.value, K.SELECT.value)
        chunks = GH if 0 < step <= K.COMPACT.value else G
        grid = (max(1, min(programs * _CUT_PROGRAMS.get(step, 1),
                           owned if per_row else owned * chunks)),)
        run_named(K.cut_step_kernel, grid, launch, **source,
                  tokens_ptr=out.tokens, logprobs_ptr=out.logprobs, logz_ptr=out.logz,
                  flag_ptr=out.fallback, count_ptr=count, part_ptr=part, keys_ptr=keys,
                  win_ptr=out.scratch, win_at=B * F.KNOWN_CAP, **rec, B=B, G=G, C=C, W=W, S=S,
                  STEP=step, ALIGNED4=aligned, BLOCK=block, WINNER=use_winner,
                  LOGPROBS=use_winner and logprobs, XMAX_KNOWN=xmax_known,
                  EARLY=K.CAP.value if B >= EARLY_FROM_B else EARLY_SMALL,
                  SUB=min(block, 512), BLOCK_G=max(2, 1 << (G - 1).bit_length()),
                  BLOCK_F=block_f, PDL="launch_pdl" in launch, SLOTTED=slotted, **owners,
                  SPLIT=split, hist_ptr=hist, GH=GH, CH=CH,
                  BLOCK_GH=max(2, 1 << (GH - 1).bit_length()), top_tok_ptr=out.top_tokens,
                  top_lp_ptr=out.top_logprobs, n_top=out.top_tokens.shape[1],
                  BLOCK_N=max(16, 1 << max(out.top_tokens.shape[1] - 1, 0).bit_length()))
