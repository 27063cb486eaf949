"""A call's arguments and results: validation, per-row parameters, SampleOutput.

Shared by tpsample.sample, VocabParallelSampler, OnlineSampler and the reference, so every
entry point accepts and rejects the same things with errors that name the argument.
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch

from . import drawn_seeds, knobs
from .records import MAX_SAMPLES, MAX_VOCAB

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MERGES = ("max", "logmass", "cdf")
BACKENDS = ("auto", "triton", "torch")
SEED_HIGH = 1 << 62
# Temperatures outside [T_MIN, T_MAX] take their limits: below T_MIN the row is greedy
# (T -> 0+: the argmax), above T_MAX it is sampled at T_MAX (T -> inf: uniform over the
# real vocabulary up to |l| / 2**64). Inside, 1/T and l/T stay normal float32 numbers.
T_MIN = 2.0 ** -64
T_MAX = 2.0 ** 64
MAX_TOP_LOGPROBS = 64   # top_logprobs: the n most probable tokens, n <= this
MAX_DISTINCT = 64       # replacement=False: at most this many distinct tokens per row


class SampleOutput(NamedTuple):
    """tokens int64 [B] or [B, S]; logprobs fp32, same shape: log p(token); logz fp32 [B]:
    the log-normaliser those log-probs use, so logprobs = logit - logz.

    Which distribution (logprobs_mode):
      "processed" (default) the distribution sampled from: bias, the constraints
                  (allowed_mask, logit_adjust, repetition_penalty), temperature and the
                  filters applied (a filtered row's logz is the logsumexp over its kept set;
                  tokens outside it have log-prob -inf). Greedy rows: T = 1, no filters.
      "raw"       bias and the constraints applied, T = 1, no filters.
    top_tokens int64 [B, n] / top_logprobs fp32 [B, n] (top_logprobs=n > 0, else None): the
    n most probable tokens in (logit desc, id asc) order and their log-probs in that mode.
    """
    tokens: torch.Tensor
    logprobs: torch.Tensor
    logz: torch.Tensor
    top_tokens: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


class Filters(NamedTuple):
    """A call's filters, normalised (tpsample/filters.py): per-row tensors [B] on the device,
    or None where no row uses that filter."""
    top_k: torch.Tensor | None   # int32; 0 = off for that row
    top_p: torch.Tensor | None   # fp32 in (0, 1]; 1 = off
    min_p: torch.Tensor | None   # fp32 in [0, 1); 0 = off
    top_n: int = 0               # top_logprobs
    replacement: bool = True
    raw: bool = False            # logprobs_mode == "raw"
    top_k_every_row: bool = False  # top_k was one value > 0: every row has a top-k, so no
                                   # flagged row takes kernels/filter_cut.py's fast path

    @property
    def any_filter(self) -> bool:
        return self.top_k is not None or self.top_p is not None or self.min_p is not None

    @property
    def needs_candidates(self) -> bool:
        """Whether stage 1 must emit per-tile candidates (tpsample/filters.py)."""
        return self.any_filter or self.top_n > 0 or self.raw


NO_FILTERS = Filters(None, None, None)
LOGPROBS_MODES = ("processed", "raw")


class RowParams(NamedTuple):
    """Per-row sampling parameters, normalised to device tensors of shape [B]."""
    inv_temp: torch.Tensor  # fp32 1/T; 0 marks a greedy row (T = 0), NaN an invalid one
    seed: torch.Tensor      # int64
    offset: torch.Tensor    # int64


def check_matrix(name: str, t, ndim: int = 2) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {t.dtype}")


def check_hidden_weight(hidden, weight, weight_name: str = "weight") -> None:
    check_matrix("hidden", hidden)
    check_matrix(weight_name, weight)
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"{weight_name} has D={weight.shape[1]} but hidden has D={hidden.shape[1]}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{weight_name} dtype {weight.dtype} differs from hidden dtype {hidden.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"{weight_name} is on {weight.device} but hidden is on {hidden.device}")
    if weight.shape[0] > 0 and weight.stride(1) != 1:
        raise ValueError(f"{weight_name} rows must be contiguous (stride(1) == 1); "
                         "a copy of an LM head is too large to make silently")


def check_vocab_size(vocab_size, rows: int, what: str = "rows of weight") -> int:
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or not 1 <= vocab_size <= rows:
        raise ValueError(f"vocab_size must be an int in [1, {rows}] ({what}), got {vocab_size!r}")
    if vocab_size > MAX_VOCAB:
        raise ValueError(f"vocab_size must be <= 2**24 (token ids travel as float32), got {vocab_size}")
    return vocab_size


_FILLED: dict = {}


def capturing(device) -> bool:
    """Whether the current CUDA stream of `device` is capturing a graph (False on the CPU).
    Asked once per call and passed on (each ask costs host time)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _filled(B: int, value, dtype: torch.dtype, device, in_capture: bool | None = None) -> torch.Tensor:
    """torch.full((B,), value) on device, cached for reuse across calls (kernels only read it).
    Saves a launch and ~7 µs of host time per parameter; never cached during graph capture
    (a tensor filled inside a capture holds nothing until the first replay). in_capture:
    capturing(device), when the caller knows it."""
    if capturing(device) if in_capture is None else in_capture:
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
    return value.to(device).contiguous()  # (the kernels read one value per row, stride 1)


