"""SASS instructions per token of the stage-1 kernels, without a GPU.

    python -m tools.sass [--arch 90]

Compiles the records pass (`logits_records_kernel`, one sample, no log-mass: the B >= 128
path), the fused kernel (16- and 64-row tiles, epilogue noise) and, where Triton has Gluon,
the Hopper kernels ws and pp exactly as tpsample.launchers launches them, for sm_<arch> with
Triton's own ptxas; disassembles the cubin with the bundled nvdisasm and counts
instructions. The records pass is straight-line code per tile, so its count divided by the
tokens each thread holds is the issue cost of one token; for the other kernels the binary's
total is printed, with its spilled words (LDL/STL). Use it to predict an epilogue change
before spending device time (docs/design.md, v1.6, v2.1).
"""
from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import tempfile
from collections import Counter

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tpsample import launchers, records, replay
from tpsample.kernels import gluon_compat
from tpsample.kernels.fused_sample import fused_sample_records_kernel, logits_records_kernel
from tpsample.params import RowParams
from tpsample.plan import DeviceKind, make_plan, with_options

POINTER_TYPES = {"seed_ptr": "*i64", "offset_ptr": "*i64", "peer_ptrs": "*i64", "parity_ptr": "*i32",
                 "mask_ptr": "*i32", "first_ptr": "*i32", "eff_ptr": "*i32", "ids_ptr": "*i64",
                 "h_ptr": "*bf16", "w_ptr": "*bf16"}
ALIGNED_INTS = {"stride_lb", "stride_hb", "stride_wv", "rec_stride_s", "rec_stride_b", "rec_stride_t", "D"}


def sass_ops(kernel, constexprs: dict, num_warps: int, arch: int = 90,
             aligned: tuple = (), types: dict | None = None) -> Counter:
    """Opcode counts of `kernel` compiled with these constexprs (pointers 16-byte aligned, and
    the int arguments named in ALIGNED_INTS or `aligned` multiples of 16); types: argument
    types where POINTER_TYPES's defaults are not the launched ones ({"y_ptr": "*i64"})."""
    params = inspect.signature(kernel.fn).parameters
    names = list(params)
    # constexprs left out take their defaults (else they would be typed as runtime ints)
    constexprs = {**{n: q.default for n, q in params.items()
                     if q.default is not inspect.Parameter.empty and "constexpr" in str(q.annotation)},
                  **constexprs}
    sig = {n: "constexpr" if n in constexprs else
           (types or {}).get(n) or POINTER_TYPES.get(n, "*fp32" if n.endswith("_ptr") else "i32")
           for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or n in ALIGNED_INTS or n in aligned}
    compiled = triton.compile(ASTSource(kernel, sig, constexprs, attrs),
                              target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps))
    return cubin_ops(compiled)


def gluon_ops(strategy: str, num_samples: int = 1, need_mass: bool = False, num_peers: int = 0,
              B: int = 256, D: int = 4096, arch: int = 90, cdf: bool = False,
              trace_rows: int | None = None, masked: bool = False, candidates: bool = False,
              raw_mass: bool = False, listed: bool = False, side: bool = False,
              **cfg) -> Counter:
    """Opcode counts of the Hopper stage-1 kernel `strategy` ("ws" or "pp") as
    tpsample.launchers would launch it with this config (their defaults for the
    keys not given): the launcher runs on CPU tensors and hands its kernel, arguments,
    constexprs and options to a compile for sm_<arch> instead of a launch."""
    return cubin_ops(gluon_compile(strategy, num_samples, need_mass, num_peers, B, D, arch, cdf,
                                   trace_rows, masked, candidates, raw_mass, listed, side, **cfg))


