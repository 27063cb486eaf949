"""The symmetric-memory exchange's signal and bounded wait (kernels/exchange_wait.py),
interpreted on the CPU with ordinary tensors standing in for the peers' flags and buffers:
one rank's launch at a time, so a peer has either signalled before it or never does."""
import pytest
import torch

from tpsample import merge, records
from tpsample.transport import signal_and_wait


class Ranks:
    """world ranks' exchange state as the transport lays it out (flags int64 [world] each,
    the address of flags[r] in every peer, a call counter, a status, a two-half buffer)."""

    def __init__(self, world: int, slot_numel: int, device):
        self.world, self.slot_numel = world, slot_numel
        self.flags = [torch.zeros(world, dtype=torch.int64, device=device) for _ in range(world)]
        self.calls = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
        self.status = [torch.zeros(world, dtype=torch.int32) for _ in range(world)]
        self.bufs = [torch.arange(2 * world * slot_numel, dtype=torch.float32, device=device)
                     for _ in range(world)]
        self.parity = torch.zeros(2, dtype=torch.int32, device=device)
        self.device = device

    def exchange(self, rank: int, timeout_s: float = 2e-5):
        peer_flags = torch.tensor([f.data_ptr() + 8 * rank for f in self.flags],
                                  dtype=torch.int64, device=self.device)
        status = self.status[rank].to(self.device)
        signal_and_wait(self.flags[rank], peer_flags, self.calls[rank], status, self.bufs[rank],
                        self.parity, rank=rank, world=self.world, slot_numel=self.slot_numel,
                        parity_stride=self.world * self.slot_numel, timeout_s=timeout_s)
        self.status[rank].copy_(status.cpu())

    def half(self, rank: int, k: int) -> torch.Tensor:
        n = self.world * self.slot_numel
        return self.bufs[rank][k * n:(k + 1) * n].view(self.world, self.slot_numel)


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_signals_every_peer_and_passes_once_all_arrived(world, device):
    r = Ranks(world, 8, device)
    before = [b.clone() for b in r.bufs]
    for rank in range(1, world):  # the others signal first (their waits time out here) ...
        r.exchange(rank)
    r.status = [torch.zeros(world, dtype=torch.int32) for _ in range(world)]
    r.bufs = [b.clone() for b in before]
    r.exchange(0, timeout_s=1.0)  # ... so rank 0 finds every flag set at once
    assert r.status[0].tolist() == [0] * world
    assert r.calls[0].item() == 1
    assert all(f[0].item() == 1 for f in r.flags)  # rank 0's signal reached every peer
    assert torch.equal(r.bufs[0], before[0])  # nothing poisoned
    # the next exchange needs epoch 2 from every peer: rank 0 alone times out on all of them
    r.exchange(0)
    assert r.status[0].tolist() == [0] + [2] * (world - 1)
    assert r.calls[0].item() == 2


def test_a_missing_peer_times_out_and_its_slot_becomes_nan(device):
    world, n = 3, 10
    r = Ranks(world, n, device)
    r.parity[0] = 1  # this call's records are in the second half
    r.flags[0][2] = 1  # rank 2 has signalled rank 0; rank 1 never does
    r.exchange(0)
    assert r.status[0].tolist() == [0, 1, 0]  # status[p] = the exchange p missed
    assert r.calls[0].item() == 1  # the call counts: a later wait needs the next epoch
    assert torch.isnan(r.half(0, 1)[1]).all()  # the missing peer's slot, this call's half
    assert not torch.isnan(r.half(0, 1)[[0, 2]]).any()  # own and arrived slots untouched
    assert not torch.isnan(r.half(0, 0)).any()  # the other half untouched


@pytest.mark.parametrize("merge_mode", ["max", "logmass", "cdf"])
@pytest.mark.parametrize("nan_part", ["slot", "some tiles"])
def test_a_nan_slot_gives_every_row_the_degenerate_result(merge_mode, nan_part):
    """What stage 2 makes of a timed-out call's records (a whole peer slot NaN, or part of
    one: an NCCL all-gather aborted midway): token 0, log-prob and log Z NaN."""
    slots, S, B, T = 3, 1, 4, 3
    rec = torch.randn(slots, S, B, T, records.WIDTH, generator=torch.Generator().manual_seed(0))
    if nan_part == "slot":
        rec[1] = float("nan")
    else:
        rec[1, :, :, :2] = float("nan")
    tokens, logprobs, logz = merge.reduce_records(rec, torch.arange(B), torch.zeros(B, dtype=torch.int64),
                                                  torch.zeros(B, dtype=torch.bool), merge_mode)
    assert (tokens == 0).all() and torch.isnan(logprobs).all() and torch.isnan(logz).all()


def test_wait_is_bounded_by_the_timeout(device):
    """Interpreted, a poll counts as 1 µs: a 50 µs bound gives up after ~50 polls."""
    r = Ranks(2, 4, device)
    r.exchange(0, timeout_s=5e-5)
    assert r.status[0].tolist() == [0, 1]
