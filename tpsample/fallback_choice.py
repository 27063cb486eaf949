"""Which way a filtered call's exact fallback goes: on the device or from the host.

The device fallback (kernels/filter_fallback.py, kernels/filter_cut.py) needs no host
synchronisation; the host's (tpsample/host_fallback.py) is faster for rows that keep
falling back on the one-program-per-row path. FallbackChoice keeps the device's counts of
fallback rows (that path's, and the cut's fast path's), reads them back without blocking,
and decides per call whether the fallback runs on the device (see device_now) and whether
stage 1 writes the side output the cut reads (see side_output)."""
from __future__ import annotations

import collections

import torch

from . import knobs


class FallbackChoice:
    """The fallback path of one pipeline's filtered calls. deterministic: every rank of a
    tensor-parallel group must decide alike (a transport that gathers rows on the device):
    the count is then read at the same calls on every rank (DeterministicReads)."""

    def __init__(self, device: torch.device, deterministic: bool):
        self.device = device
        self.deterministic = deterministic
        self.host_mode = False  # see device_now
        self.device_rows = None  # int32 [2]: rows the device fallback took (lazily): [0]
        # one program per row (filter_fallback.py), [1] the cut's fast path (filter_cut.py)
        self._seen = None
        self._copy = None
        self.reads = DeterministicReads(FALLBACK_READ_LAG, FALLBACK_READ_EVERY) \
            if deterministic else None
        self._grew = False  # (deterministic: a growth that watch() read, for device_now)
        self.watched = 0  # calls watch() saw (see watch)
        self.side = True  # see side_output
        self.clean_calls = 0
        self.lazy_after = SIDE_LAZY_AFTER

    def forget(self) -> None:
        """Start over as a new pipeline's choice would (the device path, the side output,
        SIDE_LAZY_AFTER), keeping the device count that captured graphs add to. Under TP
        every rank must call it at the same call."""
        if self._seen is not None:  # (a copy still in flight would land after the reset)
            self._seen[0].synchronize()
            self._seen = None
        self.host_mode = False
        self.side = True
        self.clean_calls = 0
        self.lazy_after = SIDE_LAZY_AFTER
        if self.deterministic:  # (the copies in flight read as old news)
            self.reads.drain()
            self._grew = False

    def counter(self) -> torch.Tensor:
        """The device counts the fallback kernels add their rows to (launchers.
        fallback_on_device): int32 [2], the one-program-per-row path's rows, then the cut's."""
        if self.device_rows is None:
            self.device_rows = torch.zeros(2, dtype=torch.int32, device=self.device)
        return self.device_rows

    def device_now(self, hidden, in_capture: bool) -> bool:
        """Whether this call takes the device fallback (else the host's).

        The device fallback (kernels/filter_fallback.py) costs two near-empty launches when no
        row falls back, but a flagged row takes one program per row (~5 ms at V = 151936):
        rows that keep falling back (top-k past the candidates, top log-probs, samples without
        replacement) are far faster through the host (cuBLAS and a sort over the whole GPU).
        So: the device path, until such a row is seen (the count of the per-row path's rows,
        copied back without blocking and read once ready; the cut's fast path, kernels/
        filter_cut.py, counts its rows apart: they are fast on the device, so a top-p row
        of a call with a per-row top-k tensor does not send it to the host); then the host
        path, which counts exactly, until a call has no flagged row for the per-row path. During
        CUDA-graph capture always the device path. Both are exact; their tokens agree up to
        fp32 near-ties (the logits are computed differently). Under TP (a transport that
        gathers rows on the device) every rank must take the same path, so the count is read
        at the same calls on every rank (DeterministicReads: a copy every 8th call, read two
        copies later), and the switch comes up to ~24 calls after rows start falling back."""
        if not hidden.is_cuda or in_capture:
            return True
        if self.deterministic:  # every rank must decide alike
            if self.host_mode:
                return False
            if self._grew or self.reads.grew():
                self._grew = False
                self.host_mode = True
                self.reads.drain()
            return not self.host_mode
        self._poll()
        return not self.host_mode

    def side_output(self, hidden, in_capture: bool) -> bool:
        """Whether this call, whose rows may take the cut's fast path (top-p / min-p rows
        without a top-k, one device: filters.cut_rows_possible), has its stage 1
        write the side output, the rows' fp32 logits (B·V·4 bytes: ~7 % of the call at
        B = 64), which its flagged rows are redone from; without it they are
        recomputed from W (kernels/filter_fallback.py: one tensor-core pass over W for all
        of them, about one more W read).

        Rows are flagged only where the candidates cannot certify the kept set (large
        nuclei: flat rows), so the side output is dropped once SIDE_LAZY_AFTER calls in a
        row (counted here) saw no flagged row, and written again from the call after one is
        seen (the cut's count, read back without blocking as device_now reads its own): a
        call that drops it and then flags a row pays the recompute. Each such miss doubles
        the calls to wait the next time (up to SIDE_LAZY_AFTER_MAX), so a mix of flat and
        peaked batches settles on the side output. Always written inside the caller's
        CUDA-graph capture (its replays cannot change course), under tensor parallelism
        (every rank must decide alike) and with TPSAMPLE_LAZY_SIDE=0. Both give the same
        tokens up to fp32 near-ties (the recomputed logits are summed in another order)."""
        if self.deterministic or in_capture or not hidden.is_cuda or not knobs.LAZY_SIDE:
            return True
        self._poll()
        self.clean_calls += 1
        if self.side and self.clean_calls > self.lazy_after:
            self.side = False
        return self.side

    def _poll(self) -> None:
        """Read the count copied back by watch() once it is ready (never waits)."""
        if self._seen is not None and self._seen[0].query():
            event, copy, before = self._seen
            self._seen = None
            rows, cut_rows = copy.tolist()
            if rows > before[0]:  # (the per-row path's: the host is faster)
                self.host_mode = True
            if cut_rows > before[1]:  # (the cut's fast path's: they read the side output)
                self._flagged()

    def _flagged(self) -> None:
        """A call flagged rows: the side output from the next call on (see side_output)."""
        if not self.side:
            self.lazy_after = min(2 * self.lazy_after, SIDE_LAZY_AFTER_MAX)
        self.side = True
        self.clean_calls = 0

    def watch(self) -> None:
        """Copy the device fallback count back without blocking (read by the next calls;
        eager CUDA calls only): every LOCAL_READ_EVERY-th call at most (a copy and its event
        cost ~25 µs of host time), so a growth is seen within about that many calls."""
        if self.deterministic:  # (read here too: calls on the cut's fast path never ask
            self.reads.push(self.device_rows[:1])  # device_now, and unread copies would pile
            # up; the per-row path's count only: under TP the side output is always written)
            self._grew |= self.reads.grew()
            return
        self.watched += 1
        if self._seen is not None or self.watched % LOCAL_READ_EVERY:
            return
        if self._copy is None:
            self._copy = torch.zeros(2, dtype=torch.int32,
                                     pin_memory=self.device.type == "cuda")
        before = self._copy.tolist()  # the last values read back (ready)
        self._copy.copy_(self.device_rows, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._seen = (event, self._copy, before)


SIDE_LAZY_AFTER = 64  # calls without a flagged row before the side output is dropped
SIDE_LAZY_AFTER_MAX = 1 << 14  # (after misses: see FallbackChoice.side_output)
FALLBACK_READ_EVERY = 8  # calls between two copies of the device fallback count (TP)
LOCAL_READ_EVERY = 8  # (one device: the most often it is copied)
FALLBACK_READ_LAG = 2  # copies between a copy and its (blocking) read


class DeterministicReads:
    """A device counter (int32 [1]) read back so that every rank reads the same values at
    the same calls, whatever its timing: every `every`-th call copies it back without
    blocking, and a copy is read, waiting for it if need be, `lag` copies later.
    Tensor-parallel ranks decide alike from it (the filtered calls' fallback path, which
    every rank must take together). The host waits only when the device is lag * every
    calls behind; a copy and its event cost ~30 µs of host time, hence not every call."""

    def __init__(self, lag: int, every: int = 1):
        self.lag, self.every = lag, every
        self.calls = 0
        self.pending: collections.deque = collections.deque()  # (event, pinned copy)
        self.spare: list = []
        self.last = 0

    def push(self, counter: torch.Tensor) -> None:
        """After a call's launches: every `every`-th call, copy counter back."""
        self.calls += 1
        if self.calls % self.every:
            return
        if self.spare:
            event, copy = self.spare.pop()
        else:
            event, copy = torch.cuda.Event(), torch.zeros(1, dtype=torch.int32,
                                                          pin_memory=counter.is_cuda)
        copy.copy_(counter, non_blocking=True)
        event.record()
        self.pending.append((event, copy))

    def _read(self, keep: int) -> bool:
        grew = False
        while len(self.pending) > keep:
            event, copy = self.pending.popleft()
            event.synchronize()
            value = int(copy.item())
            grew |= value > self.last
            self.last = value
            self.spare.append((event, copy))
        return grew

    def grew(self) -> bool:
        """Whether the counter grew in the copies that are now `lag` copies old."""
        return self._read(self.lag)

    def drain(self) -> None:
        """Read every pending copy (waits for the newest)."""
        self._read(0)
