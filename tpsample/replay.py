"""Replaying the Triton launches of a recorded call with new per-call tensors.

A decode step repeats the same call: same batch size, same sampler, new hidden states and
parameters. `fn[grid](...)` re-binds and re-specializes every argument each time (26–36 µs
per launch on the lent H100/H200 hosts, against 8 µs for the compiled kernel's own
launcher), which makes an eager tensor-parallel call host-bound.

The launchers (tpsample/launchers.py) launch through `run_kernel` / `run_step`; inside
`record()` those are logged (compiled kernel, grid, arguments, constexprs). `Replay`
re-issues them through the compiled kernels, with the tensors that change per call
substituted by name. It is only valid while everything Triton specialized on is unchanged —
every scalar argument and each pointer's 16-byte alignment — so the pipeline keys replays by
those (tpsample/pipeline.py).

Re-issuing goes through Triton's private launcher API (CompiledKernel.run with the packed
metadata), so it is gated: SUPPORTED is true only on the Triton versions it was tested on
and where the compiled kernel has what it calls; elsewhere every call is dispatched by
Triton as usual (same kernels, more host time). TPSAMPLE_REPLAY=0 turns it off.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import threading

import torch
import triton
from triton.runtime import driver

from . import knobs

# Triton versions whose launcher API the replay was run against on H100 (tests/gpu: replays
# equal dispatched calls, the Gluon kernels' descriptors included): 3.6 (the device image)
# and 3.7, 3.8, 3.9 (carried with tools/triton_carry.sh).
TESTED_TRITON = ((3, 6), (3, 7), (3, 8), (3, 9))
TRITON_VERSION = tuple(int(x) for x in triton.__version__.split(".")[:2])
SUPPORTED = TRITON_VERSION in TESTED_TRITON
ENABLED = knobs.REPLAY and SUPPORTED

_RECORDER = threading.local()  # the log of the record() block this thread is in, if any


def run_kernel(fn, grid, args: tuple, constexprs: dict, options: dict):
    """fn[grid](*args, **constexprs, **options), logged when inside record()."""
    compiled = fn[grid](*args, **constexprs, **options)
    log = getattr(_RECORDER, "log", None)
    if log is not None:
        log.append((fn, compiled, grid, args, constexprs))
    return compiled


_SIGNATURES: dict = {}  # id(kernel) -> (runtime parameter names in order, constexpr names)


def run_named(fn, grid, options: dict, **named):
    """run_kernel by keyword: `named` holds every runtime argument of fn, in any order, and
    the constexprs to set (the rest keep their defaults), so a parameter added to a kernel
    cannot shift the others. A missing or unknown name raises TypeError naming it."""
    sig = _SIGNATURES.get(id(fn))  # (by id: a JITFunction hashes its source's cache key)
    if sig is None:
        sig = _SIGNATURES[id(fn)] = _signature(fn)
    runtime, constexprs = sig
    missing = [n for n in runtime if n not in named]
    unknown = [n for n in named if n not in constexprs and n not in runtime]
    if missing or unknown:
        raise TypeError(f"{fn.__name__}: missing arguments {missing}, unknown {unknown}")
    return run_kernel(fn, grid, tuple(named[n] for n in runtime),
                      {n: v for n, v in named.items() if n in constexprs}, options)


def _signature(fn) -> tuple[tuple, frozenset]:
    """(runtime parameter names in order, constexpr names) of a Triton or Gluon kernel (under
    TRITON_INTERPRET=1 from its Python signature: constexprs are annotated tl.constexpr)."""
    params = getattr(fn, "params", None)
    if params is not None:
        return (tuple(p.name for p in params if not p.is_constexpr),
                frozenset(p.name for p in params if p.is_constexpr))
    sig = inspect.signature(fn.fn).parameters.values()
    const = {p.name for p in sig if "constexpr" in str(p.annotation)}
    return tuple(p.name for p in sig if p.name not in const), frozenset(const)


def run_step(fn, args: tuple):
    """fn(*args) for a torch step between launches (the hybrid's GEMM); logged as
    (fn, None, None, args, result) so a replay re-runs it and feeds its new result on. A
    step fn with a `next_stream(stream) -> stream` attribute may move a replay's later
    launches to another stream (tpsample/fallback_gate.py)."""
    result = fn(*args)
    log = getattr(_RECORDER, "log", None)
    if log is not None:
        log.append((fn, None, None, args, result))
    return result


@contextlib.contextmanager
def record():
    """Collect the launches made through run_kernel / run_step inside the block (on this
    thread) into the yielded list."""
    log: list = []
    previous = getattr(_RECORDER, "log", None)
    _RECORDER.log = log
    try:
        yield log
    finally:
        _RECORDER.log = previous


def current_stream(device_index: int) -> int:
    """The raw handle of torch's current stream on that device (as Triton launches use:
    its NVIDIA driver's get_current_stream is this function of torch's)."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def tensor_key(tensors) -> tuple:
    """What a replay of a call depends on among its per-call tensors: each one's 16-byte
    alignment (Triton specializes pointers on it), dtype, and which of them are one object
    (the index of its first occurrence)."""
    key = []
    first: dict = {}
    for i, t in enumerate(tensors):
        if t is None:
            key.append(None)
        else:
            key.append((t.data_ptr() % 16 == 0, t.dtype, first.setdefault(id(t), i)))
    return tuple(key)


