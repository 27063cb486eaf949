"""The symmetric-memory exchange's signal and bounded wait (kernels/exchange_wait.py),
interpreted on the CPU with ordinary tensors standing in for the peers' flags and buffers:
one rank's launch at a time, so a peer has either signalled before it or never does."""
import time

import pytest
import torch

from tpsample import merge, records
from tpsample.kernels import exchange_wait
from tpsample.transport import signal_and_wait

BROKEN = exchange_wait.BROKEN.value


class Ranks:
    """world ranks' exchange state as the transport lays it out (flags int64 [world] each,
    the address of flags[r] in every peer, a call counter, a status, a two-half buffer, the
    fan-out addresses [2, world] of each rank's slot in every peer's buffer)."""

    def __init__(self, world: int, slot_numel: int, device):
        self.world, self.slot_numel = world, slot_numel
        self.flags = [torch.zeros(world, dtype=torch.int64, device=device) for _ in range(world)]
        self.calls = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
        self.status = [torch.zeros(world, dtype=torch.int32) for _ in range(world)]
        self.bufs = [torch.arange(2 * world * slot_numel, dtype=torch.float32, device=device)
                     for _ in range(world)]
        half = world * slot_numel
        self.ptrs = [torch.tensor([[b.data_ptr() + 4 * (k * half + rank * slot_numel) for b in self.bufs]
                                   for k in range(2)], dtype=torch.int64, device=device)
                     for rank in range(world)]
        self.fanout_before = [t.clone() for t in self.ptrs]
        self.parity = torch.zeros(2, dtype=torch.int32, device=device)
        self.device = device

    def exchange(self, rank: int, timeout_s: float = 2e-5, cond=None) -> float:
        """One exchange of rank (cond: only if some cond[i] != 0); its wall time in seconds."""
        t0 = time.perf_counter()
        peer_flags = torch.tensor([f.data_ptr() + 8 * rank for f in self.flags],
                                  dtype=torch.int64, device=self.device)
        status = self.status[rank].to(self.device)
        signal_and_wait(self.flags[rank], peer_flags, self.calls[rank], status, self.bufs[rank],
                        self.parity, self.ptrs[rank], rank=rank, world=self.world,
                        slot_numel=self.slot_numel, parity_stride=self.world * self.slot_numel,
                        timeout_s=timeout_s, cond=cond)
        self.status[rank].copy_(status.cpu())
        return time.perf_counter() - t0

    def half(self, rank: int, k: int) -> torch.Tensor:
        n = self.world * self.slot_numel
        return self.bufs[rank][k * n:(k + 1) * n].view(self.world, self.slot_numel)

    def told_everyone(self, rank: int, value: int) -> bool:
        """flags[rank] of every rank holds value."""
        return all(f[rank].item() == value for f in self.flags)

    def fans_out_locally(self, rank: int) -> bool:
        """every fan-out address of rank points at its own slot of its own buffer."""
        own = self.fanout_before[rank][:, rank:rank + 1]
        return torch.equal(self.ptrs[rank], own.expand(2, self.world))


# Interpreted, a poll counts as 1 µs of the bound and takes ~1.5 ms of wall time: a rank
# that waited out LONG would take ~3 s; one that does not wait returns well under AT_ONCE.
LONG, AT_ONCE = 2e-3, 1.0


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_signals_every_peer_and_passes_once_all_arrived(world, device):
    r = Ranks(world, 8, device)
    before = [b.clone() for b in r.bufs]
    for p in range(1, world):  # the others have signalled exchange 1 ...
        r.flags[0][p] = 1
    assert r.exchange(0, timeout_s=LONG) < AT_ONCE  # ... so rank 0 passes at once
    assert r.status[0].tolist() == [0] * world
    assert r.calls[0].item() == 1
    assert r.told_everyone(0, 1)  # rank 0's signal reached every peer
    assert torch.equal(r.bufs[0], before[0])  # nothing poisoned
    assert torch.equal(r.ptrs[0], r.fanout_before[0])  # fan-out unchanged
    # the next exchange needs epoch 2 from every peer: rank 0 alone times out on all of them
    r.exchange(0)
    assert r.status[0].tolist() == [0] + [2] * (world - 1)
    assert r.calls[0].item() == -2  # gave up at exchange 2


def test_a_conditional_exchange_runs_only_where_a_flag_is_set(device):
    """cond (the filtered fallback's flags, equal on every rank): all zero, no rank signals or
    waits (a missing peer cannot fail it); one flag set, the exchange runs as any other."""
    r = Ranks(2, 4, device)
    zeros = torch.zeros(37, dtype=torch.int32, device=device)
    for rank in (0, 1):
        assert r.exchange(rank, timeout_s=LONG, cond=zeros) < AT_ONCE
    assert [c.item() for c in r.calls] == [0, 0] and r.told_everyone(0, 0)
    assert r.told_everyone(1, 0) and r.status[0].tolist() == [0, 0]
    flagged = zeros.clone()
    flagged[36] = 1
    r.exchange(1, cond=flagged)  # rank 0 has not signalled: rank 1 gives up, as without cond
    assert r.calls[1].item() == -1 and r.status[1].tolist() == [1, 0]
    r = Ranks(2, 4, device)
    r.flags[0][1] = 1
    assert r.exchange(0, timeout_s=LONG, cond=flagged) < AT_ONCE
    assert r.calls[0].item() == 1 and r.told_everyone(0, 1)


