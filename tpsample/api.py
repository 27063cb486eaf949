"""tpsample.sample: exact samples from one device's LM head without materialising logits."""
from __future__ import annotations

import torch

from . import drawn_seeds, knobs
from . import params as P
from . import verify as VF
from .call_memo import CallMemo, signature
from .pipeline import Pipeline
from .spec import sampling_spec

_MEMO = CallMemo()  # repeated calls straight to their graph (tpsample/call_memo.py)


class _Pipelines(dict):
    """(backend, device) -> the process's local Pipeline; clear() also drops the memo's
    entries, which hold pipelines."""

    def clear(self) -> None:
        super().clear()
        _MEMO.clear()


_PIPELINES = _Pipelines()


def _pipeline(backend: str, device: torch.device) -> Pipeline:
    pipe = _PIPELINES.get((backend, device))
    if pipe is None:
        pipe = _PIPELINES[(backend, device)] = Pipeline(backend, device)
    return pipe


def sample(hidden: torch.Tensor, weight: torch.Tensor, *, temperature: float | torch.Tensor = 1.0,
           seed: int | torch.Tensor | None = None, offset: int | torch.Tensor = 0,
           bias: torch.Tensor | None = None, vocab_size: int | None = None, num_samples: int = 1,
           merge: str = "max", return_logprobs: bool = False,
           top_k: int | torch.Tensor | None = None, top_p: float | torch.Tensor | None = None,
           min_p: float | torch.Tensor | None = None, top_logprobs: int = 0,
           replacement: bool = True, logprobs_mode: str = "processed",
           allowed_mask: torch.Tensor | None = None,
           logit_adjust: tuple[torch.Tensor, torch.Tensor] | None = None,
           repetition_penalty: float | torch.Tensor | None = None,
           backend: str = "auto", out: torch.Tensor | None = None) -> torch.Tensor | P.SampleOutput:
    """Exact samples from softmax((hidden @ weight.T + bias) / T) without materialising logits.

    Args:
        hidden: [B, D] bfloat16 / float16 / float32, CPU or CUDA.
        weight: [V, D] same dtype and device, rows contiguous (the LM head).
        temperature: float or Tensor[B] (any float dtype); 0 means greedy (argmax) for that
            row. T below 2**-64 is greedy (the limit T -> 0+), T above 2**64 samples at
            2**64 (the limit T -> inf: uniform over the real vocabulary).
        seed: None (drawn from torch's default generator, one per row: on CUDA derived on
            the host from its Philox seed and offset, tpsample/drawn_seeds.py, so
            torch.manual_seed repeats them), int (every row) or Tensor[B] int64. Rows with
            equal (seed, offset) get the same noise.
        offset: int or Tensor[B] int64, e.g. the decode step.
        bias: optional Tensor[V] (used as float32), added before the temperature.
        vocab_size: rows [0, vocab_size) of weight are real tokens (padded vocabulary).
        num_samples: samples per row: independent (replacement=True), or distinct tokens
            (replacement=False: distributed as sequential sampling without replacement from
            the row's filtered distribution, at most 64; merge "max" only; a row that keeps
            fewer tokens returns -1 with log-prob -inf past them).
        merge: "max" (pathwise Gumbel-max: the same tokens for any tiling or TP degree),
            "logmass" (Group-Gumbel-Max over 128-token groups) or "cdf" (the same groups, the
            token in each by inverse CDF: no per-token noise; on Hopper the fastest at
            B >= 128, slower than "max" at B <= 64). All are exact (tpsample/merge.py).
        return_logprobs: also return log p(token) and log Z.
        top_k: None | int | Tensor[B] int32/int64: keep the k highest logits (ties at the
            boundary by smaller id); 0 or -1 = off for that row.
        top_p: None | float | Tensor[B] in (0, 1]: then keep the shortest prefix (logit desc,
            id asc) of what top-k kept whose renormalised mass reaches p; 1 = off.
        min_p: None | float | Tensor[B] in [0, 1): then keep tokens with p >= min_p * p_max;
            0 = off. Greedy rows (T = 0) ignore the three filters; per-row values mix
            freely. Filtered rows are sampled exactly from softmax over the kept set, by
            Gumbel-max over it with the same noise (whatever the merge: the tokens are the
            same for every tiling and TP degree). tpsample/filters.py says how.
        top_logprobs: n >= 0 (at most 64): also return the n most probable token ids per
            row and their log-probs (SampleOutput.top_tokens / top_logprobs).
        logprobs_mode: "processed" (log-probs under the distribution sampled from: after
            temperature and filters) or "raw" (bias and constraints, T = 1, no filters); see
            SampleOutput.
        allowed_mask: None | Tensor[B, ceil(V / 32)] int32, packed as grammar engines
            produce it: bit j of word i allows token 32 i + j; disallowed tokens are -inf
            before the noise. A row that allows nothing is degenerate (token -1, log Z -inf).
        logit_adjust: None | (ids Tensor[B, K] int64 padded with -1, values Tensor[B, K]
            float): added to the listed tokens' logits (logit bias, presence / frequency
            penalties: tpsample.penalty_adjustments builds them from a token history); a
            repeated id adds its values. K <= 256.
        repetition_penalty: None | float | Tensor[B] >= 1, on the tokens listed in
            logit_adjust's ids: l > 0 → l / r, l <= 0 → l * r (as HF and vLLM), once per token.
            Order: bias → mask → repetition penalty and adjustments → temperature → filters
            → sample; exact, and path by path with merge "max" (tpsample/constraints.py).
            Tensor contents are checked with one host synchronisation (not during capture).
        backend: "auto" (Triton on CUDA or under TRITON_INTERPRET=1, else the chunked torch
            path), "triton" or "torch". All give the same tokens for the same seed.
        out: None, or an int64 tensor of the tokens' shape on hidden's device, contiguous:
            the tokens are written there and `out` is returned in their place (as torch's
            out= arguments). A decode loop that passes the same `out` each step saves the
            per-call output allocation and copy of a replayed call (its CUDA graph writes the
            tokens there itself).

    Returns:
        int64 [B] (num_samples == 1) or [B, num_samples]; with return_logprobs or
        top_logprobs a SampleOutput(tokens, logprobs fp32 same shape, logz fp32 [B],
        top_tokens, top_logprobs). Rows whose log Z is not finite (all logits -inf, any NaN,
        +inf) return token -1 and logprob NaN: test tokens < 0 or torch.isfinite(out.logz).

    Calls with filters, top_logprobs, replacement=False or logprobs_mode="raw" on the Triton
    backend redo the rows their candidates cannot certify on the device (tpsample/filters.py,
    5.): no host synchronisation, and they can be captured in a CUDA graph. While rows keep
    failing their certificate (top-p alone on heavy tails) the pipeline redoes them from the
    host instead (faster there; one synchronisation per call) until a call has none.

    `tpsample.explain(B, D, V, ...)` shows which kernels run for a shape. On CUDA a call
    like an earlier one re-issues its compiled launches (tpsample/pipeline.py), and from the
    third such eager call replays them as one CUDA graph (tpsample/call_graphs.py;
    TPSAMPLE_GRAPHS=0 turns that off), and a later call with the same arguments (new
    hidden states, an int offset and seed=None aside) goes straight to that graph
    (tpsample/call_memo.py). Each call's outputs are tensors of its own: clones of the
    graph's, or the outputs of one of its output slots, written in place once no tensor
    refers to that slot's earlier outputs (TPSAMPLE_REUSE_OUTPUTS=0 turns that off; like
    the caching allocator's memory, outputs another stream still reads must stay referenced
    until that stream's work is ordered before the next call).
    """
    sig = None
    if knobs.MEMO and type(hidden) is torch.Tensor and hidden.is_cuda:
        sig = signature(hidden, weight, bias, seed, offset, (
            temperature, vocab_size, num_samples, merge, return_logprobs, top_k, top_p, min_p,
            top_logprobs, replacement, logprobs_mode, allowed_mask, logit_adjust,
            repetition_penalty, backend), out)
        if sig is not None:
            res = _MEMO.call(sig, hidden, seed, offset)
            if res is not None:
                return res if out is None else P.write_out(res, out)
    P.check_hidden_weight(hidden, weight)
    V = weight.shape[0]
    vocab_size = P.check_vocab_size(V if vocab_size is None else vocab_size, V)
    P.check_options(1, merge, backend)
    P.check_out(out, hidden, num_samples)
    given_bias = bias
    bias = P.check_bias(bias, V, hidden.device)
    in_capture = P.capturing(hidden.device)
    spec = sampling_spec(hidden, vocab_size=vocab_size, rows=V, merge=merge,
                         temperature=temperature, seed=seed, offset=offset,
                         num_samples=num_samples, return_logprobs=return_logprobs, top_k=top_k,
                         top_p=top_p, min_p=min_p, top_logprobs=top_logprobs,
                         replacement=replacement, logprobs_mode=logprobs_mode,
                         allowed_mask=allowed_mask, logit_adjust=logit_adjust,
                         repetition_penalty=repetition_penalty, in_capture=in_capture)
    if hidden.shape[0] == 0:
        return P.write_out(P.empty_result(hidden.device, num_samples, return_logprobs,
                                          spec.filters.top_n), out)
    pipe = _pipeline(P.resolve_backend(backend, hidden.device), hidden.device)
    tokens, logprobs, logz, top = pipe.run(
        hidden.contiguous(), weight, bias, spec, n_real=vocab_size,
        need_mass=return_logprobs or merge != "max", in_capture=in_capture,
        tokens_out=P.sink(out))
    if sig is not None and pipe.last_graph is not None:
        _MEMO.store(sig, pipe, spec, seed, offset, given_bias, bias, _draw_base, out)
    return P.write_out(P.package(tokens, logprobs, logz, num_samples, return_logprobs, top), out)


