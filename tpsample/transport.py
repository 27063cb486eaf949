"""How candidate records travel between tensor-parallel ranks: one small interface.

A transport owns an exchange buffer laid out as [world, capacity] float32: rank r's
records live in slot r. Per call, `slots(numel)` hands out the slot views of the buffer
for this call, stage 1 writes this rank's records, and `exchange()` makes every slot valid
on every rank. Only records travel, never logits.

  local     one device, no peers (tpsample.sample): a fresh [1, numel] buffer per call.

  symm_mem  CUDA + P2P: the buffer is torch symmetric memory; the kernel stores its records
            straight into every peer's slot (fan-out from the epilogue) and `exchange` is
            the symmetric-memory barrier. Two buffers alternate between calls, so a fast
            rank's next call never overwrites records a slow rank is still reducing (passing
            the barrier of call k+1 implies every peer finished reducing call k). The parity
            is a device tensor that the reduce kernel flips, so CUDA-graph replays alternate too.
  nccl      CUDA: the records are all-gathered with NCCL.
  gloo      CPU tensors: all-gather with gloo (what CI runs).
"""
from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

log = logging.getLogger("tpsample")


# torch >= 2.13 renamed all_gather_into_tensor; the device machines run 2.11
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ExchangeTimeout(TimeoutError):
    """A peer rank did not join an exchange in time."""


