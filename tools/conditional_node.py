"""Can a CUDA graph skip a filtered call's empty fallback launches here, and what would it buy?

    python -m tools.conditional_node [--launches 10] [--replays 300] [--out DIR]

A one-GPU filtered call launches its exact fallback's steps in every call (up to ten:
kernels/filter_cut.py and the rows kernel); where no row is flagged each program only scans
the flags. This experiment, outside the library, captures a stand-in of that tail in torch
CUDA graphs and times their replays with no row flagged:

    plain   a flag kernel, then --launches probe launches (2 programs of 8 warps per SM,
            each reading the flag, as the steps scan theirs)
    gated   the flag kernel, a one-thread kernel that sets a conditional handle from the flag,
            and the probes in the body of an IF node (captured from a second stream)
    none    the flag kernel alone (the floor)

with the probes launched plainly and as programmatic dependents (PDL, as the steps are).
torch 2.11 has no conditional nodes on its CUDAGraph, so the node is made through
cuda.bindings; cudaGraphSetConditional is an extern device function of the CUDA device
runtime, so the one-thread kernel is compiled by NVRTC and linked with libcudadevrt.a by
nvJitLink (the wheels torch's CUDA build depends on: nvidia-cuda-nvrtc, nvidia-nvjitlink,
nvidia-cuda-runtime). Checks first that the body runs exactly when the flag is set (each
probe program 0 counts itself when the flag is set). Prints a table; --out writes JSON.
"""
import argparse
import ctypes
import glob
import json
import os

import torch
import triton
import triton.language as tl

SET_CONDITION = rb'''
typedef unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __attribute__((cudart_builtin)) void cudaGraphSetConditional(
    cudaGraphConditionalHandle handle, unsigned int value);
extern "C" __global__ void set_condition(cudaGraphConditionalHandle handle,
                                         const unsigned char* flag) {
    cudaGraphSetConditional(handle, *flag != 0);
}
'''


