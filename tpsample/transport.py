"""How candidate records travel between tensor-parallel ranks: one small interface.

A transport owns an exchange buffer laid out as [world, capacity] float32: rank r's
records live in slot r. Per call, `slots(numel)` hands out the slot views of the buffer
for this call, stage 1 writes this rank's records, and `exchange()` makes every slot valid
on every rank. Only records travel, never logits.

  local     one device, no peers (tpsample.sample): a fresh [1, numel] buffer per call.

  symm_mem  CUDA + P2P: the buffer is torch symmetric memory; the kernel stores its records
            straight into every peer's slot (fan-out from the epilogue) and `exchange` is
            one program of kernels/exchange_wait.py: it signals every peer through a
            symmetric-memory flag and waits on the device, bounded by timeout_s, for the
            peers' flags. Two buffers alternate between calls, so a fast rank's next call
            never overwrites records a slow rank is still reducing (passing the exchange of
            call k+1 implies every peer finished reducing call k). The parity is a device
            tensor that the reduce kernel flips, so CUDA-graph replays alternate too.
  nccl      CUDA: the records are all-gathered with NCCL.
  gloo      CPU tensors: all-gather with gloo (what CI runs).

The filtered-sampling fallback needs a few rows' whole logits, spread over the ranks: over
symm_mem kernels store each rank's shard into every rank's `rows_gather` buffer and
`gather_exchange` (the same signal and bounded wait, only when some row is flagged) makes
them visible; the others all-gather them from the host (`all_gather`).

Failures. An exchange a peer does not join within timeout_s raises ExchangeTimeout, naming
the peers that did not arrive:
  gloo      at once (the host waits for the all-gather; the abandoned all-gather stays in
            gloo's worker until the group's own timeout, so the group should have timeout_s
            too: a process that exits while one is held can abort in torch's teardown);
  symm_mem  the device wait gives up after timeout_s without trapping and tells every peer
            (a late peer then gives up too, at once, rather than pair its call with records
            out of step); the outputs of that call and of any later call this rank ran are
            the degenerate rows (token -1, log-prob NaN, log Z NaN), and the host raises at
            the next call of the sampler, or at once from check() (which synchronises);
  nccl      NCCL has no device-side bound torch exposes: the process group's timeout and
            torch's watchdog decide. With the default TORCH_NCCL_ASYNC_ERROR_HANDLING (3) the
            watchdog tears the process down; with 2 it aborts the communicator and the process
            lives on, and the host raises at the next call (each call's WorkResult future,
            read without blocking; calls captured in a CUDA graph have none). check() waits
            for the newest all-gather for at most timeout_s on the host. The record buffer is
            stamped per call and a slot without this call's stamp becomes NaN, so an aborted
            all-gather's rows are the degenerate ones whatever it left behind (a NaN fill
            before the all-gather was not enough: NCCL 2.28.9 left other records). No
            same-process recovery was seen to work over NCCL (README).
After an ExchangeTimeout the ranks are out of step (a late peer's next exchange meets a call
its peers never make), so the transport, and the sampler that owns it, refuses every later
call with ExchangeTimeout: build a new sampler on a new process group to go on.
"""
from __future__ import annotations

import collections
import datetime
import logging
import os
import socket
import time
import weakref

import torch
import torch.distributed as dist
import triton

from . import records, replay

POLL_SPIN_S = 0.005   # Transport.wait: polls that only yield, then
POLL_SLEEP_S = 0.0005  # a sleep between polls

log = logging.getLogger("tpsample")


# torch >= 2.13 renamed all_gather_into_tensor; the device machines run 2.11
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ExchangeTimeout(TimeoutError):
    """A peer rank did not join an exchange in time (or this sampler's group is out of step
    since an earlier one did). `missing`: the peer ranks (in the sampler's group) that did
    not arrive, when known; `call`: the exchange's number (1 = the sampler's first call)."""

    def __init__(self, message: str, missing: list[int] | None = None, call: int | None = None):
        super().__init__(message)
        self.missing = missing
        self.call = call


class GroupRef:
    """A process group held by weak reference. torch's registry keeps a group until
    `destroy_process_group`; a sampler that held it too kept a destroyed gloo group alive
    until interpreter shutdown, where destroying it aborts the process in about one run in
    five ("terminate called without an active exception"; docs/design.md). Calling it
    returns the group, or raises once the group was destroyed."""
    __slots__ = ("_ref",)

    def __init__(self, group):
        self._ref = weakref.ref(group)

    def __call__(self):
        group = self._ref()
        if group is None:
            raise RuntimeError("tpsample: this sampler's process group was destroyed "
                               "(dist.destroy_process_group); build a new sampler on a live "
                               "group")
        return group


