"""The exact fallback of filtered calls under TP, on the device (symm_mem transports): every
rank stores its shard of the flagged rows' logits into the buffer of every rank that redoes
the row, a conditional exchange (only when a row is flagged) makes them visible, and the
rows are redone from all shards (kernels/filter_fallback.py, FANOUT and SLOTTED): by every
rank, or, split (top-p / min-p from the side output), each by one rank that sends its
outputs through one more exchange. Interpreted on the CPU: two ranks simulated in one
process for the kernels, two forked processes sharing their buffers, and whole calls
through one-rank and two-rank stand-ins of the symmetric-memory transport on ordinary
tensors."""
import pytest
import torch

import tpsample
from tpsample import filters as F, launchers, params as P, records
from tpsample.reference import reference_sample
from tpsample.transport import SymmMemTransport

from dist_utils import run_world
from test_filters import MIXED, assert_matches_reference, mixed_inputs

V = 4096


def flat_case():
    """mixed_inputs' rows made near-flat: rows 2, 3 and 5 (top-p reaching below the
    candidates) take the fallback."""
    h, w = mixed_inputs()
    return h * 0.05, w


def call_args(h, extra):
    kw = dict(MIXED, seed=torch.arange(8) * 7, top_logprobs=4, **extra)
    row = P.row_params(h, kw["temperature"], kw["seed"], 0)
    filters = P.filter_params(h, kw["top_k"], kw["top_p"], kw["min_p"], kw["top_logprobs"],
                              kw.get("num_samples", 1), kw.get("replacement", True),
                              kw.get("logprobs_mode", "processed"), V)
    return row, filters, kw.get("num_samples", 1)


def fresh_out(B, S, n, flags):
    out = launchers.filtered_outputs(B, S, n, torch.device("cpu"))
    for t in out[:5]:
        t.zero_()
    out.fallback.copy_(flags)
    return out


class Stop(Exception):
    pass


def stop(_flags):
    raise Stop


@pytest.mark.slow
@pytest.mark.parametrize("extra", [dict(), dict(num_samples=3, replacement=False),
                                   dict(num_samples=2, logprobs_mode="raw")])
def test_two_ranks_uneven_shards_in_swapped_order_equal_one_device(extra):
    """Rank 0 holds ids [2600, 4096), rank 1 ids [0, 2600) (a shard not a multiple of a tile,
    the shards not in rank order): rank 0's outputs from the gathered rows equal the
    one-device fallback's, output by output, for the flagged rows, and leave the others."""
    h, w = flat_case()
    row, filters, S = call_args(h, extra)
    B, n_top = h.shape[0], filters.top_n
    flags = torch.tensor([1, 0, 1, 1, 0, 1, 0, 1], dtype=torch.int32)
    want = fresh_out(B, S, n_top, flags)
    count = torch.zeros(2, dtype=torch.int32)
    T1 = records.num_tiles(V)
    launchers.fallback_on_device(h, w, None, row, filters, want,
                                 torch.empty(B, T1 * records.TILE), count, n_real=V)
    assert count.sum().item() == 5

    starts = [2600, 0]
    shards = [w[2600:], w[:2600]]
    T = max(records.num_tiles(s.shape[0]) for s in shards)
    n = T * records.TILE
    bufs = [torch.full((2, B, n), 7.0) for _ in range(2)]
    calls = torch.zeros(1, dtype=torch.int64)
    starts_t = torch.tensor(starts, dtype=torch.int64)

    def gather(rank, exchange):
        peers = torch.tensor([b[rank].data_ptr() for b in bufs], dtype=torch.int64)
        return launchers.FallbackGather(bufs[rank], bufs[rank][rank], peers, calls, starts_t,
                                        exchange, rank)

    with pytest.raises(Stop):  # rank 1 stores its shard everywhere, then waits (stopped here)
        launchers.fallback_on_device(h, shards[1], None, row, filters, fresh_out(B, S, n_top, flags),
                                     None, torch.zeros(2, dtype=torch.int32), n_real=2600,
                                     vocab_start=0, gather=gather(1, stop))
    got = fresh_out(B, S, n_top, flags)
    count = torch.zeros(2, dtype=torch.int32)
    launchers.fallback_on_device(h, shards[0], None, row, filters, got, None, count,
                                 n_real=1496, vocab_start=2600, gather=gather(0, lambda f: None))
    assert count.sum().item() == 5
    for b in bufs:  # flagged rows hold both shards (padding -inf), other rows are untouched
        assert (b[:, flags == 0] == 7.0).all()
        assert torch.isinf(b[0, flags == 1, 1496:]).all() and torch.isinf(b[1, flags == 1, 2600:]).all()
    assert torch.equal(bufs[0][:, flags == 1], bufs[1][:, flags == 1])
    assert torch.equal(got.tokens, want.tokens)
    assert torch.equal(got.top_tokens, want.top_tokens)
    for a, b in ((got.logprobs, want.logprobs), (got.logz, want.logz),
                 (got.top_logprobs, want.top_logprobs)):
        assert torch.allclose(a, b, atol=1e-5, equal_nan=True)


