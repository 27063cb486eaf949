"""Transports: the local one, gloo, and how "auto" chooses (symmetric memory needs no
environment variable: tpsample never uses NVLink multicast)."""
import datetime
import time

import pytest
import torch

from tpsample import transport

from dist_utils import run_world


def test_local_transport_gives_fresh_slots_and_no_fanout():
    t = transport.LocalTransport(torch.device("cpu"))
    mine, full = t.slots(12)
    again, _ = t.slots(12)
    assert full.shape == (1, 12) and full.data_ptr() == mine.data_ptr()
    assert again.data_ptr() != mine.data_ptr() and t.fanout() is None and t.key() == ()
    t.exchange(mine, full)


def _gloo(rank, world):
    import torch.distributed as dist
    t = transport.make_transport("auto", dist.group.WORLD, torch.device("cpu"), 30.0)
    mine, full = t.slots(5)
    mine.fill_(rank + 1)
    t.exchange(mine, full)
    usable, why = transport.symm_mem_usable(dist.group.WORLD, torch.device("cpu"))
    return dict(name=t.name, full=full.clone(), usable=usable, why=why)


def test_auto_picks_gloo_on_cpu_and_every_slot_arrives():
    res = run_world(2, _gloo)
    for r in res:
        assert r["name"] == "gloo" and torch.equal(r["full"], torch.tensor([[1.0] * 5, [2.0] * 5]))
        assert not r["usable"] and "CPU" in r["why"]


def _gloo_group_timeouts(rank, world):
    import datetime
    import logging
    import torch.distributed as dist
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("tpsample").addHandler(handler)
    short = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=30))
    transport.make_transport("gloo", short, torch.device("cpu"), 30.0)
    fine = list(said)
    transport.make_transport("gloo", dist.group.WORLD, torch.device("cpu"), 30.0)
    return dict(fine=fine, default=said[len(fine):])


@pytest.mark.slow  # (multi-process / subprocess: CI runs it under -m slow)
def test_gloo_warns_when_the_group_outlives_timeout_s():
    """A group whose own timeout is longer than timeout_s (the default group's 30 min) keeps a
    timed-out all-gather in gloo's worker: the transport says so; a group built with
    timeout_s does not warn."""
    for r in run_world(2, _gloo_group_timeouts):
        assert r["fine"] == [], r
        assert len(r["default"]) == 1 and "timeout (0:30:00) is longer than timeout_s (30 s)" in r["default"][0], r


def _fake_group(monkeypatch, where):
    """symm_mem_usable's view of a group whose ranks sit at `where` [(host, GPU index)]."""
    def gather(out, obj, group=None):
        out[:] = where
    monkeypatch.setattr(transport.dist, "get_world_size", lambda group: len(where))
    monkeypatch.setattr(transport.dist, "all_gather_object", gather)


def test_symm_mem_is_usable_wherever_p2p_works_without_the_multicast_variable(monkeypatch):
    """Two GPUs of one host that reach each other over P2P: symmetric memory, whether or
    not TORCH_SYMM_MEM_DISABLE_MULTICAST is set (tpsample never uses multicast); a pair
    without P2P: not usable, and the reason names the GPUs; ranks on two hosts or sharing a
    GPU (torch's rendezvous refuses overlapping devices): not usable."""
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)
    _fake_group(monkeypatch, [("h", 0), ("h", 1)])
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    usable, why = transport.symm_mem_usable(None, torch.device("cuda", 0))
    assert usable, why
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: False)
    usable, why = transport.symm_mem_usable(None, torch.device("cuda", 0))
    assert not usable and "GPU 0 cannot reach GPU 1" in why
    _fake_group(monkeypatch, [("h", 0), ("h", 0)])
    usable, why = transport.symm_mem_usable(None, torch.device("cuda", 0))
    assert not usable and "share a GPU" in why
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    _fake_group(monkeypatch, [("h", 0), ("g", 1)])
    usable, why = transport.symm_mem_usable(None, torch.device("cuda", 0))
    assert not usable and "several hosts" in why


class FakeResult:
    """A WorkResult future: pending until the watchdog (the test) decides."""

    def __init__(self):
        self.value_ = None

    def done(self):
        return self.value_ is not None

    def value(self):
        return self.value_


class FakeWork:
    def __init__(self, finishes: bool = True):
        self.result, self.finishes, self.waited = FakeResult(), finishes, []

    def wait(self, timeout=None):
        self.waited.append(timeout)
        if timeout is not None and not self.finishes:
            raise RuntimeError("Work ran time out")

    def is_completed(self):
        return self.finishes

    def get_future_result(self):
        return self.result


