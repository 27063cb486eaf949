"""tpsample on a Hugging Face transformers causal LM: the decoder's last hidden state goes to
tpsample.sample with the model's LM-head weight, in place of lm_head + logits processors +
softmax + multinomial.

    from tpsample import hf
    weight, bias = hf.lm_head(model)                           # [V, D] (and [V] or None)
    hidden, cache = hf.last_hidden(model, input_ids, cache)    # [B, D], the updated KV cache
    out = tpsample.sample(hidden, weight, bias=bias, temperature=0.7, top_k=50, top_p=0.9,
                          seed=seed, offset=step)

transformers is not imported here (the functions read the model's attributes), so it stays
the user's dependency. Semantics match transformers' sampling (temperature, then top-k, then
top-p on the renormalised top-k distribution: tpsample/filters.py); models whose logits are
transformed after the LM head (a final soft-cap, a logit scale) are refused, since their
distribution is not softmax(h·Wᵀ + b).
"""
from __future__ import annotations

import inspect

import torch

# config fields of models whose logits are not the LM head's output as it is
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale",
                     "logits_scaling")


def lm_head(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [V, D], bias [V] or None) of a causal LM's output projection
    (model.get_output_embeddings(), tied or not; no copy)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"model: {type(model).__name__} has no linear output projection "
                         "(get_output_embeddings().weight [V, D])")
    config = getattr(model, "config", None)
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0, 0, 0.0):
            raise ValueError(f"model: its config sets {name}={value!r}: the logits are "
                             "transformed after the LM head, which tpsample does not do")
    return weight, getattr(head, "bias", None)


def last_hidden(model, input_ids: torch.Tensor, past_key_values=None,
                attention_mask: torch.Tensor | None = None):
    """The decoder's last hidden state (after its final norm) at the last position of
    input_ids [B, T] (int64), and the updated KV cache: (hidden [B, D], past_key_values).
    Runs model.get_decoder() (the base model without the LM head): no logits are formed."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a [B, T] tensor, got "
                         f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        raise ValueError(f"model: {type(model).__name__} has no separate decoder "
                         "(get_decoder()) to run without its LM head")
    # newer transformers name the cache argument `cache` (past_key_values is deprecated)
    key = "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
    out = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=True,
                  **{key: past_key_values})
    cache = out.get("cache") if key == "cache" else out.get("past_key_values")
    return out.last_hidden_state[:, -1].contiguous(), cache
