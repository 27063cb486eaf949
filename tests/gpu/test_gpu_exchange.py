"""The symmetric-memory exchange on a GPU (kernels/exchange_wait.py): the device-side wait
gives up after its bound without trapping, the CUDA context stays usable, the host raises
ExchangeTimeout naming the missing peers, and a rebuilt sampler samples again.

The bounded wait and the one-rank sampler run on one GPU; the two-rank drill needs two
(torch's symmetric-memory rendezvous refuses two ranks on one GPU). Over NCCL (the watchdog
set to abort the communicator only) the drill stops before the rebuild: a new NCCL group and
sampler in a process whose communicator was aborted ended it (SIGSEGV; two H100s, torch 2.11,
NCCL 2.28.9), so over NCCL a service restarts the process (README)."""
import time

import pytest
import torch

import tpsample
from tpsample.kernels import exchange_wait
from tpsample.transport import signal_and_wait

from dist_utils import run_world
from test_multigpu import gpu_rank, inputs, VOCAB

pytestmark = pytest.mark.gpu
BROKEN = exchange_wait.BROKEN.value


def test_device_wait_is_bounded_and_leaves_the_context_usable():
    """A peer that never signals: the wait ends after timeout_s (measured on the host
    around a synchronisation), status names it, its slot is NaN, the rank tells the peer it
    gave up (BROKEN) and fans out locally from then on; a later exchange ends at once;
    later work runs."""
    dev = torch.device("cuda")
    world, n = 2, 4096

    def state():
        flags = torch.zeros(world, dtype=torch.int64, device=dev)
        ghost = torch.zeros(world, dtype=torch.int64, device=dev)  # the peer's flags
        peer_flags = torch.tensor([flags.data_ptr(), ghost.data_ptr()], dtype=torch.int64, device=dev)
        calls = torch.zeros(1, dtype=torch.int64, device=dev)
        status = torch.zeros(world, dtype=torch.int32, pin_memory=True)
        buf = torch.zeros(2 * world * n, device=dev)
        ptrs = torch.tensor([[buf.data_ptr() + 4 * k * world * n, 1 << 40] for k in range(2)],
                            dtype=torch.int64, device=dev)  # own slot, a peer's (never stored to)
        parity = torch.zeros(2, dtype=torch.int32, device=dev)
        return flags, ghost, peer_flags, calls, status, buf, parity, ptrs

    kw = dict(rank=0, world=world, slot_numel=n, parity_stride=world * n)
    flags, ghost, peer_flags, calls, status, buf, parity, ptrs = state()
    signal_and_wait(flags, peer_flags, calls, status, buf, parity, ptrs, timeout_s=0.01, **kw)  # compile
    torch.cuda.synchronize()
    flags, ghost, peer_flags, calls, status, buf, parity, ptrs = state()
    own = ptrs[:, :1].clone()
    t0 = time.perf_counter()
    signal_and_wait(flags, peer_flags, calls, status, buf, parity, ptrs, timeout_s=0.5, **kw)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    assert 0.5 <= elapsed < 0.6, elapsed
    assert status.tolist() == [0, 1] and calls.item() == -1 and ghost[0].item() == BROKEN
    assert torch.equal(ptrs, own.expand(2, world))
    assert torch.isnan(buf[n:2 * n]).all() and not torch.isnan(buf[:n]).any()
    t0 = time.perf_counter()
    signal_and_wait(flags, peer_flags, calls, status, buf, parity, ptrs, timeout_s=0.5, **kw)
    torch.cuda.synchronize()
    assert time.perf_counter() - t0 < 0.05 and calls.item() == -2 and status.tolist() == [0, 1]
    x = torch.randn(1000, device=dev)
    assert torch.allclose((x @ torch.eye(1000, device=dev)).sum(), x.sum(), rtol=1e-4)


