"""Launchers for the Triton kernels: stage 1 (records) and stage 2 (reduce)."""
from __future__ import annotations

import functools
import json
import os
import threading
import warnings
from pathlib import Path

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .kernels import (fused_sample_records_kernel, fused_sample_records_persistent_kernel,
                      gluon_pingpong, gluon_sample, logits_records_kernel, reduce_records_kernel)
from .merge import GROUP_MERGES
from .torch_records import DEFAULT_TILE

BLOCK_V = DEFAULT_TILE  # one record per 128 tokens everywhere: logmass partitions agree


CONFIG_DIR = Path(__file__).parent / "configs"


@functools.lru_cache(maxsize=None)
def tuned_table(device_index: int) -> tuple[dict[int, dict], dict[int, dict[int, dict]]]:
    """Configs written by `python -m tpsample.tune` for this GPU model: (buckets, by_max_d),
    configs keyed by batch bucket, and overrides {max_d: {bucket: config}} for D <= max_d
    (`tune --max-d`: thin heads, where less work per W byte moves the best kernel)."""
    name = torch.cuda.get_device_name(device_index)
    key = "h200" if "H200" in name else "h100" if "H100" in name else None
    path = CONFIG_DIR / f"{key}.json"
    if key is None or not path.exists():
        return {}, {}
    data = json.loads(path.read_text())
    return ({int(b): cfg for b, cfg in data["buckets"].items()},
            {int(d): {int(b): cfg for b, cfg in over.items()}
             for d, over in data.get("by_max_d", {}).items()})


def table_config(buckets: dict[int, dict], by_max_d: dict[int, dict[int, dict]], B: int,
                 D: int) -> dict:
    """The config for (B, D): the bucket is the smallest >= B (else the largest), and the
    override of the smallest max_d >= D replaces that bucket's config where it has one."""
    bucket = min((b for b in buckets if b >= B), default=max(buckets))
    for max_d in sorted(d for d in by_max_d if d >= D):
        if bucket in by_max_d[max_d]:
            return dict(by_max_d[max_d][bucket])
    return dict(buckets[bucket])


def kernel_config(B: int, D: int, dtype: torch.dtype, device_type: str = "cuda",
                  device_index: int = 0) -> dict:
    """Stage-1 strategy and block sizes (docs/perf-notes.md says how they were chosen).

    strategy "fused": the matmul runs inside the kernel (logits never leave registers);
    "persistent": the same with a fixed grid of PROGRAMS_PER_SM × SMs programs walking the
    tiles (epilogue overlapped with the next tile's loads);
    "logits": cuBLAS writes fp32 logits and one Triton pass turns them into records;
    "ws" (Hopper): the warp-specialized Gluon kernel (kernels/gluon_sample.py), "logits"
    where it does not apply (ws_supported); "pp" (Hopper): its ping-pong variant
    (kernels/gluon_pingpong.py, [128, 128] tiles), "ws" where it does not apply (pp_supported).
    NOISE_STEP (fused, one sample): the noise is drawn in D step int(NOISE_STEP * steps) of
    the main loop, under the loads in flight, instead of in the epilogue; NOISE_CHUNKS (1, 2,
    4) splits it into row blocks drawn NOISE_EVERY (default 2) steps apart.
    Shipped tables (tpsample/configs/*.json, see table_config) are used for bf16/fp16;
    otherwise a default."""
    if device_type != "cuda":  # the interpreter pays per program: few, large tiles
        return dict(strategy="fused", BLOCK_B=min(max(16, next_pow2(B)), 256),
                    BLOCK_D=64, NUM_STAGES=1, num_warps=4)
    buckets, by_max_d = tuned_table(device_index) if dtype != torch.float32 else ({}, {})
    if buckets:
        return table_config(buckets, by_max_d, B, D)
    if B > 64:  # Hopper: the warp-specialized kernel (elsewhere WS_FALLBACK, cuBLAS + records
        # pass, which beats the fused main loop there)
        return dict(strategy="ws", BLOCK_B=128, NUM_STAGES=4, EPI_B=64, num_warps=8)
    block_b = min(max(16, next_pow2(B)), 64)
    return dict(strategy="fused", BLOCK_B=block_b, BLOCK_D=64 if dtype == torch.float32 else 128,
                NUM_STAGES=4, num_warps=4 if block_b <= 16 else 8)


