"""tpsample.hf on a small random transformers causal LM (CPU): the helpers give the model's
own logits without forming them, and tpsample's samples follow the distribution
transformers' own sampling draws from (its temperature / top-k / top-p warpers on the same
logits, then softmax): chi-squared against it in float64, with negative controls."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import tpsample  # noqa: E402
from tpsample import hf  # noqa: E402

from stats import ALPHA, chi2_pvalue  # noqa: E402

V = 96
N = 40_000  # draws per case: ~400 per kept token at the smallest kept set


@pytest.fixture(scope="module")
def model():
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(30.0)  # logits a few nats apart, so the filters cut something
    return m


def prompt():
    return torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(3))


def test_helpers_give_the_models_own_logits_and_cache(model):
    """hidden · Wᵀ equals the model's last-position logits, also one cached step later; greedy
    tokens equal the logits' argmax."""
    ids = prompt()
    weight, bias = hf.lm_head(model)
    assert weight.data_ptr() == model.lm_head.weight.data_ptr() and bias is None
    with torch.no_grad():
        hidden, cache = hf.last_hidden(model, ids)
        nxt = torch.tensor([[5]])
        hidden2, _ = hf.last_hidden(model, nxt, cache)
        logits = model(torch.cat([ids, nxt], 1)).logits
    torch.testing.assert_close(hidden @ weight.T, logits[:, -2], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(hidden2 @ weight.T, logits[:, -1], rtol=1e-5, atol=1e-4)
    greedy = tpsample.sample(hidden2, weight, temperature=0.0)
    assert torch.equal(greedy, logits[:, -1].argmax(-1))


def hf_probs(logits, temperature, top_k=None, top_p=None):
    """float64 probabilities of transformers' sampling: its warpers in generate()'s order."""
    warpers = [transformers.TemperatureLogitsWarper(temperature)]
    if top_k is not None:
        warpers.append(transformers.TopKLogitsWarper(top_k))
    if top_p is not None:
        warpers.append(transformers.TopPLogitsWarper(top_p))
    scores = transformers.LogitsProcessorList(warpers)(prompt(), logits.double().clone())
    return torch.softmax(scores, -1)[0]


def tpsample_draws(model, temperature, top_k=None, top_p=None, seed0=0):
    with torch.no_grad():
        hidden, _ = hf.last_hidden(model, prompt())
        logits = model(prompt()).logits[:, -1]
    weight, _ = hf.lm_head(model)
    rows = hidden.expand(N, -1).contiguous()
    # the torch path (the interpreted kernels are checked on the same semantics elsewhere)
    tokens = tpsample.sample(rows, weight, temperature=temperature, top_k=top_k, top_p=top_p,
                             seed=torch.arange(N) + seed0, backend="torch")
    return tokens, logits


# the filtered cases run every row through the exact fallback (V = 96 is one tile: its
# candidates cannot certify top-k = 10): ~25 s each on 2 cores, so they are slow tests
CASES = [dict(temperature=0.8),
         *(pytest.param(c, marks=pytest.mark.slow) for c in (
             dict(temperature=0.8, top_k=10), dict(temperature=1.2, top_p=0.8),
             dict(temperature=1.0, top_k=20, top_p=0.9)))]


def case_id(case):
    return "-".join(f"{k}{v}" for k, v in case.items())


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_samples_follow_transformers_sampling(model, case):
    """Chi-squared (alpha = ALPHA) of N draws against transformers' processed distribution;
    the negative controls (a temperature 10 % off, a top-p 0.1 off, a top-k one smaller)
    must fail the same test on the same draws."""
    tokens, logits = tpsample_draws(model, **case)
    right = hf_probs(logits, **case)
    assert right[tokens].min() > 0  # never a token transformers would not sample
    assert chi2_pvalue(tokens, right) > ALPHA
    wrong = dict(case, temperature=case["temperature"] * 1.1)
    if "top_p" in case:
        wrong = dict(case, top_p=case["top_p"] - 0.1)
    elif "top_k" in case:
        wrong = dict(case, top_k=case["top_k"] - 1)
    near = hf_probs(logits, **wrong)
    assert (near[tokens] == 0).any() or chi2_pvalue(tokens, near) < ALPHA


def test_lm_head_refuses_transformed_logits(model):
    """A config that transforms the logits after the LM head (here a final soft-cap) is
    refused with an error naming the argument, as is a model without an output projection."""
    model.config.final_logit_softcapping = 30.0
    try:
        with pytest.raises(ValueError, match="^model: .*final_logit_softcapping"):
            hf.lm_head(model)
    finally:
        model.config.final_logit_softcapping = None
    with pytest.raises(ValueError, match="^model: "):
        hf.lm_head(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="^input_ids"):
        hf.last_hidden(model, torch.zeros(6, dtype=torch.long))
