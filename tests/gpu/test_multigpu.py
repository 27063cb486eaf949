"""Vocabulary-parallel sampling over NCCL and symmetric memory (device: nvidia-h200-x2/x4)."""
import pytest
import torch

import tpsample

from dist_utils import run_world

pytestmark = pytest.mark.multigpu

D, V, VOCAB = 2048, 50000, 49999


def inputs(B):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(B, D, generator=g).bfloat16()
    w = (torch.randn(V, D, generator=g) * 0.03).bfloat16()
    temp = torch.full((B,), 0.8)
    temp[::3] = 0.0
    return h, w, temp, torch.arange(B, dtype=torch.int64) * 5 + 1


def shard(w, rank, world, dev):
    """Rank's rows of w on dev (the first V % world ranks one row more)."""
    base, extra = divmod(V, world)
    lo = rank * base + min(rank, extra)
    return w[lo:lo + base + (rank < extra)].contiguous().to(dev)


def gpu_rank(rank, world, transport, merge, B):
    h, w, temp, seeds = inputs(B)
    dev = torch.device("cuda", rank)
    sampler = tpsample.VocabParallelSampler(shard(w, rank, world, dev), vocab_size=VOCAB,
                                            transport=transport, merge=merge, check_inputs=False)
    h, temp, seeds = h.to(dev), temp.to(dev), seeds.to(dev)
    offset = torch.zeros(B, dtype=torch.int64, device=dev)
    eager = [sampler(h, temperature=temp, seed=seeds, offset=offset + k, return_logprobs=True)
             for k in range(3)]
    # CUDA graph: capture one call, replay with the offset advanced in place
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sampler(h, temperature=temp, seed=seeds, offset=offset)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sampler(h, temperature=temp, seed=seeds, offset=offset)
    replays = []
    for k in range(3):
        offset.fill_(k)
        graph.replay()
        replays.append(out.clone())
    torch.cuda.synchronize()
    sampler.check_exchange(synchronize=False)  # no exchange failed: neither check raises
    sampler.check_exchange()
    return dict(transport=sampler.transport.name, eager=[e.tokens for e in eager],
                logz=eager[0].logz, replay=replays, replayed_calls=len(sampler.pipeline.replays))


@pytest.mark.parametrize("transport", ["symm_mem", "nccl", "auto"])
@pytest.mark.parametrize("merge", ["max", "logmass"])
@pytest.mark.parametrize("B", [16, 192])  # 192: the hybrid (cuBLAS + records pass) or, on Hopper, the warp-specialized kernel
def test_tp_gpu_transports(transport, merge, B):
    world = min(torch.cuda.device_count(), 4)
    outs = run_world(world, gpu_rank, transport, merge, B, backend="nccl")
    for o in outs:
        assert not ("error" in o and "eager" not in o), o
        # auto: symmetric memory wherever the GPUs reach each other over P2P
        assert o["transport"] == ("symm_mem" if transport == "auto" else transport)
        for k in range(3):
            assert torch.equal(o["eager"][k], outs[0]["eager"][k])
            assert torch.equal(o["replay"][k], o["eager"][k]), "graph replay differs from eager"
        # calls after the first re-issue the recorded launches (the pipeline's replays)
        assert o["replayed_calls"] >= 1
    if merge == "max":  # the first call is recorded, the next ones are replays
        h, w, temp, seeds = inputs(B)
        for k in range(3):
            single = tpsample.sample(h.cuda(), w.cuda(), temperature=temp.cuda(), seed=seeds.cuda(),
                                     offset=k, vocab_size=VOCAB)
            assert torch.equal(outs[0]["eager"][k], single.cpu())


def filtered_rank(rank, world, transport, B):
    h, w, temp, seeds = inputs(B)
    dev = torch.device("cuda", rank)
    sampler = tpsample.VocabParallelSampler(shard(w, rank, world, dev), vocab_size=VOCAB,
                                            transport=transport, check_inputs=False)
    k = torch.arange(B, device=dev) % 7 * 10
    return sampler(h.to(dev), temperature=temp.to(dev), seed=seeds.to(dev), top_k=k, top_p=0.9,
                   min_p=0.02, top_logprobs=4, num_samples=2, return_logprobs=True)