def test_the_two_paths_count_their_rows_apart():
    """count[0] gains the rows of the one-program-per-row path, count[1] those of the cut's
    fast path (filters.cut_path_rows): a pipeline can tell a top-k row past the candidates
    (slow on the device, what the host path is for) from a top-p row of the same call."""
    h, w = flat_case()
    B = h.shape[0]
    row = P.row_params(h, MIXED["temperature"], torch.arange(B) * 5 + 2, 0)
    filters = P.filter_params(h, MIXED["top_k"], MIXED["top_p"], MIXED["min_p"], 0, 1, True,
                              "processed", V)
    flags = (row.inv_temp != 0).to(torch.int32)
    logits = ((h @ w.T) * torch.where(row.inv_temp == 0, 1.0, row.inv_temp)[:, None])
    count = torch.zeros(2, dtype=torch.int32)
    launchers.fallback_on_device(h, w, None, row, filters, fresh_out(B, 1, 0, flags), None,
                                 count, n_real=V, side=logits.contiguous())
    fast = F.cut_path_rows(filters, row.inv_temp) & (flags != 0)
    assert 0 < int(fast.sum()) < int(flags.sum())
    assert count.tolist() == [int(flags.sum() - fast.sum()), int(fast.sum())]
    with pytest.raises(ValueError, match="count must be int32 \\[2\\]"):
        launchers.fallback_on_device(h, w, None, row, filters, fresh_out(B, 1, 0, flags), None,
                                     torch.zeros(1, dtype=torch.int32), n_real=V,
                                     side=logits.contiguous())


def test_a_rank_whose_exchange_failed_stores_nothing_and_gives_degenerate_rows():
    h, w = flat_case()
    row, filters, S = call_args(h, {})
    B = h.shape[0]
    flags = torch.tensor([0, 0, 1, 0, 0, 1, 0, 0], dtype=torch.int32)
    out = fresh_out(B, S, filters.top_n, flags)
    n = records.num_tiles(V) * records.TILE
    buf = torch.full((1, B, n), 7.0)
    gather = launchers.FallbackGather(buf, buf[0], torch.tensor([buf.data_ptr()]),
                                      torch.tensor([-3]), torch.tensor([0]), lambda f: None, 0)
    count = torch.zeros(2, dtype=torch.int32)
    launchers.fallback_on_device(h, w, None, row, filters, out, None, count, n_real=V,
                                 gather=gather)
    assert (buf == 7.0).all() and count.sum().item() == 0
    lost = flags == 1
    assert (out.tokens[lost] == -1).all() and torch.isnan(out.logprobs[lost]).all()
    assert torch.isnan(out.logz[lost]).all() and torch.isnan(out.top_logprobs[lost]).all()
    assert (out.tokens[~lost] == 0).all() and (out.logz[~lost] == 0).all()  # untouched


