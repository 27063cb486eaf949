"""VocabParallelSampler over gloo in real local processes (world sizes 2, 3, 4)."""
import time

import pytest
import torch

import tpsample
from tpsample import VocabParallelSampler

from cases import exact_probs, lm_head_case, random_inputs
from dist_utils import run_world
from stats import ALPHA, chi2_pvalue

B, D, V, VOCAB = 6, 32, 1000, 990


def shard_bounds(rank, world, V):
    """Uneven contiguous split: the first V % world ranks get one extra row."""
    base, extra = divmod(V, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def common_inputs():
    h, w = random_inputs(B, D, V, torch.float32, seed=21)
    bias = torch.randn(V, generator=torch.Generator().manual_seed(1))
    temp = torch.tensor([1.0, 0.0, 0.5, 2.0, 1.0, 0.7])
    seeds = torch.tensor([5, 6, 7, 8, 9, -10], dtype=torch.int64)
    offsets = torch.arange(B, dtype=torch.int64) * 3
    return h, w, bias, temp, seeds, offsets


def tp_sample(rank, world, merge, backend, explicit_start):
    h, w, bias, temp, seeds, offsets = common_inputs()
    lo, hi = shard_bounds(rank, world, V)
    if explicit_start:  # reversed placement: rank r holds the shard of rank world-1-r
        lo, hi = shard_bounds(world - 1 - rank, world, V)
    sampler = VocabParallelSampler(w[lo:hi].contiguous(), vocab_size=VOCAB,
                                   vocab_start=lo if explicit_start else None, merge=merge,
                                   backend=backend)
    out = torch.empty(B, 2, dtype=torch.int64)  # (out=: the tokens written there)
    res = sampler(h, temperature=temp, seed=seeds, offset=offsets, bias=bias[lo:hi],
                  num_samples=2, return_logprobs=True, out=out)
    assert res.tokens is out
    return res


@pytest.mark.parametrize("world,backend,explicit", [
    (2, "auto", False), pytest.param(3, "torch", False, marks=pytest.mark.slow),
    pytest.param(4, "torch", True, marks=pytest.mark.slow),
    pytest.param(3, "auto", True, marks=pytest.mark.slow)])
def test_tp_tokens_equal_single_device_and_identical_on_ranks(world, backend, explicit):
    outs = run_world(world, tp_sample, "max", backend, explicit)
    for o in outs:
        assert not isinstance(o, dict), o
    h, w, bias, temp, seeds, offsets = common_inputs()
    single = tpsample.sample(h, w, temperature=temp, seed=seeds, offset=offsets, bias=bias,
                             vocab_size=VOCAB, num_samples=2, return_logprobs=True, backend="torch")
    for o in outs:
        assert torch.equal(o.tokens, outs[0].tokens)
        assert torch.equal(o.logprobs, outs[0].logprobs) and torch.equal(o.logz, outs[0].logz)
    assert torch.equal(outs[0].tokens, single.tokens)  # TP invariance of the max merge
    assert torch.allclose(outs[0].logprobs, single.logprobs, atol=1e-5)
    assert torch.allclose(outs[0].logz, single.logz, atol=1e-5)


def tp_chi2(rank, world, rows, samples, merge="logmass"):
    h, w = lm_head_case("zipf", V=300, seed=12)
    bias = torch.linspace(-1, 1, 300)
    lo, hi = shard_bounds(rank, world, 300)
    sampler = VocabParallelSampler(w[lo:hi].contiguous(), vocab_size=290, merge=merge, backend="torch")
    seeds = torch.arange(rows, dtype=torch.int64) * 31
    return sampler(h.expand(rows, -1).contiguous(), temperature=0.8, seed=seeds, bias=bias[lo:hi],
                   num_samples=samples)


@pytest.mark.slow
@pytest.mark.parametrize("world,merge", [(2, "logmass"), (3, "logmass"), (2, "cdf")])
def test_tp_group_merge_chi2(world, merge):
    outs = run_world(world, tp_chi2, 400, 25, merge)
    assert all(torch.equal(o, outs[0]) for o in outs)
    h, w = lm_head_case("zipf", V=300, seed=12)
    p = exact_probs(h, w, temperature=0.8, bias=torch.linspace(-1, 1, 300), vocab_size=290)
    assert outs[0].max() < 290
    assert chi2_pvalue(outs[0], p[:290]) > ALPHA


def tp_seed_none(rank, world):
    h, w, *_ = common_inputs()
    lo, hi = shard_bounds(rank, world, V)
    torch.manual_seed(1234 + rank * (rank != 0))  # only rank 0's generator matters
    sampler = VocabParallelSampler(w[lo:hi].contiguous(), vocab_size=V, backend="torch")
    return torch.stack([sampler(h, num_samples=3) for _ in range(2)])


@pytest.mark.slow
def test_tp_seed_none_agrees_across_ranks_and_follows_rank0_manual_seed():
    a = run_world(2, tp_seed_none)
    b = run_world(2, tp_seed_none)
    assert torch.equal(a[0], a[1]) and torch.equal(a[0], b[0])
    assert not torch.equal(a[0][0], a[0][1])  # two calls draw different seeds


def tp_tokens_without_logprobs(rank, world):
    h, w, bias, temp, seeds, offsets = common_inputs()
    lo, hi = shard_bounds(rank, world, V)
    kw = dict(temperature=temp, seed=seeds, offset=offsets, bias=bias[lo:hi], num_samples=2)
    samplers = [VocabParallelSampler(w[lo:hi].contiguous(), vocab_size=VOCAB, logprobs=flag,
                                     backend="triton") for flag in (True, False)]
    out = [s(h, **kw) for s in samplers]
    given = torch.empty(B, 2, dtype=torch.int64)
    assert samplers[1](h, out=given, **kw) is given  # (out=: the tokens written there)
    return out + [given]


@pytest.mark.slow
def test_tp_logprobs_false_keeps_tokens():
    """logprobs=False skips the tile log-masses and logits in stage 1: same tokens."""
    for with_lp, without, given in run_world(2, tp_tokens_without_logprobs):
        assert torch.equal(with_lp, without) and torch.equal(given, without)


def tp_bad(rank, world, case):
    h, w, *_ = common_inputs()
    lo, hi = shard_bounds(rank, world, V)
    shard = w[lo:hi].contiguous()
    kw = dict(vocab_size=V, backend="torch")
    if case == "D":
        shard = torch.randn(hi - lo, D + rank)
    elif case == "vocab_size":
        kw["vocab_size"] = V + 1
    elif case == "vocab_start":
        kw["vocab_start"] = [0, 600][rank]  # gap between the shards
    elif case == "logprobs":
        kw["logprobs"] = rank == 0
    elif case == "no_logprobs":
        kw["logprobs"] = False
    elif case == "timeout_s":
        kw["timeout_s"] = float("inf")
    sampler = VocabParallelSampler(shard, **kw)
    if case == "B":
        sampler(h[: B - rank], seed=1)
    if case == "no_logprobs":
        sampler(h, seed=1, return_logprobs=True)
    return "no error"


TP_BAD = [("D", "ValueError", "D"), ("B", "ValueError", "disagree on B"),
          ("logprobs", "ValueError", "logprobs differs"),
          ("vocab_size", "ValueError", "vocab_size"), ("vocab_start", "ValueError", "vocab_start"),
          ("no_logprobs", "ValueError", "logprobs=False"), ("timeout_s", "ValueError", "timeout_s")]


def tp_bad_each(rank, world):
    """tp_bad's cases one after the other in one world: {case: result or error dict}."""
    out = {}
    for case, _, _ in TP_BAD:
        try:
            out[case] = tp_bad(rank, world, case)
        except Exception as e:  # noqa: BLE001 - the test reads the error per case
            out[case] = {"error": type(e).__name__, "message": str(e)}
    return out


def test_tp_bad_input_raises_on_every_rank():
    """Each bad input raises on both ranks with an error naming it, every case in one
    two-rank world (a case that raises leaves the group usable for the next: the ranks
    agree on every exchange before they raise)."""
    for o in run_world(2, tp_bad_each):
        assert isinstance(o, dict) and set(o) == {c for c, _, _ in TP_BAD}, o
        for case, exc, words in TP_BAD:
            r = o[case]
            assert isinstance(r, dict) and r.get("error") == exc and words in r["message"], \
                (case, r)


def tp_timeout(rank, world):
    import datetime
    import torch.distributed as dist
    h, w, *_ = common_inputs()
    lo, hi = shard_bounds(rank, world, V)
    dist.barrier()  # the group's timeout ends rank 0's abandoned all-gather (see below)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2.0))
    sampler = VocabParallelSampler(w[lo:hi].contiguous(), vocab_size=V, timeout_s=2.0,
                                   backend="torch", group=group)
    if rank == 1:
        time.sleep(6)  # never calls; stays alive past rank 0's timeout
        return "skipped"
    t0 = time.time()
    try:
        sampler(h, seed=1)
    except tpsample.ExchangeTimeout as e:
        return {"error": "ExchangeTimeout", "message": str(e), "elapsed": time.time() - t0}
    return "no error"


@pytest.mark.slow
def test_tp_missing_rank_times_out_with_clear_message():
    outs = run_world(2, tp_timeout)
    assert outs[0]["error"] == "ExchangeTimeout", outs[0]
    assert "never made the same call" in outs[0]["message"] and outs[0]["elapsed"] < 5.5


def tp_timeout_recovery(rank, world):
    """A service's drill: rank 1 skips a call; rank 0 gets ExchangeTimeout, and the sampler
    refuses further calls; rank 1's late call gets ExchangeTimeout too; every rank then
    builds a new group and a new sampler, which samples the same tokens as before the
    failure."""
    import datetime
    import torch.distributed as dist
    h, w, *_ = common_inputs()
    lo, hi = shard_bounds(rank, world, V)
    timeout_s = 1.5

    def build(group):
        return VocabParallelSampler(w[lo:hi].contiguous(), vocab_size=V, timeout_s=timeout_s,
                                    backend="torch", group=group)
    # The group's own timeout ends an abandoned all-gather in gloo's worker; with the default
    # (30 min) it outlives the process, and torch aborts an exit that it races.
    dist.barrier()  # both ranks connect the new group well within timeout_s
    sampler = build(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)))
    result = {"before": sampler(h, seed=1)}
    if rank == 1:
        time.sleep(4)  # skips the next call, alive past rank 0's timeout
        try:  # then makes it late: never tokens paired with a call rank 0 gave up on
            result["late"] = sampler(h, seed=2)
        except tpsample.ExchangeTimeout as e:
            result["late"] = {"message": str(e)}
    else:
        for name, seed in (("timeout", 2), ("again", 3)):
            t0 = time.time()
            try:
                sampler(h, seed=seed)
                result[name] = "no error"
            except tpsample.ExchangeTimeout as e:
                result[name] = {"message": str(e), "call": e.call, "elapsed": time.time() - t0}
        try:
            sampler.check_exchange(synchronize=False)
            result["check"] = "no error"
        except tpsample.ExchangeTimeout as e:
            result["check"] = str(e)
    fresh = build(dist.new_group(backend="gloo"))  # waits for the late rank
    result["after"] = fresh(h, seed=1)
    return result