def gluon_compile(strategy: str, num_samples: int = 1, need_mass: bool = False, num_peers: int = 0,
                  B: int = 256, D: int = 4096, arch: int = 90, cdf: bool = False,
                  trace_rows: int | None = None, masked: bool = False, candidates: bool = False,
                  raw_mass: bool = False, listed: bool = False, side: bool = False, **cfg):
    """The compiled kernel behind gluon_ops: the plan for a Hopper GPU with this config,
    launched by tpsample.launchers on CPU tensors, with the launch intercepted. trace_rows:
    pp with its per-tile clock trace (a plan with trace=True) into a [trace_rows, 4] buffer;
    masked: with an allowed-token mask (ws only); candidates, raw_mass: with the candidate
    planes (ws only; raw_mass: the raw plane at T = 1); listed: masked, keeping the listed
    tokens' logits (a call with logit_adjust); side: with the logits side output (ws)."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    V = 4096
    hidden, weight = torch.empty(B, D, dtype=torch.bfloat16), torch.empty(V, D, dtype=torch.bfloat16)
    row, seed = torch.empty(B), torch.empty(B, dtype=torch.int64)
    out = torch.empty(records.planes(num_samples, candidates), B, V // records.TILE, 4)
    fanout = (torch.empty(2, num_peers, dtype=torch.int64), torch.empty(2, dtype=torch.int32)) \
        if num_peers else None
    if strategy == "ws":
        cfg = dict(dict(strategy="ws", BLOCK_B=128, NUM_STAGES=5, EPI_B=64, num_warps=8), **cfg)
    elif strategy == "pp":
        cfg = dict(dict(strategy="pp", BLOCK_B=128, NUM_STAGES=6, num_warps=4), **cfg)
    else:
        raise ValueError(f"strategy must be 'ws' or 'pp', got {strategy!r}")
    hopper = DeviceKind("cuda", None, (arch // 10, arch % 10), 132, gluon_missing=None)
    plan = make_plan(hopper, B=B, D=D, V=V, dtype=torch.bfloat16, merge="cdf" if cdf else "max",
                     num_samples=num_samples, need_mass=need_mass, config=cfg,
                     candidates=candidates, raw_mass=raw_mass)
    trace = None
    if trace_rows is not None:
        plan = with_options(plan, trace=True)
        trace = torch.empty(trace_rows, 4, dtype=torch.int64)
    launch = {}
    saved = replay.run_kernel, launchers._num_sms, launchers._smem_of
    replay.run_kernel = lambda fn, grid, args, constexprs, options: launch.update(
        fn=fn, args=args, constexprs=constexprs, options=options)  # (run_named calls it)
    launchers._num_sms = lambda device: 132
    launchers._smem_of = lambda device: HOPPER_SMEM_PER_BLOCK
    try:
        launchers.stage1(plan, hidden, weight, None, RowParams(row, seed, seed), out, n_real=V,
                         fanout=fanout, trace=trace,
                         mask=torch.empty(B, V // 32, dtype=torch.int32) if masked or listed
                         else None,
                         held=(torch.empty(B, V // 32, dtype=torch.int32),
                               torch.empty(B, V // 32)) if listed else None,
                         side=torch.empty(B, V) if side else None)
    finally:
        replay.run_kernel, launchers._num_sms, launchers._smem_of = saved
    kernel = launch["fn"]
    names = [n for n in inspect.signature(kernel.fn).parameters if n not in launch["constexprs"]]
    sig = dict.fromkeys(launch["constexprs"], "constexpr")
    consts = dict(launch["constexprs"])
    for name, arg in zip(names, launch["args"]):
        if arg is None:  # (as a launch specializes it)
            sig[name], consts[name] = "constexpr", None
        elif isinstance(arg, GluonDescriptor):
            sig[name] = f"tensordesc<bf16{list(arg.block_shape)},{arg.layout!r}>"
        elif isinstance(arg, torch.Tensor):
            sig[name] = {torch.float32: "*fp32", torch.int64: "*i64", torch.int32: "*i32"}[arg.dtype]
        else:
            sig[name] = "i32"
    order = list(inspect.signature(kernel.fn).parameters)
    attrs = {(order.index(n),): [["tt.divisibility", 16]] for n in names
             if sig[n].startswith("*") or n == "stride_side"}
    return triton.compile(GluonASTSource(kernel, {n: sig[n] for n in order}, consts, attrs),
                          target=GPUTarget("cuda", arch, 32), options=launch["options"])


HOPPER_SMEM_PER_BLOCK = 232448  # shared memory per block (opt-in), sm_90

INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)(\S*)(.*)")


def exchange_wait_sass(world: int = 2, arch: int = 90) -> str:
    """The SASS of the exchange's signal and bounded wait (kernels/exchange_wait.py) as
    tpsample.transport launches it (one warp, the global timer)."""
    from tpsample.kernels.exchange_wait import signal_wait_kernel
    sig = {"flags_ptr": "*i64", "peer_flags_ptr": "*i64", "calls_ptr": "*i64", "status_ptr": "*i32",
           "buf_ptr": "*fp32", "parity_ptr": "*i32", "peer_ptrs_ptr": "*i64", "rank": "i32", "world": "i32",
           "slot_numel": "i32", "parity_stride": "i32", "timeout_ns": "i64",
           "cond_ptr": "*i32", "cond_n": "i32", "WORLD_P2": "constexpr", "USE_CLOCK": "constexpr",
           "BLOCK": "constexpr", "COND": "constexpr", "BLOCK_C": "constexpr"}
    consts = dict(WORLD_P2=triton.next_power_of_2(world), USE_CLOCK=True, BLOCK=1024, COND=False,
                  BLOCK_C=16)
    compiled = triton.compile(ASTSource(signal_wait_kernel, sig, consts, {}),
                              target=GPUTarget("cuda", arch, 32), options=dict(num_warps=1))
    return disassemble(compiled)


def disassemble(compiled) -> str:
    """The SASS of a compiled kernel's cubin (nvdisasm)."""
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        return subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout


def cubin_ops(compiled) -> Counter:
    """Opcode counts of a compiled kernel's cubin (nvdisasm)."""
    return text_ops(disassemble(compiled))


def text_ops(text: str) -> Counter:
    """Opcode counts of a disassembly."""
    ops = Counter()
    for line in text.splitlines():
        m = INSTRUCTION.match(line)
        if m:
            ops[m.group(1)] += 1
    return ops


def loop_bodies(text: str) -> list[Counter]:
    """Opcode counts of every loop of a disassembly: the instructions from a backward branch's
    target label to the branch."""
    ops, labels, loops = [], {}, []
    for line in text.splitlines():
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(ops)
        m = INSTRUCTION.match(line)
        if m:
            ops.append(m.group(1))
            target = re.search(r"`\(\.(L_x_\d+)\)", m.group(3)) if m.group(1) == "BRA" else None
            if target and labels.get(target.group(1), len(ops)) < len(ops) - 1:
                loops.append(Counter(ops[labels[target.group(1)]:]))
    return loops


def pp_chunk_loop(need_mass: bool = False, cdf: bool = False,
                  arch: int = 90) -> tuple[float, Counter]:
    """pp's records loop (one sample): instructions per token and opcode counts of one pass,
    which turns one 16-column chunk of the tile into records (16 tokens per thread). It is the innermost loop with the chunks' MUFU (16 per chunk: the noise's outer
    log2, or the weights' exp2)."""
    loops = [c for c in loop_bodies(disassemble(gluon_compile("pp", need_mass=need_mass, arch=arch,
                                                              cdf=cdf)))
             if c["MUFU"] >= 16 and c["HGMMA"] == 0]
    body = min(loops, key=lambda c: sum(c.values()))
    return sum(body.values()) / 16, body