class _Handle:
    def barrier(self, channel=0):
        pass


class CpuSymmTransport(SymmMemTransport):
    """symm_mem's protocol (fan-out, signal, bounded wait, the gathered fallback) on ordinary
    CPU tensors, for one rank: its only peer is itself."""

    def _symmetric(self, numel, dtype):
        assert self.world == 1
        t = torch.zeros(numel, dtype=dtype, device=self.device)
        return t, _Handle(), [t.data_ptr()]

    def gather_exchange(self, cond):
        self.at_exchange = self.gather_buf.clone()  # what peers could read once it signals
        super().gather_exchange(cond)


def one_rank_call(rank, world, h, w, kws, vocab=V, logprobs=True):
    import tpsample.parallel as par
    par.make_transport = lambda name, group, device, timeout_s: CpuSymmTransport(
        group, device, timeout_s)
    from tpsample import replay
    from tpsample.kernels import filter_cut
    modes = []  # (WINNER, USE_PARITY) of the fast path's SAMPLE launches
    run = replay.run_kernel

    def spy(k, grid, args, const, opts):
        if const.get("STEP") == filter_cut.SAMPLE.value:
            modes.append((const.get("WINNER"), const.get("USE_PARITY")))
        return run(k, grid, args, const, opts)
    replay.run_kernel = spy
    sampler = tpsample.VocabParallelSampler(w, vocab_size=vocab, backend="triton")
    outs, exchanges, device_rows, stored_before_signal = [], [], [], []
    pipe = sampler.pipeline
    for hh, kw in zip(h, kws):
        outs.append(sampler(hh, return_logprobs=logprobs, **kw))
        exchanges.append(int(sampler.transport.calls.item()))
        device_rows.append(int(pipe.fallback.device_rows.sum().item()))
        t = sampler.transport
        stored_before_signal.append(torch.equal(t.at_exchange, t.gather_buf))
    return dict(outs=outs, exchanges=exchanges, device_rows=device_rows,
                host_rows=pipe.host_fallback_rows, stored_before_signal=stored_before_signal,
                modes=modes)


@pytest.mark.slow
def test_one_rank_symm_mem_tokens_only_call_checks_winners_on_gathered_rows():
    """A tokens-only call with top-p / min-p alone through the symmetric-memory transport:
    the gathered rows take the fast path's winner check and its tile-skipping SAMPLE, which
    read this call's records through the fan-out's parity; tokens equal the reference's in
    every row, twice (both record buffers)."""
    h, w = flat_case()
    kw = dict(temperature=MIXED["temperature"], top_p=torch.tensor([0.9, 0.5, 0.95, 0.3] * 2),
              min_p=torch.tensor([0.0, 0.1, 0.0, 0.0, 0.2, 0.0, 0.05, 0.0]),
              seed=torch.arange(8) * 3 + 1)
    kw2 = dict(kw, seed=torch.arange(8) * 5 + 2)
    (res,) = run_world(1, one_rank_call, [h, h], w, [kw, kw2], V, False)
    assert "error" not in res, res
    assert res["host_rows"] == 0 and res["device_rows"][0] >= 4
    assert set(res["modes"]) == {(True, True)}, res["modes"]
    for out, k in zip(res["outs"], (kw, kw2)):
        assert torch.equal(out.view(-1), reference_sample(h, w, **k).tokens.view(-1))


