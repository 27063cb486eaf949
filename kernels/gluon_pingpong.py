"""Stage 1 for large batches on Hopper, ping-pong (Gluon): the records of
gluon_sample.ws_records_kernel with the epilogue run by the matmul warps on their own
accumulator registers.

Two consumer warpgroups take a program's tiles alternately and a 1-warp loader feeds both
from one TMA ring:

    loader      (1 warp)    W [128, BLOCK_K] and h [BLOCK_B, BLOCK_K] into STAGES slots, tiles
                            in order
    consumer 0  (default)   wgmma over D for tiles 0, 2, 4, ... of this program, then the
                            tile's records straight from the accumulator registers
    consumer 1  (4 warps)   the same for tiles 1, 3, 5, ...

A consumer starts a tile's MMAs only once the other has issued all of the previous tile's
(mbarrier mma_done): the MMAs stay in tile order, so while one warpgroup turns its tile into
records the other keeps the tensor cores busy, and the ring's phases stay unambiguous (every
slot of the previous tile is loaded before anyone waits on the next). There is no fp32
hand-off through shared memory (the ws kernel's 64 KB buffer and its store/load passes).

A second row tile (EXTRA_B = 32 or 64, 129 to 128 + EXTRA_B rows, one sample): the loader
also brings the batch's rows past 128 ([EXTRA_B, BLOCK_K] per stage) and each consumer runs
two wgmmas per K step on the same W tile, into [128, 128] and [128, EXTRA_B] accumulators,
then makes both tiles' records. W then goes from L2 to shared memory once per tile instead
of once per 128 rows, the traffic that bounds this kernel at 129-255 rows (docs/design.md).

Philox groups in registers: a wgmma accumulator [128, N] gives each thread the rows
64r + 16w + 8h + j (r, h ∈ {0, 1}; w the warp, j = lane // 4). The loader's TMA view puts
token 32w + 4j + 2r + h of the tile at that row, so a thread's four rows with the same
(w, j) are tokens 4q + a (q = 8w + j, a = 2r + h): one Philox call, four tokens, the same
bits as fused_sample.gumbel_noise_tile. W is read as the view [2, V/32, 2, 8, D] (r, 4·tile
+ w, h, j, k), which needs V_rows % 32 == 0 (tpsample.plan.gluon_refusal).
"""
from .gluon_compat import AVAILABLE


