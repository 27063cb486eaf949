"""Replaying the Triton launches of a recorded call with new per-call tensors.

A decode step repeats the same call: same batch size, same sampler, new hidden states and
parameters. `fn[grid](...)` re-binds and re-specializes every argument each time (26–36 µs
per launch on the lent H100/H200 hosts, against 8 µs for the compiled kernel's own launcher:
`python -m tpsample.probe --host`), which makes an eager tensor-parallel call host-bound.

`record()` logs the launches tpsample.fused makes during one call (compiled kernel, grid,
arguments, constexprs). `Replay` re-issues them through the compiled kernels, with the
tensors that change per call substituted by name. It is only valid while everything Triton
specialized on is unchanged — every scalar argument and each pointer's 16-byte alignment —
so the caller keys replays by those (see VocabParallelSampler).
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import os

import torch
from triton import knobs
from triton.runtime import driver

from . import fused
from .kernels import (fused_sample_records_kernel, fused_sample_records_persistent_kernel,
                      gluon_pingpong, gluon_sample, logits_records_kernel)

# TPSAMPLE_REPLAY=0 turns the launch replay off (A/B timing, debugging)
ENABLED = os.environ.get("TPSAMPLE_REPLAY", "1") != "0"

# what a recorded stage 1 may consist of: launches and steps Replay knows how to re-issue
REPLAYABLE_STAGE1 = (fused_sample_records_kernel, fused_sample_records_persistent_kernel,
                     logits_records_kernel, fused.logits_fp32) + (
                         (gluon_sample.ws_records_kernel, gluon_pingpong.pp_records_kernel)
                         if gluon_sample.AVAILABLE else ())


@contextlib.contextmanager
def record():
    """Collect the launches tpsample.fused makes inside the block (on this thread) into the
    yielded list."""
    log: list = []
    previous = getattr(fused.RECORDER, "log", None)
    fused.RECORDER.log = log
    try:
        yield log
    finally:
        fused.RECORDER.log = previous


def current_stream(device_index: int) -> int:
    """The raw handle of torch's current stream on that device (as Triton launches use)."""
    return driver.active.get_current_stream(device_index)


def tensor_key(tensors) -> tuple:
    """What a replay of a call depends on among its per-call tensors: each one's 16-byte
    alignment (Triton specializes pointers on it), dtype, and which of them are one object
    (the index of its first occurrence)."""
    key = []
    for t in tensors:
        if t is None:
            key.append(None)
            continue
        first = 0
        while tensors[first] is not t:
            first += 1
        key.append((t.data_ptr() % 16 == 0, t.dtype, first))
    return tuple(key)


class Replay:
    """The launches of one recorded call. named: {name: tensor of the recorded call}; each
    launch argument that IS one of them becomes a slot filled from replay(**tensors). A torch
    step (fused.run_step) is re-run with its slots filled, and its result fills the slots of
    the launches that took the recorded result. A TMA descriptor argument whose base is one
    of them is passed rebased on the new tensor (_Rebased; shape and strides are part of the
    call key). No slot keeps a tensor between calls."""

    def __init__(self, launches: list, named: dict[str, torch.Tensor]):
        by_id: dict = {}
        for n, t in named.items():  # a tensor passed under two names fills from the first
            if t is not None:
                by_id.setdefault(id(t), n)
        self.launches = []
        for k, (fn, compiled, grid, args, extra) in enumerate(launches):
            slots = [(i, by_id[id(a)], None) for i, a in enumerate(args) if id(a) in by_id]
            slots += [(i, by_id[id(a.base)], _unbased(a)) for i, a in enumerate(args)
                      if _is_descriptor(a) and id(a.base) in by_id]
            args = [None if any(i == j for j, _, _ in slots) else a for i, a in enumerate(args)]
            if compiled is None:  # a torch step; extra is its recorded result
                by_id[id(extra)] = f"step{k}"
                self.launches.append((fn, None, args, slots, f"step{k}"))
                continue
            params = list(inspect.signature(fn.fn).parameters.values())[len(args):]
            tail = tuple(extra.get(p.name, p.default) for p in params)
            grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
            self.launches.append((fn, compiled, args + list(tail), slots, grid3))

    @staticmethod
    def usable() -> bool:
        """No launch hooks registered (Triton 3.6 keeps them as HookChain objects, never None;
        profilers such as proton add to them and then need Triton's normal launch path)."""
        return not knobs.runtime.launch_enter_hook.calls and not knobs.runtime.launch_exit_hook.calls

    def __call__(self, stream: int, **tensors):
        """Launch on `stream` (a raw CUDA stream handle, see current_stream)."""
        for fn, compiled, recorded, slots, extra in self.launches:
            args = list(recorded)  # per call: concurrent replays (threads) never share it
            for i, name, desc in slots:
                if desc is None:
                    args[i] = tensors[name]
                else:
                    args[i] = _Rebased(tensors[name], desc)
            if compiled is None:
                tensors[extra] = fn(*args)
            else:
                gx, gy, gz = extra
                compiled.run(gx, gy, gz, stream, compiled.function, compiled.packed_metadata,
                             None, None, None, *args)


def _unbased(desc):
    """A copy of a descriptor without its tensor (the template of a slot keeps none)."""
    template = copy.copy(desc)
    template.base = None
    return template


class _Rebased:
    """A slot's descriptor on this call's tensor, for Triton's launcher: `base` is the new
    tensor and every other field (shape, strides, block shape, layout, padding, and whatever
    a Triton version adds) reads through to the template. ~5 µs cheaper than copying the
    dataclass, whose __post_init__ re-validates everything per call."""
    __slots__ = ("base", "_template")

    def __init__(self, base, template):
        self.base = base
        self._template = template

    def __getattr__(self, name):  # only for names not in __slots__
        if name == "_template":  # not set yet (e.g. a copy under construction): no recursion
            raise AttributeError(name)
        return getattr(self._template, name)


def _is_descriptor(a) -> bool:
    """A host-side TMA descriptor (Triton's or Gluon's TensorDescriptor dataclass)."""
    return type(a).__name__ == "TensorDescriptor" and isinstance(getattr(a, "base", None),
                                                                  torch.Tensor)


def reduce_outputs(B: int, num_samples: int, device) -> dict:
    """Fresh stage-2 outputs for a replayed call (the kernel writes tokens b·S + s)."""
    shape = (B,) if num_samples == 1 else (B, num_samples)
    return dict(tokens=torch.empty(shape, dtype=torch.int64, device=device),
                logprobs=torch.empty(shape, dtype=torch.float32, device=device),
                logz=torch.empty(B, dtype=torch.float32, device=device))


class CallReplays:
    """The (stage 1, stage 2) Replays of recorded calls by call key, at most `limit` of them
    (all are dropped when full: keys change only when shapes or options do)."""

    def __init__(self, limit: int = 64):
        self.limit = limit
        self.calls: dict = {}

    def __len__(self) -> int:  # tests and debugging: how many calls are kept
        return len(self.calls)

    def get(self, key):
        return self.calls.get(key)

    def clear(self) -> None:
        self.calls.clear()

    def add(self, key, log1: list, named1: dict, log2: list, named2: dict) -> None:
        """Keep the call if stage 1 consists only of launches Replay can re-issue."""
        if key is None or not log1 or not all(entry[0] in REPLAYABLE_STAGE1 for entry in log1):
            return
        if len(self.calls) >= self.limit:
            self.calls.clear()
        self.calls[key] = (Replay(log1, named1), Replay(log2, named2))