def _nccl_without_a_group(monkeypatch, works, handling="2"):
    """An NcclTransport on the CPU whose all-gathers issue `works` and write nothing (a
    collective that has not run, or that the watchdog aborted)."""
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", handling)
    monkeypatch.setattr(transport.dist, "get_rank", lambda group: 0)
    monkeypatch.setattr(transport.dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(transport, "all_gather_flat", lambda out, inp, group, async_op: works.pop(0))
    return transport.NcclTransport(None, torch.device("cpu"), 2.0)


def test_nccl_a_failed_all_gather_gives_nan_records_and_raises_at_the_next_call(monkeypatch):
    """No host wait per call; a WorkResult other than SUCCESS, read at the next call, raises
    ExchangeTimeout naming the call; that call's records are NaN (the degenerate row), never
    the last call's; the transport then refuses every call."""
    works = [FakeWork(), FakeWork(), FakeWork()]
    first, second = works[0], works[1]
    t = _nccl_without_a_group(monkeypatch, works)
    mine, full = t.slots(6)
    full.fill_(1.0)  # the records of an earlier call
    t.exchange(mine, full)
    assert torch.isnan(full).all() and first.waited == [None]  # stream-ordered wait only
    t.check()  # its result is not known yet: no error, no blocking
    first.result.value_ = 0  # SUCCESS
    t.exchange(mine, full)
    second.result.value_ = 1  # TIMEOUT: the watchdog aborted all-gather #2
    with pytest.raises(transport.ExchangeTimeout, match=r"record all-gather #2 failed") as e:
        t.exchange(mine, full)
    assert e.value.call == 2 and e.value.missing is None and len(works) == 1
    with pytest.raises(transport.ExchangeTimeout, match="unusable since exchange #2 failed"):
        t.check()


def test_nccl_fills_no_records_where_an_abort_ends_the_process(monkeypatch):
    """Torch's default error handling (3) tears the process down, so no call can return
    stale records: no stamps, no fill per call."""
    t = _nccl_without_a_group(monkeypatch, [FakeWork()], handling="3")
    mine, full = t.slots(4)
    full.fill_(1.0)
    t.exchange(mine, full)
    assert not t.survives_abort and (full == 1.0).all() and full.is_contiguous()


def test_nccl_a_slot_without_this_calls_stamp_becomes_nan(monkeypatch):
    """Rank 0 of 2. The all-gather (simulated: it copies the slots it is given) delivers the
    peer's records with the peer's stamp on call 1; on call 2 it is aborted and writes the
    peer's call-1 slot again (stale data, as an aborted NCCL all-gather can leave); on call 3
    the peer's slot gets this rank's own records and stamp (foreign). Only the peer's slot of
    calls 2 and 3 becomes NaN; the records keep their alignment (slot stride a multiple of
    WIDTH). A NaN fill before the all-gather fails this test."""
    from tpsample import records
    sent, peer = [], []

    def all_gather(out, inp, group, async_op):
        rows, pad = out.view(2, -1), inp.numel()
        rows[0].copy_(inp)  # this rank's slot always arrives
        if len(sent) == 0:  # the peer's call-1 slot, stamped as the peer stamps it
            peer.append(inp.clone())
            peer[0][:-t.stamp_width].fill_(7.0)
            peer[0][pad - t.stamp_width:pad - t.stamp_width + 1].view(torch.int32).add_(1)
        rows[1].copy_(peer[0] if len(sent) < 2 else inp)
        sent.append(inp.clone())
        return FakeWork()

    t = _nccl_without_a_group(monkeypatch, [])
    monkeypatch.setattr(transport, "all_gather_flat", all_gather)
    mine, full = t.slots(8)
    assert full.shape == (2, 8) and full.stride(0) % records.WIDTH == 0
    for call in range(3):
        mine.copy_(torch.arange(8.0) + call)
        t.exchange(mine, full)
        assert torch.equal(full[0], mine)
        if call == 0:
            assert (full[1] == 7.0).all()
        else:
            assert torch.isnan(full[1]).all(), call
    assert [int(x[8:9].view(torch.int32)) for x in sent] == [2, 4, 6]  # call × world + rank


def _stamped_all_gather_rank(rank, world):
    """A real all-gather (gloo) through the stamped layout: every rank's records arrive."""
    import os
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    t = transport.NcclTransport(None, torch.device("cpu"), 30.0)
    out = []
    for call in range(2):
        mine, full = t.slots(12)
        mine.copy_(torch.arange(12.0) + 100 * rank + call)
        t.exchange(mine, full)
        out.append(full.clone())
    return out


@pytest.mark.slow  # (multi-process / subprocess: CI runs it under -m slow)
def test_nccl_stamped_slots_carry_every_ranks_records_over_a_real_all_gather():
    from dist_utils import run_world
    for rank_out in run_world(3, _stamped_all_gather_rank):
        for call, full in enumerate(rank_out):
            want = torch.stack([torch.arange(12.0) + 100 * r + call for r in range(3)])
            assert torch.equal(full, want), (call, full)


def test_nccl_check_synchronize_waits_for_the_newest_all_gather_bounded(monkeypatch):
    works = [FakeWork(), FakeWork(finishes=False)]
    done, hung = works
    t = _nccl_without_a_group(monkeypatch, works)
    mine, full = t.slots(4)
    t.exchange(mine, full)
    t.check(synchronize=True)
    assert done.waited[-1] is None  # polled to completion, then the stream-ordered wait
    t.exchange(mine, full)
    t.timeout = datetime.timedelta(seconds=0.2)  # (the wait polls for the whole bound)
    with pytest.raises(transport.ExchangeTimeout, match=r"record all-gather #2 did not complete within 0.2 s") as e:
        t.check(synchronize=True)
    assert e.value.call == 2


class PolledWork:
    """A collective that completes at its `polls`-th is_completed() (or fails in wait())."""
    def __init__(self, polls: int, error: bool = False):
        self.polls, self.error, self.seen, self.waited = polls, error, 0, []

    def is_completed(self):
        self.seen += 1
        return self.seen >= self.polls

    def wait(self, timeout=None):
        self.waited.append(timeout)
        if self.error:
            raise RuntimeError("NCCL error: remote process exited")


def test_wait_polls_completion_without_the_backends_timed_wait(monkeypatch):
    """Transport.wait polls is_completed() (NCCL's timed wait sleeps milliseconds per poll), then
    waits without a timeout (the collective's own error; stream order); a collective that
    never completes raises ExchangeTimeout after timeout_s, one that failed raises it too."""
    t = _nccl_without_a_group(monkeypatch, [])
    work = PolledWork(polls=50)
    t.wait(work, "the fallback all-gather")
    assert work.seen == 50 and work.waited == [None]
    t.timeout = datetime.timedelta(seconds=0.05)
    hung = PolledWork(polls=1 << 40)
    start = time.monotonic()
    with pytest.raises(transport.ExchangeTimeout, match="the fallback all-gather did not complete"):
        t.wait(hung, "the fallback all-gather")
    assert 0.05 <= time.monotonic() - start < 1.0 and hung.waited == []
    with pytest.raises(transport.ExchangeTimeout, match="remote process exited"):
        t.wait(PolledWork(polls=1, error=True), "the per-call input check")


def test_nccl_unread_results_stay_bounded(monkeypatch):
    works = [FakeWork() for _ in range(5)]
    t = _nccl_without_a_group(monkeypatch, works)
    monkeypatch.setattr(transport, "MAX_PENDING", 3)
    mine, full = t.slots(2)
    for _ in range(5):
        t.exchange(mine, full)  # the watchdog never reports: results stay unread
    assert [call for call, *_ in t._pending] == [3, 4, 5]


def test_nccl_warns_when_the_group_outlives_timeout_s_only_where_the_process_survives(monkeypatch, caplog):
    """With TORCH_NCCL_ASYNC_ERROR_HANDLING=2 a lost peer is reported after the group's
    timeout: a group timeout above timeout_s is a misconfiguration worth a warning; with the
    default (3) the watchdog ends the process anyway."""
    import datetime
    monkeypatch.setattr(transport, "group_timeout", lambda group, device: datetime.timedelta(minutes=10))
    with caplog.at_level("WARNING", logger="tpsample"):
        _nccl_without_a_group(monkeypatch, [], handling="3")
        assert caplog.messages == []
        _nccl_without_a_group(monkeypatch, [], handling="2")
    assert len(caplog.messages) == 1 and "timeout (0:10:00) is longer than timeout_s (2 s)" in caplog.messages[0]
    monkeypatch.setattr(transport, "group_timeout", lambda group, device: datetime.timedelta(seconds=2))
    caplog.clear()
    with caplog.at_level("WARNING", logger="tpsample"):
        _nccl_without_a_group(monkeypatch, [], handling="2")
    assert caplog.messages == []


def _after_destroy(rank, world):
    import torch.distributed as dist
    import tpsample
    g = dist.new_group(list(range(world)))
    V, D = 64, 8
    w = torch.randn(V, D, generator=torch.Generator().manual_seed(0))
    lo = V * rank // world
    s = tpsample.VocabParallelSampler(w[lo:V * (rank + 1) // world].contiguous(), vocab_size=V,
                                      vocab_start=lo, group=g)
    h = torch.randn(2, D, generator=torch.Generator().manual_seed(1))
    before = s(h, seed=1).tolist()
    dist.destroy_process_group(g)
    del g
    try:
        s(h, seed=1)
    except RuntimeError as e:
        return {"before": before, "after": str(e)}
    return {"before": before, "after": None}


@pytest.mark.slow  # (multi-process / subprocess: CI runs it under -m slow)
def test_a_sampler_holds_no_destroyed_group():
    """Samplers hold their group by weak reference (a destroyed gloo group kept alive until
    interpreter exit aborts the process: tests/test_exit.py): after destroy_process_group the
    sampler raises, naming what happened, instead of keeping the group."""
    for r in run_world(2, _after_destroy):
        assert len(r["before"]) == 2
        assert r["after"] is not None and "process group was destroyed" in r["after"]
