"""The fast path's steps (kernels/filter_cut.py) compile for sm_90 on a machine without a GPU.

The interpreter runs a kernel's Python, so a branch that only the compiler types (a name
bound on one side of a runtime `if`, a loop-carried variable whose shape changes) passes
every interpreted test and fails on the device. This compiles each step with Triton's own
frontend and ptxas, in a fresh process without the interpreter, for the configurations the
launcher uses: one device and tensor parallel (SLOTTED, SPLIT), tokens only, the winner
check, with log-probs (WINNER, LOGPROBS) and raw log-probs; top-p and min-p, either alone
(HAS_P, HAS_M), and min-p alone or log-probs with the filter kernel's row max and log Z
(XMAX_KNOWN); the HIST
passes with and without their early end (EARLY, here CAP under tensor parallel, else 0).
"""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton.backends.nvidia")

PRELUDE = r'''
import inspect
import itertools
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tpsample import replay


def compile_sm90(kernel, pointers, consts, warps, what):
    # the kernel for sm_90 with these constexprs (the others: their defaults; Triton 3.9
    # wants them given); an error ends the process, naming `what`
    runtime, _ = replay._signature(kernel)
    defaults = {n: q.default for n, q in inspect.signature(kernel.fn).parameters.items()
                if q.default is not inspect.Parameter.empty and "constexpr" in str(q.annotation)}
    sig = {n: pointers.get(n, "i32") for n in runtime} | {k: "constexpr" for k in defaults | consts}
    try:
        triton.compile(ASTSource(kernel, sig, defaults | consts, {}),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    except Exception as e:
        raise SystemExit(f"{what}: {str(e)[-1500:]}")
'''

COMPILE = PRELUDE + r'''
from tpsample.kernels import filter_cut as K

# the element types of the pointers tpsample/launchers.py (_cut_steps) passes
POINTERS = dict(l_ptr="*fp32", inv_temp_ptr="*fp32", seed_ptr="*i64", offset_ptr="*i64",
                top_k_ptr="*i64", top_p_ptr="*fp32", min_p_ptr="*fp32", tokens_ptr="*i64",
                logprobs_ptr="*fp32", logz_ptr="*fp32", flag_ptr="*i32", count_ptr="*i32",
                part_ptr="*fp32", keys_ptr="*i64", win_ptr="*i64", rec_ptr="*fp32",
                parity_ptr="*i32", starts_ptr="*i64", calls_ptr="*i32", peer_ptrs_ptr="*i64",
                hist_ptr="*fp32", top_tok_ptr="*i64", top_lp_ptr="*fp32")
STEPS = (K.STATS.value, K.SELECT.value, *range(1, K.PASSES.value + 1), K.COMPACT.value,
         K.FINISH.value, K.SAMPLE.value, K.FINAL.value)
done = 0
for tp, (winner, lp), raw, (has_p, has_m) in itertools.product(
        (False, True), ((False, False), (True, False), (True, True)), (False, True),
        ((True, True), (True, False), (False, True))):
    if raw and not lp:
        continue
    # (a call with the winner check and log-probs takes x_max and log Z from the filter
    # kernel, XMAX_KNOWN, and launches no STATS)
    for step in STEPS if has_p else (K.STATS.value, K.SAMPLE.value, K.FINAL.value):
        if lp and step == K.STATS.value:
            continue
        c = dict(HAS_K=False, HAS_P=has_p, HAS_M=has_m, ALIGNED4=not tp, BLOCK=2048, SUB=512,
                 BLOCK_G=8, BLOCK_F=256, PDL=True, BLOCK_GH=8, BLOCK_R=2048, BLOCK_TC=32,
                 SLOTTED=tp, SPLIT=tp, WINNER=winner, LOGPROBS=lp, RAW=raw, STEP=step,
                 EARLY=K.CAP.value if tp else 0, XMAX_KNOWN=lp)
        compile_sm90(K.cut_step_kernel, POINTERS, c, 8,
                     f"STEP {step} SLOTTED {tp} WINNER {winner} LOGPROBS {lp} RAW {raw}"
                     f" HAS_P {has_p} HAS_M {has_m}")
        done += 1
for tp, lp, step in itertools.product((False, True), (False, True), (K.SAMPLE.value,
                                                                      K.FINAL.value)):
    c = dict(HAS_K=False, HAS_P=False, HAS_M=True, ALIGNED4=not tp, BLOCK=2048, SUB=512,
             BLOCK_G=8, BLOCK_F=256, PDL=True, BLOCK_GH=8, BLOCK_R=2048, BLOCK_TC=32,
             SLOTTED=tp, SPLIT=tp, WINNER=True, LOGPROBS=lp, RAW=False, XMAX_KNOWN=True,
             STEP=step, EARLY=0)
    compile_sm90(K.cut_step_kernel, POINTERS, c, 8,
                 f"XMAX_KNOWN STEP {step} SLOTTED {tp} LOGPROBS {lp}")
    done += 1
print(done)
'''


def compiled(code: str, tmp_path, timeout: int) -> int:
    # code run in a fresh process without the interpreter; the count it prints last
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # (Triton 3.9 warns unless it is set)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return int(out.stdout.split()[-1])


@pytest.mark.slow
def test_every_cut_step_compiles_for_sm90(tmp_path):
    n = compiled(COMPILE, tmp_path, 1200)
    # 8 configurations x (9 steps with top-p and min-p, 9 with top-p alone, 3 with min-p alone)
    # less STATS in the 4 with log-probs, and min-p alone with the filter kernel's row max:
    # 4 x SAMPLE, FINAL
    assert n == 8 * (9 + 9 + 3) - 4 * 3 + 8


LOGITS = PRELUDE + r'''
from tpsample.kernels import filter_fallback as K

done = 0
for dtype, has_mask, fanout in itertools.product(("bf16", "fp16", "fp32"), (False, True),
                                                 (False, True)):
    pointers = dict(h_ptr=f"*{dtype}", w_ptr=f"*{dtype}", bias_ptr="*fp32",
                    inv_temp_ptr="*fp32", flag_ptr="*i32", out_ptr="*fp32", mask_ptr="*i32",
                    peer_ptrs_ptr="*i64", calls_ptr="*i32", side_ptr="*fp32")
    c = dict(HAS_BIAS=True, BLOCK_V=128, BLOCK_D=64, BLOCK_F=256, HAS_MASK=has_mask, PDL=True,
             FANOUT=fanout, FROM_SIDE=False, F32_DOT=dtype == "fp32")
    compile_sm90(K.fallback_logits_kernel, pointers, c, 4,
                 f"{dtype} HAS_MASK {has_mask} FANOUT {fanout}")
    done += 1
print(done)
'''


@pytest.mark.slow
def test_the_recomputed_logits_compile_for_sm90(tmp_path):
    """kernels/filter_fallback.py's logits kernel where it recomputes rows by tl.dot (the
    interpreter's dot is numpy's): bfloat16, float16 and float32 inputs, with and without the
    mask and the tensor-parallel fan-out."""
    assert compiled(LOGITS, tmp_path, 600) == 12
