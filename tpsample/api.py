"""Public single-device API: tpsample.sample."""
from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch

from . import merge as merge_math
from . import noise
from .torch_records import records_torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MERGES = ("max", "logmass", "cdf")
BACKENDS = ("auto", "triton", "torch")
MAX_VOCAB = 1 << 24  # token ids travel as float32 in the records
SEED_HIGH = 1 << 62


class SampleOutput(NamedTuple):
    """tokens int64 [B] or [B, S]; logprobs fp32, same shape: log p(token) under the
    transformed distribution; logz fp32 [B]: logsumexp of the row's transformed logits."""
    tokens: torch.Tensor
    logprobs: torch.Tensor
    logz: torch.Tensor


class RowParams(NamedTuple):
    """Per-row sampling parameters, normalised to device tensors of shape [B]."""
    inv_temp: torch.Tensor  # fp32; 0 marks a greedy row (T = 0), NaN an invalid one
    seed: torch.Tensor      # int64
    offset: torch.Tensor    # int64


def _check_matrix(name: str, t, ndim: int = 2):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {t.dtype}")


def check_hidden_weight(hidden, weight, weight_name: str = "weight"):
    _check_matrix("hidden", hidden)
    _check_matrix(weight_name, weight)
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"{weight_name} has D={weight.shape[1]} but hidden has D={hidden.shape[1]}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{weight_name} dtype {weight.dtype} differs from hidden dtype {hidden.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"{weight_name} is on {weight.device} but hidden is on {hidden.device}")
    if weight.shape[0] > 0 and weight.stride(1) != 1:
        raise ValueError(f"{weight_name} rows must be contiguous (stride(1) == 1); "
                         "a copy of an LM head is too large to make silently")


_FILLED: dict = {}