class Replay:
    """The launches of one recorded call. named: {name: tensor of the recorded call}; each
    launch argument that IS one of them becomes a slot filled from replay(**tensors). A torch
    step (run_step) is re-run with its slots filled, and its result fills the slots of
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
            full = args + list(tail)
            direct = _DirectLaunch.of(compiled, full, slots, launches[k][3])  # (recorded args)
            if direct is not None:
                self.launches.append((fn, direct, None, None, grid3))
            else:
                self.launches.append((fn, compiled, full, slots, grid3))

    @staticmethod
    def usable() -> bool:
        """Enabled, and no launch hooks registered (profilers such as proton add them and
        then need Triton's normal launch path; Triton >= 3.6 keeps them as HookChain
        objects, never None)."""
        if not ENABLED:
            return False
        rt = triton.knobs.runtime
        return not any(getattr(getattr(rt, hook, None), "calls", None)
                       for hook in ("launch_enter_hook", "launch_exit_hook"))

    def __call__(self, stream: int, **tensors):
        """Launch on `stream` (a raw CUDA stream handle, see current_stream)."""
        addresses = None  # each named tensor's address, asked once for all direct launches
        for fn, compiled, recorded, slots, extra in self.launches:
            if recorded is None:  # a _DirectLaunch
                if addresses is None:
                    addresses = {n: t.data_ptr() for n, t in tensors.items()
                                 if isinstance(t, torch.Tensor)}
                compiled(extra, stream, addresses)
                continue
            args = list(recorded)  # per call: concurrent replays (threads) never share it
            for i, name, desc in slots:
                if desc is None:
                    args[i] = tensors[name]
                else:
                    args[i] = _Rebased(tensors[name], desc)
            if compiled is None:
                tensors[extra] = fn(*args)
                addresses = None  # (a step's result is a new named tensor)
                moves = getattr(fn, "next_stream", None)
                if moves is not None:  # (tpsample/fallback_gate.py: into a node's body)
                    stream = moves(stream)
            else:
                gx, gy, gz = extra
                compiled.run(gx, gy, gz, stream, compiled.function, compiled.packed_metadata,
                             None, None, None, *args)


class _DirectLaunch:
    """One recorded launch through the C function of Triton 3.6's launcher, skipping its two
    Python layers (CudaLauncher.__call__, and the wrapper that expands every host TMA
    descriptor argument per launch: ~8 µs of host time for a Gluon stage 1). The arguments
    are expanded once, as that wrapper would (make_tensordesc_arg); per call only the slots
    are filled: tensors as their addresses (for a tensor the launcher asks the driver what
    the address is on the device, cuPointerGetAttribute per argument and launch; a call's
    tensors are CUDA memory, whose address is that), and each per-call descriptor's
    CUtensorMap re-encoded for the new base (shape and strides are part of the call key). Only for kernels without scratch
    memory, on the launcher layout it was written against; else the launch goes through
    compiled.run (Replay.__call__)."""
    __slots__ = ("raw", "function", "head", "args", "tensor_slots", "desc_slots", "fill_tma")

    @staticmethod
    def of(compiled, full: list, slots: list, recorded: tuple):
        """The direct launch of `compiled` with kernel arguments `full` (None at slots),
        `slots` [(index, name, descriptor template or None)] and the recorded call's
        arguments, or None where not possible."""
        if TRITON_VERSION != (3, 6) or not knobs.DIRECT_LAUNCH:
            return None
        try:
            from triton.backends.nvidia import driver as nv
            run = compiled.run
            if run.global_scratch_size or run.profile_scratch_size:
                return None
            launch = run.launch
            if getattr(launch, "__closure__", None):  # wrap_handle_tensordesc's inner
                cells = dict(zip(launch.__code__.co_freevars,
                                 (c.cell_contents for c in launch.__closure__)))
                raw = cells["launcher"]
                desc_at = sorted(cells["tensordesc_indices"])
                meta = cells["tensordesc_meta"]
            elif type(launch).__name__ == "builtin_function_or_method":
                raw, desc_at, meta = launch, [], []
            else:
                return None
            head = (run.launch_cooperative_grid, run.launch_pdl, None, None,
                    compiled.packed_metadata, None, None, None)
        except (AttributeError, KeyError, ImportError, TypeError):
            return None
        slot_desc = {i: (name, desc) for i, name, desc in slots if desc is not None}
        slot_tensor = {i: name for i, name, desc in slots if desc is None}
        out, tensor_slots, desc_slots = [], [], []
        for i, a in enumerate(full):
            if i in desc_at:
                m = meta[desc_at.index(i)]
                if i in slot_desc:
                    name, template = slot_desc[i]
                    # (a descriptor the kernel takes apart without TMA, or fp4's padded
                    # shape: none of ours; through compiled.run)
                    if m is None or m["fp4_padded"]:
                        return None
                    expanded = nv.make_tensordesc_arg(recorded[i], m)
                    fill = (m["swizzle"], m["elem_size"],
                            nv.TMA_DTYPE_DEVICE_TO_HOST[m["elem_type"]], m["block_size"],
                            template.shape, template.strides,
                            1 if template.padding == "nan" else 0)
                    desc_slots.append((len(out), name, fill))
                    out.extend([None, *expanded[1:]])
                else:
                    out.extend(nv.make_tensordesc_arg(a, m))
            else:
                if i in slot_tensor:
                    tensor_slots.append((len(out), slot_tensor[i]))
                out.append(a)
        self = _DirectLaunch()
        self.raw, self.function, self.head = raw, compiled.function, head
        self.args, self.tensor_slots, self.desc_slots = out, tensor_slots, desc_slots
        self.fill_tma = driver.active.utils.fill_tma_descriptor if desc_slots else None
        return self

    def __call__(self, grid3, stream: int, addresses: dict) -> None:
        """Launch with the named tensors' addresses (`addresses`: {name: data_ptr()})."""
        args = list(self.args)
        for i, name in self.tensor_slots:  # (the launcher would ask the driver about each
            args[i] = addresses[name]  # tensor's address; a call's are CUDA memory)
        for i, name, (swizzle, size, dtype, block, shape, strides, pad) in self.desc_slots:
            args[i] = self.fill_tma(addresses[name], swizzle, size, dtype, block,
                                    shape, strides, pad)
        gx, gy, gz = grid3
        self.raw(gx, gy, gz, stream, self.function, *self.head, *args)


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
        """Keep the call if both stages were recorded and every launch has what Replay
        calls (Triton's launcher API: run, function, packed_metadata)."""
        if key is None or not _replayable(log1) or not _replayable(log2):
            return
        self._room()
        self.calls[key] = (Replay(log1, named1), Replay(log2, named2))

    def add_split(self, key1, log1: list, named1: dict, key2, log2: list,
                  named2: dict) -> None:
        """As add, for a call whose stage 2 depends on more than its stage 1 (filtered
        calls): key1 → (stage 1, {key2: stage 2}); add_stage2 adds stage 2s to it."""
        if key1 is None or not _replayable(log1) or not _replayable(log2):
            return
        self._room()
        self.calls[key1] = (Replay(log1, named1), {key2: Replay(log2, named2)})

    def add_stage2(self, stage2s: dict, key2, log2: list, named2: dict) -> None:
        """Another stage 2 for a stage 1 kept by add_split (stage2s: its dict)."""
        if not _replayable(log2):
            return
        if len(stage2s) >= self.limit:
            stage2s.clear()
        stage2s[key2] = Replay(log2, named2)

    def _room(self) -> None:
        if len(self.calls) >= self.limit:
            self.calls.clear()


def _replayable(log: list) -> bool:
    """Recorded launches, every one with what Replay calls (Triton's launcher API: run,
    function, packed_metadata)."""
    return bool(log) and all(compiled is None or all(hasattr(compiled, a) for a in
                                                     ("run", "function", "packed_metadata"))
                             for _, compiled, *_ in log)