@pytest.mark.slow
def test_one_rank_symm_mem_call_gathers_on_the_device_and_matches_the_reference():
    """A whole filtered call through the symmetric-memory transport: the flagged rows take the
    gathered device fallback (no host fallback), with a second exchange only in the call that
    has flagged rows; outputs equal the float64 reference and tpsample.sample's."""
    h, w = flat_case()
    kw = dict(MIXED, seed=torch.arange(8) * 7, top_logprobs=4)
    sharp = mixed_inputs()[0]
    kw_sharp = dict(temperature=MIXED["temperature"], seed=torch.arange(8), top_k=3,
                    top_logprobs=2)  # the 3 best are above every tile's 4th best: certified
    (res,) = run_world(1, one_rank_call, [h, sharp], w, [kw, kw_sharp])
    assert "error" not in res, res
    assert res["host_rows"] == 0 and res["device_rows"][0] >= 3
    assert res["device_rows"][1] == res["device_rows"][0]
    assert res["exchanges"] == [2, 3]  # records + gather, then records alone
    assert res["stored_before_signal"] == [True, True]
    assert_matches_reference(res["outs"][0], reference_sample(h, w, **kw))
    assert_matches_reference(res["outs"][1], reference_sample(sharp, w, **kw_sharp))
    local = tpsample.sample(h, w, backend="triton", return_logprobs=True, **kw)
    assert torch.equal(res["outs"][0].tokens, local.tokens)
    assert torch.equal(res["outs"][0].top_tokens, local.top_tokens)


@pytest.mark.slow
def test_one_rank_symm_mem_call_with_constraints_gathers_the_listed_tokens_too():
    """The mask, listed tokens (repeated, padded, banned) and penalties with near-flat rows:
    the gathered fallback stores the listed tokens' logits after the rest (in stream order)
    and the call equals the float64 reference and tpsample.sample's device fallback."""
    from test_constraints import assert_same, mixed
    h, w, kw = mixed()
    h = h * 0.05
    kw = dict(kw, top_p=0.7, top_logprobs=2)
    (res,) = run_world(1, one_rank_call, [h], w, [kw], w.shape[0])
    assert "error" not in res, res
    assert res["host_rows"] == 0 and res["device_rows"][0] >= 3 and res["exchanges"] == [2]
    assert res["stored_before_signal"] == [True]  # the listed tokens' stores precede the signal
    assert_same(res["outs"][0], reference_sample(h, w, **kw), True)
    local = tpsample.sample(h, w, backend="triton", return_logprobs=True, **kw)
    assert torch.equal(res["outs"][0].tokens, local.tokens)


@pytest.mark.parametrize("B,S", [(45, 1), (45, 192), (7, 1)],
                         ids=["split", "outputs-too-wide", "too-few-rows"])
def test_side_rows_are_gathered_to_their_owner_or_to_every_rank(B, S):
    """FROM_SIDE with FANOUT (a top-p call under TP): each flagged row of the side output
    lands, bit for bit, in this rank's slot of its owner's buffer (rank b % 2, rows split)
    or, when its outputs would not fit a slot's row (2·S + 1 > its columns) or the call has
    fewer than SPLIT_MIN_ROWS rows per rank, of every rank's; unflagged rows and the other
    rank's slots are not written. (B = 45: more rows than one step's block, not a multiple.)"""
    n, world, me = 3 * records.TILE, 2, 1
    split = S == 1 and B >= launchers.SPLIT_MIN_ROWS * world
    side = torch.randn(B, n, generator=torch.Generator().manual_seed(3))
    flags = (torch.arange(B) % 3 != 1).to(torch.int32)
    flags[42:] = 0  # (rows 32-41 in the second block, some flagged)
    bufs = [torch.full((world, B, n), 7.0) for _ in range(world)]
    peers = torch.tensor([b[me].data_ptr() for b in bufs], dtype=torch.int64)
    gather = launchers.FallbackGather(bufs[me], bufs[me][me], peers, torch.zeros(1, dtype=torch.int64),
                                      torch.tensor([0, n], dtype=torch.int64), stop, me)
    h = torch.zeros(B, 8)
    row = P.row_params(h, 1.0, 1, 0)
    filters = P.filter_params(h, None, 0.9, None, 0, S, True, "processed", 2 * n)
    with pytest.raises(Stop):  # (stopped at the exchange, after the stores)
        launchers.fallback_on_device(h, torch.zeros(n, 8), None, row, filters,
                                     fresh_out(B, S, 0, flags), None,
                                     torch.zeros(2, dtype=torch.int32), n_real=n,
                                     vocab_start=n, gather=gather, side=side)
    for q, b in enumerate(bufs):
        mine = (flags == 1) & ((torch.arange(B) % world == q) | (not split))
        assert torch.equal(b[me][mine], side[mine])
        assert (b[me][~mine] == 7.0).all() and (b[1 - me] == 7.0).all()