def _check(result):
    """A cuda.bindings call's values after its error code, raising on an error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA call failed: {err}")
    return values[0] if len(values) == 1 else values


def set_condition_cubin(arch: str = "sm_90") -> bytes:
    """The one-thread kernel's cubin: NVRTC's PTX linked with the device runtime library."""
    import nvidia
    from cuda.bindings import nvjitlink, nvrtc
    prog = _check(nvrtc.nvrtcCreateProgram(SET_CONDITION, b"set_condition.cu", 0, [], []))
    opts = [f"--gpu-architecture={arch}".encode(), b"-rdc=true"]
    _check(nvrtc.nvrtcCompileProgram(prog, len(opts), opts))
    ptx = b" " * _check(nvrtc.nvrtcGetPTXSize(prog))
    _check(nvrtc.nvrtcGetPTX(prog, ptx))
    libs = [p for d in nvidia.__path__ for p in glob.glob(os.path.join(d, "*", "lib", "libcudadevrt.a"))]
    libs += glob.glob(os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "lib64",
                                   "libcudadevrt.a"))
    if not libs:
        raise RuntimeError("libcudadevrt.a not found (nvidia-cuda-runtime wheel or CUDA_HOME)")
    h = nvjitlink.create(1, [f"-arch={arch}"])
    nvjitlink.add_data(h, nvjitlink.InputType.PTX, ptx, len(ptx), "set_condition.ptx")
    nvjitlink.add_file(h, nvjitlink.InputType.LIBRARY, libs[0])
    nvjitlink.complete(h)
    cubin = bytearray(nvjitlink.get_linked_cubin_size(h))
    nvjitlink.get_linked_cubin(h, cubin)
    nvjitlink.destroy(h)
    return bytes(cubin)


@triton.jit
def flag_kernel(want_ptr, flag_ptr):
    tl.store(flag_ptr, tl.load(want_ptr))


@triton.jit
def probe_kernel(flag_ptr, count_ptr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if tl.load(flag_ptr) != 0:
        if tl.program_id(0) == 0:
            tl.atomic_add(count_ptr, 1)


class Node:
    """An IF node in the graph the current torch stream is capturing: enter() launches the
    set kernel and adds the node, and makes a second stream, capturing into the node's body,
    current; leave() ends that capture and restores the stream."""

    def __init__(self, func):
        self.func = func
        self.inner = torch.cuda.Stream()  # (made before the capture)

    def enter(self, flag: torch.Tensor):
        from cuda.bindings import driver, runtime as rt
        self.outer = torch.cuda.current_stream()
        hs = rt.cudaStream_t(self.outer.cuda_stream)
        _, _, graph, _, _, _ = _check(rt.cudaStreamGetCaptureInfo(hs))
        handle = _check(rt.cudaGraphConditionalHandleCreate(graph, 0, 0))
        args = ((int(handle), flag.data_ptr()), (ctypes.c_ulonglong, ctypes.c_void_p))
        _check(driver.cuLaunchKernel(self.func, 1, 1, 1, 1, 1, 1, 0,
                                     driver.CUstream(self.outer.cuda_stream), args, 0))
        _, _, graph, deps, edges, n = _check(rt.cudaStreamGetCaptureInfo(hs))
        params = rt.cudaGraphNodeParams()
        params.type = rt.cudaGraphNodeType.cudaGraphNodeTypeConditional
        params.conditional.handle = handle
        params.conditional.type = rt.cudaGraphConditionalNodeType.cudaGraphCondTypeIf
        params.conditional.size = 1
        node = _check(rt.cudaGraphAddNode(graph, deps, edges, n, params))
        body = params.conditional.phGraph_out[0]
        _check(rt.cudaStreamUpdateCaptureDependencies(
            hs, [node], None, 1,
            rt.cudaStreamUpdateCaptureDependenciesFlags.cudaStreamSetCaptureDependencies))
        _check(rt.cudaStreamBeginCaptureToGraph(
            rt.cudaStream_t(self.inner.cuda_stream), body, None, None, 0,
            rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal))
        torch.cuda.set_stream(self.inner)

    def leave(self):
        from cuda.bindings import runtime as rt
        _check(rt.cudaStreamEndCapture(rt.cudaStream_t(self.inner.cuda_stream)))
        torch.cuda.set_stream(self.outer)


def load_set_condition():
    from cuda.bindings import driver
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # (torch's primary context current on this thread)
    module = _check(driver.cuModuleLoadData(set_condition_cubin()))
    return _check(driver.cuModuleGetFunction(module, b"set_condition")), module


def capture(kind: str, launches: int, pdl: bool, want, flag, count, func):
    programs = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    opts = dict(num_warps=8, **({"launch_pdl": True} if pdl else {}))
    flag_kernel[(1,)](want, flag)  # (compiled outside the capture)
    probe_kernel[(programs,)](flag, count, PDL=pdl, **opts)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    node = Node(func) if kind == "gated" else None
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        flag_kernel[(1,)](want, flag)
        if node is not None:
            node.enter(flag)
        for _ in range(launches if kind != "none" else 0):
            probe_kernel[(programs,)](flag, count, PDL=pdl, **opts)
        if node is not None:
            node.leave()
    g.node = node  # (its body stream lives as long as the graph)
    return g


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launches", type=int, default=10)
    ap.add_argument("--replays", type=int, default=300)
    ap.add_argument("--out")
    a = ap.parse_args()
    func, _module = load_set_condition()
    want = torch.zeros(1, dtype=torch.uint8, device="cuda")
    flag = torch.zeros(1, dtype=torch.uint8, device="cuda")
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    rows, result = [], {}
    for pdl in (False, True):
        graphs = {k: capture(k, a.launches, pdl, want, flag, count, func)
                  for k in ("none", "plain", "gated")}
        for k, g in graphs.items():  # the body runs exactly when the flag is set
            for w in (1, 0, 1, 0, 0):
                want.fill_(w)
                count.zero_()
                g.replay()
                torch.cuda.synchronize()
                ran = int(count.item())
                expect = w * a.launches * (k != "none")
                assert ran == expect, f"{k} pdl={pdl} flag={w}: {ran} probes ran, want {expect}"
        want.fill_(0)
        for k, g in graphs.items():
            for _ in range(20):
                g.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(3):
                torch.cuda.synchronize()
                start.record()
                for _ in range(a.replays):
                    g.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3 / a.replays)
            us = sorted(times)[1]
            result[f"{k}{'_pdl' if pdl else ''}"] = us
            rows.append((k, pdl, us))
    print(f"{torch.cuda.get_device_name()}, {a.launches} probe launches, flag clear, "
          f"µs per replay (median of 3 x {a.replays}):")
    print("| graph | PDL probes | µs | over none |")
    print("|---|---|---|---|")
    for k, pdl, us in rows:
        base = result["none_pdl" if pdl else "none"]
        print(f"| {k} | {pdl} | {us:.2f} | {us - base:+.2f} |")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "conditional_node.json"), "w") as f:
            json.dump(dict(result, launches=a.launches, device=torch.cuda.get_device_name()), f)


if __name__ == "__main__":
    main()