def _filled(B: int, value, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.full((B,), value) on device, cached for reuse across calls (kernels only read it).
    Saves a launch and ~7 µs of host time per parameter; never cached during graph capture
    (a tensor filled inside a capture holds nothing until the first replay)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.full((B,), value, dtype=dtype, device=device)
    key = (B, value, dtype, device)
    t = _FILLED.get(key)
    if t is None:
        if len(_FILLED) >= 256:
            _FILLED.clear()
        t = _FILLED[key] = torch.full((B,), value, dtype=dtype, device=device)
    return t


def _per_row_tensor(name: str, value, B: int, device, dtypes: tuple[torch.dtype, ...]):
    if value.ndim != 1 or value.shape[0] != B:
        raise ValueError(f"{name} tensor must have shape [{B}], got {tuple(value.shape)}")
    if value.dtype not in dtypes:
        raise TypeError(f"{name} tensor must have dtype {' or '.join(map(str, dtypes))}, got {value.dtype}")
    return value if value.device == device else value.to(device)


def row_params(hidden: torch.Tensor, temperature, seed, offset) -> RowParams:
    """Validate and normalise temperature / seed / offset (scalars or Tensor[B])."""
    B, dev = hidden.shape[0], hidden.device
    if isinstance(temperature, torch.Tensor):
        t = _per_row_tensor("temperature", temperature, B, dev,
                            (torch.float32, torch.float64, torch.float16, torch.bfloat16)).float()
        if not torch.cuda.is_available() or not torch.cuda.is_current_stream_capturing():
            bad = ~torch.isfinite(t) | (t < 0)
            if bool(bad.any()):
                raise ValueError("temperature must be finite and >= 0 (0 = greedy); got "
                                 f"{t[bad][:4].tolist()} in rows {bad.nonzero()[:4, 0].tolist()}")
        # under CUDA-graph capture nothing is checked on the host: invalid rows get a NaN
        # inverse temperature and come back as degenerate rows (logz NaN, token 0)
        inv_temp = torch.where(t > 0, 1.0 / t, torch.where(t == 0, 0.0, float("nan")))
    elif isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
        if not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {temperature}")
        inv = 0.0 if temperature == 0 else 1.0 / temperature
        inv_temp = _filled(B, inv, torch.float32, dev)
    else:
        raise TypeError(f"temperature must be a float or a Tensor[B], got {type(temperature).__name__}")

    if seed is None:
        seed_t = torch.randint(0, SEED_HIGH, (B,), dtype=torch.int64, device=dev)
    elif isinstance(seed, torch.Tensor):
        seed_t = _per_row_tensor("seed", seed, B, dev, (torch.int64,))
    elif isinstance(seed, int) and not isinstance(seed, bool):
        if not -(1 << 63) <= seed < (1 << 63):
            raise ValueError(f"seed must fit in int64, got {seed}")
        seed_t = _filled(B, seed, torch.int64, dev)
    else:
        raise TypeError(f"seed must be None, an int or a Tensor[B] int64, got {type(seed).__name__}")

    if isinstance(offset, torch.Tensor):
        offset_t = _per_row_tensor("offset", offset, B, dev, (torch.int64,))
    elif isinstance(offset, int) and not isinstance(offset, bool):
        if not -(1 << 63) <= offset < (1 << 63):
            raise ValueError(f"offset must fit in int64, got {offset}")
        offset_t = _filled(B, offset, torch.int64, dev)
    else:
        raise TypeError(f"offset must be an int or a Tensor[B] int64, got {type(offset).__name__}")
    return RowParams(inv_temp, seed_t, offset_t)


def check_bias(bias, rows: int, device, name: str = "bias"):
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor[{rows}] or None, got {type(bias).__name__}")
    if bias.ndim != 1 or bias.shape[0] != rows:
        raise ValueError(f"{name} must have shape [{rows}], got {tuple(bias.shape)}")
    if not bias.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor (used as float32), got {bias.dtype}")
    if bias.device != device:
        raise ValueError(f"{name} is on {bias.device} but hidden is on {device}")
    return bias.float().contiguous()


def check_options(num_samples, merge, backend):
    if (not isinstance(num_samples, int) or isinstance(num_samples, bool)
            or not 1 <= num_samples < noise.MAX_SAMPLES):
        raise ValueError(f"num_samples must be an int in [1, 2**29), got {num_samples!r}")
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def resolve_backend(backend: str, device: torch.device) -> str:
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if backend == "auto":
        return "triton" if device.type == "cuda" or interpret else "torch"
    if backend == "triton" and device.type != "cuda" and not interpret:
        raise ValueError("backend='triton' needs CUDA tensors or TRITON_INTERPRET=1")
    return backend


def package(tokens, logprobs, logz, num_samples: int, return_logprobs: bool):
    """tokens / logprobs [B, S] (or already [B] when S == 1) → the public result."""
    if num_samples == 1 and tokens.ndim == 2:
        tokens, logprobs = tokens[:, 0], logprobs[:, 0]
    return SampleOutput(tokens, logprobs, logz) if return_logprobs else tokens


def empty_result(device, num_samples, return_logprobs):
    shape = (0,) if num_samples == 1 else (0, num_samples)
    tokens = torch.empty(shape, dtype=torch.int64, device=device)
    if not return_logprobs:
        return tokens
    return SampleOutput(tokens, torch.empty(shape, device=device), torch.empty(0, device=device))


def sample(hidden: torch.Tensor, weight: torch.Tensor, *, temperature=1.0, seed=None, offset=0,
           bias=None, vocab_size: int | None = None, num_samples: int = 1, merge: str = "max",
           return_logprobs: bool = False, backend: str = "auto"):
    """Exact samples from softmax((hidden @ weight.T + bias) / T) without materialising logits.

    Args:
        hidden: [B, D] bfloat16 / float16 / float32, CPU or CUDA.
        weight: [V, D] same dtype and device, rows contiguous (the LM head).
        temperature: float or Tensor[B]; 0 means greedy (argmax) for that row.
        seed: None (drawn from torch's default generator, one per row), int (every row)
            or Tensor[B] int64. Rows with equal (seed, offset) get the same noise.
        offset: int or Tensor[B] int64, e.g. the decode step.
        bias: optional Tensor[V] (used as float32), added before the temperature.
        vocab_size: rows [0, vocab_size) of weight are real tokens (padded vocabulary).
        num_samples: independent samples per row (with replacement).
        merge: "max" (pathwise Gumbel-max, tiling/TP invariant), "logmass"
            (Group-Gumbel-Max over 128-token groups) or "cdf" (the same groups, the token in
            each by inverse CDF: five uniforms per group instead of a Gumbel per token; tokens
            depend on the tiling). All are exact (tpsample.merge). On Hopper at B = 256 cdf
            is 6-12% faster than max (perf notes v2.3); at B <= 64 it is slower.
        return_logprobs: also return log p(token) and log Z.
        backend: "auto" (Triton on CUDA or under TRITON_INTERPRET=1, else the chunked torch
            path), "triton" or "torch". All give the same tokens for the same seed.

    Returns:
        int64 [B] (num_samples == 1) or [B, num_samples]; with return_logprobs a
        SampleOutput(tokens, logprobs fp32 same shape, logz fp32 [B]). Greedy rows report
        logprobs of the T = 1 distribution. Rows whose log Z is not finite (all logits -inf,
        any NaN, +inf) return token 0 and logprob NaN (see tpsample.merge).

    On CUDA, a call with the shapes, strides, dtypes, pointer alignments and options of an
    earlier one re-issues that call's compiled kernels with the new tensors (no config lookup,
    no Triton dispatch; TPSAMPLE_REPLAY=0 turns this off). Outputs are fresh tensors per call.
    """
    check_hidden_weight(hidden, weight)
    V = weight.shape[0]
    if vocab_size is None:
        vocab_size = V
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or not 1 <= vocab_size <= V:
        raise ValueError(f"vocab_size must be an int in [1, {V}] (rows of weight), got {vocab_size!r}")
    if vocab_size > MAX_VOCAB:
        raise ValueError(f"vocab_size must be <= 2**24, got {vocab_size}")
    check_options(num_samples, merge, backend)
    bias = check_bias(bias, V, hidden.device)
    params = row_params(hidden, temperature, seed, offset)
    B = hidden.shape[0]
    if B == 0:
        return empty_result(hidden.device, num_samples, return_logprobs)
    hidden = hidden.contiguous()

    backend = resolve_backend(backend, hidden.device)
    need_mass = return_logprobs or merge != "max"
    if backend == "triton" and hidden.is_cuda:
        tokens, logprobs, logz = _sample_cuda(hidden, weight, bias, params, vocab_size,
                                              num_samples, merge, need_mass)
        return package(tokens, logprobs, logz, num_samples, return_logprobs)
    rec = compute_records(backend, hidden, weight, bias=bias, params=params, num_samples=num_samples,
                          n_real=vocab_size, need_mass=need_mass, cdf=merge == "cdf")
    tokens, logprobs, logz = reduce_records(backend, rec[None], params, merge)
    return package(tokens, logprobs, logz, num_samples, return_logprobs)


_REPLAYS = None  # tpsample.replay.CallReplays of sample() on CUDA, made on first use


def _sample_cuda(hidden, weight, bias, params: RowParams, n_real: int, num_samples: int,
                 merge: str, need_mass: bool):
    """Stages 1 and 2 on CUDA. A call like an earlier one (same shapes, strides, dtypes,
    pointer alignments and options: what the kernels were specialized on) re-issues that
    call's compiled launches with this call's tensors (tpsample.replay): no config lookup
    and no Triton dispatch, which otherwise cost more host time per call than a D = 2048
    call takes on the GPU (perf notes v1.8). Every call gets fresh records and outputs."""
    global _REPLAYS
    from . import fused, replay
    if _REPLAYS is None:
        _REPLAYS = replay.CallReplays()
    B = hidden.shape[0]
    named = dict(hidden=hidden, weight=weight, inv_temp=params.inv_temp, seed=params.seed,
                 offset=params.offset, bias=bias)
    records = torch.empty(num_samples, B, fused.num_tiles(weight.shape[0]), 4,
                          dtype=torch.float32, device=hidden.device)
    key = None
    if replay.ENABLED and not torch.cuda.is_current_stream_capturing() and replay.Replay.usable():
        key = (hidden.device, hidden.shape, hidden.stride(), weight.shape, weight.stride(), n_real,
               num_samples, merge, need_mass, fused.PDL_ENABLED,
               replay.tensor_key(tuple(named.values())))
        hit = _REPLAYS.get(key)
        if hit is not None:
            stage1, stage2 = hit
            stream = replay.current_stream(hidden.device.index)
            stage1(stream, records=records, **named)
            out = replay.reduce_outputs(B, num_samples, hidden.device)
            # stage 2 was recorded with records[None]: the same address, strides recorded
            stage2(stream, records=records, **out, **named)
            return out["tokens"], out["logprobs"], out["logz"]
    with replay.record() as log1:
        fused.fused_records(hidden, weight, bias=bias, inv_temp=params.inv_temp, seed=params.seed,
                            offset=params.offset, num_samples=num_samples, n_real=n_real,
                            out=records, need_mass=need_mass, cdf=merge == "cdf")
    with replay.record() as log2:
        view = records[None]
        tokens, logprobs, logz = fused.reduce_records(view, params.inv_temp, params.seed,
                                                      params.offset, merge)
    _REPLAYS.add(key, log1, dict(named, records=records), log2,
                 dict(named, records=view, tokens=tokens, logprobs=logprobs, logz=logz))
    return tokens, logprobs, logz


def compute_records(backend: str, hidden, weight, *, bias, params: RowParams, num_samples: int,
                    n_real: int, vocab_start: int = 0, tiles=None, out=None, fanout=None,
                    need_mass: bool = True, cdf: bool = False):
    """Stage 1 with the chosen backend → records [S, B, T, 4] (written into `out` if given;
    with `fanout` = (peer_ptrs, parity, _) stored into every peer's buffer instead).
    need_mass=False lets the Triton path skip the tile log-masses (see fused.fused_records):
    only for the max merge without log-probs, and never where ranks might disagree on it.
    cdf: the records of the "cdf" merge (tpsample.merge, fact 6; needs need_mass)."""
    if cdf and not need_mass:
        raise ValueError("cdf records need the tile log-masses (need_mass=True)")
    if backend == "triton":
        from . import fused
        peer_ptrs, parity = fanout[:2] if fanout is not None else (None, None)
        return fused.fused_records(hidden, weight, bias=bias, inv_temp=params.inv_temp,
                                   seed=params.seed, offset=params.offset, num_samples=num_samples,
                                   n_real=n_real, vocab_start=vocab_start, tiles=tiles, out=out,
                                   peer_ptrs=peer_ptrs, parity=parity, need_mass=need_mass,
                                   cdf=cdf)
    if fanout is not None:
        raise ValueError("P2P fan-out needs the Triton backend on CUDA")
    rec = records_torch(hidden, weight, bias=bias, inv_temp=params.inv_temp, seed=params.seed,
                        offset=params.offset, num_samples=num_samples, n_real=n_real,
                        vocab_start=vocab_start, num_tiles=tiles, cdf=cdf)
    if out is not None:
        out.copy_(rec)
        return out
    return rec


def reduce_records(backend: str, records, params: RowParams, merge: str, fanout=None):
    """Stage 2: records [slots, S, B, T, 4] → tokens [B, S], logprobs [B, S], logz [B]
    (with `fanout`, from the buffer its device-side parity selects)."""
    if backend == "triton":
        from . import fused
        parity, stride = fanout[1:] if fanout is not None else (None, 0)
        return fused.reduce_records(records, params.inv_temp, params.seed, params.offset, merge,
                                    parity=parity, parity_stride=stride)
    return merge_math.reduce_records(records, params.seed, params.offset, params.inv_temp == 0, merge)