def _split_rank(rank, bufs, calls, outs, counts, barrier, h, shard, side, start, n_real,
                row, filters, flags):
    torch.set_num_threads(1)
    peers = torch.tensor([b[rank].data_ptr() for b in bufs], dtype=torch.int64)
    starts = torch.tensor([2600, 0], dtype=torch.int64)
    gather = launchers.FallbackGather(bufs[rank], bufs[rank][rank], peers, calls[rank], starts,
                                      lambda f: barrier.wait(timeout=600), rank)
    out = fresh_out(h.shape[0], outs[rank].tokens.shape[1], 0, flags)
    launchers.fallback_on_device(h, shard, None, row, filters, out, None, counts[rank],
                                 n_real=n_real, vocab_start=start, gather=gather, side=side)
    for got, t in zip(outs[rank], out):
        got.copy_(t)


@pytest.mark.slow
@pytest.mark.parametrize("S", [1, 2])
def test_split_rows_on_two_processes_equal_one_device(S):
    """Rows split between two ranks (two forked processes sharing their gathered buffers as
    symmetric memory would; the exchange a barrier): rank b % 2 alone gathers and cuts
    flagged row b and sends its outputs; both ranks end with the one-device fallback's
    tokens, log-probs and log Z in every row, and count every flagged row."""
    import multiprocessing
    h, w = flat_case()
    B = h.shape[0]
    kw = dict(temperature=MIXED["temperature"], top_p=torch.tensor([0.9, 0.5, 0.95, 0.3] * 2),
              min_p=torch.tensor([0.0, 0.1, 0.0, 0.0, 0.2, 0.0, 0.05, 0.0]))
    row = P.row_params(h, kw["temperature"], torch.arange(B) * 3 + 1, 0)
    filters = P.filter_params(h, None, kw["top_p"], kw["min_p"], 0, S, True, "processed", V)
    flags = (row.inv_temp != 0).to(torch.int32)  # (row 4, greedy, is never flagged)
    logits = (h @ w.T) * row.inv_temp[:, None]
    want = fresh_out(B, S, 0, flags)
    count = torch.zeros(2, dtype=torch.int32)
    launchers.fallback_on_device(h, w, None, row, filters, want, None, count, n_real=V,
                                 side=logits.contiguous())
    assert count.sum().item() == int(flags.sum())

    n = records.num_tiles(2600) * records.TILE
    sides, starts, reals = [], [2600, 0], [V - 2600, 2600]
    for r in range(2):
        part = torch.full((B, n), float("-inf"))
        part[:, :reals[r]] = logits[:, starts[r]:starts[r] + reals[r]]
        sides.append(part)
    bufs = [torch.full((2, B, n), 7.0).share_memory_() for _ in range(2)]
    calls = [torch.zeros(1, dtype=torch.int64).share_memory_() for _ in range(2)]
    counts = [torch.zeros(2, dtype=torch.int32).share_memory_() for _ in range(2)]
    outs = [launchers.filtered_outputs(B, S, 0, torch.device("cpu")) for _ in range(2)]
    for o in outs:
        for t in o:
            t.share_memory_()
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_split_rank,
                         args=(r, bufs, calls, outs, counts, barrier, h, w[starts[r]:starts[r] + reals[r]],
                               sides[r], starts[r], reals[r], row, filters, flags))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(900)
        assert p.exitcode == 0
    for r in range(2):
        assert counts[r].sum().item() == int(flags.sum())
        got = outs[r]
        assert torch.equal(got.tokens, want.tokens), (r, got.tokens, want.tokens)
        assert torch.allclose(got.logprobs, want.logprobs, atol=1e-5, equal_nan=True)
        assert torch.allclose(got.logz, want.logz, atol=1e-5, equal_nan=True)
    for q in range(2):  # a rank's buffer holds the shards of the rows it owns only (and,
        mine = torch.arange(B) % 2 == q  # of the others, their owner's 2·S + 1 output words)
        owned = (flags == 1) & mine
        assert torch.equal(bufs[q][0][owned], sides[0][owned])
        assert torch.equal(bufs[q][1][owned], sides[1][owned])
        assert (bufs[q][:, ~mine, 2 * S + 1:] == 7.0).all()
        assert (bufs[q][q, ~mine] == 7.0).all()