def inverse_temperature(temperature: float) -> float:
    """1/T of a valid scalar temperature, with the limits of T_MIN / T_MAX (0 = greedy)."""
    if temperature < T_MIN:
        return 0.0
    return 1.0 / min(temperature, T_MAX)


def row_params(hidden: torch.Tensor, temperature, seed, offset,
               in_capture: bool | None = None) -> RowParams:
    """Validate and normalise temperature / seed / offset (scalars or Tensor[B]).

    A tensor temperature costs one host sync for its range check, except during CUDA-graph
    capture or with TPSAMPLE_CHECK_TENSORS=0, where an invalid row gets a NaN inverse temperature and comes back as a
    degenerate row (token -1, logz NaN). in_capture: capturing(hidden.device), if known."""
    B, dev = hidden.shape[0], hidden.device
    if in_capture is None:
        in_capture = capturing(dev)
    if isinstance(temperature, torch.Tensor):
        t = _per_row_tensor("temperature", temperature, B, dev,
                            (torch.float32, torch.float64, torch.float16, torch.bfloat16))
        if not skip_tensor_checks(dev, in_capture):
            bad = ~torch.isfinite(t) | (t < 0)
            if bool(bad.any()):
                raise ValueError("temperature must be finite and >= 0 (0 = greedy); got "
                                 f"{t[bad][:4].tolist()} in rows {bad.nonzero()[:4, 0].tolist()}")
        valid = torch.isfinite(t) & (t >= 0)
        t = t.float().clamp(max=T_MAX)  # (a float64 above float32's range becomes T_MAX)
        inv_temp = torch.where(t >= T_MIN, 1.0 / t, 0.0)
        inv_temp = torch.where(valid, inv_temp, float("nan"))
    elif isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
        if not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {temperature}")
        inv_temp = _filled(B, inverse_temperature(temperature), torch.float32, dev, in_capture)
    else:
        raise TypeError(f"temperature must be a float or a Tensor[B], got {type(temperature).__name__}")

    if seed is None:
        seed_t = drawn_seeds.draw(B, dev, None, in_capture)
    elif isinstance(seed, torch.Tensor):
        seed_t = _per_row_tensor("seed", seed, B, dev, (torch.int64,))
    elif isinstance(seed, int) and not isinstance(seed, bool):
        if not -(1 << 63) <= seed < (1 << 63):
            raise ValueError(f"seed must fit in int64, got {seed}")
        seed_t = _filled(B, seed, torch.int64, dev, in_capture)
    else:
        raise TypeError(f"seed must be None, an int or a Tensor[B] int64, got {type(seed).__name__}")

    if isinstance(offset, torch.Tensor):
        offset_t = _per_row_tensor("offset", offset, B, dev, (torch.int64,))
    elif isinstance(offset, int) and not isinstance(offset, bool):
        if not -(1 << 63) <= offset < (1 << 63):
            raise ValueError(f"offset must fit in int64, got {offset}")
        offset_t = _filled(B, offset, torch.int64, dev, in_capture)
    else:
        raise TypeError(f"offset must be an int or a Tensor[B] int64, got {type(offset).__name__}")
    return RowParams(inv_temp, seed_t, offset_t)


def skip_tensor_checks(device, in_capture: bool | None = None) -> bool:
    """Whether tensor contents go unchecked: during CUDA-graph capture (a host
    synchronisation cannot be captured) or with TPSAMPLE_CHECK_TENSORS=0."""
    return not knobs.CHECK_TENSORS or (capturing(device) if in_capture is None else in_capture)


