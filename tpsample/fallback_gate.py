"""A one-GPU filtered call's exact fallback, skipped in its CUDA graph when no row needs it.

A filtered call whose fallback runs on the device launches the fallback's kernels in every
call, flagged rows or not (the logits kernel of kernels/filter_fallback.py where the rows'
logits are recomputed, kernels/filter_cut.py's steps, up to nine, then the rows kernel):
where no row is flagged, each program of each launch only scans the flags. Where the
candidates certify every row (kept sets of a few hundred tokens, the usual case) those
launches are all the fallback costs. In the call's own CUDA graph
(tpsample/call_graphs.py) they are captured into the body of a conditional IF node instead
(CUDA >= 12.4), which runs only when the call's gate is set.

The gate: bool [1], one per pipeline and stream, false at the start of every call. The
filter kernel (kernels/filter_records.py, GATE) sets it when it flags a row, and the
fallback's rows kernel (kernels/filter_fallback.py, GATE) clears it; a call whose body is
skipped never set it. A stream runs its calls in order, so a graph's condition is its own
filter kernel's. Calls outside a graph launch every kernel as before (the gate is set and
cleared, read by nobody); the kernels in the body still test the flags themselves, so a
gate that stayed set would cost only the launches it could have skipped.

The node is made through cuda.bindings (torch 2.11's CUDAGraph has no conditional nodes):
open_body adds, to the graph the current stream is capturing, a one-thread kernel that sets
the node's condition from the gate (cudaGraphSetConditional is a function of the CUDA device
runtime, so the kernel is NVRTC's PTX linked with libcudadevrt.a by nvJitLink, once per
process and architecture), then the node, and captures what follows into its body from a
stream of its own, which it makes torch's current stream; a replay's launches follow it
there (tpsample/replay.py: a step's `next_stream`). close_body ends that capture. Nothing
is allocated between the two (the body's workspace is allocated before open_body): the
body's stream is not the graph's capture, so torch's allocator would not put its blocks in
the graph's pool.

On the typical head (H100, D = 4096, top-p 0.9, same run) the node saves 11 / 13 / 19 µs
per call at B = 16 / 64 / 256 (tools/onegpu.sh gate). TPSAMPLE_FALLBACK_GATE=0 captures the
launches without the conditional node, as does a process without cuda.bindings or the CUDA
wheels
(nvidia-cuda-nvrtc, nvidia-nvjitlink, nvidia-cuda-runtime: torch's CUDA build installs
them). A capture that fails after opening a node turns the gate off for the process, with
one warning, and is tried again without it (tpsample/call_graphs.py).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import os
import threading
import warnings

import torch

from . import knobs

SET_CONDITION = rb'''
typedef unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __attribute__((cudart_builtin)) void cudaGraphSetConditional(
    cudaGraphConditionalHandle handle, unsigned int value);
extern "C" __global__ void set_condition(cudaGraphConditionalHandle handle,
                                         const unsigned char* gate) {
    cudaGraphSetConditional(handle, *gate != 0);
}
'''

_CAPTURE = threading.local()  # .nodes: a stack (a Node, or None where nothing opened);
# .maker: the node maker of the capture in progress here (None: no node); .any: whether the
# last capture on this thread opened a node; .moved_to: the stream handle the last gate step
# moved a replay's launches to (None: they stay where they were)
FAILED: str | None = None  # the error of a capture with a node: no more nodes in this process
_KERNELS: dict = {}  # architecture -> (CUfunction, CUmodule) of set_condition
_BODY_STREAMS: dict = {}  # (thread, device index) -> torch.cuda.ExternalStream of our own


class Gates:
    """The gates of one pipeline, one per stream (a raw stream handle; None off CUDA)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.by_stream: dict = {}

    def get(self, stream) -> torch.Tensor:
        gate = self.by_stream.get(stream)
        if gate is None:
            gate = self.by_stream[stream] = torch.zeros(1, dtype=torch.bool, device=self.device)
        return gate