class Transport:
    name = "base"
    device_gather = False  # rows_gather / gather_exchange (symm_mem): kernels gather rows

    def key(self) -> tuple:
        """What a recorded call's launches depend on besides its tensors (the fan-out
        addresses): changes whenever the buffers are re-allocated."""
        return ()

    def __init__(self, group, device: torch.device, timeout_s: float):
        self._group = GroupRef(group) if group is not None else None  # None: the default
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.capacity = 0
        self.failure: ExchangeTimeout | None = None  # set by the first failed exchange

    _group: GroupRef | None = None

    @property
    def group(self):
        return self._group() if self._group is not None else None

    def check(self, synchronize: bool = False) -> None:
        """Raise ExchangeTimeout if an exchange of this transport has failed (then every
        later call does too: the group is out of step). synchronize: first wait for the work
        issued so far (the exchanges that are still running count then)."""
        if self.failure is not None:
            which = "an exchange" if self.failure.call is None else f"exchange #{self.failure.call}"
            raise ExchangeTimeout(
                f"{self._who()}: this sampler is unusable since {which} "
                f"failed ({self.failure}); its ranks are out of step. Build a new "
                "VocabParallelSampler on a new process group to go on.",
                self.failure.missing, self.failure.call) from self.failure

    def _who(self) -> str:
        return f"tpsample rank {self.rank}/{self.world} ({self.name})"

    def _fail(self, message: str, missing=None, call=None) -> ExchangeTimeout:
        self.failure = ExchangeTimeout(message, missing, call)
        return self.failure

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

    def wait(self, work, what: str, call: int | None = None) -> None:
        """Wait for an async collective; a peer that never joins raises ExchangeTimeout.

        The host polls work.is_completed() itself for up to timeout_s: NCCL's own timed
        wait (work.wait(timeout)) sleeps a fixed interval of milliseconds between its polls
        (c10d's kSynchronizeBusyWaitMillis), which a collective of a few microseconds pays
        in full. Polls only yield for POLL_SPIN_S, then sleep POLL_SLEEP_S each (a late peer
        does not cost a busy core). work.wait() after completion raises the collective's
        own error and orders the current stream after it."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        spin_until = time.monotonic() + POLL_SPIN_S
        try:
            while not work.is_completed():
                now = time.monotonic()
                if now > deadline:
                    raise RuntimeError(f"not completed after {self.timeout.total_seconds():g} s")
                time.sleep(0 if now < spin_until else POLL_SLEEP_S)
            work.wait()
        except RuntimeError as e:
            raise self._fail(
                f"{self._who()}: {what} did not complete within "
                f"{self.timeout.total_seconds():g} s; a peer rank probably never made the same "
                f"call (every rank must call the sampler with the same batch). Cause: {e}",
                None, call) from e


class LocalTransport(Transport):
    """No exchange: the records of one device, in a fresh buffer per call (outputs and
    records are never shared between calls)."""
    name = "local"

    def __init__(self, device: torch.device):
        self.rank, self.world, self.device, self.capacity = 0, 1, device, 0
        self.failure = None

    def slots(self, numel):
        mine = torch.empty(numel, dtype=torch.float32, device=self.device)
        return mine, mine.view(1, numel)

    def exchange(self, mine, full):
        pass

    def all_gather(self, t):
        return t[None]


class CollectiveTransport(Transport):
    """all_gather_into_tensor over a process group (nccl on CUDA, gloo on CPU)."""

    calls = 0  # exchanges issued
    stamp_width = 0  # floats after each slot's records (NcclTransport's per-call stamp)

    def _allocate(self, numel):
        padded = numel + self.stamp_width  # zeros: no slot holds a stamp before its call
        self.send = torch.zeros(padded, dtype=torch.float32, device=self.device)
        self.buf = torch.zeros(self.world * padded, dtype=torch.float32, device=self.device)
        self.capacity = numel

    def _padded(self, numel):
        """(this rank's slot with its stamp [numel + stamp_width], all of them [world, same])"""
        padded = numel + self.stamp_width
        return self.send[:padded], self.buf[: self.world * padded].view(self.world, padded)

    def slots(self, numel):
        self.reserve(numel)
        send, rows = self._padded(numel)
        return send[:numel], rows[:, :numel]

    def exchange(self, mine, full):
        self.check()
        self.calls += 1
        work = all_gather_flat(full.view(-1), mine, group=self.group, async_op=True)
        self.wait(work, "the record all-gather", self.calls)

    def _warn_if_the_group_outlives_timeout(self, consequence: str) -> None:
        own = group_timeout(self.group, self.device)
        if own is not None and own > self.timeout:
            log.warning("%s: the process group's timeout (%s) is longer than timeout_s (%g s): "
                        "%s; build the group with timeout=timedelta(seconds=timeout_s)",
                        self._who(), own, self.timeout.total_seconds(), consequence)


def group_timeout(group, device: torch.device) -> datetime.timedelta | None:
    """The process group's own collective timeout (its backend's options), or None where torch
    does not say."""
    try:
        pg = group if group is not None else dist.group.WORLD
        return pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, TypeError):
        return None