def _filter_param(name: str, value, B: int, device, *, is_int: bool, ok, rule: str, off,
                  in_capture: bool):
    """One per-row filter parameter: None | scalar | Tensor[B] → Tensor[B] or None (off on
    every row). Tensors are range-checked with one host sync, except during graph capture."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        dtypes = (torch.int32, torch.int64) if is_int else (torch.float32, torch.float64,
                                                            torch.float16, torch.bfloat16)
        t = _per_row_tensor(name, value, B, device, dtypes)
        if not skip_tensor_checks(device, in_capture):
            bad = ~ok(t.double())
            if bool(bad.any()):
                raise ValueError(f"{name} must be {rule}; got {t[bad][:4].tolist()} in rows "
                                 f"{bad.nonzero()[:4, 0].tolist()}")
        return t.to(torch.int32 if is_int else torch.float32).contiguous()
    if is_int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be None, an int or a Tensor[B] int32/int64, got "
                            f"{type(value).__name__}")
    elif not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be None, a float or a Tensor[B], got {type(value).__name__}")
    if not ok(float(value)):  # NaN fails every comparison
        raise ValueError(f"{name} must be {rule}, got {value!r}")
    if value == off or (is_int and value == -1):
        return None
    return _filled(B, value, torch.int32 if is_int else torch.float32, device, in_capture)


def filter_params(hidden: torch.Tensor, top_k, top_p, min_p, top_logprobs, num_samples: int,
                  replacement, logprobs_mode, vocab_size: int,
                  in_capture: bool | None = None) -> Filters:
    """Validate and normalise the filter arguments of tpsample.sample (see its docstring).
    in_capture: capturing(hidden.device), if known."""
    if (top_k is None and top_p is None and min_p is None and type(top_logprobs) is int
            and top_logprobs == 0 and replacement is True and logprobs_mode == "processed"):
        return NO_FILTERS  # the defaults: nothing to check
    B, dev = hidden.shape[0], hidden.device
    if in_capture is None:
        in_capture = capturing(dev)
    # scalar filters (the usual request) repeat from call to call: checked once per
    # combination, then one dict lookup (the types are in the key: True is not 1)
    key = None
    if not in_capture and not any(isinstance(v, torch.Tensor) for v in (top_k, top_p, min_p)):
        key = (B, dev, type(top_k), top_k, type(top_p), top_p, type(min_p), min_p,
               type(top_logprobs), top_logprobs, num_samples, type(replacement), replacement,
               logprobs_mode, vocab_size)
        try:
            hit = _FILTERS.get(key)
        except TypeError:  # an unhashable argument: the checks below name it
            key = hit = None
        if hit is not None:
            return hit
    out = _check_filters(B, dev, top_k, top_p, min_p, top_logprobs, num_samples, replacement,
                         logprobs_mode, vocab_size, in_capture)
    if key is not None:
        if len(_FILTERS) >= 256:
            _FILTERS.clear()
        _FILTERS[key] = out
    return out


_FILTERS: dict = {}  # filter_params of scalar arguments, by the arguments


def _check_filters(B: int, dev, top_k, top_p, min_p, top_logprobs, num_samples: int,
                   replacement, logprobs_mode, vocab_size: int, in_capture: bool) -> Filters:
    k = _filter_param("top_k", top_k, B, dev, is_int=True, off=0,
                      ok=lambda t: (t >= -1) & (t < 2 ** 31), rule="an int >= -1 (0 or -1 = off)",
                      in_capture=in_capture)
    if isinstance(top_k, torch.Tensor):
        k = k.clamp(min=0)  # -1 and 0 both mean off (scalars: _filter_param)
    p = _filter_param("top_p", top_p, B, dev, is_int=False, off=1.0,
                      ok=lambda t: (t > 0) & (t <= 1), rule="in (0, 1] (1 = off)",
                      in_capture=in_capture)
    m = _filter_param("min_p", min_p, B, dev, is_int=False, off=0.0,
                      ok=lambda t: (t >= 0) & (t < 1), rule="in [0, 1) (0 = off)",
                      in_capture=in_capture)
    if (not isinstance(top_logprobs, int) or isinstance(top_logprobs, bool)
            or not 0 <= top_logprobs <= min(vocab_size, MAX_TOP_LOGPROBS)):
        raise ValueError(f"top_logprobs must be an int in [0, {min(vocab_size, MAX_TOP_LOGPROBS)}]"
                         f", got {top_logprobs!r}")
    if not isinstance(replacement, bool):
        raise TypeError(f"replacement must be a bool, got {type(replacement).__name__}")
    if not replacement and num_samples > vocab_size:
        raise ValueError(f"num_samples={num_samples} distinct tokens need num_samples <= "
                         f"vocab_size ({vocab_size}) with replacement=False")
    if not replacement and num_samples > MAX_DISTINCT:
        raise ValueError(f"num_samples must be <= {MAX_DISTINCT} with replacement=False, got "
                         f"{num_samples}")
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
    return Filters(k, p, m, top_logprobs, replacement, logprobs_mode == "raw",
                   k is not None and not isinstance(top_k, torch.Tensor))


def check_bias(bias, rows: int, device, name: str = "bias"):
    """None, or bias as a contiguous fp32 Tensor[rows] on `device`."""
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


def check_options(num_samples, merge, backend="auto") -> None:
    if (not isinstance(num_samples, int) or isinstance(num_samples, bool)
            or not 1 <= num_samples < MAX_SAMPLES):
        raise ValueError(f"num_samples must be an int in [1, 2**29), got {num_samples!r}")
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def resolve_backend(backend: str, device: torch.device) -> str:
    """"auto" → "triton" on CUDA or under TRITON_INTERPRET=1, else "torch"."""
    if backend != "torch" and device.type == "cuda":
        return "triton"
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if backend == "auto":
        return "triton" if device.type == "cuda" or interpret else "torch"
    if backend == "triton" and device.type != "cuda" and not interpret:
        raise ValueError("backend='triton' needs CUDA tensors or TRITON_INTERPRET=1")
    return backend


def check_out(out, hidden: torch.Tensor, num_samples: int):
    """out: None, or the int64 tensor a call writes its tokens into ([B] when num_samples
    is 1, else [B, num_samples], contiguous, on hidden's device)."""
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    B = hidden.shape[0]
    shape = (B,) if num_samples == 1 else (B, num_samples)
    if tuple(out.shape) != shape:
        raise ValueError(f"out must have shape {list(shape)} (B = {B}, num_samples = "
                         f"{num_samples}), got {list(out.shape)}")
    if out.dtype != torch.int64:
        raise TypeError(f"out must be int64, got {out.dtype}")
    if out.device != hidden.device:
        raise ValueError(f"out is on {out.device} but hidden is on {hidden.device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if out.requires_grad:
        raise ValueError("out must not require grad")


def sink(out):
    """The tensor a call's kernels may write their tokens into directly: out where its
    address is 16-byte aligned (the kernels were compiled for fresh allocations, and Triton
    specialises pointers on that alignment), else None (the tokens are copied into out)."""
    return out if out is not None and out.data_ptr() % 16 == 0 else None


def write_out(result, out):
    """result (package's) with its tokens in `out` (copied unless the kernels wrote them
    there) and `out` in their place; result as it is where out is None."""
    if out is None:
        return result
    tokens = result if isinstance(result, torch.Tensor) else result.tokens
    if tokens.data_ptr() != out.data_ptr():  # (a fresh tensor never shares out's address)
        out.copy_(tokens.reshape(out.shape))
    return out if isinstance(result, torch.Tensor) else result._replace(tokens=out)


def package(tokens, logprobs, logz, num_samples: int, return_logprobs: bool, top=None):
    """tokens / logprobs [B, S] (or already [B] when S == 1) → the public result; top:
    (top_tokens, top_logprobs) when top_logprobs > 0 was asked (the result is then a
    SampleOutput even without return_logprobs)."""
    if num_samples == 1 and tokens.ndim == 2:
        tokens, logprobs = tokens[:, 0], logprobs[:, 0]
    if top is not None:
        return SampleOutput(tokens, logprobs, logz, *top)
    return SampleOutput(tokens, logprobs, logz) if return_logprobs else tokens


def empty_result(device, num_samples: int, return_logprobs: bool, top_n: int = 0):
    shape = (0,) if num_samples == 1 else (0, num_samples)
    tokens = torch.empty(shape, dtype=torch.int64, device=device)
    top = None
    if top_n:
        top = (torch.empty(0, top_n, dtype=torch.int64, device=device),
               torch.empty(0, top_n, device=device))
    if not return_logprobs and top is None:
        return tokens
    return SampleOutput(tokens, torch.empty(shape, device=device), torch.empty(0, device=device),
                        *(top or ()))
