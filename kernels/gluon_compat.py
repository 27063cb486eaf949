"""The Gluon API the Hopper kernels (gluon_sample.py, gluon_pingpong.py) are written against,
one spelling for every Triton they support.

Gluon is experimental and renames calls between releases. The kernels call only the names
below; this module maps each to the installed Triton's spelling, so there is one copy of
each kernel for all versions. What changed, 3.6 → 3.9 (from the releases' sources):

    name here          3.6                               3.7                 3.8, 3.9
    thread_barrier     gl.thread_barrier()               gl.barrier()        gl.barrier()
    tma_load           tma.async_copy_global_to_shared   (the same)          tma.async_load
                                                                            (the old name raises
                                                                            in 3.9)
    reinterpret(s, …)  s._reinterpret(…)                 (the same)          3.9: s.reinterpret(…)

Every other call the kernels make (layouts, shared-memory allocation, mbarrier, wgmma,
warp_specialize with a list of (function, args) and per-worker warps and registers,
NVMMASharedLayout.get_default_for, the host TensorDescriptor) has the same signature on all
four. SUPPORTED lists the versions the kernels were compiled with (tools/tests/test_sass.py
checks them for sm_90 without a GPU); on any other version, or a Triton without Gluon,
AVAILABLE is False and tpsample.plan takes the cuBLAS + records-pass path and says why.
"""
import triton

SUPPORTED = ((3, 6), (3, 7), (3, 8), (3, 9))
TRITON_VERSION = tuple(int(x) for x in triton.__version__.split(".")[:2])

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAS_GLUON = True
except ImportError:  # Triton without Gluon's Hopper API (< 3.4)
    HAS_GLUON = False

AVAILABLE = HAS_GLUON and TRITON_VERSION in SUPPORTED

if HAS_GLUON:
    # gl.thread_barrier was renamed gl.barrier (which takes cluster=False: the same CTA barrier)
    thread_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
    # tma.async_copy_global_to_shared(desc, coord, barrier, dest) became tma.async_load with
    # the same positional arguments
    tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

    from triton.experimental.gluon.language._core import builtin as _builtin

    @_builtin
    def reinterpret(smem, dtype, shape, layout, _semantic=None):
        """The shared-memory descriptor `smem` viewed as (dtype, shape, layout): the method
        is public from 3.9 on (smem.reinterpret), private before (smem._reinterpret)."""
        method = smem.reinterpret if hasattr(smem, "reinterpret") else smem._reinterpret
        return method(dtype, shape, layout, _semantic=_semantic)


def unavailable_reason() -> str | None:
    """Why the Gluon kernels cannot run with the installed Triton, or None if they can."""
    if not HAS_GLUON:
        return f"Triton {triton.__version__} has no Gluon Hopper API"
    if TRITON_VERSION not in SUPPORTED:
        allowed = ", ".join(f"{a}.{b}" for a, b in SUPPORTED)
        return (f"the Gluon kernels are built for Triton {allowed}; this is Triton "
                f"{triton.__version__}")
    return None