class GlooTransport(CollectiveTransport):
    """The host waits for each all-gather, bounded by timeout_s."""
    name = "gloo"

    def __init__(self, group, device, timeout_s):
        super().__init__(group, device, timeout_s)
        self._warn_if_the_group_outlives_timeout(
            "an all-gather abandoned by an ExchangeTimeout stays in gloo's worker until then, "
            "and a process that exits meanwhile can abort")


MAX_PENDING = 4096  # NCCL exchanges whose WorkResult is still unread (torch's watchdog marks
# them every ~100 ms: about 100 ms of calls, ~1000 at 0.1 ms per call)


class NcclTransport(CollectiveTransport):
    """The all-gather is stream-ordered (no host wait per call). Each call's WorkResult
    future, which torch's watchdog completes (SUCCESS, or TIMEOUT / COMM_ERROR on a failure),
    is read at the next call without blocking; a process lives on after a failure only with
    TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (the default tears it down).

    In that mode each slot ends in a stamp (one record's width, so the records keep their
    alignment): the call count on the device times world plus the rank. After the
    all-gather, a slot whose stamp is not this call's becomes NaN, so the call's rows are the
    degenerate ones: a peer that never made the call cannot have sent this call's stamp,
    whatever an aborted all-gather left behind (NCCL 2.28.9 left records other than a NaN
    fill there; with the stamp, the aborted call's rows were the degenerate ones). Five small
    launches per call (18-180 µs more per eager call on two H100s, host-bound); the count
    lives on the device, so graph replays count."""
    name = "nccl"

    def __init__(self, group, device, timeout_s):
        super().__init__(group, device, timeout_s)
        self._pending: collections.deque = collections.deque()  # (call, work, result future)
        # Only this mode lets a process run on after an aborted all-gather (torch reads the
        # variable when it builds the group; the others hang or end the process).
        self.survives_abort = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "2"
        if self.survives_abort:
            self._warn_if_the_group_outlives_timeout(
                "a lost peer is reported only after the group's timeout")
            self.stamp_width = records.WIDTH  # the first float holds the int32 stamp
            self.stamp = torch.zeros(1, dtype=torch.int32, device=device)  # calls × world
            self.ranks = torch.arange(self.world, dtype=torch.int32, device=device)[:, None]

    def exchange(self, mine, full):
        self.check()
        self.calls += 1
        if self.survives_abort:
            numel = mine.numel()
            send, rows = self._padded(numel)
            self.stamp += self.world
            torch.add(self.stamp, self.rank, out=send[numel:numel + 1].view(torch.int32))
            work = all_gather_flat(rows.view(-1), send, group=self.group, async_op=True)
            work.wait()  # orders the current stream after the collective; no host sync
            stale = rows[:, numel:numel + 1].view(torch.int32) != self.stamp + self.ranks
            full.masked_fill_(stale, float("nan"))
        else:
            work = all_gather_flat(full.view(-1), mine, group=self.group, async_op=True)
            work.wait()
        if full.is_cuda and torch.cuda.is_current_stream_capturing():
            return  # a captured collective has no watchdog entry: its future never completes
        try:
            result = work.get_future_result()
        except RuntimeError:  # a backend without it: the watchdog alone decides
            result = None
        self._pending.append((self.calls, work, result))
        if len(self._pending) > MAX_PENDING:  # never read (a watchdog that does not track
            self._pending.popleft()  # them): bounded; later calls on that communicator fail too

    def check(self, synchronize: bool = False) -> None:
        super().check()
        if synchronize and self._pending:  # bounded host wait for the newest exchange: the
            call, work, _ = self._pending[-1]  # earlier ones ran before it on the same stream
            self._pending.clear()
            self.wait(work, f"record all-gather #{call}", call)
        while self._pending:
            call, work, result = self._pending[0]
            if result is None or not result.done():
                return
            self._pending.popleft()
            outcome = result.value()
            if outcome != 0:  # WorkResult.SUCCESS
                raise self._fail(
                    f"{self._who()}: record all-gather #{call} failed (WorkResult {outcome}: "
                    "torch's NCCL watchdog aborted it after the process group's timeout, or the "
                    "communicator failed); that call returned degenerate rows (token -1, "
                    "log-prob NaN, log Z NaN)", None, call)


