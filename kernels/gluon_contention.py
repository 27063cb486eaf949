"""A Hopper microbenchmark (Gluon): does ALU work issued beside an in-flight wgmma slow the
wgmma down, and does it depend on the kind of instruction? (tpsample.contention; perf notes
v2.2.)

One CTA per SM. The default partition (4 warps, one per scheduler) issues back-to-back
wgmma [128, 128] += [128, 64] @ [64, 128] from shared memory, as pp's consumers do; a
worker partition of 4 warps runs a loop of one kind of ALU instruction on registers, as
pp's other consumer does in its epilogue. Each partition writes its elapsed SM cycles
(clock64) per CTA, so the answer does not depend on the clock the power cap sets.
"""

from .gluon_sample import AVAILABLE

# ALU kinds: 16 dependent instructions per chain per loop step; a thread runs CHAINS chains
KINDS = ("ffma", "fmul", "fadd", "fmnmx", "hfma2", "dfma", "imad", "imad_hi", "imad_wide",
         "iadd", "iadd3", "lea_hi", "lop3", "lop_iadd", "shf", "prmt", "i2f", "f2i", "mufu",
         "noise_wide", "noise_halves")
CHAINS = 8
STEP = 16

if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared,
                                                                  warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from .fused_sample import gumbel_log, philox_with
    from .gluon_sample import sm_clock

    CHAINS_C = gl.constexpr(CHAINS)

    def _asm(*ops: str) -> gl.constexpr:
        """STEP dependent instructions: `ops` repeated, as one inline-asm block."""
        return gl.constexpr("{ .reg .u64 t; .reg .u32 h, l; .reg .f32 f; "
                            + " ".join(list(ops) * (STEP // len(ops))) + " }")

    FFMA = _asm("fma.rn.f32 $0, $0, 0f3F7FFFFE, 0f3A800000;")
    IMAD = _asm("mad.lo.u32 $0, $0, 0x9E3779B9, 0x7F4A7C15;")
    # Philox's multiply: the high and low words, then one xor
    IMAD_WIDE = _asm("mul.wide.u32 t, $0, 0xD2511F53;", "mov.b64 {l, h}, t;", "xor.b32 $0, h, l;",
                     "mul.wide.u32 t, $0, 0xCD9E8D57;", "mov.b64 {l, h}, t;", "xor.b32 $0, h, l;",
                     "add.u32 $0, $0, 0x7F4A7C15;", "xor.b32 $0, $0, 0x9E3779B9;")
    LOP_IADD = _asm("xor.b32 $0, $0, 0x9E3779B9;", "add.u32 $0, $0, 0x7F4A7C15;")
    MUFU = _asm("lg2.approx.ftz.f32 $0, $0;", "ex2.approx.ftz.f32 $0, $0;")
    FMUL = _asm("mul.rn.f32 $0, $0, 0f3F800001;")
    FADD = _asm("add.rn.f32 $0, $0, 0f33800000;")
    FMNMX = _asm("max.f32 $0, $0, $1;", "min.f32 $1, $1, $0;")
    HFMA2 = gl.constexpr("{ .reg .b32 a, c; mov.b32 a, 0x3C013C01; mov.b32 c, 0x00010001; "
                         + " ".join(["fma.rn.f16x2 $0, $0, a, c;"] * STEP) + " }")
    DFMA = gl.constexpr("{ .reg .f64 d; cvt.f64.f32 d, $0; "
                        + " ".join(["fma.rn.f64 d, d, 0d3FEFFFFFFFFFFFFF, 0d3E50000000000000;"]
                                   * STEP) + " cvt.rn.f32.f64 $0, d; }")
    IMAD_HI = _asm("mad.hi.u32 $0, $0, 0xD2511F53, 0x7F4A7C15;")
    IADD = _asm("add.u32 $0, $0, $1;", "add.u32 $1, $1, $0;")
    # four registers, so ptxas cannot fuse two LOP3s into one (each has > 3 inputs)
    LOP3 = gl.constexpr("{ " + " ".join(
        ["lop3.b32 $0, $0, $1, $2, 0x96; lop3.b32 $1, $1, $2, $3, 0xE8; "
         "lop3.b32 $2, $2, $3, $0, 0x96; lop3.b32 $3, $3, $0, $1, 0xE8;"] * (STEP // 4)) + " }")
    IADD3 = gl.constexpr("{ .reg .u32 t; " + " ".join(
        ["add.u32 t, $0, $1; add.u32 $0, t, $2; add.u32 t, $1, $2; add.u32 $1, t, $3; "
         "add.u32 t, $2, $3; add.u32 $2, t, $0; add.u32 t, $3, $0; add.u32 $3, t, $1;"]
        * (STEP // 4)) + " }")
    LEA_HI = gl.constexpr("{ .reg .u32 t; " + " ".join(
        ["shr.u32 t, $0, 16; add.u32 $1, t, $1; shr.u32 t, $1, 16; add.u32 $2, t, $2; "
         "shr.u32 t, $2, 16; add.u32 $3, t, $3; shr.u32 t, $3, 16; add.u32 $0, t, $0;"]
        * (STEP // 4)) + " }")
    SHF = _asm("shf.l.wrap.b32 $0, $0, $1, 7;", "shf.l.wrap.b32 $1, $1, $0, 13;")
    PRMT = _asm("prmt.b32 $0, $0, $1, 0x5410;", "prmt.b32 $1, $1, $0, 0x3276;")
    I2F = _asm("cvt.rn.f32.u32 f, $0;", "mov.b32 $0, f;")  # the float's bits feed the next
    F2I = _asm("mov.b32 f, $0;", "cvt.rzi.u32.f32 $0, f;")

    @gluon.jit
    def _one(x, ASM: gl.constexpr):
        return gl.inline_asm_elementwise(ASM, "=r,0", [x], dtype=gl.uint32, is_pure=True, pack=1)

    @gluon.jit
    def _one_f(x, ASM: gl.constexpr):
        return gl.inline_asm_elementwise(ASM, "=f,0", [x], dtype=gl.float32, is_pure=True, pack=1)

    @gluon.jit
    def _two(x, y, ASM: gl.constexpr):
        """Two chains that feed each other (no instruction of the block folds away)."""
        return gl.inline_asm_elementwise(ASM, "=r,=r,0,1", [x, y], dtype=(gl.uint32, gl.uint32),
                                         is_pure=True, pack=1)

    @gluon.jit
    def _two_f(x, y, ASM: gl.constexpr):
        return gl.inline_asm_elementwise(ASM, "=f,=f,0,1", [x, y],
                                         dtype=(gl.float32, gl.float32), is_pure=True, pack=1)

    @gluon.jit
    def _four(x, y, ASM: gl.constexpr):
        """Four chains (two fused LOP3s would have more than three inputs)."""
        return gl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,0,1,2,3", [x, y, x ^ y, x + y],
                                         dtype=(gl.uint32, gl.uint32, gl.uint32, gl.uint32),
                                         is_pure=True, pack=1)

    @gluon.jit
    def _alu_step(x, y, KIND: gl.constexpr):
        if KIND == "ffma":
            x = _one_f(x, FFMA)
        elif KIND == "fmul":
            x = _one_f(x, FMUL)
        elif KIND == "fadd":
            x = _one_f(x, FADD)
        elif KIND == "dfma":
            x = _one_f(x, DFMA)
        elif KIND == "mufu":
            x = _one_f(x, MUFU)
        elif KIND == "fmnmx":
            x, y = _two_f(x, y, FMNMX)
        elif KIND == "imad":
            x = _one(x, IMAD)
        elif KIND == "imad_hi":
            x = _one(x, IMAD_HI)
        elif KIND == "imad_wide":
            x = _one(x, IMAD_WIDE)
        elif KIND == "hfma2":
            x = _one(x, HFMA2)
        elif KIND == "lop_iadd":
            x = _one(x, LOP_IADD)
        elif KIND == "i2f":
            x = _one(x, I2F)
        elif KIND == "f2i":
            x = _one(x, F2I)
        elif KIND == "iadd":
            x, y = _two(x, y, IADD)
        elif KIND == "lop3" or KIND == "iadd3" or KIND == "lea_hi":
            if KIND == "lop3":
                x, y, z, w = _four(x, y, LOP3)
            elif KIND == "iadd3":
                x, y, z, w = _four(x, y, IADD3)
            else:
                x, y, z, w = _four(x, y, LEA_HI)
            x = x ^ z
            y = y ^ w
        elif KIND == "shf":
            x, y = _two(x, y, SHF)
        else:
            gl.static_assert(KIND == "prmt", "unknown KIND")
            x, y = _two(x, y, PRMT)
        return x, y

    @gluon.jit
    def _mma_part(a_s, b_s, clk_ptr, out_ptr, n_mma, n_alu, KIND: gl.constexpr):
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
    def _alu_part(a_s, b_s, clk_ptr, out_ptr, n_mma, n_alu, KIND: gl.constexpr):
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
        elif (KIND == "ffma" or KIND == "fmul" or KIND == "fadd" or KIND == "fmnmx"
              or KIND == "dfma" or KIND == "mufu"):
            x = i.to(gl.float32) * 1e-3 + 1.5
            y = x * 0.5
            for s in range(n_alu):
                x, y = _alu_step(x, y, KIND)
            x = x + y
        else:
            x = i.to(gl.uint32)
            y = x * 3 + 1
            for s in range(n_alu):
                x, y = _alu_step(x, y, KIND)
            x = x ^ y
        t1 = sm_clock()
        gl.store(clk_ptr + 3 * pid + 1, t1 - t0)
        gl.store(out_ptr + 2 * pid + 1, gl.sum(x.to(gl.float32), axis=0))

    @gluon.jit
    def contention_kernel(a_ptr, b_ptr, clk_ptr, out_ptr, n_mma, n_alu, KIND: gl.constexpr,
                          ALU_REGS: gl.constexpr):
        """a, b: [128, 64] bf16 (the wgmma's operands, copied to shared memory once);
        clk [grid, 3] int64 ← elapsed cycles of (wgmma loop, ALU loop) and the SM id;
        out [grid, 2] fp32 ← their results, so neither loop is dead code. n_mma = 0 or
        n_alu = 0 runs one loop alone."""
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
            (_mma_part, (a_s, b_s, clk_ptr, out_ptr, n_mma, n_alu, KIND)),
            (_alu_part, (a_s, b_s, clk_ptr, out_ptr, n_mma, n_alu, KIND)),
        ], [4], [ALU_REGS])
