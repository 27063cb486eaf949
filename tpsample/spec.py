"""SamplingSpec: one call's sampling parameters, validated and normalised once.

tpsample.sample, VocabParallelSampler and the reference build it with `sampling_spec`, so
every entry point accepts and rejects the same arguments with the same messages, and the
pipeline, the filters and the reference ask it (not the raw arguments) which rows are
greedy, filtered or constrained.

A new filter touches: this spec (its argument, checked in params._check_filters and
carried in params.Filters), the full-row semantics (filters.filtered_rows, which the
reference and the host fallback share), the kernel epilogue (kernels/filter_records.py
with its launcher), and a test. docs/design.md lists the files.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import constraints as C
from . import params as P
from .filters import row_is_filtered


class SamplingSpec(NamedTuple):
    """A call's parameters after validation (immutable; a NamedTuple, which builds in a
    fraction of a frozen dataclass's host time).

    row: per-row inverse temperature / seed / offset, device tensors [B] (params.RowParams);
    filters: per-row top_k / top_p / min_p tensors [B] or None, top_logprobs, replacement,
    the log-prob mode (params.Filters); constraints: mask / listed ids / values / penalty
    (constraints.Constraints); num_samples, merge, return_logprobs as given."""
    row: P.RowParams
    filters: P.Filters
    constraints: C.Constraints
    num_samples: int
    merge: str
    return_logprobs: bool

    @property
    def candidates(self) -> bool:
        """Whether the call takes the candidate path (tpsample/filters.py): filters, top
        log-probs, samples without replacement or raw log-probs."""
        return self.filters.needs_candidates or not self.filters.replacement

    @property
    def constrained(self) -> bool:
        return self.constraints.any

    def greedy_rows(self) -> torch.Tensor:
        """bool [B]: rows sampled at T = 0 (the argmax)."""
        return self.row.inv_temp == 0

    def filtered_rows(self) -> torch.Tensor:
        """bool [B]: rows whose filters can cut (some filter on, not greedy)."""
        return row_is_filtered(self.filters, self.row.inv_temp)


def sampling_spec(hidden: torch.Tensor, *, vocab_size: int, rows: int, merge: str,
                  temperature, seed, offset, num_samples, return_logprobs, top_k, top_p,
                  min_p, top_logprobs, replacement, logprobs_mode, allowed_mask, logit_adjust,
                  repetition_penalty, in_capture: bool | None = None) -> SamplingSpec:
    """Validate and normalise one call's sampling arguments (tpsample.sample's docstring
    says what each means). hidden [B, D] is already checked; vocab_size: real tokens;
    rows: the LM head's rows over all ranks (padding included); merge: already checked;
    seed None must already be drawn by the caller where it has its own generator (else
    torch's default generator draws it). in_capture: params.capturing(hidden.device), when
    the caller knows it. Raises TypeError / ValueError naming the argument."""
    if (not isinstance(num_samples, int) or isinstance(num_samples, bool)
            or not 1 <= num_samples < P.MAX_SAMPLES):
        raise ValueError(f"num_samples must be an int in [1, 2**29), got {num_samples!r}")
    if not isinstance(return_logprobs, bool):
        raise TypeError(f"return_logprobs must be a bool, got {type(return_logprobs).__name__}")
    if in_capture is None:
        in_capture = P.capturing(hidden.device)
    row = P.row_params(hidden, temperature, seed, offset, in_capture)
    filters = P.filter_params(hidden, top_k, top_p, min_p, top_logprobs, num_samples,
                              replacement, logprobs_mode, vocab_size, in_capture)
    if not filters.replacement and merge != "max":
        raise ValueError(f"replacement=False needs merge='max' (Gumbel-top-S), got merge={merge!r}")
    constraints = C.check_constraints(hidden, allowed_mask, logit_adjust, repetition_penalty,
                                      vocab_size, rows)
    return SamplingSpec(row, filters, constraints, num_samples, merge, return_logprobs)
