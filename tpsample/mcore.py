"""tpsample on a megatron-core GPT model: sample the next tokens from the final hidden states
with the model's own vocab-parallel LM-head shard, without forming the logits.

    from tpsample.mcore import MegatronSampler
    sampler = MegatronSampler(model)                  # after initialize_model_parallel
    hidden = ...                                      # [s, b, h] decoder output (final norm applied)
    out = sampler(hidden, temperature=0.7, top_p=0.9)  # out.tokens [b], the same on every TP rank

megatron-core is not imported here: the adapter reads the model's attributes
(`output_layer`, `share_embeddings_and_output_weights`, `shared_embedding_or_output_weight`,
`config.sequence_parallel`), so tpsample does not depend on it (`pip install
tpsample[megatron]` installs a megatron-core that was tested). The layout it relies on is
megatron-core's:

- the LM head is vocabulary-parallel: TP rank r holds rows [r·V_p/tp, (r+1)·V_p/tp) of the
  padded vocabulary V_p (`make_vocab_size_divisible_by`), in `output_layer.weight`, or in the
  word embedding's weight when embeddings and output weights are tied;
- rows at or beyond the tokenizer's vocabulary are padding: give `vocab_size` (the
  unpadded size) and they are never sampled (megatron's own sampling masks nothing: its
  padding rows' logits are whatever the trained weights give);
- hidden states are [s, b, h], sequence first; with sequence parallelism each TP rank holds
  s/tp consecutive positions, so the last position lives on the last TP rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .parallel import VocabParallelSampler
from .transport import GroupRef


def lm_head_shard(model) -> torch.Tensor:
    """This TP rank's rows of the LM head, [V_p / tp, h]: the output layer's weight, or the
    word embedding's when the model ties them. `model`: a megatron-core GPTModel, or its
    output layer (a ColumnParallelLinear that owns its weight)."""
    if hasattr(model, "output_layer"):
        if getattr(model, "share_embeddings_and_output_weights", False):
            weight = model.shared_embedding_or_output_weight()
        else:
            weight = model.output_layer.weight
    else:
        weight = getattr(model, "weight", None)
        if weight is None:
            raise ValueError("model: an output layer without a weight of its own (tied "
                             "embeddings); pass the GPTModel instead")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"model: expected a 2-d LM-head weight, got {type(weight).__name__}")
    return weight


def _tp_group(group):
    if group is not None:
        return group
    try:
        from megatron.core import parallel_state
    except ImportError as e:
        raise ValueError("group: pass the tensor-parallel process group (megatron-core is not "
                         "installed to look it up)") from e
    return parallel_state.get_tensor_model_parallel_group()


class MegatronSampler:
    """A VocabParallelSampler over a megatron-core model's LM-head shard.

    Args:
        model: a megatron-core GPTModel (tied or untied embeddings), or its output layer
            (untied only). Its weight is used in place: no copy, so weight updates are seen.
        vocab_size: the tokenizer's vocabulary (rows from it on are padding and never
            sampled); None = every row of the padded vocabulary is a token.
        group: the tensor-parallel group; None = megatron-core's
            (parallel_state.get_tensor_model_parallel_group()).
        sequence_parallel: whether the hidden states given to the call are split over the
            TP ranks along the sequence; None = the model's config.sequence_parallel (False
            for an output layer without a config).
        **kwargs: VocabParallelSampler's (max_batch, transport, merge, timeout_s,
            check_inputs, backend, logprobs).

    Call: sampler(hidden_states, **sample_args) with hidden_states the decoder's output
    after the final norm, [s_local, b, h] (Megatron's sequence-first layout; the last
    position is sampled) or [b, h] (one position per row, the same on every rank, whatever
    sequence_parallel says); sample_args as VocabParallelSampler's call (temperature, seed,
    top_k, top_p, min_p, allowed_mask, ...). Returns tpsample.SampleOutput with global token
    ids, identical on every TP rank.
    """

    def __init__(self, model, *, vocab_size: int | None = None, group=None,
                 sequence_parallel: bool | None = None, **kwargs):
        self._group = GroupRef(_tp_group(group))
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        weight = lm_head_shard(model)
        rows = weight.shape[0]
        self.padded_vocab_size = rows * self.world
        if vocab_size is None:
            vocab_size = self.padded_vocab_size
        if not isinstance(vocab_size, int) or not 0 < vocab_size <= self.padded_vocab_size:
            raise ValueError(f"vocab_size must be an int in [1, {self.padded_vocab_size}] (the "
                             f"padded vocabulary: {rows} rows x {self.world} TP ranks), got "
                             f"{vocab_size!r}")
        if sequence_parallel is None:
            config = getattr(model, "config", None)
            sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        self.sequence_parallel = sequence_parallel
        self.vocab_size = vocab_size
        self.hidden_size = weight.shape[1]
        self.sampler = VocabParallelSampler(weight, vocab_size=vocab_size,
                                            vocab_start=self.rank * rows, group=self.group,
                                            **kwargs)

    @property
    def group(self):
        """The tensor-parallel group (held by weak reference: transport.GroupRef)."""
        return self._group()

    def last_hidden(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[b, h] contiguous: the last position of hidden_states [s_local, b, h] (under
        sequence parallelism the last TP rank's last row, broadcast to the group: b·h
        values, not the sequence), or hidden_states itself if it is [b, h]."""
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() not in (2, 3):
            raise ValueError("hidden_states must be a tensor [s, b, h] or [b, h], got "
                             f"{getattr(hidden_states, 'shape', type(hidden_states).__name__)}")
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states: last dimension {hidden_states.shape[-1]} is not "
                             f"the LM head's hidden size {self.hidden_size}")
        if hidden_states.dim() == 2:
            return hidden_states.contiguous()
        last = hidden_states[-1].contiguous()
        if self.sequence_parallel and self.world > 1:
            dist.broadcast(last, src=dist.get_global_rank(self.group, self.world - 1),
                           group=self.group)
        return last

    def __call__(self, hidden_states: torch.Tensor, **sample_args):
        return self.sampler(self.last_hidden(hidden_states), **sample_args)