def records_pass_per_token(block_b: int = 16, num_warps: int = 4, arch: int = 90,
                           cdf: bool = False) -> tuple[float, Counter]:
    """Instructions per token of the hybrid's records pass ([128, block_b] tile); cdf: the
    "cdf" records (with the log-masses they need) instead of the max merge's."""
    consts = dict(HAS_BIAS=False, ALIGNED4=True, BLOCK_V=128, BLOCK_B=block_b, NUM_PEERS=0,
                  HALVINGS=0, TILE_MASS=cdf, PDL=True, CDF=cdf)
    ops = sass_ops(logits_records_kernel, consts, num_warps, arch)
    return sum(ops.values()) / (128 * block_b / (32 * num_warps)), ops


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90)
    a = p.parse_args(argv)
    print(f"sm_{a.arch}, Triton {triton.__version__}")
    for bb, nw in ((16, 4), (64, 8)):
        per, ops = records_pass_per_token(bb, nw, a.arch)
        top = ", ".join(f"{k} {v}" for k, v in ops.most_common(8))
        print(f"records pass BLOCK_B={bb:3d} warps={nw}: {per:6.1f} instructions/token  ({top})")
        per, ops = records_pass_per_token(bb, nw, a.arch, cdf=True)
        print(f"  the same, cdf records:           {per:6.1f} instructions/token")
    for bb, nw in ((16, 4), (64, 8)):
        consts = dict(HAS_BIAS=False, EVEN_D=True, FP32_DOT=False, ALIGNED4=True, BLOCK_V=128,
                      BLOCK_B=bb, BLOCK_D=128, NUM_STAGES=4, NUM_PEERS=0, HALVINGS=0,
                      TILE_MASS=False, PDL=True, W_DESC=False, NOISE_AT=-1, NOISE_CHUNKS=1,
                      NOISE_EVERY=0, CDF=False)
        ops = sass_ops(fused_sample_records_kernel, consts, nw, a.arch)
        print(f"fused kernel BLOCK_B={bb:3d} warps={nw}: {sum(ops.values())} instructions in the "
              f"binary (HGMMA {ops['HGMMA']}, MUFU {ops['MUFU']}, SHFL {ops['SHFL']}, BAR {ops['BAR']})")
    if not gluon_compat.AVAILABLE:
        print(f"ws and pp not counted: {gluon_compat.unavailable_reason()}")
        return
    for name, kw in (("max", {}), ("max with log-masses", dict(need_mass=True)),
                     ("cdf", dict(need_mass=True, cdf=True))):
        per, body = pp_chunk_loop(arch=a.arch, **kw)
        top = ", ".join(f"{k} {v}" for k, v in body.most_common(8))
        print(f"pp records loop, {name}: {per:5.1f} instructions/token  ({top})")
    for name, kw in (("ws BLOCK_B=128, 5 stages, one sample", dict(strategy="ws")),
                     ("pp 6 stages, one sample", dict(strategy="pp")),
                     ("pp 6 stages, one sample, log-masses", dict(strategy="pp", need_mass=True)),
                     ("pp 6 stages, two samples", dict(strategy="pp", num_samples=2)),
                     ("pp 6 stages, one sample, cdf", dict(strategy="pp", need_mass=True, cdf=True)),
                     ("pp 160 rows (EXTRA_B 32), one sample", dict(strategy="pp", B=160, EXTRA_B=64)),
                     ("pp 160 rows (EXTRA_B 32), log-masses",
                      dict(strategy="pp", B=160, EXTRA_B=64, need_mass=True)),
                     ("pp 192 rows (EXTRA_B 64), one sample", dict(strategy="pp", B=192, EXTRA_B=64))):
        ops = gluon_ops(arch=a.arch, **kw)
        print(f"{name}: {sum(ops.values())} instructions in the binary, spilled words "
              f"LDL {ops['LDL']} / STL {ops['STL']} (MUFU {ops['MUFU']}, HGMMA {ops['HGMMA']})")


if __name__ == "__main__":
    main()