@pytest.mark.parametrize("B", [16, 64])
@pytest.mark.parametrize("transport", ["symm_mem", "nccl"])
def test_tp_filtered_equals_single_gpu(transport, B):
    """Filtered sampling under TP: every rank the same tokens, equal to one GPU's call (B = 16:
    the fused kernel's candidate epilogue; B = 64 on Hopper: ws's, through the fan-out)."""
    world = min(torch.cuda.device_count(), 4)
    if world < 2:
        pytest.skip("needs 2 GPUs")
    outs = run_world(world, filtered_rank, transport, B, backend="nccl")
    for o in outs:
        assert not isinstance(o, dict), o
        assert torch.equal(o.tokens, outs[0].tokens) and torch.equal(o.top_tokens, outs[0].top_tokens)
    h, w, temp, seeds = inputs(B)
    k = torch.arange(B) % 7 * 10
    single = tpsample.sample(h.cuda(), w.cuda(), vocab_size=VOCAB, temperature=temp.cuda(),
                             seed=seeds.cuda(), top_k=k.cuda(), top_p=0.9, min_p=0.02,
                             top_logprobs=4, num_samples=2, return_logprobs=True)
    assert (outs[0].tokens == single.tokens.cpu()).float().mean() > 0.95  # fp32 near-ties aside
    assert torch.equal(outs[0].top_tokens, single.top_tokens.cpu())


def filtered_graph_rank(rank, world, B, graphs, top_k=None):
    """Eight repeated top-p calls over symmetric memory on near-flat rows (the gathered
    device fallback's fast path; with top_k: its one-program-per-row bisection, on the
    device while the fallback choice, read alike on every rank, keeps it there), new hidden
    states and seeds each call; graphs: filtered calls through their CUDA graph (the
    default) or re-issued launches (TPSAMPLE_GRAPHS=plain)."""
    from tpsample import api, knobs
    with knobs.overridden(GRAPHS_FILTERED=graphs):
        res = _filtered_graph_calls(rank, world, B, top_k)
    api._PIPELINES.clear()
    return res


def _filtered_graph_calls(rank, world, B, top_k=None):
    h, w, temp, seeds = inputs(B)
    dev = torch.device("cuda", rank)
    sampler = tpsample.VocabParallelSampler(shard(w, rank, world, dev), vocab_size=VOCAB,
                                            transport="symm_mem", check_inputs=False)
    seed = seeds.to(dev)
    outs = []
    for i in range(8):
        seed.add_(1)
        out = sampler((h * 0.02 * (1 + i / 8)).to(dev), temperature=temp.to(dev), seed=seed,
                      offset=3, top_p=0.95, top_k=top_k, return_logprobs=True)
        outs.append((out.tokens.cpu(), out.logprobs.cpu(), out.logz.cpu()))
    res = dict(outs=outs, captures=sum(sampler.pipeline.graphs.captures.values()),
               fallback_rows=sampler.pipeline.fallback_rows,
               host_rows=sampler.pipeline.host_fallback_rows)
    sampler.check_exchange()
    return res


@pytest.mark.parametrize("top_k", [None, 3000])
def test_tp_filtered_calls_through_their_graph_equal_reissued_launches(top_k):
    """Under TP (symmetric memory, the fallback's rows gathered on the device), repeated
    top-p calls (top_k 3000: beyond the candidates, so every row takes the bisection; the
    count is read back every 8th call, so all eight stay on the device) replay one CUDA
    graph from their third call (the default): tokens, log-probs and log Z equal re-issued
    launches on every call, flagged rows included."""
    world = min(torch.cuda.device_count(), 4)
    if world < 2:
        pytest.skip("needs 2 GPUs")
    B = 16
    got = run_world(world, filtered_graph_rank, B, True, top_k, backend="nccl")
    want = run_world(world, filtered_graph_rank, B, False, top_k, backend="nccl")
    for g, w_ in zip(got, want):
        assert "error" not in g and "error" not in w_, (g, w_)
        assert g["captures"] == 1 and w_["captures"] == 0
        assert g["fallback_rows"] > 0 and g["host_rows"] == w_["host_rows"] == 0
        for i, (a, b) in enumerate(zip(g["outs"], w_["outs"])):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), i
            assert torch.equal(a[2], b[2]), i