if AVAILABLE:
    from .gluon_compat import (gl, gluon, mbarrier, reinterpret, thread_barrier, tma_load,
                               warpgroup_mma, warpgroup_mma_wait)

    from .fused_sample import CDF_PICK_STREAM, CDF_STREAM, TWO_POW_M23, philox
    from .gluon_sample import (_exp_or_0, _nan_max, best_lane, block_start, noise_coef,
                               sm_clock, store_records, transform)

    @gluon.jit
    def _loader(w_desc, h_desc, h2_desc, w_bufs, h_bufs, h2_bufs, ready, empty, mma_done,
                part_a0, part_a1, part_b0, part_b1, params0, params1, bias_ptr, inv_temp_ptr,
                seed_ptr, offset_ptr, rec_ptr, B, n_real, vocab_start, num_samples,
                rec_stride_s, rec_stride_b, rec_stride_t, peer_ptrs, parity_ptr, trace_ptr,
                num_tiles, num_b_tiles, k_steps,
                HAS_BIAS: gl.constexpr, TILE_MASS: gl.constexpr, NUM_PEERS: gl.constexpr,
                STAGES: gl.constexpr, SINGLE: gl.constexpr, WHICH: gl.constexpr,
                TRACE: gl.constexpr, CDF: gl.constexpr, EXTRA_B: gl.constexpr):
        # (worker partitions share one signature: everything after mma_done is the consumer's)
        BLOCK_K: gl.constexpr = w_desc.block_type.shape[4]
        BLOCK_B: gl.constexpr = h_desc.block_type.shape[0]
        it = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            v32 = (tile // num_b_tiles) * 4  # the tile's first 32-row group
            if EXTRA_B > 0:  # (one row block: nothing to move)
                b0 = 0
            else:
                b0 = block_start(tile % num_b_tiles, BLOCK_B, B)
            for k in range(k_steps):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                if EXTRA_B > 0:
                    mbarrier.expect(bar, w_desc.block_type.nbytes + h_desc.block_type.nbytes
                                    + h2_desc.block_type.nbytes)
                else:
                    mbarrier.expect(bar, w_desc.block_type.nbytes + h_desc.block_type.nbytes)
                tma_load(w_desc, [0, v32, 0, 0, k * BLOCK_K], bar, w_bufs.index(s))
                tma_load(h_desc, [b0, k * BLOCK_K], bar, h_bufs.index(s))
                if EXTRA_B > 0:  # the batch's rows past the first 128 (num_b_tiles is 1)
                    tma_load(h2_desc, [b0 + 128, k * BLOCK_K], bar, h2_bufs.index(s))
                it += 1

    @gluon.jit
    def _consumer(w_desc, h_desc, h2_desc, w_bufs, h_bufs, h2_bufs, ready, empty, mma_done,
                  part_a0, part_a1, part_b0, part_b1, params0, params1, bias_ptr, inv_temp_ptr,
                  seed_ptr, offset_ptr, rec_ptr, B, n_real, vocab_start, num_samples,
                  rec_stride_s, rec_stride_b, rec_stride_t, peer_ptrs, parity_ptr, trace_ptr,
                  num_tiles, num_b_tiles, k_steps, HAS_BIAS: gl.constexpr, TILE_MASS: gl.constexpr,
                  NUM_PEERS: gl.constexpr, STAGES: gl.constexpr, SINGLE: gl.constexpr,
                  WHICH: gl.constexpr, TRACE: gl.constexpr, CDF: gl.constexpr,
                  EXTRA_B: gl.constexpr):
        BLOCK_K: gl.constexpr = w_desc.block_type.shape[4]
        BLOCK_B: gl.constexpr = h_desc.block_type.shape[0]
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_B, 16])
        N2: gl.constexpr = EXTRA_B if EXTRA_B > 0 else 32  # (a valid shape when unused)
        layout2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, N2, 16])
        if WHICH == 0:  # this consumer's partials and parameters (see _tile_records)
            part_a = part_a0
            part_b = part_b0
            params = params0
        else:
            part_a = part_a1
            part_b = part_b1
            params = params1
        nprog = gl.num_programs(0)
        j = 0
        for tile in range(gl.program_id(0) + WHICH * nprog, num_tiles, 2 * nprog):
            seq = 2 * j + WHICH  # the tile's place in this program's sequence (the loader's)
            if TRACE:
                gl.store(trace_ptr + 4 * tile, sm_clock())
            if seq > 0:  # the other consumer has issued every MMA of tile seq - 1
                mbarrier.wait(mma_done.index(1 - WHICH), ((seq - 1) // 2) & 1)
            it = seq * k_steps
            if TRACE:
                gl.store(trace_ptr + 4 * tile + 1, sm_clock())
            acc = gl.zeros([128, BLOCK_B], gl.float32, layout)
            if EXTRA_B > 0:
                acc2 = gl.zeros([128, N2], gl.float32, layout2)
            for k in range(k_steps):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                w_tile = w_bufs.index(s).reshape([128, BLOCK_K])
                acc = warpgroup_mma(w_tile, h_bufs.index(s).permute((1, 0)), acc, is_async=True)
                # the previous step's MMAs are done: its slot goes back to the loader
                if EXTRA_B > 0:  # the same W tile against the batch's rows past 128
                    acc2 = warpgroup_mma(w_tile, h2_bufs.index(s).permute((1, 0)), acc2,
                                         is_async=True)
                    acc, acc2 = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc2))
                else:
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=k > 0)
                it += 1
            mbarrier.arrive(mma_done.index(WHICH))
            if EXTRA_B > 0:
                acc, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc2))
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))
            if TRACE:
                gl.store(trace_ptr + 4 * tile + 2, sm_clock())
            if EXTRA_B > 0:  # (one row block)
                b0 = (tile % num_b_tiles) * BLOCK_B
            else:
                b0 = block_start(tile % num_b_tiles, BLOCK_B, B)
            _tile_records(acc, part_a, part_b, params, tile // num_b_tiles, b0,
                          (tile % num_b_tiles) * BLOCK_B, bias_ptr,
                          inv_temp_ptr, seed_ptr, offset_ptr, rec_ptr, B, n_real, vocab_start,
                          num_samples, rec_stride_s, rec_stride_b, rec_stride_t, peer_ptrs,
                          parity_ptr, HAS_BIAS, TILE_MASS, NUM_PEERS, SINGLE, CDF,
                          EXTRA_B == 0)
            if EXTRA_B > 0:
                _tile_records(acc2, part_a, part_b, params, tile, 128, 128, bias_ptr,
                              inv_temp_ptr, seed_ptr, offset_ptr, rec_ptr, B, n_real, vocab_start,
                              num_samples, rec_stride_s, rec_stride_b, rec_stride_t, peer_ptrs,
                              parity_ptr, HAS_BIAS, TILE_MASS, NUM_PEERS, SINGLE, CDF, False)
            if TRACE:
                gl.store(trace_ptr + 4 * tile + 3, sm_clock())
            j += 1

    @gluon.jit
    def _quarters(x):
        """x [..., 2, 2] → x[..., 0, 0], x[..., 0, 1], x[..., 1, 0], x[..., 1, 1] (register
        moves only: both trailing dimensions are held within each thread)."""
        lo, hi = gl.split(x)
        x00, x10 = gl.split(lo)
        x01, x11 = gl.split(hi)
        return x00, x01, x10, x11

    @gluon.jit
    def _tile_records(acc, part_a, part_b, params, pid_v, b0, b_lo, bias_ptr, inv_temp_ptr,
                      seed_ptr, offset_ptr, rec_ptr, B, n_real, vocab_start, num_samples,
                      rec_stride_s, rec_stride_b, rec_stride_t, peer_ptrs, parity_ptr,
                      HAS_BIAS: gl.constexpr, TILE_MASS: gl.constexpr, NUM_PEERS: gl.constexpr,
                      SINGLE: gl.constexpr, CDF: gl.constexpr, LOWER: gl.constexpr = True):
        """Records of the tile (pid_v, columns [max(b0, b_lo), b0 + 128): the columns below b_lo
        are the previous row block's, see gluon_sample.block_start; LOWER False: no such columns,
        b_lo unused) from the accumulator
        acc [128, 128] in wgmma layout, in 8 chunks of 16 columns (per-column keys and scales
        for 4 columns per thread).

        A column's 128 rows lie in 4 warps × 8 lanes × 4 registers. Each warp reduces its 32
        rows with shuffles alone and leaves its partials in shared memory: part_a
        [8, 4, 16, 2] (chunk, warp, column: max, log-mass), part_b [8, 4, 16, 4] (best score,
        its row, its logit); one barrier later each thread merges the 4 warps' partials of a
        column (_merge_warps). The columns' parameters are staged in `params` once per tile,
        so no chunk waits on a global load.

        SINGLE (one sample): a runtime loop over the chunks, rotating them through the loop's
        registers, so the code is one chunk long: unrolled, the 8 chunks × 2 consumers
        (~290 KB of SASS) missed the instruction cache on most issues (ncu: "no instruction"
        was the top stall). Otherwise the transformed logits of all chunks stay in registers
        for the sample loop (unrolled; S > 1 is the rare case).

        CDF (one sample, with TILE_MASS): the records of the "cdf" merge (tpsample/merge.py,
        fact 6). A warp's 32 rows of a column are one subgroup: each warp picks its token by
        inverse CDF over the weights its log-mass already computes (_chunk_cdf), and
        _merge_warps picks the warp by mass. The five uniforms per column are drawn once per
        tile with the parameters (_stage_params): no per-token noise."""
        N: gl.constexpr = acc.shape[1]
        gl.static_assert(N == 128 or (SINGLE and (N == 32 or N == 64)),
                         "ping-pong tiles are [128, 128], or [128, 32 / 64] with one sample")
        gl.static_assert(not CDF or (SINGLE and TILE_MASS), "CDF needs SINGLE and TILE_MASS")
        if N == 128:
            # rows 64r + 16w + 8h + j, columns 64c2 + 32c1 + 16c0 + n
            # → (w, j, n, r, h, c2, c1, c0)
            x = gl.permute(gl.reshape(acc, [2, 4, 2, 8, 2, 2, 2, 16]), [1, 3, 7, 0, 2, 4, 5, 6])
            k0, k1, k2, k3 = _quarters(x)  # chunks 2·c1 + c0 (+ 4 where c2 = 1)
            k0, k4 = gl.split(k0)
            k1, k5 = gl.split(k1)
            k2, k6 = gl.split(k2)
            k3, k7 = gl.split(k3)
        tile_start = vocab_start + pid_v * 128
        thread_barrier()  # the previous tile's partials and parameters have been read
        _stage_params(params, b0, tile_start, inv_temp_ptr, seed_ptr, offset_ptr, B, CDF)
        thread_barrier()
        # a narrow tile's chunks past N / 16 keep the previous tile's partials: _merge_warps
        # merges them into columns b0 + N ... >= B (the plan's EXTRA_B covers the batch),
        # which it does not store
        if N == 32:  # columns 16c0 + n → (w, j, n, r, h, c0)
            k0, k1 = gl.split(gl.permute(gl.reshape(acc, [2, 4, 2, 8, 2, 16]),
                                         [1, 3, 5, 0, 2, 4]))
            for c in range(0, 2):
                _chunk_one_sample(k0, c, part_a, part_b, params, pid_v, bias_ptr, n_real,
                                  tile_start, HAS_BIAS, TILE_MASS, CDF)
                k0, k1 = k1, k0
            thread_barrier()
            _merge_warps(part_a, part_b, params, pid_v, b0, b_lo, 0, tile_start, rec_ptr, B,
                         rec_stride_s, rec_stride_b, rec_stride_t, peer_ptrs, parity_ptr,
                         TILE_MASS, NUM_PEERS, CDF, LOWER)
        elif N == 64:  # columns 32c1 + 16c0 + n → (w, j, n, r, h, c1, c0)
            k0, k1, k2, k3 = _quarters(gl.permute(gl.reshape(acc, [2, 4, 2, 8, 2, 2, 16]),
                                                  [1, 3, 6, 0, 2, 4, 5]))
            for c in range(0, 4):
                _chunk_one_sample(k0, c, part_a, part_b, params, pid_v, bias_ptr, n_real,
                                  tile_start, HAS_BIAS, TILE_MASS, CDF)
                k0, k1, k2, k3 = k1, k2, k3, k0
            thread_barrier()
            _merge_warps(part_a, part_b, params, pid_v, b0, b_lo, 0, tile_start, rec_ptr, B,
                         rec_stride_s, rec_stride_b, rec_stride_t, peer_ptrs, parity_ptr,
                         TILE_MASS, NUM_PEERS, CDF, LOWER)
        elif SINGLE:
            for c in range(0, 8):  # rotate the chunks not yet done through the registers
                _chunk_one_sample(k0, c, part_a, part_b, params, pid_v, bias_ptr, n_real,
                                  tile_start, HAS_BIAS, TILE_MASS, CDF)
                k0, k1, k2, k3, k4, k5, k6, k7 = k1, k2, k3, k4, k5, k6, k7, k0
            thread_barrier()
            _merge_warps(part_a, part_b, params, pid_v, b0, b_lo, 0, tile_start, rec_ptr, B,
                         rec_stride_s, rec_stride_b, rec_stride_t, peer_ptrs, parity_ptr,
                         TILE_MASS, NUM_PEERS, CDF, LOWER)
        else:
            l0 = _chunk_logits(k0, 0, part_a, params, pid_v, bias_ptr, n_real, HAS_BIAS, TILE_MASS)
            l1 = _chunk_logits(k1, 1, part_a, params, pid_v, bias_ptr, n_real, HAS_BIAS, TILE_MASS)
            l2 = _chunk_logits(k2, 2, part_a, params, pid_v, bias_ptr, n_real, HAS_BIAS, TILE_MASS)
            l3 = _chunk_logits(k3, 3, part_a, params, pid_v, bias_ptr, n_real, HAS_BIAS, TILE_MASS)
            l4 = _chunk_logits(k4, 4, part_a, params, pid_v, bias_ptr, n_real, HAS_BIAS, TILE_MASS)
            l5 = _chunk_logits(k5, 5, part_a, params, pid_v, bias_ptr, n_real, HAS_BIAS, TILE_MASS)
            l6 = _chunk_logits(k6, 6, part_a, params, pid_v, bias_ptr, n_real, HAS_BIAS, TILE_MASS)
            l7 = _chunk_logits(k7, 7, part_a, params, pid_v, bias_ptr, n_real, HAS_BIAS, TILE_MASS)
            for s in range(num_samples):
                thread_barrier()  # the previous sample's partials have been read
                _chunk_noise(l0, 0, part_b, params, s, tile_start, TILE_MASS)
                _chunk_noise(l1, 1, part_b, params, s, tile_start, TILE_MASS)
                _chunk_noise(l2, 2, part_b, params, s, tile_start, TILE_MASS)
                _chunk_noise(l3, 3, part_b, params, s, tile_start, TILE_MASS)
                _chunk_noise(l4, 4, part_b, params, s, tile_start, TILE_MASS)
                _chunk_noise(l5, 5, part_b, params, s, tile_start, TILE_MASS)
                _chunk_noise(l6, 6, part_b, params, s, tile_start, TILE_MASS)
                _chunk_noise(l7, 7, part_b, params, s, tile_start, TILE_MASS)
                thread_barrier()
                _merge_warps(part_a, part_b, params, pid_v, b0, b_lo, s, tile_start, rec_ptr, B,
                             rec_stride_s, rec_stride_b, rec_stride_t, peer_ptrs, parity_ptr,
                             TILE_MASS, NUM_PEERS, False, LOWER)

    @gluon.jit
    def _chunk_one_sample(x, c, part_a, part_b, params, pid_v, bias_ptr, n_real, tile_start,
                          HAS_BIAS: gl.constexpr, TILE_MASS: gl.constexpr, CDF: gl.constexpr):
        """The partials of chunk c (x: its accumulator registers) for the one-sample records."""
        if CDF:
            _chunk_cdf(x, c, part_a, part_b, params, pid_v, bias_ptr, n_real, HAS_BIAS)
        else:
            lanes = _chunk_logits(x, c, part_a, params, pid_v, bias_ptr, n_real, HAS_BIAS,
                                  TILE_MASS)
            _chunk_noise(lanes, c, part_b, params, gl.to_tensor(0), tile_start, TILE_MASS)

    @gluon.jit
    def _stage_params(params, b0, tile_start, inv_temp_ptr, seed_ptr, offset_ptr, B,
                      CDF: gl.constexpr):
        """params [64, 16] int32 ([128, 16] with CDF), row 8k + chunk ← word k of the tile's
        columns: 1 / T (bits), seed and offset (low and high words). One coalesced load per
        thread instead of one per chunk. CDF: rows 40 + chunk ← the subgroup-choice uniform
        (bits), rows 64 + 4·chunk + w ← the uniform of warp w's subgroup
        (noise.cdf_uniforms: one Philox call each, sample 0)."""
        col_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        offs = b0 + gl.arange(0, 128, layout=col_l)
        mask = offs < B
        inv_t = gl.load(inv_temp_ptr + offs, mask=mask, other=1.0)
        seed = gl.load(seed_ptr + offs, mask=mask, other=0)
        off = gl.load(offset_ptr + offs, mask=mask, other=0)
        P_ROWS: gl.constexpr = 128 if CDF else 64  # (a view must keep the buffer's size)
        rows = reinterpret(params, gl.int32, [P_ROWS, 16],
                           gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        rows.slice(0, 8).store(gl.reshape(inv_t.to(gl.int32, bitcast=True), [8, 16]))
        rows.slice(8, 8).store(gl.reshape(seed.to(gl.int32), [8, 16]))
        rows.slice(16, 8).store(gl.reshape((seed >> 32).to(gl.int32), [8, 16]))
        rows.slice(24, 8).store(gl.reshape(off.to(gl.int32), [8, 16]))
        rows.slice(32, 8).store(gl.reshape((off >> 32).to(gl.int32), [8, 16]))
        if CDF:
            zero = gl.zeros_like(offs).to(gl.uint32)
            key = seed + zero.to(gl.int64)
            c0 = (tile_start >> 2).to(gl.uint32) + zero
            off_lo = off.to(gl.uint32) + zero
            off_hi = (off >> 32).to(gl.uint32) + zero
            r0, r1, r2, r3 = philox(key, c0, zero + CDF_STREAM, off_lo, off_hi)
            p0, _p1, _p2, _p3 = philox(key, c0, zero + CDF_PICK_STREAM, off_lo, off_hi)
            rows.slice(40, 8).store(gl.reshape(_uniform_bits(p0), [8, 16]))
            u = gl.join(gl.join(_uniform_bits(r0), _uniform_bits(r2)),
                        gl.join(_uniform_bits(r1), _uniform_bits(r3)))  # [128, 2, 2]: word 2i + k
            u = gl.permute(gl.reshape(u, [8, 16, 4]), [0, 2, 1])  # [chunk, w, column]
            per_warp = reinterpret(params, gl.int32, [32, 4, 16],
                                   gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
            per_warp.slice(16, 8, dim=0).store(u)  # rows 64 + 4·chunk + w

    @gluon.jit
    def _uniform_bits(x):
        """noise.bits_to_uniform of Philox words x, as int32 bits (for the parameter rows)."""
        u = ((x >> 9).to(gl.float32) + 0.5) * TWO_POW_M23
        return u.to(gl.int32, bitcast=True)

    @gluon.jit
    def _chunk_param(params, k: gl.constexpr, c, lane):
        """Word k of chunk c's columns' parameters, [1, 1, N] in the layout of lane [4, 8, N]."""
        layout: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, lane.type.layout))
        v = params.index(8 * k + c).load(layout)
        return gl.expand_dims(gl.expand_dims(v, 0), 1)

    @gluon.jit
    def _chunk_index(lane):
        """(w [4, 1, 1], j [1, 8, 1]) in the layout of lane [4, 8, N]."""
        layout: gl.constexpr = lane.type.layout
        w = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
        j = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
        return gl.expand_dims(gl.expand_dims(w, 1), 2), gl.expand_dims(gl.expand_dims(j, 0), 2)

    @gluon.jit
    def _chunk_lanes(x, c, params, pid_v, bias_ptr, n_real, HAS_BIAS: gl.constexpr):
        """Chunk c of the tile, x [4, 8, N, 2, 2] (w, j, n, r, h): its four lanes' transformed
        logits [4, 8, N] (lane a = 2r + h holds token 4(8w + j) + a), each warp's max over
        its rows [4, N] (NaN if any is NaN) and the columns' 1 / T [1, 1, N]."""
        a0, a1, a2, a3 = _quarters(x)
        w, j = _chunk_index(a0)
        inv_t = _chunk_param(params, 0, c, a0).to(gl.float32, bitcast=True)
        scale = gl.where(inv_t == 0.0, 1.0, inv_t)
        row0 = pid_v * 128 + 4 * (8 * w + j)
        l0 = transform(a0, row0, scale, bias_ptr, n_real, HAS_BIAS)
        l1 = transform(a1, row0 + 1, scale, bias_ptr, n_real, HAS_BIAS)
        l2 = transform(a2, row0 + 2, scale, bias_ptr, n_real, HAS_BIAS)
        l3 = transform(a3, row0 + 3, scale, bias_ptr, n_real, HAS_BIAS)
        m = gl.reduce(_nan_max(_nan_max(l0, l1), _nan_max(l2, l3)), 1, _nan_max)
        return l0, l1, l2, l3, m, inv_t

    @gluon.jit
    def _chunk_logits(x, c, part_a, params, pid_v, bias_ptr, n_real,
                      HAS_BIAS: gl.constexpr, TILE_MASS: gl.constexpr):
        """Chunk c of the tile: _chunk_lanes' transformed logits; each warp's max and log-mass
        (0 without TILE_MASS) over its rows go to part_a[c, w, n]."""
        l0, l1, l2, l3, m, inv_t = _chunk_lanes(x, c, params, pid_v, bias_ptr, n_real, HAS_BIAS)
        if TILE_MASS:
            m_safe = gl.expand_dims(gl.where(m == float("-inf"), 0.0, m), 1)
            mass = _exp_or_0(l0, m_safe) + _exp_or_0(l1, m_safe)
            mass = gl.sum((mass + _exp_or_0(l2, m_safe)) + _exp_or_0(l3, m_safe), axis=1)
        else:
            mass = gl.zeros_like(m)
        part_a.index(c).store(gl.join(m, mass))
        return l0, l1, l2, l3

    @gluon.jit
    def _chunk_cdf(x, c, part_a, part_b, params, pid_v, bias_ptr, n_real, HAS_BIAS: gl.constexpr):
        """Chunk c of the tile for the "cdf" records: what _chunk_logits stores to part_a
        (each warp's max and log-mass), and each warp's token by inverse CDF to part_b[c, w, n]
        (as _chunk_noise lays it out: the token's logit, its row, its logit). Warp w's rows
        are the tile's ids 32w + [0, 32): a subgroup of fact 6 (tpsample/merge.py). Greedy
        columns take the warp's first maximum."""
        l0, l1, l2, l3, m, inv_t = _chunk_lanes(x, c, params, pid_v, bias_ptr, n_real, HAS_BIAS)
        _w, j = _chunk_index(l0)
        m3 = gl.expand_dims(m, 1)
        m_safe = gl.where(m3 == float("-inf"), 0.0, m3)
        # the weights and their running sums in id order (4q + a), as the log-mass sums them
        e0 = _weight(l0, m_safe)
        e1 = _weight(l1, m_safe)
        e2 = _weight(l2, m_safe)
        e3 = _weight(l3, m_safe)
        c1 = e0 + e1
        c2 = c1 + e2
        c3 = c2 + e3
        mass = gl.sum(c3, axis=1)
        part_a.index(c).store(gl.join(m, mass))
        # the warp's sum over lanes j' < j; Gluon scans blocked layouts only: this one holds
        # the same elements in the same threads as the accumulator's [4, 8, 16] view
        scan_l: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, 8, 4], [4, 1, 1], [2, 1, 0])
        before = gl.associative_scan(gl.convert_layout(c3, scan_l), 1, _add)
        before = gl.convert_layout(before, c3.type.layout) - c3
        u_layout: gl.constexpr = gl.SliceLayout(1, l0.type.layout)
        # (a layout of one rank less than the view: .index drops the leading dimension)
        u = reinterpret(params, gl.int32, [32, 4, 16], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        u = gl.expand_dims(u.index(16 + c).load(u_layout).to(gl.float32, bitcast=True), 1)
        target = u * gl.expand_dims(mass, 1)
        greedy = inv_t == 0.0
        pos = 4 * j
        k, lg = _cdf_key(l3, e3, before + c3, target, m3, greedy, pos + 3)
        k, lg = _cdf_lower(k, lg, _cdf_key(l2, e2, before + c2, target, m3, greedy, pos + 2))
        k, lg = _cdf_lower(k, lg, _cdf_key(l1, e1, before + c1, target, m3, greedy, pos + 1))
        k, lg = _cdf_lower(k, lg, _cdf_key(l0, e0, before + e0, target, m3, greedy, pos))
        key, logit = gl.reduce((k, lg), 1, _cdf_min)  # [4, N]
        idx = gl.where(key < 32, key, gl.where(key < 127, 95 - key, 0))
        idx = 32 * gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(1, key.type.layout)),
                                  1) + idx  # the warp's first id in the tile
        part = gl.join(gl.join(logit, logit), gl.join(idx.to(gl.float32), logit))
        part_b.index(c).store(gl.reshape(part, [4, l0.shape[2], 4]))

    @gluon.jit
    def _weight(la, m):
        """exp(la - m) on the MUFU, denormal results flushed to 0 (a token 87 nats below its
        subgroup's max cannot be drawn, as it cannot at 19.5 nats in the Gumbel-max path). A NaN
        logit needs no mapping: it made m NaN, so its row is degenerate (tpsample/merge.py)."""
        x = (la - m) * 1.4426950408889634
        return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                         dtype=gl.float32, is_pure=True, pack=1)

    @gluon.jit
    def _cdf_key(la, ea, run, target, m, greedy, pos):
        """merge.inverse_cdf as a key to minimise over the subgroup: pos (the id in it) where
        the running sum `run` first exceeds the target with a positive weight, 95 - pos for
        the other positive weights (the last of them if nothing crosses), 127 for weight 0;
        greedy columns: pos at the maximum. Returns (key, la)."""
        cross = gl.where(greedy, la == m, (run > target) & (ea > 0.0))
        key = gl.where(cross, pos, gl.where(ea > 0.0, 95 - pos, 127))
        return key, la

    @gluon.jit
    def _cdf_lower(k, lg, other):
        """The smaller key of (k, lg) and other = (key, logit) (keys below 127 are distinct)."""
        k2, lg2 = other
        take = k2 < k
        return gl.where(take, k2, k), gl.where(take, lg2, lg)

    @gluon.jit
    def _cdf_min(k1, l1, k2, l2):
        take = k2 < k1
        return gl.where(take, k2, k1), gl.where(take, l2, l1)

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _chunk_noise(lanes, c, part_b, params, s, tile_start,
                     TILE_MASS: gl.constexpr):
        """Sample s of chunk c (lanes: _chunk_logits' four [4, 8, N]): each warp's best
        perturbed score, its row and its logit go to part_b[c, w, n]. The noise is
        gluon_sample._chunk_records' (Philox (seed; 4-token group, s, offset), word a)."""
        l0, l1, l2, l3 = lanes
        N: gl.constexpr = l0.shape[2]
        w, j = _chunk_index(l0)
        q = 8 * w + j
        coef = noise_coef(_chunk_param(params, 0, c, l0).to(gl.float32, bitcast=True))
        seed = ((_chunk_param(params, 2, c, l0).to(gl.int64) << 32)
                | (_chunk_param(params, 1, c, l0).to(gl.int64) & 0xFFFFFFFF))
        zero = gl.zeros_like(l0).to(gl.uint32)
        off_lo = _chunk_param(params, 3, c, l0).to(gl.uint32, bitcast=True) + zero
        off_hi = _chunk_param(params, 4, c, l0).to(gl.uint32, bitcast=True) + zero
        ctr = ((tile_start >> 2) + q).to(gl.uint32) + zero
        r0, r1, r2, r3 = philox(seed + zero.to(gl.int64), ctr, zero + s.to(gl.uint32), off_lo,
                                off_hi)
        zb, za = best_lane(l0, l1, l2, l3, coef, r0, r1, r2, r3)
        # the warp's best score, its row (first on ties: smallest) and its logit in one
        # reduction over the 8 lanes: no reduction waits for another's result
        if TILE_MASS:
            pick = gl.where(za == 0, l0, gl.where(za == 1, l1, gl.where(za == 2, l2, l3)))
        else:
            pick = gl.zeros_like(l0)
        best, idx, logit = gl.reduce((zb, 4 * q + za, pick), 1, _argmax_combine)  # [4, N]
        # [4, N, 2, 2] → [4, N, 4]: (best, row, logit, logit)
        part = gl.join(gl.join(best, logit), gl.join(idx.to(gl.float32), logit))
        part_b.index(c).store(gl.reshape(part, [4, N, 4]))

    @gluon.jit
    def _argmax_combine(b1, i1, l1, b2, i2, l2):
        """(score, row, logit) of the better of two candidates: the higher score, the smaller
        row on ties (scores are never NaN: _perturb maps NaN logits to -inf)."""
        take2 = (b2 > b1) | ((b2 == b1) & (i2 < i1))
        return gl.where(take2, b2, b1), gl.where(take2, i2, i1), gl.where(take2, l2, l1)

    @gluon.jit
    def _merge_warps(part_a, part_b, params, pid_v, b0, b_lo, s, tile_start, rec_ptr, B,
                     rec_stride_s, rec_stride_b, rec_stride_t, peer_ptrs, parity_ptr,
                     TILE_MASS: gl.constexpr, NUM_PEERS: gl.constexpr, CDF: gl.constexpr,
                     LOWER: gl.constexpr):
        """Sample s's records of the tile's 128 columns from the 4 warps' partials: a thread
        holds one column's four. The same values as one reduction over the column (the best
        score, the smallest row among equal scores, its logit); the log-mass is merged from
        per-warp masses, so its last bits can differ from the ws kernel's. CDF: the warps'
        picks (_chunk_cdf) are chosen among by inverse CDF over their masses (greedy columns:
        as above), and the score field is the token's logit."""
        # [chunk, warp, column, field]: a thread holds the 4 warps × fields of one column
        a_l: gl.constexpr = gl.BlockedLayout([1, 4, 1, 2], [2, 1, 16, 1], [4, 1, 1, 1],
                                             [3, 1, 2, 0])
        b_l: gl.constexpr = gl.BlockedLayout([1, 4, 1, 4], [2, 1, 16, 1], [4, 1, 1, 1],
                                             [3, 1, 2, 0])
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])
        pb = reinterpret(part_b, gl.float32, [8, 4, 16, 4], flat).load(b_l)
        best_w, idx_w, logit_w, _ = _quarters(gl.reshape(pb, [8, 4, 16, 2, 2]))
        best, idx, logit = gl.reduce((best_w, idx_w, logit_w), 1, _argmax_combine)  # [8, 16]
        m_w, mass_w = gl.split(reinterpret(part_a, gl.float32, [8, 4, 16, 2], flat).load(a_l))
        m = gl.reduce(m_w, 1, _nan_max)
        if TILE_MASS:
            m_safe = gl.where(m == float("-inf"), 0.0, m)
            scaled = mass_w * gl.exp(m_w - gl.expand_dims(m_safe, 1))  # the warps' Z_w / e^M
            lse = gl.where(m != m, m, m_safe + gl.log(gl.sum(scaled, axis=1)))
        else:
            lse = m
        if CDF:
            cl: gl.constexpr = gl.SliceLayout(1, m_w.type.layout)
            row_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
            rows = reinterpret(params, gl.int32, [128, 16], row_l)
            greedy = rows.slice(0, 8).load(cl).to(gl.float32, bitcast=True) == 0.0
            u = rows.slice(40, 8).load(cl).to(gl.float32, bitcast=True)
            wi = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, m_w.type.layout)))
            wi = gl.expand_dims(gl.expand_dims(wi, 0), 2)  # [1, 4, 1]
            scan_l: gl.constexpr = gl.BlockedLayout([1, 4, 1], [2, 1, 16], [4, 1, 1], [1, 2, 0])
            run = gl.associative_scan(gl.convert_layout(scaled, scan_l), 1, _add)
            run = gl.convert_layout(run, scaled.type.layout)  # (both: a_l without its last dim)
            total = gl.sum(gl.where(wi == 3, run, 0.0), axis=1)
            positive = scaled > 0.0
            cross = (run > gl.expand_dims(u * total, 1)) & positive
            key = gl.min(gl.where(cross, wi, gl.where(positive, 7 - wi, 15)), axis=1)
            pick = gl.expand_dims(gl.where(key < 4, key, gl.where(key < 15, 7 - key, 0)), 1)
            # (the same threads hold a column's partials in both: a register-only conversion)
            idx_w = gl.convert_layout(idx_w, m_w.type.layout)
            logit_w = gl.convert_layout(logit_w, m_w.type.layout)
            idx_c = gl.sum(gl.where(wi == pick, idx_w, 0.0), axis=1)
            logit_c = gl.sum(gl.where(wi == pick, logit_w, 0.0), axis=1)
            idx_c = gl.convert_layout(idx_c, idx.type.layout)
            logit_c = gl.convert_layout(logit_c, logit.type.layout)
            greedy = gl.convert_layout(greedy, idx.type.layout)
            idx = gl.where(greedy, idx, idx_c)
            logit = gl.where(greedy, logit, logit_c)
            best = logit
        col_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])  # column c·16 + n
        best = gl.convert_layout(gl.reshape(best, [128]), col_l)
        idx = gl.convert_layout(gl.reshape(idx, [128]), col_l)
        logit = gl.convert_layout(gl.reshape(logit, [128]), col_l)
        lse = gl.convert_layout(gl.reshape(lse, [128]), col_l)
        token = (tile_start + idx.to(gl.int32)).to(gl.float32)
        offs_b = b0 + gl.arange(0, 128, layout=col_l)
        if LOWER:
            mask_b = (offs_b < B) & (offs_b >= b_lo)
        else:
            mask_b = offs_b < B
        rec = offs_b.to(gl.int64) * rec_stride_b + pid_v.to(gl.int64) * rec_stride_t
        store_records(rec_ptr, peer_ptrs, parity_ptr, rec + s * rec_stride_s, best, token, logit,
                      lse, mask_b, NUM_PEERS, 4)

    @gluon.jit(do_not_specialize=["B"])
    def pp_records_kernel(
        w_desc, h_desc, h2_desc, bias_ptr, inv_temp_ptr, seed_ptr, offset_ptr, rec_ptr,
        B, n_real, vocab_start, num_samples, rec_stride_s, rec_stride_b, rec_stride_t,
        peer_ptrs, parity_ptr, trace_ptr, num_tiles, num_b_tiles, k_steps,
        HAS_BIAS: gl.constexpr, TILE_MASS: gl.constexpr, STAGES: gl.constexpr,
        LOADER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, SINGLE: gl.constexpr = False,
        NUM_PEERS: gl.constexpr = 0, TRACE: gl.constexpr = False, CDF: gl.constexpr = False,
        EXTRA_B: gl.constexpr = 0,
    ):
        """Records [S, B, T, 4] of the [128, 128] tiles (vocabulary × batch) of this program;
        see the module docstring. num_warps must be 4 (consumer 0). w_desc: the view
        [2, V_rows / 32, 2, 8, D] of W with block [2, 4, 2, 8, BLOCK_K]; h_desc: block
        [128, BLOCK_K]. NUM_PEERS > 0: the records go to every peer, as in ws_records_kernel.
        TRACE: trace_ptr [num_tiles, 4] int64 ← the tile's consumer's SM clock (clock64)
        before its wait for the other's MMAs, before its first MMA, once its MMAs are done
        and once its records are out (a plan with trace=True: tools/probe.py). CDF: the
        "cdf" merge's records (_tile_records; SINGLE and TILE_MASS only). EXTRA_B > 0
        (SINGLE, num_b_tiles 1, 128 < B <= 128 + EXTRA_B): the rows past 128 through h2_desc
        (block [EXTRA_B, BLOCK_K]) into a second accumulator (module docstring); h2_desc is
        None otherwise."""
        BLOCK_K: gl.constexpr = w_desc.block_type.shape[4]
        BLOCK_B: gl.constexpr = h_desc.block_type.shape[0]
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape,
                                           w_desc.layout)
        h_bufs = gl.allocate_shared_memory(h_desc.dtype, [STAGES, BLOCK_B, BLOCK_K], h_desc.layout)
        if EXTRA_B > 0:
            h2_bufs = gl.allocate_shared_memory(h2_desc.dtype, [STAGES, EXTRA_B, BLOCK_K],
                                                h2_desc.layout)
        else:  # (unused: the partitions' shared signature needs a value)
            h2_desc = h_desc
            h2_bufs = h_bufs
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mma_done = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        # per consumer: per-warp partials (_tile_records) and the tile's column parameters
        part_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
        param_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        part_a0 = gl.allocate_shared_memory(gl.float32, [8, 4, 16, 2], part_l)
        part_a1 = gl.allocate_shared_memory(gl.float32, [8, 4, 16, 2], part_l)
        part_b0 = gl.allocate_shared_memory(gl.float32, [8, 4, 16, 4], part_l)
        part_b1 = gl.allocate_shared_memory(gl.float32, [8, 4, 16, 4], part_l)
        P_ROWS: gl.constexpr = 128 if CDF else 64  # CDF: the uniforms too (_stage_params)
        params0 = gl.allocate_shared_memory(gl.int32, [P_ROWS, 16], param_l)
        params1 = gl.allocate_shared_memory(gl.int32, [P_ROWS, 16], param_l)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        mbarrier.init(mma_done.index(0), count=1)
        mbarrier.init(mma_done.index(1), count=1)
        # (the argument tuples are spelled out: a tuple variable loses the constexprs)
        gl.warp_specialize([
            (_consumer, (
            w_desc, h_desc, h2_desc, w_bufs, h_bufs, h2_bufs, ready, empty, mma_done, part_a0,
            part_a1, part_b0, part_b1,
            params0, params1, bias_ptr, inv_temp_ptr, seed_ptr, offset_ptr, rec_ptr, B, n_real,
            vocab_start, num_samples, rec_stride_s, rec_stride_b, rec_stride_t, peer_ptrs,
            parity_ptr, trace_ptr, num_tiles, num_b_tiles, k_steps, HAS_BIAS, TILE_MASS, NUM_PEERS,
            STAGES, SINGLE, 0, TRACE, CDF, EXTRA_B)),
            (_consumer, (
            w_desc, h_desc, h2_desc, w_bufs, h_bufs, h2_bufs, ready, empty, mma_done, part_a0,
            part_a1, part_b0, part_b1,
            params0, params1, bias_ptr, inv_temp_ptr, seed_ptr, offset_ptr, rec_ptr, B, n_real,
            vocab_start, num_samples, rec_stride_s, rec_stride_b, rec_stride_t, peer_ptrs,
            parity_ptr, trace_ptr, num_tiles, num_b_tiles, k_steps, HAS_BIAS, TILE_MASS, NUM_PEERS,
            STAGES, SINGLE, 1, TRACE, CDF, EXTRA_B)),
            (_loader, (
            w_desc, h_desc, h2_desc, w_bufs, h_bufs, h2_bufs, ready, empty, mma_done, part_a0,
            part_a1, part_b0, part_b1,
            params0, params1, bias_ptr, inv_temp_ptr, seed_ptr, offset_ptr, rec_ptr, B, n_real,
            vocab_start, num_samples, rec_stride_s, rec_stride_b, rec_stride_t, peer_ptrs,
            parity_ptr, trace_ptr, num_tiles, num_b_tiles, k_steps, HAS_BIAS, TILE_MASS, NUM_PEERS,
            STAGES, SINGLE, 1, TRACE, CDF, EXTRA_B)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