@pytest.mark.parametrize("transport", ["symm_mem", "nccl"])
def test_one_rank_sampler_equals_single_gpu_and_replays_in_graphs(transport):
    """world 1: over symmetric memory the exchange signals itself and passes; over NCCL each
    call's WorkResult is read at the next (none kept for the captured call). Eager calls,
    launch replays and a captured CUDA graph give tpsample.sample's tokens, and
    check_exchange raises nothing."""
    B = 16
    (out,) = run_world(1, gpu_rank, transport, "max", B, backend="nccl")
    assert out.get("transport") == transport, out
    h, w, temp, seeds = inputs(B)
    dev = torch.device("cuda")
    for k in range(3):
        want = tpsample.sample(h.to(dev), w.to(dev), temperature=temp.to(dev), seed=seeds.to(dev),
                               offset=k, vocab_size=VOCAB)
        assert torch.equal(out["eager"][k], want.cpu())
        assert torch.equal(out["replay"][k], want.cpu())


def filtered_one_rank(rank, world, B):
    """A filtered sampler of world 1 over symmetric memory: mixed rows (filtered, unfiltered
    and greedy), eager calls (the first dispatched, the rest replayed; the two record buffers
    alternate) and a captured CUDA graph replayed three times."""
    h, w, temp, seeds = inputs(B)
    dev = torch.device("cuda", rank)
    sampler = tpsample.VocabParallelSampler(w.to(dev), vocab_size=VOCAB, transport="symm_mem",
                                            check_inputs=False)
    h = h.to(dev)
    offset = torch.zeros(B, dtype=torch.int64, device=dev)
    kw = filtered_kwargs(B, dev)
    eager = [sampler(h, offset=offset + k, **kw) for k in range(4)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sampler(h, offset=offset, **kw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sampler(h, offset=offset, **kw)
    replays = []
    for k in range(3):
        offset.fill_(k)
        graph.replay()
        replays.append(out.tokens.clone())
    torch.cuda.synchronize()
    sampler.check_exchange()
    return dict(eager=[(e.tokens.cpu(), e.logprobs.cpu(), e.logz.cpu()) for e in eager],
                replay=[r.cpu() for r in replays], transport=sampler.transport.name)


def filtered_kwargs(B, dev):
    """Rows without filters (top_k 0 and top_p 1), with top-k, with top-p, both; greedy
    rows (inputs: every third temperature 0)."""
    r = torch.arange(B, device=dev)
    return dict(temperature=inputs(B)[2].to(dev), seed=inputs(B)[3].to(dev),
                top_k=(r % 2) * 30, top_p=torch.where(r % 4 < 2, 1.0, 0.9),
                return_logprobs=True)


@pytest.mark.parametrize("B", [16, 64])
def test_one_rank_filtered_sampler_equals_single_gpu(B):
    """The filter kernel as the whole stage 2 of merge "max" (its last program flips the
    symmetric-memory buffers' parity): a world-1 sampler's filtered calls, eager and from a
    CUDA graph, give tpsample.sample's tokens and log-probs, call after call."""
    (out,) = run_world(1, filtered_one_rank, B, backend="nccl")
    assert out.get("transport") == "symm_mem", out
    h, w, _, _ = inputs(B)
    dev = torch.device("cuda")
    kw = filtered_kwargs(B, dev)
    for k in range(4):
        want = tpsample.sample(h.to(dev), w.to(dev), offset=k, vocab_size=VOCAB, **kw)
        tokens, logprobs, logz = out["eager"][k]
        assert torch.equal(tokens, want.tokens.cpu())
        assert torch.allclose(logprobs, want.logprobs.cpu(), atol=1e-5, equal_nan=True)
        assert torch.allclose(logz, want.logz.cpu(), atol=1e-5, equal_nan=True)
        if k < 3:
            assert torch.equal(out["replay"][k], want.tokens.cpu())


def drill(rank, world, timeout_s, transport):
    """Rank 1 skips a call; rank 0's check_exchange raises within timeout_s + 1 s; its
    context still works; the sampler refuses further calls; rank 1's late call gives the
    degenerate rows and ExchangeTimeout too; every rank then builds a new
    group and sampler, which samples the tokens of before. NCCL: the sampler's group has
    timeout_s as its timeout and TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (the watchdog aborts the
    communicator and leaves the process up), as the README tells a service to set it, and the
    drill ends before the rebuild (the process would be restarted)."""
    import datetime
    import os
    import torch.distributed as dist
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    B = 8
    h, w, temp, seeds = inputs(B)
    h, temp, seeds = h.to(dev), temp.to(dev), seeds.to(dev)
    V = w.shape[0]
    lo, hi = (0, V // 2) if rank == 0 else (V // 2, V)

    def new_group():
        if transport == "symm_mem":
            return dist.new_group(backend="gloo")
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
        return dist.new_group(backend="nccl", timeout=datetime.timedelta(seconds=timeout_s))

    def build(group):
        return tpsample.VocabParallelSampler(w[lo:hi].contiguous().to(dev), vocab_size=VOCAB,
                                             group=group, transport=transport,
                                             timeout_s=timeout_s, check_inputs=False)
    sampler = build(new_group())
    res = {"before": sampler(h, temperature=temp, seed=seeds).cpu()}
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 1:
        time.sleep(timeout_s + 3)
        late = sampler(h, temperature=temp, seed=seeds, return_logprobs=True)  # the late call
        try:
            sampler.check_exchange()
            res["late"] = "no error"
        except tpsample.ExchangeTimeout as e:
            res["late"] = dict(message=str(e), missing=e.missing)
        res["late_degenerate"] = bool((late.tokens == -1).all() and torch.isnan(late.logz).all())
        res["late_tokens"] = late.tokens.cpu()
        if transport == "nccl" and res["late"] == "no error":
            try:  # its records paired with the peer's given-up call; the next one cannot
                sampler(h, temperature=temp, seed=seeds)
                sampler.check_exchange()
                res["next"] = "no error"
            except tpsample.ExchangeTimeout as e:
                res["next"] = str(e)
    else:
        t0 = time.time()
        out = sampler(h, temperature=temp, seed=seeds, return_logprobs=True)
        try:
            sampler.check_exchange()
            res["timeout"] = "no error"
        except tpsample.ExchangeTimeout as e:
            res["timeout"] = dict(message=str(e), missing=e.missing, call=e.call,
                                  elapsed=time.time() - t0)
        res["degenerate"] = bool((out.tokens == -1).all() and torch.isnan(out.logz).all())
        res["context_ok"] = float(torch.ones(4096, device=dev).sum()) == 4096.0
        try:
            sampler(h, temperature=temp, seed=seeds)
            res["again"] = "no error"
        except tpsample.ExchangeTimeout as e:
            res["again"] = str(e)
    if transport == "nccl":
        dist.barrier()  # (gloo) neither process ends while its peer may still reach it
        return res
    fresh = build(new_group())
    res["after"] = fresh(h, temperature=temp, seed=seeds).cpu()
    fresh.check_exchange()
    return res


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("transport", ["symm_mem", "nccl"])
def test_a_rank_that_skips_a_call_gives_exchange_timeout_and_the_service_recovers(transport):
    timeout_s = 2.0
    # gloo for the control plane, CUDA tensors; an aborted NCCL communicator's process is
    # ended without teardown, as a service restarts it
    outs = run_world(2, drill, timeout_s, transport, hard_exit=transport == "nccl")
    r0 = outs[0]
    assert isinstance(r0.get("timeout"), dict), outs
    assert r0["timeout"]["call"] == 2, r0
    if transport == "symm_mem":
        assert r0["timeout"]["missing"] == [1] and "peer rank(s) [1]" in r0["timeout"]["message"]
    else:
        assert "record all-gather #2" in r0["timeout"]["message"], r0
    assert timeout_s <= r0["timeout"]["elapsed"] < timeout_s + 1.0, r0
    assert r0["degenerate"] and r0["context_ok"], r0
    assert "unusable" in r0["again"], r0
    r1 = outs[1]  # the late rank: never tokens paired with another call than its own
    if transport == "nccl":
        # NCCL may still deliver the records rank 0 sent before it gave up; they carry
        # call 2's stamp, so the late call 2 gets its true tokens (the first call's: same
        # inputs) and no error, and its next call fails. No in-process recovery over NCCL.
        if r1.get("late") == "no error":
            assert torch.equal(r1["late_tokens"], r1["before"]), r1
            assert "did not complete" in r1["next"] or "failed" in r1["next"], r1
        else:
            assert isinstance(r1.get("late"), dict) and r1["late_degenerate"], r1
        return
    assert isinstance(r1.get("late"), dict) and r1["late_degenerate"], r1
    assert r1["late"]["missing"] == [0], r1  # it found rank 0's flag BROKEN
    for o in outs:
        assert torch.equal(o["after"], o["before"]), o
    assert torch.equal(outs[0]["after"], outs[1]["after"])
