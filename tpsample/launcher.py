"""Low-overhead launches of the Triton kernels (decode calls are tiny: host time matters).

`fn[grid](...)` (JITFunction.run) re-binds every argument, computes its specialization and
the cache key and checks the kernel's globals on every call: 36 µs per launch on the H100
host, against 8 µs for the compiled kernel's own launcher (`python -m tpsample.probe --host`).
`launch` keeps the compiled kernel that Triton's first launch returned, keyed by what Triton
3.x specializes a kernel on — each tensor's dtype and 16-byte alignment, each int's value
== 1, divisibility by 16 and 32-bit range — plus the constexprs and launch options, and
calls its launcher directly afterwards. A key not seen before takes Triton's normal path.
"""
from __future__ import annotations

import inspect

import torch
from triton.runtime import driver
from triton import knobs

ENABLED = True  # False: every launch through fn[grid](...) (for A/B timing and debugging)

_HANDLES: dict = {}
_I32 = 1 << 31


def _spec(args) -> tuple:
    key = []
    for a in args:
        if a.__class__ is int:
            key.append((a == 1) | (a % 16 == 0) << 1 | (-_I32 <= a < _I32) << 2)
        else:  # a torch.Tensor (launch() only accepts tensors and ints)
            key.append((a.dtype, a.data_ptr() % 16 == 0))
    return tuple(key)


def launch(fn, grid: tuple, args: tuple, constexprs: dict, options: dict):
    """fn[grid](*args, **constexprs, **options). args: the kernel's non-constexpr arguments
    in order (CUDA tensors and ints only); constexprs: all its constexprs by name."""
    if (not ENABLED or not args[0].is_cuda or knobs.runtime.launch_enter_hook is not None
            or knobs.runtime.launch_exit_hook is not None):
        return fn[grid](*args, **constexprs, **options)
    device = driver.active.get_current_device()
    key = (fn, device, _spec(args), tuple(constexprs.items()), tuple(options.items()))
    entry = _HANDLES.get(key)
    if entry is None:
        handle = fn[grid](*args, **constexprs, **options)
        params = list(inspect.signature(fn.fn).parameters.values())[len(args):]
        _HANDLES[key] = (handle, tuple(constexprs.get(p.name, p.default) for p in params))
        return handle
    handle, tail = entry
    handle.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
               driver.active.get_current_stream(device), handle.function, handle.packed_metadata,
               None, None, None, *args, *tail)
    return handle


def clear():
    _HANDLES.clear()


__all__ = ["launch", "clear", "ENABLED"]
