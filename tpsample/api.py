"""tpsample.sample: exact samples from one device's LM head without materialising logits."""
from __future__ import annotations

import torch

from . import params as P
from .pipeline import Pipeline

_PIPELINES: dict = {}  # (backend, device) -> the process's local Pipeline


def _pipeline(backend: str, device: torch.device) -> Pipeline:
    pipe = _PIPELINES.get((backend, device))
    if pipe is None:
        pipe = _PIPELINES[(backend, device)] = Pipeline(backend, device)
    return pipe


def sample(hidden: torch.Tensor, weight: torch.Tensor, *, temperature: float | torch.Tensor = 1.0,
           seed: int | torch.Tensor | None = None, offset: int | torch.Tensor = 0,
           bias: torch.Tensor | None = None, vocab_size: int | None = None, num_samples: int = 1,
           merge: str = "max", return_logprobs: bool = False,
           backend: str = "auto") -> torch.Tensor | P.SampleOutput:
    """Exact samples from softmax((hidden @ weight.T + bias) / T) without materialising logits.

    Args:
        hidden: [B, D] bfloat16 / float16 / float32, CPU or CUDA.
        weight: [V, D] same dtype and device, rows contiguous (the LM head).
        temperature: float or Tensor[B] (any float dtype); 0 means greedy (argmax) for that
            row. T below 2**-64 is greedy (the limit T -> 0+), T above 2**64 samples at
            2**64 (the limit T -> inf: uniform over the real vocabulary).
        seed: None (drawn from torch's default generator, one per row), int (every row)
            or Tensor[B] int64. Rows with equal (seed, offset) get the same noise.
        offset: int or Tensor[B] int64, e.g. the decode step.
        bias: optional Tensor[V] (used as float32), added before the temperature.
        vocab_size: rows [0, vocab_size) of weight are real tokens (padded vocabulary).
        num_samples: independent samples per row (with replacement).
        merge: "max" (pathwise Gumbel-max: the same tokens for any tiling or TP degree),
            "logmass" (Group-Gumbel-Max over 128-token groups) or "cdf" (the same groups, the
            token in each by inverse CDF: no per-token noise; on Hopper the fastest at
            B >= 128, slower than "max" at B <= 64). All are exact (tpsample/merge.py).
        return_logprobs: also return log p(token) and log Z.
        backend: "auto" (Triton on CUDA or under TRITON_INTERPRET=1, else the chunked torch
            path), "triton" or "torch". All give the same tokens for the same seed.

    Returns:
        int64 [B] (num_samples == 1) or [B, num_samples]; with return_logprobs a
        SampleOutput(tokens, logprobs fp32 same shape, logz fp32 [B]). Log-probs are under
        the distribution sampled from (bias and temperature applied); greedy rows report
        the T = 1 distribution. Rows whose log Z is not finite (all logits -inf, any NaN,
        +inf) return token 0 and logprob NaN: test torch.isfinite(out.logz).

    `tpsample.explain(B, D, V, ...)` shows which kernels run for a shape. On CUDA a call
    like an earlier one re-issues its compiled launches (tpsample/pipeline.py); outputs are
    fresh tensors per call.
    """
    P.check_hidden_weight(hidden, weight)
    V = weight.shape[0]
    vocab_size = P.check_vocab_size(V if vocab_size is None else vocab_size, V)
    P.check_options(num_samples, merge, backend)
    if not isinstance(return_logprobs, bool):
        raise TypeError(f"return_logprobs must be a bool, got {type(return_logprobs).__name__}")
    bias = P.check_bias(bias, V, hidden.device)
    row = P.row_params(hidden, temperature, seed, offset)
    if hidden.shape[0] == 0:
        return P.empty_result(hidden.device, num_samples, return_logprobs)
    pipe = _pipeline(P.resolve_backend(backend, hidden.device), hidden.device)
    tokens, logprobs, logz = pipe.run(hidden.contiguous(), weight, bias, row, n_real=vocab_size,
                                      merge=merge, num_samples=num_samples,
                                      need_mass=return_logprobs or merge != "max")
    return P.package(tokens, logprobs, logz, num_samples, return_logprobs)
