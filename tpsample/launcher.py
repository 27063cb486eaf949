"""Low-overhead launches of the Triton kernels (host time matters: decode calls are tiny).

`JITFunction.run` re-binds every argument, computes its specialization key and checks the
kernel's globals on each call: ~25 µs of Python per launch on the H100 host (probe --host
--profile). Once a kernel is compiled for one specialization, Triton's own handle for it
(`CompiledKernel[grid](*args)`) launches it directly. `launch` keeps those handles keyed by
exactly what Triton specializes on in 3.x — each tensor's dtype and 16-byte alignment, each
int's value == 1, divisibility by 16 and 32/64-bit range, the constexprs and the launch
options — so a new key always takes the normal path (and compiles or finds the kernel there).
"""
from __future__ import annotations

import inspect

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

_HANDLES: dict = {}
_SIGNATURES: dict = {}


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool) or a is None:
        return a
    if isinstance(a, int):
        return (a == 1, a % 16 == 0, -(1 << 31) <= a < (1 << 31), 0 <= a < (1 << 63))
    if isinstance(a, float):
        return float
    if isinstance(a, TensorDescriptor):
        return (a.base.dtype, tuple(a.block_shape), a.base.data_ptr() % 16 == 0)
    raise TypeError(f"launch: unsupported argument type {type(a).__name__}")


def _constexpr_order(fn):
    """Names and defaults of fn's parameters after the positional ones, in signature order."""
    sig = _SIGNATURES.get(fn)
    if sig is None:
        params = list(inspect.signature(fn.fn).parameters.values())
        sig = _SIGNATURES[fn] = [(p.name, p.default) for p in params]
    return sig


def launch(fn, grid: tuple, args: tuple, constexprs: dict, options: dict):
    """fn[grid](*args, **constexprs, **options), through the cached compiled handle when the
    arguments' specialization was seen before. args: the non-constexpr arguments, in order;
    constexprs: every constexpr by name (defaults may be omitted); options: num_warps etc."""
    if not args[0].is_cuda:  # the interpreter has no compiled handles
        return fn[grid](*args, **constexprs, **options)
    key = (fn, tuple(map(_arg_key, args)), tuple(constexprs.items()), tuple(options.items()),
           args[0].device.index)
    handle = _HANDLES.get(key)
    if handle is None:
        handle = fn[grid](*args, **constexprs, **options)
        _HANDLES[key] = handle
        return handle
    rest = [constexprs.get(name, default) for name, default in _constexpr_order(fn)[len(args):]]
    grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    handle[grid3](*args, *rest, stream=torch.cuda.current_stream(args[0].device).cuda_stream)
    return handle