def _check(result):
    """A cuda.bindings call's values after its error code, raising on an error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA call failed: {err!r}")
    return values[0] if len(values) == 1 else values


@functools.cache
def available() -> str | None:
    """None where conditional nodes can be made here, else why not (asked once)."""
    try:
        from cuda.bindings import driver, nvjitlink, nvrtc, runtime  # noqa: F401
    except ImportError as e:
        return f"cuda.bindings is not importable ({e})"
    if not _device_runtime_library():
        return "libcudadevrt.a not found (the nvidia-cuda-runtime wheel, or CUDA_HOME)"
    return None


def _device_runtime_library() -> str | None:
    found = []
    try:
        import nvidia
        found = [p for d in nvidia.__path__
                 for p in sorted(glob.glob(os.path.join(d, "*", "lib", "libcudadevrt.a")))]
    except ImportError:
        pass
    found += glob.glob(os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "lib64",
                                    "libcudadevrt.a"))
    return found[0] if found else None


def set_condition_cubin(arch: str) -> bytes:
    """The one-thread kernel's cubin for `arch` (e.g. "sm_90"): NVRTC's PTX linked with the
    device runtime library (runs without a GPU)."""
    from cuda.bindings import nvjitlink, nvrtc
    prog = _check(nvrtc.nvrtcCreateProgram(SET_CONDITION, b"set_condition.cu", 0, [], []))
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"-rdc=true"]
        _check(nvrtc.nvrtcCompileProgram(prog, len(opts), opts))
        ptx = b" " * _check(nvrtc.nvrtcGetPTXSize(prog))
        _check(nvrtc.nvrtcGetPTX(prog, ptx))
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    h = nvjitlink.create(1, [f"-arch={arch}"])
    try:
        nvjitlink.add_data(h, nvjitlink.InputType.PTX, ptx, len(ptx), "set_condition.ptx")
        nvjitlink.add_file(h, nvjitlink.InputType.LIBRARY, _device_runtime_library())
        nvjitlink.complete(h)
        cubin = bytearray(nvjitlink.get_linked_cubin_size(h))
        nvjitlink.get_linked_cubin(h, cubin)
    finally:
        nvjitlink.destroy(h)
    return bytes(cubin)


class Node:
    """An IF node in the graph that `stream` (a raw handle) is capturing, on `gate`;
    enter() adds it and moves the capture of what follows into its body, on `body` (a torch
    stream), which becomes torch's current stream; leave() ends the body's capture and
    makes `outer` current again."""

    def __init__(self, gate: torch.Tensor, stream: int, body, outer, function):
        self.gate, self.stream, self.body, self.outer = gate, stream, body, outer
        self.function = function

    def enter(self) -> None:
        from cuda.bindings import driver, runtime as rt
        hs = rt.cudaStream_t(self.stream)
        graph = _check(rt.cudaStreamGetCaptureInfo(hs))[2]
        handle = _check(rt.cudaGraphConditionalHandleCreate(graph, 0, 0))
        args = ((int(handle), self.gate.data_ptr()), (ctypes.c_ulonglong, ctypes.c_void_p))
        _check(driver.cuLaunchKernel(self.function, 1, 1, 1, 1, 1, 1, 0,
                                     driver.CUstream(self.stream), args, 0))
        _, _, graph, deps, edges, n = _check(rt.cudaStreamGetCaptureInfo(hs))
        params = rt.cudaGraphNodeParams()
        params.type = rt.cudaGraphNodeType.cudaGraphNodeTypeConditional
        params.conditional.handle = handle
        params.conditional.type = rt.cudaGraphConditionalNodeType.cudaGraphCondTypeIf
        params.conditional.size = 1
        node = _check(rt.cudaGraphAddNode(graph, deps, edges, n, params))
        _check(rt.cudaStreamUpdateCaptureDependencies(
            hs, [node], None, 1,
            rt.cudaStreamUpdateCaptureDependenciesFlags.cudaStreamSetCaptureDependencies))
        _check(rt.cudaStreamBeginCaptureToGraph(
            rt.cudaStream_t(self.body.cuda_stream), params.conditional.phGraph_out[0], None,
            None, 0, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal))
        torch.cuda.set_stream(self.body)

    def leave(self) -> None:
        from cuda.bindings import runtime as rt
        _check(rt.cudaStreamEndCapture(rt.cudaStream_t(self.body.cuda_stream)))
        torch.cuda.set_stream(self.outer)


class NodeMaker:
    """Makes the Nodes of captures on one device: the set kernel loaded, a body stream of
    this thread's (both made before the capture begins)."""

    def __init__(self, device: torch.device):
        from cuda.bindings import driver, runtime as rt
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        arch = f"sm_{major}{minor}"
        with torch.cuda.device(index):
            if arch not in _KERNELS:
                torch.zeros(1, device=device)  # (torch's primary context current here)
                module = _check(driver.cuModuleLoadData(set_condition_cubin(arch)))
                _KERNELS[arch] = (_check(driver.cuModuleGetFunction(module, b"set_condition")),
                                  module)
            key = (threading.get_ident(), index)
            if key not in _BODY_STREAMS:
                handle = _check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking))
                _BODY_STREAMS[key] = torch.cuda.ExternalStream(int(handle), device=index)
        self.function = _KERNELS[arch][0]
        self.body = _BODY_STREAMS[key]

    def __call__(self, gate: torch.Tensor) -> Node:
        outer = torch.cuda.current_stream(gate.device)
        return Node(gate, outer.cuda_stream, self.body, outer, self.function)