PDL_ENABLED = True  # programmatic dependent launch of stage 2 (Hopper+); off for A/B timing


@functools.lru_cache(maxsize=None)
def _pdl_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """Stage 2 launched with programmatic stream serialization: its launch and prologue
    overlap the tail of stage 1 (gdc_wait in the kernel keeps the order). CUDA only."""
    return (PDL_ENABLED and device.type == "cuda"
            and _pdl_capable(device.index if device.index is not None else torch.cuda.current_device()))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def cdiv(a: int, b: int) -> int:  # triton.cdiv is a constexpr_function: ~3 µs per host call
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# set by tpsample.replay.record: launches this thread makes while it is set are logged
RECORDER = threading.local()


def run_kernel(fn, grid, args: tuple, constexprs: dict, options: dict):
    """fn[grid](*args, **constexprs, **options); logs (fn, compiled kernel, grid, args,
    constexprs) to this thread's RECORDER log when one is set."""
    compiled = fn[grid](*args, **constexprs, **options)
    log = getattr(RECORDER, "log", None)
    if log is not None:
        log.append((fn, compiled, grid, args, constexprs))
    return compiled


def run_step(fn, args: tuple):
    """fn(*args) for a torch step between launches (the hybrid's GEMM); logged to RECORDER
    as (fn, None, None, args, result) so a replay re-runs it and feeds its new result on."""
    result = fn(*args)
    log = getattr(RECORDER, "log", None)
    if log is not None:
        log.append((fn, None, None, args, result))
    return result


def num_tiles(rows: int) -> int:
    return cdiv(rows, BLOCK_V)


def records_view(flat: torch.Tensor, S: int, B: int, T: int,
                 tile_major: bool = False) -> torch.Tensor:
    """[..., S·B·T·4] fp32 → the records view [..., S, B, T, 4]. Row-major by default (a row's
    records contiguous: what stage 2 reads best); tile_major lays them out [S, T, B, 4], so
    the records of one stage-1 program (one tile, its rows) are one contiguous run: what the
    P2P fan-out writes best over NVLink (perf notes v1.6)."""
    lead = flat.shape[:-1]
    if tile_major:
        return flat.view(*lead, S, T, B, 4).transpose(-3, -2)
    return flat.view(*lead, S, B, T, 4)


def check_records_layout(out: torch.Tensor, shape: tuple) -> None:
    """Stage 1 writes records through strides: the field dim contiguous, every other stride
    a multiple of 4 floats and the base 16-byte aligned (whole records, never split across
    cache sectors)."""
    ok = (tuple(out.shape) == shape and out.dtype == torch.float32 and out.stride(-1) == 1
          and all(st % 4 == 0 for st in out.stride()[:-1]) and out.data_ptr() % 16 == 0)
    if not ok:
        raise ValueError(f"records `out` must be fp32 {list(shape)}, last dim contiguous, other "
                         f"strides multiples of 4, 16-byte aligned; got {out.dtype} "
                         f"{list(out.shape)} strides {out.stride()}")


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