def memo_rank(rank, world, B, memo, kw):
    """A decode loop over symmetric memory: new hidden states, the step as an int offset,
    seed=None (the sampler's generator), with TPSAMPLE_MEMO on (and the tokens into one
    out= tensor) or off."""
    from tpsample import knobs
    knobs.MEMO = memo
    h, w, _, _ = inputs(B)
    dev = torch.device("cuda", rank)
    torch.manual_seed(0)  # (rank 0's draw of the sampler's base seed)
    sampler = tpsample.VocabParallelSampler(shard(w, rank, world, dev), vocab_size=VOCAB,
                                            transport="symm_mem")
    outs = []
    given = torch.empty(B, dtype=torch.int64, device=dev) if memo else None
    for step in range(10):
        out = sampler((h * 0.05 * (1 + step / 10)).to(dev), temperature=0.9, offset=step,
                      return_logprobs=True, out=given, **kw)
        assert given is None or out.tokens is given
        outs.append((out.tokens.cpu(), out.logprobs.cpu(), out.logz.cpu()))
    sampler.check_exchange()
    return dict(outs=outs, hits=sampler.memo.hits)


@pytest.mark.parametrize("kw", [dict(), dict(top_p=0.95)])
def test_tp_memoised_calls_equal_the_full_path(kw):
    """Under TP (symmetric memory, the per-call input check on) a decode loop through
    tpsample/call_memo.py, its tokens into one out= tensor, gives every call the tokens,
    log-probs and log Z of the same loop with the memo off and no out, on every rank."""
    world = min(torch.cuda.device_count(), 4)
    if world < 2:
        pytest.skip("needs 2 GPUs")
    got = run_world(world, memo_rank, 8, True, kw, backend="nccl")
    want = run_world(world, memo_rank, 8, False, kw, backend="nccl")
    for g, w_ in zip(got, want):
        assert "error" not in g and "error" not in w_, (g, w_)
        assert g["hits"] >= 4 and w_["hits"] == 0
        for i, (a, b) in enumerate(zip(g["outs"], w_["outs"])):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), i
    assert all(torch.equal(g["outs"][i][0], got[0]["outs"][i][0])
               for g in got for i in range(10))