def test_a_missing_peer_times_out_and_rank_gives_up_telling_its_peers(device):
    """status names the missing peer; its slot of this call's half becomes NaN; every peer's
    flag of this rank is BROKEN; the fan-out stays local; calls = -epoch."""
    world, n = 3, 10
    r = Ranks(world, n, device)
    r.parity[0] = 1  # this call's records are in the second half
    r.flags[0][2] = 1  # rank 2 has signalled rank 0; rank 1 never does
    r.exchange(0)
    assert r.status[0].tolist() == [0, 1, 0]  # status[p] = the exchange p missed
    assert r.calls[0].item() == -1
    assert torch.isnan(r.half(0, 1)[1]).all()  # the missing peer's slot, this call's half
    assert not torch.isnan(r.half(0, 1)[[0, 2]]).any()  # own and arrived slots untouched
    assert not torch.isnan(r.half(0, 0)).any()  # the other half untouched
    assert r.told_everyone(0, BROKEN) and r.fans_out_locally(0)
    assert torch.equal(r.ptrs[1], r.fanout_before[1])  # the others' fan-out is theirs


def test_a_late_peer_gives_up_at_once_instead_of_pairing_with_a_rank_that_gave_up(device):
    """Rank 1 skips an exchange: rank 0 gives up. When rank 1 arrives it finds rank 0's
    flag BROKEN (rank 0 did signal epoch 1 before, so without it rank 1 would pass with
    records rank 0 no longer keeps in step), gives up without waiting, and tells rank 0."""
    r = Ranks(2, 6, device)
    r.exchange(0)
    assert r.exchange(1, timeout_s=LONG) < AT_ONCE
    assert r.status[1].tolist() == [1, 0] and r.calls[1].item() == -1
    assert torch.isnan(r.half(1, 0)[0]).all() and not torch.isnan(r.half(1, 0)[1]).any()
    assert r.told_everyone(1, BROKEN) and r.fans_out_locally(1)


def test_a_rank_that_gave_up_ends_every_peers_wait_at_once(device):
    """world 3: rank 0 gives up on ranks 1 and 2; rank 2 then arrives and, though rank 1 has
    neither arrived nor given up, stops waiting: the call is lost. Its status names both."""
    r = Ranks(3, 4, device)
    r.exchange(0)
    assert r.exchange(2, timeout_s=LONG) < AT_ONCE
    assert r.status[2].tolist() == [1, 1, 0] and r.calls[2].item() == -1
    assert torch.isnan(r.half(2, 0)[[0, 1]]).all() and r.told_everyone(2, BROKEN)


def test_after_giving_up_later_exchanges_end_at_once_with_degenerate_records(device):
    """The calls a rank runs before its host notices: no signal (the peers keep BROKEN), no
    wait, every peer slot of the call's half NaN, the first failure's status kept."""
    r = Ranks(3, 5, device)
    r.flags[0][2] = 1
    r.exchange(0)
    r.parity[0] = 1
    assert r.exchange(0, timeout_s=LONG) < AT_ONCE
    assert r.calls[0].item() == -2 and r.status[0].tolist() == [0, 1, 0]
    assert r.told_everyone(0, BROKEN)
    assert torch.isnan(r.half(0, 1)[[1, 2]]).all() and not torch.isnan(r.half(0, 1)[0]).any()


@pytest.mark.parametrize("merge_mode", ["max", "logmass", "cdf"])
@pytest.mark.parametrize("nan_part", ["slot", "some tiles"])
def test_a_nan_slot_gives_every_row_the_degenerate_result(merge_mode, nan_part):
    """What stage 2 makes of a timed-out call's records (a whole peer slot NaN, or part of
    one: an NCCL all-gather aborted midway): token -1, log-prob and log Z NaN."""
    slots, S, B, T = 3, 1, 4, 3
    rec = torch.randn(slots, S, B, T, records.WIDTH, generator=torch.Generator().manual_seed(0))
    if nan_part == "slot":
        rec[1] = float("nan")
    else:
        rec[1, :, :, :2] = float("nan")
    tokens, logprobs, logz = merge.reduce_records(rec, torch.arange(B), torch.zeros(B, dtype=torch.int64),
                                                  torch.zeros(B, dtype=torch.bool), merge_mode)
    assert (tokens == -1).all() and torch.isnan(logprobs).all() and torch.isnan(logz).all()


def test_wait_is_bounded_by_the_timeout(device):
    """Interpreted, a poll counts as 1 µs: a 50 µs bound gives up after ~50 polls."""
    r = Ranks(2, 4, device)
    r.exchange(0, timeout_s=5e-5)
    assert r.status[0].tolist() == [0, 1]