class SymmMemTransport(Transport):
    name = "symm_mem"

    def __init__(self, group, device: torch.device, timeout_s: float):
        super().__init__(group, device, timeout_s)
        self._views: dict = {}  # numel -> (mine, full) slot views of the current buffer
        self._signal = None  # the exchange's recorded launch (replay.Replay), per buffer
        self.flags = None
        self.gather_buf = None  # rows_gather's buffer (symmetric memory), and its views
        self._gather_views: dict = {}

    def key(self):
        return ((self.buf.data_ptr(), self.capacity) if self.capacity else ()) + \
            ((self.gather_buf.data_ptr(),) if self.gather_buf is not None else ())

    def _symmetric(self, numel: int, dtype: torch.dtype):
        """(a symmetric-memory tensor [numel], its handle, every rank's data_ptr of it);
        collective: every rank allocates together."""
        import torch.distributed._symmetric_memory as symm_mem
        t = symm_mem.empty(numel, dtype=dtype, device=self.device)
        handle = symm_mem.rendezvous(t, self.group.group_name)
        return t, handle, [handle.get_buffer(p, (numel,), dtype, 0).data_ptr()
                           for p in range(self.world)]

    def _allocate(self, numel):
        if self.flags is None:
            self._allocate_flags()
        half = self.world * numel  # one buffer; two alternate halves
        self.buf, self.handle, bases = self._symmetric(2 * half, torch.float32)
        mine = self.rank * numel * 4
        self.ptrs = torch.tensor([[b + mine + k * half * 4 for b in bases] for k in range(2)],
                                 dtype=torch.int64, device=self.device)
        self.parity = torch.zeros(2, dtype=torch.int32, device=self.device)
        self.capacity = numel
        self._views.clear()
        self._signal = None

    def _allocate_flags(self) -> None:
        """The exchange's flags (int64 [world] per rank, symmetric memory; see
        kernels/exchange_wait.py), this rank's count of its exchanges, and the status the
        device wait writes into pinned host memory (read per call without a sync)."""
        self.flags, flags_handle, bases = self._symmetric(self.world, torch.int64)
        self.flags.zero_()
        self.peer_flags = torch.tensor([b + 8 * self.rank for b in bases], dtype=torch.int64,
                                       device=self.device)
        self.calls = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.status = torch.zeros(self.world, dtype=torch.int32,
                                  pin_memory=self.device.type == "cuda")
        self._status = self.status.numpy()
        self._status_words = memoryview(self._status)  # any() over it: ~0.1 µs, numpy's ~1-2
        flags_handle.barrier(channel=0)  # once: every rank's flags are zero before any signal
        self._flags_handle = flags_handle

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
        self.check()
        if self._signal is not None:
            self._signal(replay.current_stream(self.device.index))
            return
        with replay.record() as log:
            signal_and_wait(self.flags, self.peer_flags, self.calls, self.status, self.buf,
                            self.parity, self.ptrs, rank=self.rank, world=self.world,
                            slot_numel=self.capacity, parity_stride=self.world * self.capacity,
                            timeout_s=self.timeout.total_seconds())
        if replay.Replay.usable() and all(hasattr(c, "run") and hasattr(c, "packed_metadata")
                                          for _, c, *_ in log):
            self._signal = replay.Replay(log, {})

    device_gather = True

    def rows_gather(self, B: int, n: int):
        """(full fp32 [world, B, n], mine = full[rank], peers int64 [world]: the address of
        slot rank in every rank's buffer): where a kernel stores this rank's [B, n] shard of
        some rows into every rank (the filtered-sampling fallback's logits, kernels/
        filter_fallback.py), before gather_exchange. A persistent symmetric-memory buffer,
        grown when a call needs more (collective: every rank makes the same calls)."""
        views = self._gather_views.get((B, n))
        if views is None:
            if self.flags is None:
                self._allocate_flags()
            numel = self.world * B * n
            if self.gather_buf is None or self.gather_buf.numel() < numel:
                size = max(numel, 0 if self.gather_buf is None else 2 * self.gather_buf.numel())
                self.gather_buf, self._gather_handle, self._gather_bases = \
                    self._symmetric(size, torch.float32)
                self._gather_views.clear()
            full = self.gather_buf[:numel].view(self.world, B, n)
            peers = torch.tensor([b + 4 * self.rank * B * n for b in self._gather_bases],
                                 dtype=torch.int64, device=self.device)
            views = self._gather_views[(B, n)] = (full, full[self.rank], peers)
        return views

    def gather_exchange(self, cond: torch.Tensor) -> None:
        """The exchange after rows_gather's stores, only where some cond[i] != 0 (cond equal
        on every rank: a rank skips it only when every rank does). Its signal and bounded
        wait are the records exchange's (kernels/exchange_wait.py): a peer that does not
        arrive makes this rank give up (calls < 0) and raise ExchangeTimeout at its next
        call; kernels reading the buffer check calls first."""
        signal_and_wait(self.flags, self.peer_flags, self.calls, self.status, self.buf,
                        self.parity, self.ptrs, rank=self.rank, world=self.world, slot_numel=0,
                        parity_stride=0, timeout_s=self.timeout.total_seconds(), cond=cond)

    def check(self, synchronize: bool = False) -> None:
        if synchronize and self.flags is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        if self.failure is None and self.flags is not None and any(self._status_words):
            missing = [int(p) for p in self._status.nonzero()[0]]
            call = int(self._status.max())
            self._fail(f"{self._who()}: peer rank(s) {missing} did not reach exchange #{call} "
                       f"within {self.timeout.total_seconds():g} s, or gave up on it (the device "
                       "wait gave up; that call and any this rank ran after it returned "
                       "degenerate rows: token -1, log-prob NaN, log Z NaN)", missing, call)
        super().check()