class Transport:
    name = "base"

    def key(self) -> tuple:
        """What a recorded call's launches depend on besides its tensors (the fan-out
        addresses): changes whenever the buffers are re-allocated."""
        return ()

    def __init__(self, group, device: torch.device, timeout_s: float):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.capacity = 0

    def reserve(self, numel: int) -> None:
        """Make every slot hold at least numel floats (collective for symm_mem: all ranks call it)."""
        if numel > self.capacity:
            self._allocate(max(numel, 2 * self.capacity))

    def slots(self, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's slot [numel], all slots [world, numel]) for the current call."""
        raise NotImplementedError

    def fanout(self):
        """(peer_ptrs int64 [2, world], parity int32 [2], parity_stride) for kernels that
        store into peers directly, or None when records are written locally and exchanged.
        parity[0] selects the buffer, parity[1] is the reduce kernel's program counter."""
        return None

    def exchange(self, mine: torch.Tensor, full: torch.Tensor) -> None:
        raise NotImplementedError

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[...] on every rank → [world, ...] (collective; the filtered-sampling fallback's
        rare, host-synchronised exchange of a few rows' logit shards)."""
        out = torch.empty(self.world, *t.shape, dtype=t.dtype, device=t.device)
        work = all_gather_flat(out.view(-1), t.contiguous().view(-1), group=self.group,
                               async_op=True)
        self.wait(work, "the fallback all-gather")
        return out

    def wait(self, work, what: str) -> None:
        """Wait for an async collective; a peer that never joins raises ExchangeTimeout."""
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            raise ExchangeTimeout(
                f"tpsample rank {self.rank}/{self.world} ({self.name}): {what} did not complete "
                f"within {self.timeout.total_seconds():g} s; a peer rank probably never made the "
                f"same call (every rank must call the sampler with the same batch). Cause: {e}"
            ) from e


class LocalTransport(Transport):
    """No exchange: the records of one device, in a fresh buffer per call (outputs and
    records are never shared between calls)."""
    name = "local"

    def __init__(self, device: torch.device):
        self.rank, self.world, self.device, self.capacity = 0, 1, device, 0

    def slots(self, numel):
        mine = torch.empty(numel, dtype=torch.float32, device=self.device)
        return mine, mine.view(1, numel)

    def exchange(self, mine, full):
        pass

    def all_gather(self, t):
        return t[None]


class CollectiveTransport(Transport):
    """all_gather_into_tensor over a process group (nccl on CUDA, gloo on CPU)."""

    def _allocate(self, numel):
        self.send = torch.empty(numel, dtype=torch.float32, device=self.device)
        self.buf = torch.empty(self.world, numel, dtype=torch.float32, device=self.device)
        self.capacity = numel

    def slots(self, numel):
        self.reserve(numel)
        return self.send[:numel], self.buf.view(-1)[: self.world * numel].view(self.world, numel)

    def exchange(self, mine, full):
        work = all_gather_flat(full.view(-1), mine, group=self.group, async_op=True)
        if self.name == "gloo":
            self.wait(work, "the record all-gather")
        else:
            work.wait()  # NCCL: orders the current stream after the collective; no host sync


class GlooTransport(CollectiveTransport):
    name = "gloo"


class NcclTransport(CollectiveTransport):
    name = "nccl"


class SymmMemTransport(Transport):
    name = "symm_mem"

    def __init__(self, group, device: torch.device, timeout_s: float):
        super().__init__(group, device, timeout_s)
        self._views: dict = {}  # numel -> (mine, full) slot views of the current buffer

    def key(self):
        return (self.buf.data_ptr(), self.capacity) if self.capacity else ()

    def _allocate(self, numel):
        import torch.distributed._symmetric_memory as symm_mem
        half = self.world * numel  # one buffer; two alternate halves
        self.buf = symm_mem.empty(2 * half, dtype=torch.float32, device=self.device)
        self.handle = symm_mem.rendezvous(self.buf, self.group.group_name)
        bases = [self.handle.get_buffer(p, (2 * half,), torch.float32, 0).data_ptr()
                 for p in range(self.world)]
        mine = self.rank * numel * 4
        self.ptrs = torch.tensor([[b + mine + k * half * 4 for b in bases] for k in range(2)],
                                 dtype=torch.int64, device=self.device)
        self.parity = torch.zeros(2, dtype=torch.int32, device=self.device)
        self.capacity = numel
        self._views.clear()

    def slots(self, numel):
        views = self._views.get(numel)  # emptied by every re-allocation
        if views is None:  # cached: slicing costs host µs on every call
            self.reserve(numel)
            full = self.buf[: self.world * self.capacity].view(self.world, self.capacity)
            views = self._views[numel] = (full[self.rank, :numel], full[:, :numel])
        return views  # buffer 0; kernels add the parity

    def fanout(self):
        return self.ptrs, self.parity, self.world * self.capacity

    def exchange(self, mine, full):
        # release/acquire across the group: every peer's fan-out stores are visible after it
        self.handle.barrier(channel=0, timeout_ms=int(self.timeout.total_seconds() * 1000))


def symm_mem_usable(group, device) -> tuple[bool, str]:
    """Whether every rank of the group can store into every peer's memory (P2P on one host).
    tpsample only uses symmetric memory's P2P pointers and barrier, never NVLink multicast;
    hosts where multicast must stay off set TORCH_SYMM_MEM_DISABLE_MULTICAST=1 for torch."""
    if device.type != "cuda":
        return False, "tensors are on the CPU"
    try:
        import torch.distributed._symmetric_memory as symm_mem  # noqa: F401
    except ImportError as e:
        return False, f"torch symmetric memory unavailable ({e})"
    world = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group)
    local = torch.cuda.device_count()
    if max(ranks) >= local and world > local:
        return False, "ranks span several hosts"
    for peer in range(local):
        if peer != device.index and not torch.cuda.can_device_access_peer(device.index, peer):
            return False, f"GPU {device.index} cannot reach GPU {peer} over P2P"
    return True, "CUDA tensors, all peers reachable over P2P"


def make_transport(name: str, group, device: torch.device, timeout_s: float) -> Transport:
    """Pick a transport ("auto" | "symm_mem" | "nccl" | "gloo") and log which and why."""
    backend = dist.get_backend(group)
    if name == "auto":
        if device.type == "cpu":
            name, why = "gloo", "tensors are on the CPU"
        else:
            ok, why = symm_mem_usable(group, device)
            name = "symm_mem" if ok else "nccl"
        log.info("tpsample: transport %s (%s)", name, why)
    if name == "gloo":
        if device.type != "cpu" or backend != "gloo":
            raise ValueError(f"transport='gloo' needs CPU tensors and a gloo group (got {device}, {backend})")
        return GlooTransport(group, device, timeout_s)
    if name == "nccl":
        if device.type != "cuda" or "nccl" not in backend:
            raise ValueError(f"transport='nccl' needs CUDA tensors and an nccl group (got {device}, {backend})")
        return NcclTransport(group, device, timeout_s)
    if name == "symm_mem":
        ok, why = symm_mem_usable(group, device)
        if not ok:
            raise ValueError(f"transport='symm_mem' is not usable here: {why}")
        return SymmMemTransport(group, device, timeout_s)
    raise ValueError(f"transport must be 'auto', 'symm_mem', 'nccl' or 'gloo', got {name!r}")