def fused_records(hidden, weight, *, bias, inv_temp, seed, offset, num_samples, n_real,
                  vocab_start=0, out=None, tiles=None, config=None, peer_ptrs=None,
                  parity=None, need_mass=True, cdf=False) -> torch.Tensor:
    """Stage 1 on (a shard of) the LM head → records [S, B, T, 4] fp32, written into `out`
    if given (any strides that check_records_layout accepts: e.g. this rank's slot of an
    exchange buffer, through records_view). peer_ptrs: int64 CUDA tensor [2, P] of the
    addresses of this rank's slot in every peer's buffer (same strides as `out`) for two
    alternating buffers, and parity an int32 CUDA tensor [2] whose first element selects the
    buffer (the second is stage 2's program counter, see reduce_records); the kernel then
    stores each record to all P peers of that buffer instead of `out`. need_mass=False (max
    merge, no log-probs wanted) stores the tile max instead of the tile log-mass and 0 instead
    of the winner's logit: the reduce's log Z and log-probs are then meaningless, but the
    tokens and the degenerate-row rule are unchanged. cdf: the records of the "cdf" merge
    (tpsample/merge.py, fact 6; needs need_mass): where a Hopper table (or `config`) says pp
    or ws, pp makes them for one sample at B > 64 (CDF_GLUON), else the cuBLAS + records pass
    does."""
    if cdf and not need_mass:
        raise ValueError("cdf records need the tile log-masses (need_mass=True)")
    B, D = hidden.shape
    V_rows = weight.shape[0]
    T = tiles if tiles is not None else num_tiles(V_rows)
    if out is None:
        out = torch.empty(num_samples, B, T, 4, dtype=torch.float32, device=hidden.device)
    check_records_layout(out, (num_samples, B, T, 4))
    cfg = dict(config or kernel_config(B, D, hidden.dtype, hidden.device.type,
                                        hidden.device.index or 0))
    if cfg["strategy"] == "pp":
        if cfg.get("BLOCK_B", 128) != 128:
            raise ValueError("config BLOCK_B of the ping-pong kernel must be 128, "
                             f"got {cfg['BLOCK_B']!r}")
        if not pp_supported(hidden, weight, vocab_start):
            cfg = dict(PP_FALLBACK)
    if cdf and cfg["strategy"] in ("pp", "ws"):  # ws has no cdf epilogue; pp one sample only
        # (a table's cell at B <= 64 takes the hybrid: at B = 64 on H200 pp took 1.06-1.12x its
        # time, the fused kernel 1.24-1.53x, perf notes v2.3; an explicit pp/ws config is kept)
        if (CDF_GLUON and num_samples == 1 and (B > 64 or config is not None)
                and pp_supported(hidden, weight, vocab_start)):
            cfg = cfg if cfg["strategy"] == "pp" else dict(PP_CDF)
        else:
            cfg = dict(WS_FALLBACK)
    if cfg["strategy"] == "ws" and not ws_supported(hidden, weight, vocab_start):
        cfg = dict(WS_FALLBACK)  # what the warp-specialized kernel does not take
    strategy, nw = cfg.pop("strategy"), cfg.pop("num_warps")
    maxnreg = cfg.pop("MAXNREG", None)  # register cap: lets two programs share an SM
    trim = cfg.pop("TRIM", True)  # drop padding columns before the noise (B < BLOCK_B)
    noise_step = cfg.pop("NOISE_STEP", None)  # where in the D loop the noise is drawn (fraction)
    noise_chunks = cfg.pop("NOISE_CHUNKS", 1)  # in 1, 2 or 4 row blocks ...
    noise_every = cfg.pop("NOISE_EVERY", 2)  # ... drawn this many D steps apart
    if noise_chunks not in (1, 2, 4):
        raise ValueError(f"config NOISE_CHUNKS must be 1, 2 or 4, got {noise_chunks!r}")
    grid = (cdiv(B, cfg["BLOCK_B"]), T)
    halvings = (cfg["BLOCK_B"] // next_pow2(B)).bit_length() - 1 if trim and B > 0 else 0
    consts = dict(HAS_BIAS=bias is not None, ALIGNED4=vocab_start % 4 == 0, BLOCK_V=BLOCK_V,
                  BLOCK_B=cfg["BLOCK_B"], NUM_PEERS=0 if peer_ptrs is None else peer_ptrs.shape[-1],
                  HALVINGS=max(halvings, 0), TILE_MASS=need_mass, PDL=use_pdl(hidden.device),
                  CDF=cdf)
    options = dict(num_warps=nw, **({"maxnreg": maxnreg} if maxnreg else {}))
    peers = peer_ptrs if peer_ptrs is not None else seed  # never read when NUM_PEERS == 0
    parity = parity if parity is not None else seed
    bias_arg = bias if bias is not None else inv_temp  # never read when HAS_BIAS is False
    if strategy == "pp":
        return pp_records(hidden, weight, bias_arg, inv_temp, seed, offset, out, num_samples,
                          n_real, vocab_start, bias is not None, need_mass, cfg, maxnreg,
                          peer_ptrs, parity, cdf)
    if strategy == "ws":
        return ws_records(hidden, weight, bias_arg, inv_temp, seed, offset, out, num_samples,
                          n_real, vocab_start, bias is not None, need_mass, cfg, nw, maxnreg,
                          peer_ptrs, parity)
    if strategy == "logits":
        logits = run_step(logits_fp32, (hidden, weight))
        run_kernel(logits_records_kernel, grid, (
            logits, bias_arg, inv_temp, seed, offset, out, B, V_rows, n_real, vocab_start,
            num_samples, logits.stride(0), *out.stride()[:3], peers, parity), consts,
            options)
        return out
    consts.update(EVEN_D=D % cfg["BLOCK_D"] == 0, BLOCK_D=cfg["BLOCK_D"],
                  FP32_DOT=hidden.dtype == torch.float32 or not hidden.is_cuda)
    if strategy == "persistent":
        n_prog = cfg["PROGRAMS_PER_SM"] * (_num_sms(hidden.device) if hidden.is_cuda else 1)
        run_kernel(fused_sample_records_persistent_kernel, (n_prog,), (
            hidden, weight, bias_arg, inv_temp, seed, offset, out,
            B, D, V_rows, n_real, vocab_start, T,
            hidden.stride(0), weight.stride(0), *out.stride()[:3], peers, parity),
            dict(consts, NUM_PROGRAMS=n_prog, SAMPLES=num_samples),
            dict(options, num_stages=cfg["NUM_STAGES"]))
        return out
    w_arg = weight
    if cfg.get("TMA") and weight.data_ptr() % 16 == 0 and weight.stride(0) * weight.element_size() % 16 == 0:
        # W through the tensor-memory accelerator (host-built descriptor; TMA needs 16-byte
        # aligned rows, otherwise the pointer path below)
        w_arg = TensorDescriptor.from_tensor(weight, block_shape=[BLOCK_V, cfg["BLOCK_D"]])
        consts["W_DESC"] = True
    if noise_step is not None and num_samples == 1 and vocab_start % 4 == 0 and not cdf:
        steps = cdiv(D, cfg["BLOCK_D"])  # measured best near a quarter of the loop (perf notes)
        # all blocks must land inside the loop: shrink the spacing, then the first step
        every = min(noise_every, (steps - 1) // (noise_chunks - 1)) if noise_chunks > 1 else 0
        consts.update(NOISE_AT=min(int(noise_step * steps), steps - 1 - (noise_chunks - 1) * every),
                      NOISE_CHUNKS=noise_chunks, NOISE_EVERY=every)
    run_kernel(fused_sample_records_kernel, grid, (
        hidden, w_arg, bias_arg, inv_temp, seed, offset, out,
        B, D, V_rows, n_real, vocab_start, num_samples,
        hidden.stride(0), weight.stride(0), *out.stride()[:3], peers, parity),
        dict(consts, NUM_STAGES=cfg["NUM_STAGES"]), options)
    return out


WS_BLOCK_K = 64
# The "cdf" records in the Hopper kernels (pp, one sample; where a table says ws too: ws has no
# cdf epilogue). TPSAMPLE_CDF_GLUON=0 (A/B timing) makes them with cuBLAS + the records pass.
CDF_GLUON = os.environ.get("TPSAMPLE_CDF_GLUON", "1") != "0"
# TPSAMPLE_WS=0: never the warp-specialized kernel (its fallback instead; A/B timing)
WS_ENABLED = os.environ.get("TPSAMPLE_WS", "1") != "0"
WS_FALLBACK = dict(strategy="logits", BLOCK_B=64, BLOCK_D=0, NUM_STAGES=0, num_warps=8)


@functools.lru_cache(maxsize=None)
def _is_hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


@functools.lru_cache(maxsize=None)
def _warn_no_gluon() -> None:
    allowed = " or ".join(f"{a}.{b}" for a, b in gluon_sample.GLUON_VERSIONS)
    warnings.warn(f"tpsample: the Hopper kernels (ws, pp) are written for Triton {allowed}'s "
                  f"Gluon API; with Triton {triton.__version__} the cuBLAS + records-pass path "
                  f"runs instead (same records, slower at B >= 64)", RuntimeWarning, stacklevel=4)


def ws_supported(hidden, weight, vocab_start: int) -> bool:
    """What the warp-specialized kernel (Gluon, wgmma: Hopper only) takes: 16-bit inputs
    whose rows TMA can address (16-byte aligned), V_rows and vocab_start multiples of 4
    (W is read as four row lanes, see kernels/gluon_sample.py), on a Triton whose Gluon API
    the kernel is written for (warns once otherwise)."""
    dev = hidden.device
    if not (WS_ENABLED and dev.type == "cuda"
            and _is_hopper(dev.index if dev.index is not None else torch.cuda.current_device())):
        return False
    if not gluon_sample.AVAILABLE:
        _warn_no_gluon()
        return False
    return (hidden.dtype in (torch.bfloat16, torch.float16) and weight.dtype == hidden.dtype
            and hidden.stride(1) == 1 and weight.stride(1) == 1
            and hidden.stride(0) % 8 == 0 and weight.stride(0) % 8 == 0
            and hidden.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
            and weight.shape[0] % 4 == 0 and vocab_start % 4 == 0)


@functools.lru_cache(maxsize=64)
def _ws_layouts(dtype: torch.dtype, block_b: int, block_k: int):
    from triton.experimental.gluon import language as gl
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    q = BLOCK_V // 4
    return (gl.NVMMASharedLayout.get_default_for([4, q, block_k], gdt),
            gl.NVMMASharedLayout.get_default_for([block_b, block_k], gdt))


def ws_records(hidden, weight, bias_arg, inv_temp, seed, offset, out, num_samples, n_real,
               vocab_start, has_bias, need_mass, cfg, num_warps, maxnreg, peer_ptrs=None,
               parity=None):
    """Stage 1 by the warp-specialized Hopper kernel (kernels/gluon_sample.py): a persistent
    grid of one program per SM over [BLOCK_V, BLOCK_B] tiles. W [V_rows, D] is handed to TMA
    as the view [4, V_rows / 4, D] (row 4q + a at [a, q]), so each tile lands in shared
    memory in lane order. A replay (tpsample.replay) re-issues the launch with both
    descriptors rebased on that call's hidden and weight.
    peer_ptrs / parity: the P2P fan-out, as in fused_records (`out` then gives the strides,
    and the address the peer slots are addressed from: nothing is stored into it)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    B, D = hidden.shape
    V_rows = weight.shape[0]
    block_b, block_k = cfg["BLOCK_B"], cfg.get("BLOCK_K", WS_BLOCK_K)
    mma_warps = 8 if block_b > 128 else 4  # one warpgroup holds at most a [128, 128] fp32 tile
    w_layout, h_layout = _ws_layouts(hidden.dtype, block_b, block_k)
    row = weight.stride(0)
    # base = weight itself with the view's shape and strides (TMA reads only the base
    # address), so a replay (tpsample.replay) can rebase the descriptor on another weight
    w_desc = GluonDescriptor(weight, [4, V_rows // 4, D], [row, 4 * row, 1],
                             [4, BLOCK_V // 4, block_k], w_layout)
    h_desc = GluonDescriptor(hidden, list(hidden.shape), list(hidden.stride()),
                             [block_b, block_k], h_layout)
    T = out.shape[2]
    nb = cdiv(B, block_b)
    tiles = T * nb
    grid = (min(tiles, cfg.get("PROGRAMS_PER_SM", 1) * _num_sms(hidden.device)),)
    constexprs = dict(
        HAS_BIAS=has_bias, TILE_MASS=need_mass, STAGES=cfg["NUM_STAGES"],
        EPI_B=cfg.get("EPI_B", 64), LOADER_REGS=cfg.get("LOADER_REGS", 24),
        MMA_REGS=cfg.get("MMA_REGS", 168 if mma_warps == 4 else 160), MMA_WARPS=mma_warps,
        NUM_PEERS=0 if peer_ptrs is None else peer_ptrs.shape[-1])
    # the register file split evenly over all warps (epilogue + mma + 4 for the loader)
    # before setmaxnreg moves registers from the loader to the others
    options = dict(num_warps=num_warps,
                   maxnreg=maxnreg or 65536 // (32 * (num_warps + mma_warps + 4)) // 8 * 8)
    run_kernel(gluon_sample.ws_records_kernel, grid, (
        w_desc, h_desc, bias_arg, inv_temp, seed, offset, out, B, n_real, vocab_start,
        num_samples, *out.stride()[:3], peer_ptrs if peer_ptrs is not None else seed,
        parity if parity is not None else seed, tiles, nb, cdiv(D, block_k)), constexprs, options)
    return out


# what the ping-pong kernel does not take goes to the warp-specialized kernel's 128-row tile
PP_FALLBACK = dict(strategy="ws", BLOCK_B=128, NUM_STAGES=5, EPI_B=64, num_warps=8)
PP_CDF = dict(strategy="pp", BLOCK_B=128, NUM_STAGES=5, num_warps=4)  # cdf where a table says ws


def pp_supported(hidden, weight, vocab_start: int) -> bool:
    """What the ping-pong kernel takes: what ws_supported says, with V_rows a multiple of 32
    (W is read as the view [2, V_rows / 32, 2, 8, D], see kernels/gluon_pingpong.py)."""
    return ws_supported(hidden, weight, vocab_start) and weight.shape[0] % 32 == 0


@functools.lru_cache(maxsize=64)
def _pp_layouts(dtype: torch.dtype, block_k: int):
    from triton.experimental.gluon import language as gl
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return (gl.NVMMASharedLayout.get_default_for([2, 4, 2, 8, block_k], gdt),
            gl.NVMMASharedLayout.get_default_for([128, block_k], gdt))


# Profiling only (tpsample.probe --pp-trace): an int64 CUDA tensor [tiles, 4] that pp_records
# fills with each tile's consumer clocks (kernels/gluon_pingpong.pp_records_kernel, TRACE).
PP_TRACE = None


def pp_records(hidden, weight, bias_arg, inv_temp, seed, offset, out, num_samples, n_real,
               vocab_start, has_bias, need_mass, cfg, maxnreg, peer_ptrs=None, parity=None,
               cdf=False):
    """Stage 1 by the ping-pong Hopper kernel (kernels/gluon_pingpong.py): a persistent grid
    of one program per SM over [128, 128] tiles, two consumer warpgroups taking turns. W
    [V_rows, D] is handed to TMA as the view [2, V_rows / 32, 2, 8, D] (row 32t + 4j + 2r + h
    at [r, t, h, j]), so a thread's accumulator rows are one Philox group. Arguments as
    ws_records (cfg: NUM_STAGES, optional BLOCK_K, CONSUMER_REGS); cdf: the "cdf" records
    (one sample, need_mass)."""
    if cdf and (num_samples != 1 or not need_mass):
        raise ValueError("the ping-pong kernel's cdf records need num_samples == 1 and need_mass")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    B, D = hidden.shape
    V_rows = weight.shape[0]
    block_k = cfg.get("BLOCK_K", WS_BLOCK_K)
    w_layout, h_layout = _pp_layouts(hidden.dtype, block_k)
    row = weight.stride(0)
    w_desc = GluonDescriptor(weight, [2, V_rows // 32, 2, 8, D],
                             [2 * row, 32 * row, row, 4 * row, 1], [2, 4, 2, 8, block_k], w_layout)
    h_desc = GluonDescriptor(hidden, list(hidden.shape), list(hidden.stride()), [128, block_k],
                             h_layout)
    T = out.shape[2]
    nb = cdiv(B, 128)
    tiles = T * nb
    grid = (min(tiles, _num_sms(hidden.device)),)
    constexprs = dict(
        HAS_BIAS=has_bias, TILE_MASS=need_mass, STAGES=cfg["NUM_STAGES"],
        LOADER_REGS=cfg.get("LOADER_REGS", 24), CONSUMER_REGS=cfg.get("CONSUMER_REGS", 240),
        SINGLE=num_samples == 1, NUM_PEERS=0 if peer_ptrs is None else peer_ptrs.shape[-1],
        TRACE=PP_TRACE is not None, CDF=cdf)
    if PP_TRACE is not None and PP_TRACE.shape != (tiles, 4):
        raise ValueError(f"PP_TRACE must be int64 [{tiles}, 4] for this call, got {tuple(PP_TRACE.shape)}")
    # 4 warps per consumer and 4 for the loader's warpgroup: the register file split evenly
    # before setmaxnreg moves the loader's to the consumers
    options = dict(num_warps=4, maxnreg=maxnreg or 168)
    run_kernel(gluon_pingpong.pp_records_kernel, grid, (
        w_desc, h_desc, bias_arg, inv_temp, seed, offset, out, B, n_real, vocab_start,
        num_samples, *out.stride()[:3], peer_ptrs if peer_ptrs is not None else seed,
        parity if parity is not None else seed, PP_TRACE if PP_TRACE is not None else seed, tiles,
        nb, cdiv(D, block_k)), constexprs, options)
    return out


def reduce_records(records: torch.Tensor, inv_temp, seed, offset, merge: str, parity=None,
                   parity_stride: int = 0, launch: tuple[int, int, int] | None = None):
    """Stage 2. records [slots, S, B, T, 4] (any strides, the last dim contiguous)
    → tokens int64 [B, S], logprobs fp32 [B, S], logz fp32 [B]. With `parity` (int32 CUDA
    tensor [2], (parity, 0) between calls) the records are read parity[0] * parity_stride
    elements past `records`, and the kernel flips parity[0] once all its programs are done.
    launch: (BLOCK_R, BLOCK_N, num_warps) override, for tuning."""
    slots, S, B, T, _ = records.shape
    assert records.stride(4) == 1
    dev = records.device
    tokens = torch.empty(B, S, dtype=torch.int64, device=dev)
    logprobs = torch.empty(B, S, dtype=torch.float32, device=dev)
    logz = torch.empty(B, dtype=torch.float32, device=dev)
    N = slots * T
    num_warps = 4
    if launch is not None:
        block_r, block_n, num_warps = launch
    elif dev.type == "cuda":  # one (sample, row) per program, all its records in one pass
        block_r, block_n = 1, min(4096, max(4, next_pow2(N)))
        if merge in GROUP_MERGES:  # a Gumbel per record: 8 warps hide its latency better
            num_warps = 8  # (H200, D = 4096: 10.5-16.5 -> 9.1-12.5 us; max: no change)
    else:  # the interpreter pays per program, not per element
        block_n = min(1024, max(4, next_pow2(N)))
        block_r = min(max(16384 // block_n, 1), next_pow2(B * S))
    if block_n < 4 or block_n & (block_n - 1):
        raise ValueError(f"launch BLOCK_N must be a power of 2 >= 4, got {block_n}")
    pdl = use_pdl(dev)
    run_kernel(reduce_records_kernel, (cdiv(B * S, block_r),), (
        records, inv_temp, seed, offset, tokens, logprobs, logz,
        B, S, N, T, *records.stride()[:4],
        parity if parity is not None else seed, parity_stride),
        dict(LOGMASS=merge in GROUP_MERGES, BLOCK_R=block_r, BLOCK_N=block_n,
             USE_PARITY=parity is not None, ONE_SLOT=slots == 1, PDL=pdl),
        dict(num_warps=num_warps, **({"launch_pdl": True} if pdl else {})))
    return tokens, logprobs, logz