class SharedPoolSymmTransport(SymmMemTransport):
    """symm_mem's protocol on CPU tensors for forked ranks: symmetric allocations are carved,
    in call order (the same on every rank), from per-rank pools shared before the fork, so
    every rank sees every rank's buffers at the same addresses; the handle's barrier is the
    gloo group's."""
    pools: list = []

    def _symmetric(self, numel, dtype):
        size = numel * torch.empty(0, dtype=dtype).element_size()
        at = getattr(self, "_carved", 0)
        self._carved = at + -(-size // 256) * 256
        assert self._carved <= self.pools[0].numel(), "pool too small"
        group = self.group

        class Handle:
            def barrier(self, channel=0):
                torch.distributed.barrier(group)
        return (self.pools[self.rank][at:at + size].view(dtype), Handle(),
                [p[at:at + size].data_ptr() for p in self.pools])


def _pool_sampler(rank, world, port, pools, w, **kw):
    """In a forked rank: a gloo group and a VocabParallelSampler of rank's even shard of w
    over SharedPoolSymmTransport (interpreted kernels)."""
    import torch.distributed as dist
    import tpsample.parallel as par
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    SharedPoolSymmTransport.pools = pools
    par.make_transport = lambda name, group, device, timeout_s: SharedPoolSymmTransport(
        group, device, timeout_s)
    per = w.shape[0] // world
    return tpsample.VocabParallelSampler(w[rank * per:(rank + 1) * per].contiguous(),
                                         vocab_size=w.shape[0], backend="triton", **kw)


def _fork_ranks(target, results, *args, world=2):
    """target(rank, world, port, pools, results, *args) in `world` forked processes sharing
    fresh pools; each saves its result as results/rank{r}.pt → the list of them."""
    import multiprocessing
    from dist_utils import free_port
    ctx = multiprocessing.get_context("fork")
    pools = [torch.zeros(8 << 20, dtype=torch.uint8).share_memory_() for _ in range(world)]
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, pools, str(results), *args))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(1200)
        assert p.exitcode == 0
    return [torch.load(results / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _pool_rank(rank, world, port, pools, results, h, w, calls):
    import os
    import torch.distributed as dist
    sampler = _pool_sampler(rank, world, port, pools, w)
    outs, exchanges = [], []
    for kw in calls:
        outs.append(sampler(h, **kw))
        exchanges.append(int(sampler.transport.calls.item()))
    pipe = sampler.pipeline
    torch.save(dict(outs=outs, exchanges=exchanges, host_rows=pipe.host_fallback_rows,
                    device_rows=int(pipe.fallback.device_rows.sum().item())),
               os.path.join(results, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_over_shared_symmetric_buffers_split_the_flagged_rows(tmp_path):
    """Whole TP2 calls through the symmetric-memory protocol on the CPU (two forked ranks,
    SharedPoolSymmTransport): top-p / min-p on near-flat rows, 8 rows (4 per rank, so they
    split: each flagged row gathered to and cut on one rank, its outputs sent back), tokens
    only (the winner check) and with log-probs: both ranks return the float64 reference's
    tokens and one device's log Z, count every flagged row, and run three exchanges per
    call (records, gather, outputs), none where no row is flagged."""
    h, w = flat_case()
    kw = dict(temperature=MIXED["temperature"], top_p=torch.tensor([0.9, 0.5, 0.95, 0.3] * 2),
              min_p=torch.tensor([0.0, 0.1, 0.0, 0.0, 0.2, 0.0, 0.05, 0.0]),
              seed=torch.arange(8) * 3 + 1)
    sharp = mixed_inputs()[0]
    calls = [kw, dict(kw, return_logprobs=True), dict(top_p=0.9, seed=torch.arange(8))]
    results = []
    for hh, call in ((h, calls[:2]), (sharp, calls[2:])):
        d = tmp_path / str(len(results))
        d.mkdir()
        results.append(_fork_ranks(_pool_rank, d, hh, w, call))
    flat, peaked = results
    want = reference_sample(h, w, **kw)
    local = tpsample.sample(h, w, backend="triton", return_logprobs=True, **kw)
    for res in flat:
        assert res["host_rows"] == 0 and res["device_rows"] == flat[0]["device_rows"] >= 8
        assert res["exchanges"] == [3, 6]
        assert torch.equal(res["outs"][0].view(-1), want.tokens.view(-1))
        assert torch.equal(res["outs"][1].tokens.view(-1), want.tokens.view(-1))
        assert torch.allclose(res["outs"][1].logz, local.logz, atol=1e-5)
        assert torch.equal(res["outs"][1].logprobs, flat[0]["outs"][1].logprobs)
    for res in peaked:  # (no row flagged: the records' exchange alone)
        assert res["exchanges"] == [1] and res["device_rows"] == 0
        assert torch.equal(res["outs"][0].view(-1),
                           reference_sample(sharp, w, **calls[2]).tokens.view(-1))


def _drill_rank(rank, world, port, pools, results, h, w, kw):
    """Rank 1 stops before the outputs' exchange (the second gather exchange) of its first
    call, as a rank that died there would, and makes no further call."""
    import os
    import torch.distributed as dist
    sampler = _pool_sampler(rank, world, port, pools, w,
                            timeout_s=0.02)  # (interpreted: 2·10^4 polls)
    t = sampler.transport
    if rank == 1:
        real, seen = t.gather_exchange, []

        def stop_at_second(cond):
            seen.append(1)
            if len(seen) == 2:
                raise Stop
            real(cond)
        t.gather_exchange = stop_at_second
        with pytest.raises(Stop):
            sampler(h, **kw)
        res = dict(stopped=True)
    else:
        res = dict(out=sampler(h, **kw))
        try:
            sampler(h, **kw)
            res["next"] = "returned"
        except tpsample.ExchangeTimeout as e:
            res["next"] = (e.missing, e.call)
    torch.save(res, os.path.join(results, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_peer_missing_the_outputs_exchange_gives_degenerate_rows_then_a_timeout(tmp_path):
    """Split rows, two forked ranks (SharedPoolSymmTransport): rank 1 stops before the
    outputs' exchange of the first call. Rank 0 gives up on it after its bounded wait: its
    flagged rows come back degenerate (token -1, NaN log-prob and log Z), its other rows as
    the reference's, and its next call raises ExchangeTimeout naming rank 1 and exchange
    #3 (records, gather, outputs)."""
    h, w = flat_case()
    kw = dict(temperature=MIXED["temperature"], top_p=torch.tensor([0.9, 0.5, 0.95, 0.3] * 2),
              seed=torch.arange(8) * 3 + 1, return_logprobs=True)
    r0, r1 = _fork_ranks(_drill_rank, tmp_path, h, w, kw)
    out = r0["out"]
    flagged = out.tokens.view(-1) == -1
    want = reference_sample(h, w, **{k: v for k, v in kw.items() if k != "return_logprobs"})
    assert flagged.sum() >= 3 and torch.isnan(out.logz[flagged]).all()
    assert torch.isnan(out.logprobs.view(-1)[flagged]).all()
    assert torch.equal(out.tokens.view(-1)[~flagged], want.tokens.view(-1)[~flagged])
    assert r0["next"] == ([1], 3) and r1["stopped"]
