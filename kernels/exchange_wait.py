"""The symmetric-memory exchange's signal and bounded wait (one program, between stages).

Each rank owns, in symmetric memory, a flag per peer: flags[p] is the number of exchanges
rank p has entered, as far as this rank has seen, or BROKEN once rank p gave up on one. A
call's exchange, launched after stage 1 on the same stream (so every fan-out store of this
rank is done):

  1. epoch = calls[0] + 1 (calls: this rank's count of its own exchanges, device memory,
     so CUDA-graph replays count too; negative once this rank gave up: go to 4 at once);
  2. signal: store epoch into flags[rank] of every peer, with release semantics at system
     scope (the peer that reads it also sees this rank's records);
  3. wait: poll this rank's own flags with acquire loads until flags[p] >= epoch for every
     peer p, or any peer's flag is BROKEN (the call is lost: no use waiting for the
     others), or timeout_ns have passed on the GPU's global timer;
  4. if every peer arrived: calls[0] = epoch. Else this rank gives up, and says so:
     - status[p] = epoch for each peer p that did not arrive (status: int32 [world], pinned
       host memory the host reads without a synchronisation; kept from the first failure);
     - the peers' records slots of this call's buffer are filled with NaN, so stage 2
       returns the degenerate row for every row (token -1, log-prob NaN, log Z NaN);
     - BROKEN goes into flags[rank] of every peer: a peer that arrives late, or is still
       waiting, gives up too instead of pairing its call with records this rank no longer
       keeps in step (without it a late peer would pass, since this rank did signal epoch);
     - the fan-out addresses (peer_ptrs_ptr [2, world], read by stage 1 on the device) all
       become this rank's own slot, so calls this rank runs before its host notices never
       store into a peer that may still be reducing;
     - calls[0] = -epoch: later exchanges skip steps 2-3 and give the degenerate rows.
     Then the kernel ends normally: no trap, the CUDA context stays usable.

Passing call k's exchange implies every peer finished its stage 2 of call k - 1 (its
signal k is issued after it on its stream), which is what lets the records alternate
between two buffers (tpsample/transport.py). Under TRITON_INTERPRET=1 the global timer is
unavailable and the bound counts polls as 1 µs each.

A conditional exchange (COND: the filtered-sampling fallback's gather, after its logits kernel
stored its shard into every rank) runs the same protocol only when some cond[i] != 0; cond is
equal on every rank, so either every rank takes that epoch or none does, and the records
exchanges stay in step. It passes slot_numel 0: nothing to poison, the rows' reader checks
calls[0] < 0 instead.
"""
import triton
import triton.language as tl

BROKEN = tl.constexpr(-1)  # a flag value no epoch takes (epochs count from 1)


@triton.jit
def _now_ns(USE_CLOCK: tl.constexpr, polls):
    if USE_CLOCK:
        return tl.extra.cuda.globaltimer()
    else:
        return polls * 1000


@triton.jit
def _poll(flags_ptr, p, ok, epoch):
    """(peers not arrived yet, peers that gave up) among the world's flags."""
    seen = tl.atomic_add(flags_ptr + p, 0, mask=ok, sem="acquire", scope="sys")
    return tl.where(ok, seen < epoch, False), tl.where(ok, seen < 0, False)


@triton.jit
def _store_peers(flags_ptr, peer_flags_ptr, p, ok, value):
    """flags[rank] of every peer = value (release, system scope)."""
    # a peer's flag as an element offset from flags_ptr (a pointer made from an integer)
    delta = (tl.load(peer_flags_ptr + p, mask=ok, other=0)
             - flags_ptr.to(tl.int64, bitcast=True)) >> 3
    tl.atomic_xchg(flags_ptr + delta, tl.zeros_like(delta) + value, mask=ok, sem="release",
                   scope="sys")


