"""Constrained decoding on the GPU (pytest -m gpu): the kernels at a real LM-head shape against
the torch path, exactness through tpsample.sample, launch replay and CUDA-graph capture."""
import numpy as np
import pytest
import torch

import tpsample
from tpsample.launch.bench import typical_head

from cases import lm_head_case
from stats import ALPHA, chi2_pvalue
from test_constraints import constrained_probs, pack

pytestmark = pytest.mark.gpu


def constrained_call(B, V, g, filters=False):
    mask = torch.randint(-2 ** 31, 2 ** 31, (B, -(-V // 32)), generator=g).to(torch.int32)
    ids = torch.randint(0, V, (B, 64), generator=g)
    ids[:, 60:] = -1
    ids[:, 1] = ids[:, 0]
    values = torch.randn(B, 64, generator=g) * 2
    temp = 0.5 + torch.rand(B, generator=g)
    temp[::7] = 0.0
    kw = dict(allowed_mask=mask, logit_adjust=(ids, values),
              repetition_penalty=1.0 + torch.rand(B, generator=g), temperature=temp,
              seed=torch.arange(B) * 11, offset=3)
    if filters:
        kw.update(top_k=torch.randint(0, 60, (B,), generator=g), top_p=0.9, top_logprobs=4)
    return {k: (v.cuda() if isinstance(v, torch.Tensor) else
                tuple(t.cuda() for t in v) if isinstance(v, tuple) else v) for k, v in kw.items()}


@pytest.mark.parametrize("B,filters", [(1, False), (16, True), (64, False), (128, False),
                                       (256, True)])
def test_kernels_equal_torch_path(B, filters):
    """D = 4096, V = 151936 bf16: the Triton path (fused or records pass, the extra tile's
    kernel, the filter kernels) against the torch path on the same call: tokens equal up to
    fp32 near-ties (their logits are computed differently), log Z close."""
    g = torch.Generator().manual_seed(B)
    h, w = typical_head(4096, 151936, B, torch.bfloat16, "cuda")
    kw = constrained_call(B, 151936, g, filters)
    a = tpsample.sample(h, w, return_logprobs=True, **kw)
    b = tpsample.sample(h, w, return_logprobs=True, backend="torch", **kw)
    assert (a.tokens == b.tokens).float().mean() >= 0.97
    assert torch.allclose(a.logz, b.logz, atol=2e-3, rtol=1e-4)
    if filters:
        assert (a.top_tokens == b.top_tokens).float().mean() >= 0.97


@pytest.mark.parametrize("filters", [False, True])
def test_replay_and_graph_capture(filters):
    """The launch replay (the second call) and a captured graph give the first call's tokens,
    which equal the torch path's."""
    B = 32
    g = torch.Generator().manual_seed(1)
    h, w = typical_head(4096, 151936, B, torch.bfloat16, "cuda")
    kw = constrained_call(B, 151936, g, filters=filters)
    kw["top_logprobs"] = kw.get("top_logprobs", 0)
    first = tpsample.sample(h, w, **kw)
    again = tpsample.sample(h, w, **kw)  # the launch replay
    want = tpsample.sample(h, w, backend="torch", **kw)
    assert torch.equal(first.tokens, again.tokens) if filters else torch.equal(first, again)
    tok = (lambda o: o.tokens if filters else o)
    assert (tok(first) == tok(want)).float().mean() >= 0.97
    seed = kw.pop("seed").clone()
    static = {k: v for k, v in kw.items()}
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        tpsample.sample(h, w, seed=seed, **static)  # warm up on the side stream
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = tpsample.sample(h, w, seed=seed, **static)
    torch.cuda.current_stream().wait_stream(s)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(tok(out), tok(first))
    seed += 1
    graph.replay()
    eager = tpsample.sample(h, w, seed=seed, **static)
    torch.cuda.synchronize()
    assert torch.equal(tok(out), tok(eager))


def test_chi2_constrained_on_gpu_bf16():
    h, w = lm_head_case("zipf", V=1000, dtype=torch.bfloat16, device="cuda", seed=3)
    l = (h.float().cpu().double() @ w.float().cpu().double().T).numpy()
    allowed = np.random.default_rng(1).random(1000) < 0.5
    low = int(np.argsort(np.where(allowed, l, np.inf))[8])
    ids = torch.tensor([[low, int(np.argmax(l)), 5]])
    values = torch.tensor([[4.0, -3.0, 1.0]])
    rows = 40000
    tok = tpsample.sample(h.expand(rows, -1).contiguous(), w,
                          seed=torch.arange(rows, device="cuda") * 7919,
                          allowed_mask=pack(allowed[None]).expand(rows, -1).cuda(),
                          logit_adjust=(ids.expand(rows, -1).cuda(),
                                        values.expand(rows, -1).cuda()),
                          repetition_penalty=1.3)
    p = constrained_probs(l, allowed, ids=ids[0].tolist(), values=values[0].tolist(),
                          penalty=1.3)
    assert p[tok.cpu()].min() > 0
    assert chi2_pvalue(tok, p) > ALPHA