def fallback_rank(rank, world, B):
    """Near-flat rows (top-p reaching below the candidates) over symmetric memory: the first
    calls take the gathered device fallback (also captured in a CUDA graph); rows that keep
    falling back move every rank to the host fallback at the same call, and a certified
    call moves them back."""
    from tpsample import api
    h, w, temp, seeds = inputs(B)
    dev = torch.device("cuda", rank)
    sampler = tpsample.VocabParallelSampler(shard(w, rank, world, dev), vocab_size=VOCAB,
                                            transport="symm_mem", check_inputs=False)
    h = (h * 0.02).to(dev)
    offset = torch.zeros(B, dtype=torch.int64, device=dev)
    kw = dict(temperature=temp.to(dev), seed=seeds.to(dev), top_p=0.9,
              top_k=torch.arange(B, device=dev) % 3 * 4000, top_logprobs=4,
              return_logprobs=True)
    pipe = sampler.pipeline
    pipe.fallback.reads.every = 1  # a copy of the count per call (8 by default): the switch
    first = sampler(h, offset=offset, **kw)  # within the calls below
    res = dict(first=(first.tokens.cpu(), first.top_tokens.cpu(), first.logz.cpu()))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sampler(h, offset=offset, **kw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sampler(h, offset=offset, **kw)
    graph.replay()
    torch.cuda.synchronize()
    res["replay"] = (captured.tokens.cpu(), captured.top_tokens.cpu())
    res["device_rows"] = int(pipe.fallback.device_rows.item())
    res["host_rows_before"] = pipe.host_fallback_rows
    modes, tokens = [], []
    for k in range(5):
        out = sampler(h, offset=offset + k, **kw)
        modes.append(pipe.fallback.host_mode)
        tokens.append(out.tokens.cpu())
    sampler(h, offset=offset, seed=kw["seed"], top_k=3)  # certified: back to the device path
    modes.append(pipe.fallback.host_mode)
    res.update(modes=modes, tokens=tokens, host_rows=pipe.host_fallback_rows)
    sampler.check_exchange()
    api._PIPELINES.clear()
    return res


@pytest.mark.parametrize("B", [16, 64])
def test_tp_device_fallback_over_symm_mem(B):
    """The exact fallback under TP without the host: every rank the same outputs, equal to one
    GPU's device fallback (top tokens exactly; tokens up to fp32 near-ties), a captured call
    replays to the eager one, and the switch to the host fallback happens at the same call on
    every rank."""
    world = min(torch.cuda.device_count(), 4)
    if world < 2:
        pytest.skip("needs 2 GPUs")
    outs = run_world(world, fallback_rank, B, backend="nccl")
    for o in outs:
        assert "error" not in o, o
    r0 = outs[0]
    assert r0["device_rows"] > 0 and r0["host_rows_before"] == 0
    assert torch.equal(r0["replay"][0], r0["first"][0]) and torch.equal(r0["replay"][1], r0["first"][1])
    assert any(r0["modes"][:-1]) and not r0["modes"][-1] and r0["host_rows"] > 0
    for o in outs[1:]:
        assert o["modes"] == r0["modes"]
        assert all(torch.equal(a, b) for a, b in zip(o["tokens"], r0["tokens"]))
        assert all(torch.equal(a, b) for a, b in zip(o["first"], r0["first"]))
    from tpsample import api
    api._PIPELINES.clear()  # a fresh one-GPU pipeline: its first call takes the device fallback
    h, w, temp, seeds = inputs(B)
    single = tpsample.sample((h * 0.02).cuda(), w.cuda(), vocab_size=VOCAB, temperature=temp.cuda(),
                             seed=seeds.cuda(), top_p=0.9, top_k=(torch.arange(B) % 3 * 4000).cuda(),
                             top_logprobs=4, return_logprobs=True)
    assert torch.equal(r0["first"][1], single.top_tokens.cpu())
    assert (r0["first"][0] == single.tokens.cpu()).float().mean() > 0.95
    assert torch.allclose(r0["first"][2], single.logz.cpu(), atol=1e-4)


def constrained_fallback_rank(rank, world, B):
    """Near-flat rows with top-p, listed tokens (penalties) and a mask over symmetric memory."""
    h, w, temp, seeds = inputs(B)
    dev = torch.device("cuda", rank)
    sampler = tpsample.VocabParallelSampler(shard(w, rank, world, dev), vocab_size=VOCAB,
                                            transport="symm_mem", check_inputs=False)
    out = sampler((h * 0.02).to(dev), **{k: v.to(dev) if torch.is_tensor(v) else
                                         (tuple(x.to(dev) for x in v) if isinstance(v, tuple) else v)
                                         for k, v in constrained_kwargs(B, temp, seeds).items()})
    pipe = sampler.pipeline
    torch.cuda.synchronize()
    return dict(tokens=out.tokens.cpu(), top=out.top_tokens.cpu(),
                device_rows=int(pipe.fallback.device_rows.item()), host_rows=pipe.host_fallback_rows)


def constrained_kwargs(B, temp, seeds):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (B, 16), generator=g)
    ids[:, 12:] = -1
    allowed = torch.rand(B, VOCAB, generator=g) < 0.7
    words = torch.zeros(B, (VOCAB + 31) // 32, dtype=torch.int64)
    for j in range(32):  # bit j of word i allows token 32 i + j
        col = allowed[:, j::32].long()
        words[:, :col.shape[1]] |= col << j
    return dict(temperature=temp, seed=seeds, top_p=0.8, top_logprobs=3, return_logprobs=True,
                allowed_mask=words.to(torch.int32), logit_adjust=(ids, torch.randn(B, 16, generator=g)),
                repetition_penalty=1.3)


def test_tp_device_fallback_with_constraints_over_symm_mem():
    """The gathered fallback with listed tokens (their logits stored after the rest): ranks
    agree, no row takes the host path, and the top tokens equal one GPU's."""
    world = min(torch.cuda.device_count(), 4)
    if world < 2:
        pytest.skip("needs 2 GPUs")
    B = 16
    outs = run_world(world, constrained_fallback_rank, B, backend="nccl")
    for o in outs:
        assert "error" not in o, o
        assert torch.equal(o["tokens"], outs[0]["tokens"]) and torch.equal(o["top"], outs[0]["top"])
    assert outs[0]["device_rows"] > 0 and outs[0]["host_rows"] == 0
    from tpsample import api
    api._PIPELINES.clear()
    h, w, temp, seeds = inputs(B)
    kw = constrained_kwargs(B, temp, seeds)
    kw["logit_adjust"] = tuple(x.cuda() for x in kw["logit_adjust"])
    single = tpsample.sample((h * 0.02).cuda(), w.cuda(), vocab_size=VOCAB,
                             **{k: v.cuda() if torch.is_tensor(v) else v for k, v in kw.items()})
    assert torch.equal(outs[0]["top"], single.top_tokens.cpu())
    assert (outs[0]["tokens"] == single.tokens.cpu()).float().mean() > 0.95


def fast_path_rank(rank, world, B, transport):
    """top_p (and min_p on odd rows) alone on near-flat rows: every filtered row through the
    fast path (kernels/filter_cut.py) over the gathered side output; eager and replayed."""
    h, w, temp, seeds = inputs(B)
    dev = torch.device("cuda", rank)
    sampler = tpsample.VocabParallelSampler(shard(w, rank, world, dev), vocab_size=VOCAB,
                                            transport=transport, check_inputs=False)
    kw = dict(temperature=temp.to(dev), seed=seeds.to(dev), top_p=0.9,
              min_p=torch.tensor([0.0, 0.01] * (B // 2), device=dev), return_logprobs=True)
    h = (h * 0.02).to(dev)
    out = sampler(h, **kw)
    tokens_only = sampler(h, **dict(kw, return_logprobs=False))  # (the winner check)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sampler(h, **kw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sampler(h, **kw)
    graph.replay()
    torch.cuda.synchronize()
    pipe = sampler.pipeline
    res = dict(tokens=out.tokens.cpu(), logz=out.logz.cpu(), replay=captured.tokens.cpu(),
               tokens_only=tokens_only.cpu(), logprobs=out.logprobs.cpu(),
               device_rows=int(pipe.fallback.device_rows.item()), host_rows=pipe.host_fallback_rows)
    sampler.check_exchange()
    return res


@pytest.mark.parametrize("B", [16, 64])
def test_tp_fast_path_equals_single_gpu(B, transport="symm_mem"):
    """TP top-p / min-p on near-flat rows (the fast path from the side output gathered over
    symmetric memory, each row to and cut on one rank; NCCL takes the host path, which a CUDA
    graph cannot capture): every rank the same tokens, log-probs and log Z and the same count
    of device rows, tokens equal to one GPU's up to fp32 near-ties, log Z within 1e-4, no row
    on the host, a tokens-only call (the winner check) gives the same tokens, a captured call
    replays to the eager one."""
    world = min(torch.cuda.device_count(), 4)
    if world < 2:
        pytest.skip("needs 2 GPUs")
    outs = run_world(world, fast_path_rank, B, transport, backend="nccl")
    for o in outs:
        assert "error" not in o, o
    r0 = outs[0]
    assert torch.equal(r0["replay"], r0["tokens"])
    assert torch.equal(r0["tokens_only"], r0["tokens"])
    assert r0["device_rows"] > 0 and r0["host_rows"] == 0
    for o in outs[1:]:
        assert torch.equal(o["tokens"], r0["tokens"]) and torch.equal(o["logz"], r0["logz"])
        assert torch.equal(o["logprobs"], r0["logprobs"]) and o["device_rows"] == r0["device_rows"]
        assert torch.equal(o["tokens_only"], r0["tokens_only"])
    from tpsample import api
    api._PIPELINES.clear()
    h, w, temp, seeds = inputs(B)
    single = tpsample.sample((h * 0.02).cuda(), w.cuda(), vocab_size=VOCAB, temperature=temp.cuda(),
                             seed=seeds.cuda(), top_p=0.9,
                             min_p=torch.tensor([0.0, 0.01] * (B // 2)).cuda(),
                             return_logprobs=True)
    assert (r0["tokens"] == single.tokens.cpu()).float().mean() > 0.95
    assert torch.allclose(r0["logz"], single.logz.cpu(), atol=1e-4)