def _draw_base(device: torch.device) -> int:
    """The base of a memoised call's seeds for seed=None, as params.row_params draws them
    (tpsample/drawn_seeds.py: torch's default generator of the device)."""
    return drawn_seeds.next_base(drawn_seeds.default_generator(device))


def verify_drafts(hidden: torch.Tensor, weight: torch.Tensor, draft_tokens: torch.Tensor, *,
                  draft_probs: torch.Tensor | None = None,
                  temperature: float | torch.Tensor = 1.0, seed: int | torch.Tensor | None = None,
                  offset: int | torch.Tensor = 0, bias: torch.Tensor | None = None,
                  vocab_size: int | None = None, top_k: int | torch.Tensor | None = None,
                  top_p: float | torch.Tensor | None = None,
                  min_p: float | torch.Tensor | None = None, return_logprobs: bool = False,
                  backend: str = "auto") -> VF.VerifyOutput:
    """Verify speculative drafts exactly against the LM head's distribution
    (tpsample/verify.py has the argument).

    Args:
        hidden: [B, S + 1, D] the target's hidden states at the S draft positions and the
            bonus position (dtype and device as tpsample.sample's hidden).
        weight: [V, D] the LM head (as tpsample.sample).
        draft_tokens: int64 [B, S]; -1 ends a request's drafts (ragged S per request: every
            entry after a -1 is -1).
        draft_probs: None (one-hot drafts: n-gram drafts, greedy draft heads) or fp32
            [B, S, vocab_size], the draft model's probabilities at each draft position (each
            sums to 1 within 1e-3).
        temperature, top_k, top_p, min_p: as tpsample.sample, a scalar or a Tensor[B] per
            request; they define the target distribution p at every position of that request.
            Greedy requests (T = 0) accept while the draft equals the argmax, then emit it.
        seed: None (drawn), int or Tensor[B] int64 per request; offset: int or Tensor[B]:
            position i of request b is sampled with (seed_b, offset_b + i), as ordinary
            decoding at those steps would be.
        bias, vocab_size, backend: as tpsample.sample.
        return_logprobs: also return the emitted tokens' log-probs under p.

    Returns:
        VerifyOutput(tokens int64 [B, S + 1]: the accepted drafts, then the token from the
        residual or the bonus token, then -1; num_accepted int64 [B]; logprobs fp32
        [B, S + 1] (NaN after the emitted tokens) or None). A position whose log Z is not
        finite (NaN or +inf logits) accepts no draft and emits -1, as tpsample.sample does.

    One-hot drafts take one fused sampler call on the B·(S + 1) rows and a scan; draft_probs
    computes the rows' logits with one matmul (not fused). The inputs' contents are checked with
    one host synchronisation.

    Example:
        >>> h = torch.randn(2, 3, 64); w = torch.randn(1000, 64)
        >>> out = tpsample.verify_drafts(h, w, torch.tensor([[5, 7], [9, -1]]), seed=1)
        >>> out.tokens.shape, out.num_accepted.shape
        (torch.Size([2, 3]), torch.Size([2]))
    """
    VF.check_hidden3(hidden)
    P.check_hidden_weight(hidden[:, 0], weight)
    V = weight.shape[0]
    vocab_size = P.check_vocab_size(V if vocab_size is None else vocab_size, V)
    bias = P.check_bias(bias, V, hidden.device)
    VF.check_drafts(hidden, draft_tokens, draft_probs, vocab_size)

    def sample_rows(rows, **kw):
        return sample(rows, weight, bias=bias, vocab_size=vocab_size, backend=backend, **kw)

    def draw_seed(B):
        return torch.randint(0, P.SEED_HIGH, (B,), dtype=torch.int64, device=hidden.device)
    return VF.verify(hidden, draft_tokens, draft_probs, sample_rows=sample_rows,
                     draft_logits=VF.local_logits(weight, bias, vocab_size),
                     draw_seed=draw_seed, vocab_size=vocab_size, temperature=temperature,
                     seed=seed, offset=offset, top_k=top_k, top_p=top_p, min_p=min_p,
                     return_logprobs=return_logprobs,
                     kernels=P.resolve_backend(backend, hidden.device) == "triton")