def signal_and_wait(flags, peer_flags, calls, status, buf, parity, peer_ptrs, *, rank: int,
                    world: int, slot_numel: int, parity_stride: int, timeout_s: float,
                    cond: torch.Tensor | None = None) -> None:
    """One launch of kernels/exchange_wait.py (its docstring has the protocol). cond (int32
    [n], equal on every rank): exchange only if some cond[i] != 0, else do nothing."""
    from .kernels.exchange_wait import signal_wait_kernel
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    n = 0 if cond is None else cond.numel()
    replay.run_named(signal_wait_kernel, (1,), dict(num_warps=1), flags_ptr=flags,
                     peer_flags_ptr=peer_flags, calls_ptr=calls, status_ptr=status, buf_ptr=buf,
                     parity_ptr=parity, peer_ptrs_ptr=peer_ptrs, rank=rank, world=world,
                     slot_numel=slot_numel, parity_stride=parity_stride,
                     timeout_ns=int(timeout_s * 1e9),
                     cond_ptr=cond if cond is not None else status, cond_n=n,
                     WORLD_P2=triton.next_power_of_2(world), USE_CLOCK=not interpreted,
                     BLOCK=1024, COND=cond is not None,
                     BLOCK_C=min(1024, triton.next_power_of_2(max(1, n))))


def symm_mem_usable(group, device) -> tuple[bool, str]:
    """Whether every rank of the group can store into every peer's memory: all ranks on one
    host, one GPU each, every pair of GPUs P2P-capable. Collective: every
    rank of the group calls it (make_transport does, at construction). tpsample only uses
    symmetric memory's P2P pointers, never NVLink multicast; hosts where multicast must stay
    off set TORCH_SYMM_MEM_DISABLE_MULTICAST=1 for torch."""
    if device.type != "cuda":
        return False, "tensors are on the CPU"
    try:
        import torch.distributed._symmetric_memory as symm_mem  # noqa: F401
    except ImportError as e:
        return False, f"torch symmetric memory unavailable ({e})"
    world = dist.get_world_size(group)
    where = [None] * world
    dist.all_gather_object(where, (socket.gethostname(), device.index), group=group)
    if len({host for host, _ in where}) > 1:
        return False, "ranks span several hosts"
    indices = [index for _, index in where]
    if len(set(indices)) < world:
        return False, "ranks share a GPU (torch symmetric memory needs one GPU per rank)"
    for index in indices:
        if index != device.index and not torch.cuda.can_device_access_peer(device.index, index):
            return False, f"GPU {device.index} cannot reach GPU {index} over P2P"
    return True, "CUDA tensors, one GPU per rank on one host, all reachable over P2P"


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
