"""SASS instructions per token of the stage-1 kernels, without a GPU.

    python -m tpsample.sass [--arch 90]

Compiles the records pass (`logits_records_kernel`, one sample, no log-mass: the B >= 128
path) and the fused kernel (16- and 64-row tiles, epilogue noise) for sm_<arch> with
Triton's own ptxas, disassembles the cubin with the bundled nvdisasm and counts
instructions. The records pass is straight-line code per tile, so its count divided by the
tokens each thread holds is the issue cost of one token; for the fused kernel the binary's
total is printed (its epilogue runs once per tile, the D loop once per step). Use it to
predict an epilogue change before spending device time (docs/perf-notes.md, v1.6).
"""
from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from .kernels import fused_sample_records_kernel, logits_records_kernel

POINTER_TYPES = {"seed_ptr": "*i64", "offset_ptr": "*i64", "peer_ptrs": "*i64", "parity_ptr": "*i32",
                 "h_ptr": "*bf16", "w_ptr": "*bf16"}
ALIGNED_INTS = {"stride_lb", "stride_hb", "stride_wv", "rec_stride_s", "rec_stride_b", "rec_stride_t", "D"}


def sass_ops(kernel, constexprs: dict, num_warps: int, arch: int = 90) -> Counter:
    """Opcode counts of `kernel` compiled with these constexprs (pointers 16-byte aligned)."""
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: "constexpr" if n in constexprs else
           POINTER_TYPES.get(n, "*fp32" if n.endswith("_ptr") else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or n in ALIGNED_INTS}
    compiled = triton.compile(ASTSource(kernel, sig, constexprs, attrs),
                              target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps))
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        text = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout
    ops = Counter()
    for line in text.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def records_pass_per_token(block_b: int = 16, num_warps: int = 4, arch: int = 90) -> tuple[float, Counter]:
    """Instructions per token of the hybrid's records pass ([128, block_b] tile)."""
    consts = dict(HAS_BIAS=False, ALIGNED4=True, BLOCK_V=128, BLOCK_B=block_b, NUM_PEERS=0,
                  HALVINGS=0, TILE_MASS=False, PDL=True)
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
    for bb, nw in ((16, 4), (64, 8)):
        consts = dict(HAS_BIAS=False, EVEN_D=True, FP32_DOT=False, ALIGNED4=True, BLOCK_V=128,
                      BLOCK_B=bb, BLOCK_D=128, NUM_STAGES=4, NUM_PEERS=0, HALVINGS=0,
                      TILE_MASS=False, PDL=True, W_DESC=False, NOISE_AT=-1, NOISE_CHUNKS=1,
                      NOISE_EVERY=0)
        ops = sass_ops(fused_sample_records_kernel, consts, nw, a.arch)
        print(f"fused kernel BLOCK_B={bb:3d} warps={nw}: {sum(ops.values())} instructions in the "
              f"binary (HGMMA {ops['HGMMA']}, MUFU {ops['MUFU']}, SHFL {ops['SHFL']}, BAR {ops['BAR']})")


if __name__ == "__main__":
    main()