@pytest.mark.slow
def test_tp_after_a_timeout_the_sampler_refuses_and_a_rebuilt_one_samples():
    outs = run_world(2, tp_timeout_recovery)
    r0 = outs[0]
    assert isinstance(r0["timeout"], dict), r0
    assert "did not complete within 1.5 s" in r0["timeout"]["message"]
    assert r0["timeout"]["elapsed"] < 1.5 + 1.0
    assert isinstance(r0["again"], dict) and "unusable since an exchange failed" in r0["again"]["message"], r0
    assert r0["again"]["elapsed"] < 0.5  # refused at once, no second wait
    assert "unusable since an exchange failed" in r0["check"], r0
    assert isinstance(outs[1]["late"], dict) and "did not complete" in outs[1]["late"]["message"], outs[1]
    for o in outs:
        assert torch.equal(o["after"], o["before"]), o
    assert torch.equal(outs[0]["after"], outs[1]["after"])


def tp_stamped_collective(rank, world, backend):
    """The NCCL transport's stamped layout (TORCH_NCCL_ASYNC_ERROR_HANDLING=2: each slot ends in
    a stamp, so the records a stage reads are a strided view) through the whole sampler,
    over a gloo all-gather on the CPU: plain calls and a filtered one."""
    import os
    from tpsample import parallel, transport
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    parallel.make_transport = lambda name, group, device, timeout_s: transport.NcclTransport(
        group, device, timeout_s)
    h, w, bias, temp, seeds, offsets = common_inputs()
    lo, hi = shard_bounds(rank, world, V)
    sampler = VocabParallelSampler(w[lo:hi].contiguous(), vocab_size=VOCAB, backend=backend)
    assert sampler.transport.name == "nccl" and sampler.transport.survives_abort
    kw = dict(temperature=temp, seed=seeds, offset=offsets, bias=bias[lo:hi])
    return (sampler(h, num_samples=2, return_logprobs=True, **kw),
            sampler(h, top_k=5, top_p=0.9, return_logprobs=True, **kw))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_tp_stamped_record_slots_give_the_single_device_tokens(backend):
    outs = run_world(2, tp_stamped_collective, backend)
    for o in outs:
        assert not isinstance(o, dict), o
    h, w, bias, temp, seeds, offsets = common_inputs()
    kw = dict(temperature=temp, seed=seeds, offset=offsets, bias=bias, vocab_size=VOCAB,
              return_logprobs=True, backend="torch")
    plain = tpsample.sample(h, w, num_samples=2, **kw)
    filtered = tpsample.sample(h, w, top_k=5, top_p=0.9, **kw)
    for got_plain, got_filtered in outs:
        assert torch.equal(got_plain.tokens, plain.tokens)
        assert torch.allclose(got_plain.logprobs, plain.logprobs, atol=1e-5)
        assert torch.equal(got_filtered.tokens, filtered.tokens)
        assert torch.allclose(got_filtered.logprobs, filtered.logprobs, atol=1e-5)