@triton.jit
def signal_wait_kernel(flags_ptr, peer_flags_ptr, calls_ptr, status_ptr, buf_ptr, parity_ptr,
                       peer_ptrs_ptr, rank, world, slot_numel, parity_stride, timeout_ns,
                       cond_ptr, cond_n, WORLD_P2: tl.constexpr, USE_CLOCK: tl.constexpr,
                       BLOCK: tl.constexpr, COND: tl.constexpr = False,
                       BLOCK_C: tl.constexpr = 16):
    # flags_ptr: int64 [world], this rank's flags (symmetric memory); peer_flags_ptr: int64
    # [world], the address of flags[rank] in each peer's flags; calls_ptr: int64 [1];
    # status_ptr: int32 [world]; buf_ptr: this rank's records buffer (two halves of
    # parity_stride floats, slot p of a half at p * slot_numel); parity_ptr[0]: the half
    # this call's stage 1 wrote; peer_ptrs_ptr: int64 [2, world], stage 1's fan-out addresses.
    # COND: an exchange only when some cond[i] != 0 (cond: int32 [cond_n], equal on every
    # rank, as the filtered-sampling fallback's flags are), else nothing at all.
    go = True
    if COND:
        n = tl.cast(0, tl.int32)
        for i0 in range(0, cond_n, BLOCK_C):
            i = i0 + tl.arange(0, BLOCK_C)
            n += tl.sum((tl.load(cond_ptr + i, mask=i < cond_n, other=0) != 0).to(tl.int32))
        go = n > 0
    if go:
        _signal_wait(flags_ptr, peer_flags_ptr, calls_ptr, status_ptr, buf_ptr, parity_ptr,
                     peer_ptrs_ptr, rank, world, slot_numel, parity_stride, timeout_ns,
                     WORLD_P2, USE_CLOCK, BLOCK)


@triton.jit
def _signal_wait(flags_ptr, peer_flags_ptr, calls_ptr, status_ptr, buf_ptr, parity_ptr,
                 peer_ptrs_ptr, rank, world, slot_numel, parity_stride, timeout_ns,
                 WORLD_P2: tl.constexpr, USE_CLOCK: tl.constexpr, BLOCK: tl.constexpr):
    p = tl.arange(0, WORLD_P2)
    ok = p < world
    calls = tl.load(calls_ptr)
    gave_up = calls < 0
    epoch = tl.abs(calls) + 1
    missing = ok & (p != rank)  # what a rank that gave up earlier reports (status is kept)
    if not gave_up:
        _store_peers(flags_ptr, peer_flags_ptr, p, ok, epoch)
        missing, broken = _poll(flags_ptr, p, ok, epoch)
        polls = tl.full([], 0, tl.int64)
        start = _now_ns(USE_CLOCK, polls)
        waiting = (tl.sum(missing.to(tl.int32)) > 0) & (tl.sum(broken.to(tl.int32)) == 0)
        while waiting:
            missing, broken = _poll(flags_ptr, p, ok, epoch)
            polls += 1
            in_time = _now_ns(USE_CLOCK, polls) - start <= timeout_ns
            waiting = ((tl.sum(missing.to(tl.int32)) > 0) & (tl.sum(broken.to(tl.int32)) == 0)
                       & in_time)
    failed = tl.sum(missing.to(tl.int32)) > 0
    if failed:
        if not gave_up:
            tl.store(status_ptr + p, epoch.to(tl.int32), mask=missing)
            _store_peers(flags_ptr, peer_flags_ptr, p, ok, BROKEN)
            for k in range(0, 2):
                own = tl.load(peer_ptrs_ptr + k * world + rank)
                tl.store(peer_ptrs_ptr + k * world + p, tl.zeros_like(p).to(tl.int64) + own, mask=ok)
        tl.store(calls_ptr, -epoch)
        base = buf_ptr + tl.load(parity_ptr).to(tl.int64) * parity_stride
        nan = tl.full((BLOCK,), float("nan"), tl.float32)
        for q in range(0, world):
            if tl.sum(tl.where(p == q, missing.to(tl.int32), 0)) > 0:
                for i in range(0, slot_numel, BLOCK):
                    at = i + tl.arange(0, BLOCK)
                    tl.store(base + q * slot_numel + at, nan, mask=at < slot_numel)
    else:
        tl.store(calls_ptr, epoch)
