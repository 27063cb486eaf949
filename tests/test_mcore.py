"""tpsample.mcore on real megatron-core GPT models built on the CPU (gloo, TP 1 and 2): the
adapter's tokens equal tpsample.sample on the unsharded LM head, with a padded vocabulary,
tied or untied embeddings, and sequence-parallel hidden states. (megatron-core's attention
forward needs CUDA: the hidden states here are random tensors of the decoder output's shape;
the decode loop itself is examples/mcore_decode.py.)"""
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")

import tpsample  # noqa: E402
from tpsample.mcore import MegatronSampler, lm_head_shard  # noqa: E402

from dist_utils import run_world  # noqa: E402

H, VOCAB, PADDED, SEQ, B = 64, 1000, 1024, 8, 5


def gpt_model(world, tied):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4,
                               num_query_groups=2, ffn_hidden_size=2 * H,
                               use_cpu_initialization=True, params_dtype=torch.float32,
                               tensor_model_parallel_size=world)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                        vocab_size=PADDED, max_sequence_length=SEQ,
                        share_embeddings_and_output_weights=tied)


def adapter_vs_full_weight(rank, world, tied, sequence_parallel):
    import torch.distributed as dist
    # (the local layer spec's torch norms refuse config.sequence_parallel: the layout is given
    # to the adapter instead of read from the config)
    model = gpt_model(world, tied)
    shard = lm_head_shard(model)
    assert shard.shape == (PADDED // world, H)
    if tied:
        assert shard.data_ptr() == model.embedding.word_embeddings.weight.data_ptr()
    # a distinct scale per row so the padding rows would win if they were sampled
    with torch.no_grad():
        shard.mul_(4.0)
        shard[-8:] += 10.0 * (rank == world - 1)
    assert MegatronSampler(model, vocab_size=VOCAB).sequence_parallel is False  # the config's
    sampler = MegatronSampler(model, vocab_size=VOCAB, sequence_parallel=sequence_parallel)
    full = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(full, shard.detach().contiguous())
    full = torch.cat(full)
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(SEQ, B, H, generator=g)
    local = hidden.chunk(world)[rank] if sequence_parallel else hidden
    args = dict(temperature=torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0]),
                seed=torch.arange(B) + 100, return_logprobs=True)
    with torch.no_grad():
        got = sampler(local, **args)
        want = tpsample.sample(hidden[-1].contiguous(), full[:VOCAB].contiguous(), **args)
        got_k = sampler(local, top_k=3, **args)
        want_k = tpsample.sample(hidden[-1].contiguous(), full[:VOCAB].contiguous(), top_k=3, **args)
        got_rows = sampler(hidden[-1], **args)  # [b, h]: used as it is
    return dict(got=got.tokens, want=want.tokens, got_lp=got.logprobs, want_lp=want.logprobs,
                got_k=got_k.tokens, want_k=want_k.tokens, rows=got_rows.tokens)


@pytest.mark.parametrize("world,tied,sequence_parallel",
                         [(1, False, False), (2, False, True), (2, True, False)])
def test_adapter_tokens_equal_the_unsharded_head(world, tied, sequence_parallel):
    """Every TP rank gets the tokens (and log-probs) of tpsample.sample on the full LM head cut
    to the tokenizer's vocabulary, from the model's own shards (1024 padded rows, 1000
    real; the padding rows are made the largest logits, so sampling one would show)."""
    outs = run_world(world, adapter_vs_full_weight, tied, sequence_parallel)
    for out in outs:
        assert "error" not in out, out
        assert torch.equal(out["got"], out["want"]) and torch.equal(out["got_k"], out["want_k"])
        assert torch.equal(out["rows"], out["want"])
        torch.testing.assert_close(out["got_lp"], out["want_lp"], rtol=0, atol=1e-5)
        assert int(out["got"].max()) < VOCAB
    assert all(torch.equal(o["got"], outs[0]["got"]) for o in outs)


def bad_inputs(rank, world):
    model = gpt_model(world, tied=True)
    errors = {}
    for name, call in (
            ("vocab_size", lambda: MegatronSampler(model, vocab_size=PADDED + 1)),
            ("model", lambda: MegatronSampler(model.output_layer, vocab_size=VOCAB)),
            ("hidden_states", lambda: MegatronSampler(model, vocab_size=VOCAB)(torch.randn(2, 3, H + 1))),
            ("hidden_states", lambda: MegatronSampler(model, vocab_size=VOCAB)(torch.randn(H)))):
        try:
            call()
            errors.setdefault(name, []).append("no error")
        except ValueError as e:
            errors.setdefault(name, []).append(str(e))
    return errors


def test_adapter_rejects_bad_input_naming_the_argument():
    """A vocabulary larger than the padded one, a tied model's output layer (it owns no
    weight), hidden states of the wrong width or rank: ValueErrors that name the argument."""
    (errors,) = run_world(1, bad_inputs)
    assert "error" not in errors, errors
    for name, messages in errors.items():
        for message in messages:
            assert message.startswith(name), (name, message)
