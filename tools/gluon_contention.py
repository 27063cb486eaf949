"""A Hopper microbenchmark (Gluon): does ALU work issued beside an in-flight wgmma slow the
wgmma down, and does it depend on the kind of instruction? (tools.contention; docs/design.md
v2.2.)

One CTA per SM. The default partition (4 warps, one per scheduler) issues back-to-back
wgmma [128, 128] += [128, 64] @ [64, 128] from shared memory, as pp's consumers do; a
worker partition of 4 warps runs a loop of one kind of ALU instruction on registers, as
pp's other consumer does in its epilogue. Each partition writes its elapsed SM cycles
(clock64) per CTA, so the answer does not depend on the clock the power cap sets.
"""

from tpsample.kernels.gluon_sample import AVAILABLE

CHAINS = 8  # independent chains per thread
STEP = 16  # dependent instructions per chain per loop step


def _asm(*ops: str) -> str:
    """STEP dependent instructions: `ops` repeated, as one inline-asm block."""
    return ("{ .reg .u64 t; .reg .u32 h, l; .reg .f32 f; "
            + " ".join(list(ops) * (STEP // len(ops))) + " }")


def _asm4(ops: str) -> str:
    """Four registers that feed each other, so ptxas cannot fuse two steps into one
    instruction (each would have more than three inputs)."""
    return "{ .reg .u32 t; " + " ".join([ops] * (STEP // 4)) + " }"


# kind → (inline asm of one loop step, registers it chains (1, 2 or 4), float registers,
# SASS warp-instructions per loop step of a thread's CHAINS chains: the movs of i2f/f2i vanish,
# dfma adds two conversions per chain). tests/test_sass.py checks the counts after ptxas.
ALU_KINDS = {
    "ffma": (_asm("fma.rn.f32 $0, $0, 0f3F7FFFFE, 0f3A800000;"), 1, True, 128),
    "fmul": (_asm("mul.rn.f32 $0, $0, 0f3F800001;"), 1, True, 128),
    "fadd": (_asm("add.rn.f32 $0, $0, 0f33800000;"), 1, True, 128),
    "fmnmx": (_asm("max.f32 $0, $0, $1;", "min.f32 $1, $1, $0;"), 2, True, 128),
    "hfma2": ("{ .reg .b32 a, c; mov.b32 a, 0x3C013C01; mov.b32 c, 0x00010001; "
              + " ".join(["fma.rn.f16x2 $0, $0, a, c;"] * STEP) + " }", 1, False, 128),
    "dfma": ("{ .reg .f64 d; cvt.f64.f32 d, $0; "
             + " ".join(["fma.rn.f64 d, d, 0d3FEFFFFFFFFFFFFF, 0d3E50000000000000;"] * STEP)
             + " cvt.rn.f32.f64 $0, d; }", 1, True, 128),
    "imad": (_asm("mad.lo.u32 $0, $0, 0x9E3779B9, 0x7F4A7C15;"), 1, False, 128),
    "imad_hi": (_asm("mad.hi.u32 $0, $0, 0xD2511F53, 0x7F4A7C15;"), 1, False, 128),
    # Philox's multiply: the high and low words, then one xor (mixed: no count per op)
    "imad_wide": (_asm("mul.wide.u32 t, $0, 0xD2511F53;", "mov.b64 {l, h}, t;",
                       "xor.b32 $0, h, l;", "mul.wide.u32 t, $0, 0xCD9E8D57;",
                       "mov.b64 {l, h}, t;", "xor.b32 $0, h, l;", "add.u32 $0, $0, 0x7F4A7C15;",
                       "xor.b32 $0, $0, 0x9E3779B9;"), 1, False, None),
    "iadd": (_asm("add.u32 $0, $0, $1;", "add.u32 $1, $1, $0;"), 2, False, 128),
    "iadd3": (_asm4("add.u32 t, $0, $1; add.u32 $0, t, $2; add.u32 t, $1, $2; add.u32 $1, t, $3; "
                    "add.u32 t, $2, $3; add.u32 $2, t, $0; add.u32 t, $3, $0; add.u32 $3, t, $1;"),
              4, False, 128),
    "lea_hi": (_asm4("shr.u32 t, $0, 16; add.u32 $1, t, $1; shr.u32 t, $1, 16; add.u32 $2, t, $2; "
                     "shr.u32 t, $2, 16; add.u32 $3, t, $3; shr.u32 t, $3, 16; add.u32 $0, t, $0;"),
               4, False, 128),
    "lop3": (_asm4("lop3.b32 $0, $0, $1, $2, 0x96; lop3.b32 $1, $1, $2, $3, 0xE8; "
                   "lop3.b32 $2, $2, $3, $0, 0x96; lop3.b32 $3, $3, $0, $1, 0xE8;"), 4, False, 128),
    "lop_iadd": (_asm("xor.b32 $0, $0, 0x9E3779B9;", "add.u32 $0, $0, 0x7F4A7C15;"), 1, False, 128),
    "shf": (_asm("shf.l.wrap.b32 $0, $0, $1, 7;", "shf.l.wrap.b32 $1, $1, $0, 13;"), 2, False, 128),
    "prmt": (_asm("prmt.b32 $0, $0, $1, 0x5410;", "prmt.b32 $1, $1, $0, 0x3276;"), 2, False, 128),
    # the float's bits feed the next conversion, so repeated round trips cannot fold
    "i2f": (_asm("cvt.rn.f32.u32 f, $0;", "mov.b32 $0, f;"), 1, False, 64),
    "f2i": (_asm("mov.b32 f, $0;", "cvt.rzi.u32.f32 $0, f;"), 1, False, 64),
    "mufu": (_asm("lg2.approx.ftz.f32 $0, $0;", "ex2.approx.ftz.f32 $0, $0;"), 1, True, 128),
}
# the sampler's noise (Philox with wide multiplies or 16-bit halves, then Gumbel logs)
NOISE_KINDS = ("noise_wide", "noise_halves")
KINDS = tuple(ALU_KINDS) + NOISE_KINDS


def constexprs(kind: str) -> dict:
    """contention_kernel's constexprs for `kind`."""
    if kind in NOISE_KINDS:
        return dict(KIND=kind, ASM="", NREG=1, FLOAT=False)
    if kind not in ALU_KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    asm, nreg, is_float, _ = ALU_KINDS[kind]
    return dict(KIND=kind, ASM=asm, NREG=nreg, FLOAT=is_float)


if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared,
                                                                  warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from tpsample.kernels.fused_sample import _mul_wide_a, _mul_wide_b, gumbel_log
    from tpsample.kernels.gluon_sample import sm_clock

    @gluon.jit
    def _mul_halves(a, M: gl.constexpr):
        """(high, low) words of a * M from 16-bit partial products: low-word IMADs, shifts,
        masks and adds only (no IMAD.WIDE, which takes tensor-core cycles from a wgmma)."""
        M0: gl.constexpr = M & 0xFFFF
        M1: gl.constexpr = M >> 16
        a0 = a & 0xFFFF
        a1 = a >> 16
        mid = a1 * M0 + ((a0 * M0) >> 16)
        mid2 = a0 * M1 + (mid & 0xFFFF)
        return a1 * M1 + (mid >> 16) + (mid2 >> 16), a * M

    @gluon.jit
    def philox_with(seed, c0, c1, c2, c3, MUL: gl.constexpr):
        """Philox4x32-10 (the product's words) with the multiplies "wide" or "halves"."""
        seed = seed.to(gl.uint64)
        k0 = (seed & 0xFFFFFFFF).to(gl.uint32)
        k1 = ((seed >> 32) & 0xFFFFFFFF).to(gl.uint32)
        for r in gl.static_range(10):
            if MUL == "halves":
                hi_b, lo_b = _mul_halves(c2, 0xCD9E8D57)
                hi_a, lo_a = _mul_halves(c0, 0xD2511F53)
            else:
                hi_b, lo_b = _mul_wide_b(c2)
                hi_a, lo_a = _mul_wide_a(c0)
            c0 = hi_b ^ c1 ^ k0
            c2 = hi_a ^ c3 ^ k1
            c1 = lo_b
            c3 = lo_a
            k0 = k0 + 0x9E3779B9
            k1 = k1 + 0xBB67AE85
        return c0, c1, c2, c3

    CHAINS_C = gl.constexpr(CHAINS)

    @gluon.jit
    def _alu_step(x, y, ASM: gl.constexpr, NREG: gl.constexpr, FLOAT: gl.constexpr):
        """One loop step: ASM on NREG chained registers per chain (uint32, or float32)."""
        if NREG == 4:
            x, y, z, w = gl.inline_asm_elementwise(
                ASM, "=r,=r,=r,=r,0,1,2,3", [x, y, x ^ y, x + y],
                dtype=(gl.uint32, gl.uint32, gl.uint32, gl.uint32), is_pure=True, pack=1)
            x = x ^ z
            y = y ^ w
        elif NREG == 2 and FLOAT:
            x, y = gl.inline_asm_elementwise(ASM, "=f,=f,0,1", [x, y],
                                             dtype=(gl.float32, gl.float32), is_pure=True, pack=1)
        elif NREG == 2:
            x, y = gl.inline_asm_elementwise(ASM, "=r,=r,0,1", [x, y],
                                             dtype=(gl.uint32, gl.uint32), is_pure=True, pack=1)
        elif FLOAT:
            x = gl.inline_asm_elementwise(ASM, "=f,0", [x], dtype=gl.float32, is_pure=True, pack=1)
        else:
            x = gl.inline_asm_elementwise(ASM, "=r,0", [x], dtype=gl.uint32, is_pure=True, pack=1)
        return x, y

    @gluon.jit
    def _mma_part(a_s, b_s, clk_ptr, out_ptr, n_mma, n_alu, KIND: gl.constexpr,
                  ASM: gl.constexpr, NREG: gl.constexpr, FLOAT: gl.constexpr):
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 128, 16])
        acc = gl.zeros([128, 128], gl.float32, layout)
        t0 = sm_clock()
        for i in range(n_mma):
            acc = warpgroup_mma(a_s, b_s.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        t1 = sm_clock()
        pid = gl.program_id(0)
        gl.store(clk_ptr + 3 * pid, t1 - t0)
        smid = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32,
                                         is_pure=True, pack=1)
        gl.store(clk_ptr + 3 * pid + 2, smid.to(gl.int64))
        gl.store(out_ptr + 2 * pid, gl.sum(gl.sum(acc, axis=1), axis=0))

    @gluon.jit
    def _alu_part(a_s, b_s, clk_ptr, out_ptr, n_mma, n_alu, KIND: gl.constexpr,
                  ASM: gl.constexpr, NREG: gl.constexpr, FLOAT: gl.constexpr):
        layout: gl.constexpr = gl.BlockedLayout([CHAINS_C], [32], [4], [0])
        pid = gl.program_id(0)
        i = gl.arange(0, 128 * CHAINS_C, layout=layout) + pid * 128 * CHAINS_C
        t0 = sm_clock()
        if KIND == "noise_wide" or KIND == "noise_halves":
            # the epilogue's noise: Philox words (multiplies wide or from 16-bit halves) →
            # Gumbel logs, 4 per call
            acc = gl.zeros([128 * CHAINS_C], gl.float32, layout)
            ctr = i.to(gl.uint32)
            zero = gl.zeros_like(ctr)
            seed = (i + 12345).to(gl.int64)
            for s in range(n_alu):
                if KIND == "noise_wide":
                    r0, r1, r2, r3 = philox_with(seed, ctr, zero + s.to(gl.uint32), zero, zero,
                                                 "wide")
                else:
                    r0, r1, r2, r3 = philox_with(seed, ctr, zero + s.to(gl.uint32), zero, zero,
                                                 "halves")
                acc = gl.maximum(acc, gumbel_log(r0) + gumbel_log(r1))
                acc = gl.maximum(acc, gumbel_log(r2) + gumbel_log(r3))
            x = acc
        elif FLOAT:
            x = i.to(gl.float32) * 1e-3 + 1.5
            y = x * 0.5
            for s in range(n_alu):
                x, y = _alu_step(x, y, ASM, NREG, FLOAT)
            x = x + y
        else:
            x = i.to(gl.uint32)
            y = x * 3 + 1
            for s in range(n_alu):
                x, y = _alu_step(x, y, ASM, NREG, FLOAT)
            x = x ^ y
        t1 = sm_clock()
        gl.store(clk_ptr + 3 * pid + 1, t1 - t0)
        gl.store(out_ptr + 2 * pid + 1, gl.sum(x.to(gl.float32), axis=0))

    @gluon.jit
    def contention_kernel(a_ptr, b_ptr, clk_ptr, out_ptr, n_mma, n_alu, KIND: gl.constexpr,
                          ASM: gl.constexpr, NREG: gl.constexpr, FLOAT: gl.constexpr,
                          ALU_REGS: gl.constexpr):
        """a, b: [128, 64] bf16 (the wgmma's operands, copied to shared memory once);
        clk [grid, 3] int64 ← elapsed cycles of (wgmma loop, ALU loop) and the SM id;
        out [grid, 2] fp32 ← their results, so neither loop is dead code. n_mma = 0 or
        n_alu = 0 runs one loop alone. KIND, ASM, NREG, FLOAT: constexprs(kind)."""
        smem_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                    rank=2)
        ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        r = gl.arange(0, 128, layout=gl.SliceLayout(1, ld_l))
        c = gl.arange(0, 64, layout=gl.SliceLayout(0, ld_l))
        offs = gl.expand_dims(r, 1) * 64 + gl.expand_dims(c, 0)
        a_s = gl.allocate_shared_memory(gl.bfloat16, [128, 64], smem_l, gl.load(a_ptr + offs))
        b_s = gl.allocate_shared_memory(gl.bfloat16, [128, 64], smem_l, gl.load(b_ptr + offs))
        fence_async_shared()
        gl.warp_specialize([
            (_mma_part, (a_s, b_s, clk_ptr, out_ptr, n_mma, n_alu, KIND, ASM, NREG, FLOAT)),
            (_alu_part, (a_s, b_s, clk_ptr, out_ptr, n_mma, n_alu, KIND, ASM, NREG, FLOAT)),
        ], [4], [ALU_REGS])
