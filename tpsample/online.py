"""OnlineSampler: exact sampling from logits that arrive in chunks (binary merge, fact 4)."""
from __future__ import annotations

import torch

from . import merge as merge_math
from . import noise
from .params import SampleOutput, row_params


class OnlineSampler:
    """Streams chunks of TRANSFORMED logits and keeps, per row and sample, only the running
    log-mass and the running sample.

    sampler = OnlineSampler(batch_size, seed=..., offset=0, num_samples=1, device="cpu")
    sampler.update(chunk, vocab_offset)   # chunk [B, c] fp32 logits for ids [off, off + c)
    out = sampler.result()                # SampleOutput(tokens, logprobs, logz)

    Chunks may come in any order and sizes but must not overlap. Within a chunk the sample
    is a Gumbel-max keyed by global token id (same noise as tpsample.sample); chunks are
    merged with P(replace) = 1 / (1 + exp(L_run - L_chunk)), the uniform keyed by the
    chunk's first id. Exact in distribution (tpsample/merge.py, facts 3-4).
    """

    def __init__(self, batch_size: int, *, seed: int | torch.Tensor | None = None,
                 offset: int | torch.Tensor = 0, num_samples: int = 1,
                 device: torch.device | str | None = None):
        if not isinstance(batch_size, int) or batch_size < 0:
            raise ValueError(f"batch_size must be an int >= 0, got {batch_size!r}")
        if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
            raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
        dev = torch.device(device) if device is not None else torch.device("cpu")
        probe = torch.empty(batch_size, 0, device=dev)
        p = row_params(probe, 1.0, seed, offset)
        self.seed, self.offset = p.seed[:, None], p.offset[:, None]
        self.num_samples = num_samples
        shape = (batch_size, num_samples)
        self.log_mass = torch.full((batch_size,), float("-inf"), device=dev)
        self.tokens = torch.zeros(shape, dtype=torch.int64, device=dev)
        self.logits = torch.full(shape, float("-inf"), device=dev)
        self.any_nan = torch.zeros(batch_size, dtype=torch.bool, device=dev)

    def update(self, chunk: torch.Tensor, vocab_offset: int) -> None:
        if not isinstance(chunk, torch.Tensor) or chunk.ndim != 2 or chunk.shape[0] != self.tokens.shape[0]:
            raise ValueError(f"chunk must be a tensor [{self.tokens.shape[0]}, c], got "
                             f"{tuple(chunk.shape) if isinstance(chunk, torch.Tensor) else type(chunk).__name__}")
        if not isinstance(vocab_offset, int) or vocab_offset < 0:
            raise ValueError(f"vocab_offset must be an int >= 0, got {vocab_offset!r}")
        if chunk.shape[1] == 0:
            return
        l = chunk.float().to(self.tokens.device)
        nan = torch.isnan(l)
        self.any_nan |= nan.any(dim=1)
        l = l.masked_fill(nan, float("-inf"))
        mass = torch.logsumexp(l, dim=1)
        ids = vocab_offset + torch.arange(l.shape[1], device=l.device)[None, :]
        merged = self.log_mass
        for s in range(self.num_samples):
            z = l + noise.gumbel(self.seed, self.offset, s, ids)
            idx = z.argmax(dim=1)
            u = noise.uniform(self.seed, self.offset, s, torch.tensor([[vocab_offset]], device=l.device),
                              stream=noise.GROUP_STREAM)[:, 0]
            take, merged = merge_math.binary_merge(self.log_mass, mass, u)
            self.tokens[:, s] = torch.where(take, vocab_offset + idx, self.tokens[:, s])
            self.logits[:, s] = torch.where(take, l.gather(1, idx[:, None])[:, 0], self.logits[:, s])
        self.log_mass = merged

    def result(self) -> SampleOutput:
        """tokens int64 [B, S], logprobs fp32 [B, S], logz fp32 [B] (degenerate rows as in merge)."""
        logz = torch.where(self.any_nan, torch.full_like(self.log_mass, float("nan")), self.log_mass)
        tokens, logprobs = merge_math.finish(self.tokens.float(), self.logits, logz)
        return SampleOutput(tokens, logprobs, logz)
