"""Does ALU work beside an in-flight wgmma slow the wgmma down? (Hopper, CUDA only.)

    python -m tools.contention [--mma-steps 4000] [--fractions 0.25,0.5] [--out c.json]

kernels/gluon_contention.py: per SM, one warpgroup issues back-to-back wgmma
[128, 128] += [128, 64] @ [64, 128] from shared memory while a second warpgroup runs a loop
of one kind of ALU instruction (or the sampler's own Philox + Gumbel log). For each kind it
times, in SM cycles (clock64, so the power cap's clock does not enter), the wgmma loop
alone, the ALU loop alone with its length set to a fraction of the wgmma loop's time, and
both at once. "serialized" = (wgmma cycles with ALU − alone) / ALU cycles alone: 0 means the
ALU work hides completely under the wgmma, 1 means it adds its whole duration. The
ping-pong kernel measured ~0.78 cycles per noise instruction (docs/design.md).
"""
import argparse
import json
import statistics

import torch

from tools import gluon_contention as gc


def compiled_ops(kind: str, arch: int = 90):
    """Opcode counts of the microbenchmark for `kind`, compiled for sm_<arch> (no GPU): a
    check that ptxas kept every timed instruction (tests/test_sass.py)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from tools.sass import cubin_ops
    consts = dict(gc.constexprs(kind), ALU_REGS=232)
    sig = dict(a_ptr="*bf16", b_ptr="*bf16", clk_ptr="*i64", out_ptr="*fp32", n_mma="i32",
               n_alu="i32", **dict.fromkeys(consts, "constexpr"))
    src = GluonASTSource(gc.contention_kernel, sig, consts, {})
    return cubin_ops(triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                    options=dict(num_warps=4)))


def run(kind: str, n_mma: int, n_alu: int, alu_regs: int = 232) -> dict:
    """Median over SMs of the elapsed cycles of both loops (one CTA per SM)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(128, 64, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(128, 64, device="cuda", generator=g).to(torch.bfloat16)
    clk = torch.zeros(sms, 3, dtype=torch.int64, device="cuda")
    out = torch.zeros(sms, 2, device="cuda")
    for _ in range(2):  # the first launch compiles and warms up
        gc.contention_kernel[(sms, )](a, b, clk, out, n_mma, n_alu, **gc.constexprs(kind),
                                      ALU_REGS=alu_regs, num_warps=4)
    torch.cuda.synchronize()
    c = clk.cpu()
    return dict(mma=statistics.median(c[:, 0].tolist()), alu=statistics.median(c[:, 1].tolist()),
                distinct_sms=len(set(c[:, 2].tolist())), ctas=sms)


OPS_PER_STEP = {k: v[3] for k, v in gc.ALU_KINDS.items() if v[3] is not None}


def measure(kind: str, n_mma: int, fraction: float) -> dict:
    mma_alone = run(kind, n_mma, 0)["mma"]
    probe = 64
    per_step = run(kind, 0, probe)["alu"] / probe
    n_alu = max(1, round(fraction * mma_alone / per_step))
    alu_alone = run(kind, 0, n_alu)["alu"]
    both = run(kind, n_mma, n_alu)
    flops = 2 * 128 * 128 * 64 * n_mma
    return dict(kind=kind, fraction=fraction, n_mma=n_mma, n_alu=n_alu, mma_alone=mma_alone,
                alu_alone=alu_alone, mma_both=both["mma"], alu_both=both["alu"],
                mma_flop_per_cycle=flops / mma_alone, distinct_sms=both["distinct_sms"],
                serialized=(both["mma"] - mma_alone) / alu_alone,
                alu_slowdown=both["alu"] / alu_alone,
                mma_cycles_per_alu_op=((both["mma"] - mma_alone) / (n_alu * OPS_PER_STEP[kind])
                                       if kind in OPS_PER_STEP else None))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mma-steps", type=int, default=4000)
    p.add_argument("--fractions", default="0.25,0.5")
    p.add_argument("--kinds", default=",".join(gc.KINDS))
    p.add_argument("--out")
    a = p.parse_args(argv)
    rows = []
    for kind in a.kinds.split(","):
        for f in (float(x) for x in a.fractions.split(",")):
            r = measure(kind, a.mma_steps, f)
            rows.append(r)
            print(f"{kind:10s} ALU {f:.2f} x wgmma: wgmma {r['mma_alone']:.0f} -> "
                  f"{r['mma_both']:.0f} cycles, ALU {r['alu_alone']:.0f} -> {r['alu_both']:.0f}; serialized "
                  f"{r['serialized']:.2f}, {r['mma_cycles_per_alu_op'] or float('nan'):.2f} wgmma "
                  f"cycles per ALU op  ({r['mma_flop_per_cycle']:.0f} flop/cycle alone, "
                  f"{r['distinct_sms']} SMs)", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
