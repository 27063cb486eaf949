"""Which way a filtered call's exact fallback goes: on the device or from the host.

The device fallback (kernels/filter_fallback.py, kernels/filter_cut.py) needs no host
synchronisation; the host's (tpsample/host_fallback.py) is faster for rows that keep
falling back without the side output. FallbackChoice keeps the device's count of fallback
rows, reads it back without blocking, and decides per call (see device_now)."""
from __future__ import annotations

import collections

import torch


class FallbackChoice:
    """The fallback path of one pipeline's filtered calls. deterministic: every rank of a
    tensor-parallel group must decide alike (a transport that gathers rows on the device):
    the count is then read at the same calls on every rank (DeterministicReads)."""

    def __init__(self, device: torch.device, deterministic: bool):
        self.device = device
        self.deterministic = deterministic
        self.host_mode = False  # see device_now
        self.device_rows = None  # int32 [1]: rows the device fallback took (lazily)
        self._seen = None
        self._copy = None
        self.reads = DeterministicReads(FALLBACK_READ_LAG, FALLBACK_READ_EVERY) \
            if deterministic else None

    def counter(self) -> torch.Tensor:
        """The device count the fallback kernels add their rows to."""
        if self.device_rows is None:
            self.device_rows = torch.zeros(1, dtype=torch.int32, device=self.device)
        return self.device_rows

    def device_now(self, hidden, in_capture: bool) -> bool:
        """Whether this call takes the device fallback (else the host's).

        The device fallback (kernels/filter_fallback.py) costs two near-empty launches when no
        row falls back, but a flagged row takes one program per row (~5 ms at V = 151936):
        rows that keep falling back (top-p alone on heavy tails) are far faster through the
        host (cuBLAS and a sort over the whole GPU). So: the device path, until a device
        fallback is seen (its count is copied back without blocking and read once ready);
        then the host path, which counts exactly, until a call has no fallback row. During
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
            if self.reads.grew():
                self.host_mode = True
                self.reads.drain()
            return not self.host_mode
        if self._seen is not None and self._seen[0].query():
            event, copy, before = self._seen
            self._seen = None
            if int(copy.item()) > before:
                self.host_mode = True
        return not self.host_mode

    def watch(self) -> None:
        """Copy the device fallback count back without blocking (read by the next calls;
        eager CUDA calls only)."""
        if self.deterministic:
            self.reads.push(self.device_rows)
            return
        if self._seen is not None:
            return
        if self._copy is None:
            self._copy = torch.zeros(1, dtype=torch.int32,
                                     pin_memory=self.device.type == "cuda")
        before = int(self._copy.item())  # the last value read back (ready)
        self._copy.copy_(self.device_rows, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._seen = (event, self._copy, before)


FALLBACK_READ_EVERY = 8  # calls between two copies of the device fallback count
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