@contextlib.contextmanager
def capturing(device: torch.device | None):
    """Around a CUDA-graph capture on `device` (entered before it begins; None: a capture
    without a gate, which prepares no node): within the block, open_body puts the launches
    up to close_body into a conditional node of the graph."""
    global FAILED
    before = (getattr(_CAPTURE, "maker", None), getattr(_CAPTURE, "nodes", None),
              getattr(_CAPTURE, "moved_to", None))
    maker = None
    gated = device is not None and device.type == "cuda"
    if knobs.FALLBACK_GATE and FAILED is None and gated:
        FAILED = available()  # (without the CUDA wheels: no node, silently)
        if FAILED is None:
            try:
                maker = NodeMaker(device)
            except Exception as e:  # noqa: BLE001 - the graphs work without the node
                FAILED = f"{type(e).__name__}: {e}"
                warnings.warn(f"tpsample: no CUDA-graph conditional node could be prepared "
                              f"({FAILED}); filtered calls' graphs run their exact fallback's "
                              "launches in every replay", RuntimeWarning, stacklevel=3)
    _CAPTURE.maker, _CAPTURE.nodes, _CAPTURE.moved_to = maker, [], None
    _CAPTURE.any = False
    try:
        yield
    finally:
        abandon()
        _CAPTURE.maker, _CAPTURE.nodes, _CAPTURE.moved_to = before


def abandon() -> None:
    """Ends the bodies still open on this thread (a capture that failed inside one), before
    the graph's own capture ends; nothing when none is."""
    nodes = getattr(_CAPTURE, "nodes", None) or []
    while nodes:
        node = nodes.pop()
        if node is not None:
            with contextlib.suppress(Exception):
                node.leave()
            torch.cuda.set_stream(node.outer)


def open_body(gate: torch.Tensor) -> torch.Tensor:
    """Inside capturing(): the launches from here to close_body run only when gate is set
    (their conditional node depends on the launches before). Elsewhere nothing. A torch
    step of a recorded call (tpsample/replay.py run_step): a replayed call re-runs it, and
    its launches go where next_stream says."""
    maker = getattr(_CAPTURE, "maker", None)
    node = maker(gate) if maker is not None and gate.is_cuda else None
    if node is not None:
        _CAPTURE.any = True
        node.enter()
        _CAPTURE.moved_to = node.body.cuda_stream
    if maker is not None:
        _CAPTURE.nodes.append(node)
    return gate


def close_body(gate: torch.Tensor) -> torch.Tensor:
    """Ends what open_body began (its pair in the same recorded call)."""
    if getattr(_CAPTURE, "maker", None) is not None:
        node = _CAPTURE.nodes.pop()
        if node is not None:
            node.leave()
            _CAPTURE.moved_to = node.stream
    return gate


def next_stream(stream: int) -> int:
    """After a replay's open_body or close_body step: the stream its later launches go to."""
    moved, _CAPTURE.moved_to = getattr(_CAPTURE, "moved_to", None), None
    return stream if moved is None else moved


open_body.next_stream = next_stream
close_body.next_stream = next_stream


def failed_with_node(error: Exception) -> bool:
    """After a failed capture on this thread: whether it had opened a conditional node. If
    so, no later capture in this process opens one (one warning), and the caller may try
    the capture again."""
    global FAILED
    if not getattr(_CAPTURE, "any", False):
        return False
    _CAPTURE.any = False
    FAILED = f"{type(error).__name__}: {error}"
    warnings.warn(f"tpsample: a CUDA-graph capture with a conditional node failed ({FAILED}); "
                  "filtered calls' graphs run their exact fallback's launches in every replay "
                  "instead", RuntimeWarning, stacklevel=3)
    return True
