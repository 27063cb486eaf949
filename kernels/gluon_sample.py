"""Stage 1 for large batches on Hopper, warp-specialized (Gluon): the same records as
fused_sample.py, with the tile's epilogue off the matmul's critical path.

A persistent grid; each program walks [BLOCK_V, BLOCK_B] tiles (vocabulary × batch, batch
tiles fastest so neighbouring programs read the same W tile through L2) with three
partitions that talk through mbarriers:

    loader   (1 warp)   TMA: W [BLOCK_V, BLOCK_K] and h [BLOCK_B, BLOCK_K] into a ring of
                        STAGES shared-memory slots
    mma      (4 warps)  wgmma over D into a register accumulator, then hands the fp32 tile
                        over through shared memory
    epilogue (default)  transforms, Gumbel noise, argmax → one record per (sample, row, tile)

While the epilogue turns tile i into records, the mma warps already accumulate tile i + 1
and the loader keeps the HBM stream going: the noise runs in other warps than the matmul,
where in the Triton kernels it kept them ≥ 1.10 × cuBLAS at B ≥ 128 on H100 (docs/design.md).

The noise is bit-identical to fused_sample.gumbel_noise_tile: Philox (seed_b; id >> 2, s,
offset_b) word id & 3 for the token with global id `id`. The epilogue reads the tile from
shared memory as four [BLOCK_V / 4, BLOCK_B] "lanes" (rows 4q + a), so one Philox call
serves four tokens without any register shuffles.

Gluon has no interpreter: this module is compiled and run on Hopper GPUs only (tests marked
gpu); everywhere else the Triton kernels produce the same records.
"""
import triton.language as tl

from .fused_sample import NOISE_COEF, gumbel_log, philox
from .gluon_compat import AVAILABLE

if AVAILABLE:
    from .gluon_compat import gl, gluon, mbarrier, tma_load, warpgroup_mma, warpgroup_mma_wait

    @gluon.jit
    def block_start(i, BLOCK_B: gl.constexpr, B):
        """The first batch row row block i loads: i · BLOCK_B, except that the last block of a
        batch of at least BLOCK_B rows ends at its last row. Its rows before i · BLOCK_B are
        the previous block's (computed again, not stored): a TMA box partly past the tensor
        cost about a tile more than one inside it (docs/design.md, the missing-row cost)."""
        return gl.minimum(i * BLOCK_B, gl.maximum(B - BLOCK_B, 0))

    @gluon.jit
    def _loader(w_desc, h_desc, w_bufs, h_bufs, ready, empty, acc_buf, acc_ready, acc_empty,
                num_tiles, num_b_tiles, k_steps, B, BLOCK_V: gl.constexpr, BLOCK_B: gl.constexpr,
                BLOCK_K: gl.constexpr, STAGES: gl.constexpr, MMA_WARPS: gl.constexpr):
        # (worker partitions share one signature: the acc_* and MMA_* arguments are the mma's)
        it = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            v0 = (tile // num_b_tiles) * BLOCK_V
            b0 = block_start(tile % num_b_tiles, BLOCK_B, B)
            for k in range(k_steps):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, w_desc.block_type.nbytes + h_desc.block_type.nbytes)
                tma_load(w_desc, [0, v0 // 4, k * BLOCK_K], bar, w_bufs.index(s))
                tma_load(h_desc, [b0, k * BLOCK_K], bar, h_bufs.index(s))
                it += 1

    @gluon.jit
    def _mma(w_desc, h_desc, w_bufs, h_bufs, ready, empty, acc_buf, acc_ready, acc_empty,
             num_tiles, num_b_tiles, k_steps, B, BLOCK_V: gl.constexpr, BLOCK_B: gl.constexpr,
             BLOCK_K: gl.constexpr, STAGES: gl.constexpr, MMA_WARPS: gl.constexpr):
        # 4 warps: one warpgroup owns all BLOCK_V rows; 8: two warpgroups of 64 rows each
        # (for BLOCK_B = 256, whose accumulator one warpgroup cannot hold)
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                         warps_per_cta=[MMA_WARPS, 1],
                                                         instr_shape=[16, min(BLOCK_B, 128), 16])
        it = 0
        n = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            acc = gl.zeros([BLOCK_V, BLOCK_B], gl.float32, layout)
            for k in range(k_steps):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                acc = warpgroup_mma(w_bufs.index(s).reshape([BLOCK_V, BLOCK_K]),
                                    h_bufs.index(s).permute((1, 0)), acc, is_async=True)
                # the previous step's MMA is done: its slot goes back to the loader
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=k > 0)
                it += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))
            mbarrier.wait(acc_empty, (n & 1) ^ 1)
            acc_buf.store(acc)
            mbarrier.arrive(acc_ready)
            n += 1

    @gluon.jit
    def _epilogue(acc_buf, acc_ready, acc_empty, bias_ptr, inv_temp_ptr, seed_ptr, offset_ptr,
                  rec_ptr, B, n_real, vocab_start, num_samples, rec_stride_s, rec_stride_b,
                  rec_stride_t, peer_ptrs, parity_ptr, num_tiles, num_b_tiles, mask_ptr,
                  stride_mask, first_ptr, held_ptr, side_ptr, stride_side,
                  HAS_BIAS: gl.constexpr,
                  TILE_MASS: gl.constexpr, NUM_PEERS: gl.constexpr, BLOCK_V: gl.constexpr,
                  BLOCK_B: gl.constexpr, EPI_B: gl.constexpr, EPI_WARPS: gl.constexpr,
                  HAS_MASK: gl.constexpr, CANDIDATES: gl.constexpr, RAW_MASS: gl.constexpr,
                  HELD: gl.constexpr, SIDE: gl.constexpr, SIDE_ROWS: gl.constexpr):
        n = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            pid_v = tile // num_b_tiles
            b_lo = (tile % num_b_tiles) * BLOCK_B  # (the rows this block stores start here)
            b0 = block_start(tile % num_b_tiles, BLOCK_B, B)
            mbarrier.wait(acc_ready, n & 1)
            # column chunks of EPI_B keep the per-thread state small (no spills)
            for c in gl.static_range(BLOCK_B // EPI_B):
                if (b0 + c * EPI_B < B) & (b0 + (c + 1) * EPI_B > b_lo):
                    _chunk_records(acc_buf.slice(c * EPI_B, EPI_B, dim=1), pid_v, b0 + c * EPI_B,
                                   b_lo, bias_ptr, inv_temp_ptr, seed_ptr, offset_ptr, rec_ptr, B,
                                   n_real, vocab_start, num_samples, rec_stride_s, rec_stride_b,
                                   rec_stride_t, peer_ptrs, parity_ptr, mask_ptr, stride_mask,
                                   first_ptr, held_ptr, side_ptr, stride_side, HAS_BIAS,
                                   TILE_MASS, NUM_PEERS, BLOCK_V, EPI_B, EPI_WARPS, HAS_MASK,
                                   CANDIDATES, RAW_MASS, HELD, SIDE, SIDE_ROWS)
            mbarrier.arrive(acc_empty)  # the mma warps may overwrite the buffer now
            n += 1

    @gluon.jit
    def _store_side(side_ptr, stride_side, offs_b, mask_b, row0, l0, l1, l2, l3, b0, b_lo, B,
                    v0, EPI_WARPS: gl.constexpr, ALONG_ROWS: gl.constexpr):
        """side[b, row0 + a] = l_a (NaN as -inf) for the [Q, EPI_B] lanes, as one vector of
        four per thread: the joined [Q, EPI_B, 4] keeps a thread's four values in its
        registers, and the pointers are built in that layout so the store is 16 bytes wide
        (row0 is a multiple of 4; the side rows are 16-byte aligned). A warp of the lanes'
        layout spans 32 columns: its store touches 32 rows, 16 bytes each. ALONG_ROWS: first
        through shared memory into a layout whose warps span 32 positions of one column, so
        that a store writes 512 contiguous bytes of one row (full sectors; Q = 32)."""
        v = gl.reshape(gl.join(gl.join(l0, l2), gl.join(l1, l3)), [l0.shape[0], l0.shape[1], 4])
        v = gl.where(v != v, float("-inf"), v)
        if ALONG_ROWS:
            Q: gl.constexpr = l0.shape[0]
            rows_l: gl.constexpr = gl.BlockedLayout([1, 1, 4], [32, 1, 1], [1, EPI_WARPS, 1],
                                                    [2, 0, 1])
            v = gl.convert_layout(v, rows_l)
            q1 = gl.arange(0, Q, layout=gl.SliceLayout(1, gl.SliceLayout(2, rows_l)))
            b1 = gl.arange(0, l0.shape[1], layout=gl.SliceLayout(0, gl.SliceLayout(2, rows_l)))
            k1 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, rows_l)))
            q3 = gl.expand_dims(gl.expand_dims(q1, 1), 2)
            b3 = gl.expand_dims(gl.expand_dims(b1, 0), 2) + b0
            k3 = gl.expand_dims(gl.expand_dims(k1, 0), 0)
            at = b3.to(gl.int64) * stride_side + (v0 + 4 * q3 + k3)
            gl.store(side_ptr + at, v, mask=(b3 < B) & (b3 >= b_lo) & (q3 >= 0) & (k3 >= 0))
        else:
            lay3: gl.constexpr = v.type.layout
            lay2: gl.constexpr = gl.SliceLayout(2, lay3)
            at = gl.convert_layout(gl.expand_dims(offs_b, 0).to(gl.int64) * stride_side + row0,
                                   lay2)
            live = gl.convert_layout(gl.expand_dims(mask_b, 0) & (row0 >= 0), lay2)
            k = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, lay3)))
            k3 = gl.expand_dims(gl.expand_dims(k, 0), 0)
            gl.store(side_ptr + (gl.expand_dims(at, 2) + k3), v,
                     mask=gl.expand_dims(live, 2) & (k3 >= 0))

    @gluon.jit
    def _chunk_records(view, pid_v, b0, b_lo, bias_ptr, inv_temp_ptr, seed_ptr, offset_ptr,
                       rec_ptr, B,
                       n_real, vocab_start, num_samples, rec_stride_s, rec_stride_b, rec_stride_t,
                       peer_ptrs, parity_ptr, mask_ptr, stride_mask, first_ptr, held_ptr,
                       side_ptr, stride_side,
                       HAS_BIAS: gl.constexpr, TILE_MASS: gl.constexpr, NUM_PEERS: gl.constexpr,
                       BLOCK_V: gl.constexpr, EPI_B: gl.constexpr, EPI_WARPS: gl.constexpr,
                       HAS_MASK: gl.constexpr, CANDIDATES: gl.constexpr, RAW_MASS: gl.constexpr,
                       HELD: gl.constexpr, SIDE: gl.constexpr, SIDE_ROWS: gl.constexpr):
        """Records of columns [max(b0, b_lo), b0 + EPI_B) of the tile in `view` [BLOCK_V, EPI_B]
        (columns below b_lo are the previous row block's: see block_start; rows in lane order:
        row a·Q + q holds token 4q + a, see the loader), stored at rec_ptr or, with
        NUM_PEERS > 0, into every peer's slot (see fused_sample.sample_and_store). CANDIDATES > 0:
        also the candidate planes and the raw plane after the sample planes, as
        fused_sample.tile_records_epilogue writes them (tpsample/records.py). HELD: the raw
        logits of the listed tokens flagged in first_ptr go to held_ptr (as there). SIDE: the
        transformed logits to side_ptr [B, tiles * BLOCK_V] (as there)."""
        Q: gl.constexpr = BLOCK_V // 4
        # lanes [Q, EPI_B]: a warp spans the columns (conflict-free shared reads), the rows
        # of a column spread over the warps (the argmax reduces over axis 0)
        TPW_B: gl.constexpr = 32 if EPI_B >= 32 else EPI_B
        lane_l: gl.constexpr = gl.BlockedLayout([1, EPI_B // TPW_B], [32 // TPW_B, TPW_B],
                                                [EPI_WARPS, 1], [1, 0])
        col_l: gl.constexpr = gl.SliceLayout(0, lane_l)
        q = gl.expand_dims(gl.arange(0, Q, layout=gl.SliceLayout(1, lane_l)), 1)  # [Q, 1]
        offs_b = b0 + gl.arange(0, EPI_B, layout=col_l)
        mask_b = (offs_b < B) & (offs_b >= b_lo)
        inv_t = gl.load(inv_temp_ptr + offs_b, mask=mask_b, other=1.0)
        coef = gl.expand_dims(noise_coef(inv_t), 0)
        scale = gl.expand_dims(gl.where(inv_t == 0.0, 1.0, inv_t), 0)
        row0 = pid_v * BLOCK_V + 4 * q  # local vocabulary row of lane 0
        bits = row0  # (unused without HAS_MASK)
        if HAS_MASK:  # the lanes' four bits share a word (vocab_start % 4 == 0): one load
            g0 = vocab_start + row0
            word = gl.load(mask_ptr + gl.expand_dims(offs_b, 0).to(gl.int64) * stride_mask
                           + (g0 >> 5), mask=gl.expand_dims(mask_b, 0) & (row0 < n_real),
                           other=0)
            bits = word >> (g0 & 31)
        if HELD:  # (listed calls always carry a mask)
            _hold(view, lane_l, first_ptr, held_ptr, offs_b, mask_b, stride_mask, g0, row0,
                  n_real)

        # the four lanes' transformed logits, read from shared memory once and kept in
        # registers for the max, the log-mass, the noise and the winner's logit
        l0 = _lane(view, 0, lane_l, row0, scale, bias_ptr, n_real, HAS_BIAS, bits, HAS_MASK)
        l1 = _lane(view, 1, lane_l, row0, scale, bias_ptr, n_real, HAS_BIAS, bits, HAS_MASK)
        l2 = _lane(view, 2, lane_l, row0, scale, bias_ptr, n_real, HAS_BIAS, bits, HAS_MASK)
        l3 = _lane(view, 3, lane_l, row0, scale, bias_ptr, n_real, HAS_BIAS, bits, HAS_MASK)
        if SIDE:  # a thread's four lanes are four adjacent tokens: one 16-byte store
            _store_side(side_ptr, stride_side, offs_b, mask_b, row0, l0, l1, l2, l3, b0, b_lo, B,
                        pid_v * BLOCK_V, EPI_WARPS, SIDE_ROWS)
        # the tile max, NaN if any logit of the column is NaN (see fused_sample.py)
        m = gl.reduce(_nan_max(_nan_max(l0, l1), _nan_max(l2, l3)), 0, _nan_max)
        if TILE_MASS:
            m_safe = gl.expand_dims(gl.where(m == float("-inf"), 0.0, m), 0)
            mass = _exp_or_0(l0, m_safe) + _exp_or_0(l1, m_safe)
            mass = (mass + _exp_or_0(l2, m_safe)) + _exp_or_0(l3, m_safe)
            lse = gl.where(m == float("-inf"), 0.0, m) + gl.log(gl.sum(mass, axis=0))
            lse = gl.where(m != m, m, lse)
        else:
            lse = m

        seed = gl.expand_dims(gl.load(seed_ptr + offs_b, mask=mask_b, other=0), 0)
        off = gl.load(offset_ptr + offs_b, mask=mask_b, other=0)
        zero = gl.zeros([Q, EPI_B], gl.uint32, lane_l)
        off_lo = gl.expand_dims((off & 0xFFFFFFFF).to(gl.uint32), 0) + zero
        off_hi = gl.expand_dims(((off >> 32) & 0xFFFFFFFF).to(gl.uint32), 0) + zero
        seed = seed + zero.to(gl.int64)
        tile_start = vocab_start + pid_v * BLOCK_V
        c0 = ((tile_start >> 2) + q).to(gl.uint32) + zero
        rec = offs_b.to(gl.int64) * rec_stride_b + pid_v.to(gl.int64) * rec_stride_t
        for s in range(num_samples):
            r0, r1, r2, r3 = philox(seed, c0, zero + s.to(gl.uint32), off_lo, off_hi)
            # per position q: the best lane (first on ties: lanes are in id order), then the
            # best position of the column (first on ties: smallest id)
            zb, za = best_lane(l0, l1, l2, l3, coef, r0, r1, r2, r3)
            best = gl.max(zb, axis=0)
            idx = gl.min(gl.where(zb == gl.expand_dims(best, 0), 4 * q + za, BLOCK_V), axis=0)
            if TILE_MASS:  # the winner's transformed logit
                i2 = gl.expand_dims(idx, 0) - 4 * q
                pick = gl.where(i2 == 0, l0, gl.where(i2 == 1, l1, gl.where(i2 == 2, l2, l3)))
                logit = gl.sum(gl.where((i2 >= 0) & (i2 < 4), pick, 0.0), axis=0)
            else:
                logit = gl.zeros_like(best)
            token = (tile_start + idx).to(gl.float32)
            store_records(rec_ptr, peer_ptrs, parity_ptr, rec + s * rec_stride_s, best, token,
                          logit, lse, mask_b, NUM_PEERS, EPI_WARPS)
        if CANDIDATES > 0:
            # the tile's best CANDIDATES (logit desc, id asc), NaN logits as -inf; the lanes'
            # registers are free now, so the running copies take their place
            c0 = gl.where(l0 != l0, float("-inf"), l0)
            c1 = gl.where(l1 != l1, float("-inf"), l1)
            c2 = gl.where(l2 != l2, float("-inf"), l2)
            c3 = gl.where(l3 != l3, float("-inf"), l3)
            cand = rec + num_samples * rec_stride_s
            for j in gl.static_range(CANDIDATES // 2):
                x_a, i_a, c0, c1, c2, c3 = _take_best(c0, c1, c2, c3, q)
                x_b, i_b, c0, c1, c2, c3 = _take_best(c0, c1, c2, c3, q)
                store_records(rec_ptr, peer_ptrs, parity_ptr, cand + j * rec_stride_s, x_a,
                              (tile_start + i_a).to(gl.float32), x_b,
                              (tile_start + i_b).to(gl.float32), mask_b, NUM_PEERS, EPI_WARPS,
                              True)
            if RAW_MASS:  # the log-mass at T = 1
                raw = _raw_log_mass(view, lane_l, row0, gl.full_like(scale, 1.0), bias_ptr,
                                    n_real, HAS_BIAS, bits, HAS_MASK)
            else:
                raw = lse
            zero = gl.zeros_like(lse)
            store_records(rec_ptr, peer_ptrs, parity_ptr, cand + (CANDIDATES // 2) * rec_stride_s,
                          raw, zero, zero, zero, mask_b, NUM_PEERS, EPI_WARPS, True)

    @gluon.jit
    def _take_best(c0, c1, c2, c3, q):
        """Per column: the largest value of the four lanes (tokens 4q + a) and its tile-local
        id, the smallest on ties (all -inf: the smallest id holding -inf, as the Triton
        epilogue takes it); that entry becomes -inf, so the next call takes the next best.
        The values are never NaN (the caller maps NaN to -inf). One (value, id) reduction
        over the column: a max then a smallest-id reduction would cost two rounds through
        shared memory, each behind its barriers."""
        x, i = _better(c0, 4 * q, c1, 4 * q + 1)
        x, i = _better(x, i, c2, 4 * q + 2)
        x, i = _better(x, i, c3, 4 * q + 3)
        x, i = gl.reduce((x, i), 0, _better)
        d = gl.expand_dims(i, 0) - 4 * q  # the pick's lane at its position, else outside 0..3
        c0 = gl.where(d == 0, float("-inf"), c0)
        c1 = gl.where(d == 1, float("-inf"), c1)
        c2 = gl.where(d == 2, float("-inf"), c2)
        c3 = gl.where(d == 3, float("-inf"), c3)
        return x, i, c0, c1, c2, c3

    @gluon.jit
    def _better(x1, i1, x2, i2):
        """(value, id) of the better of two entries: the larger value, the smaller id on ties."""
        take2 = (x2 > x1) | ((x2 == x1) & (i2 < i1))
        return gl.where(take2, x2, x1), gl.where(take2, i2, i1)

    @gluon.jit
    def _raw_log_mass(view, layout: gl.constexpr, row0, one, bias_ptr, n_real,
                      HAS_BIAS: gl.constexpr, bits, HAS_MASK: gl.constexpr):
        """Per column: logsumexp of the tile's logits at T = 1 (bias and mask applied; NaN if
        any is NaN), re-read from shared memory."""
        a0 = _lane(view, 0, layout, row0, one, bias_ptr, n_real, HAS_BIAS, bits, HAS_MASK)
        a1 = _lane(view, 1, layout, row0, one, bias_ptr, n_real, HAS_BIAS, bits, HAS_MASK)
        a2 = _lane(view, 2, layout, row0, one, bias_ptr, n_real, HAS_BIAS, bits, HAS_MASK)
        a3 = _lane(view, 3, layout, row0, one, bias_ptr, n_real, HAS_BIAS, bits, HAS_MASK)
        m = gl.reduce(_nan_max(_nan_max(a0, a1), _nan_max(a2, a3)), 0, _nan_max)
        m_safe = gl.expand_dims(gl.where(m == float("-inf"), 0.0, m), 0)
        mass = _exp_or_0(a0, m_safe) + _exp_or_0(a1, m_safe)
        mass = (mass + _exp_or_0(a2, m_safe)) + _exp_or_0(a3, m_safe)
        lse = gl.where(m == float("-inf"), 0.0, m) + gl.log(gl.sum(mass, axis=0))
        return gl.where(m != m, m, lse)

    @gluon.jit
    def store_records(rec_ptr, peer_ptrs, parity_ptr, rec, best, token, logit, lse, mask_b,
                      NUM_PEERS: gl.constexpr, EPI_WARPS: gl.constexpr, WIDE: gl.constexpr = False):
        """The records at rec_ptr + rec (element offsets, multiples of 4) as four 4-byte
        stores, or with WIDE as one 16-byte store each, or with NUM_PEERS > 0 into every
        peer's slot (16-byte stores, _store_peers)."""
        if NUM_PEERS > 0:
            _store_peers(rec_ptr, peer_ptrs, parity_ptr, rec, best, token, logit, lse, mask_b,
                         NUM_PEERS, EPI_WARPS)
        elif WIDE:
            at, val, mask = _whole_records(rec, best, token, logit, lse, mask_b, EPI_WARPS)
            gl.store(rec_ptr + at, val, mask=mask)
        else:
            at = rec_ptr + rec
            gl.store(at + 0, best, mask=mask_b)
            gl.store(at + 1, token, mask=mask_b)
            gl.store(at + 2, logit, mask=mask_b)
            gl.store(at + 3, lse, mask=mask_b)

    @gluon.jit
    def _whole_records(rec, best, token, logit, lse, mask_b, EPI_WARPS: gl.constexpr):
        """The records as [EPI_B, 4] with a thread holding one whole record (4 contiguous
        fields): their element offsets (rec, multiples of 4, plus the field), fields and mask."""
        rec_l: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [EPI_WARPS, 1], [1, 0])
        row_l: gl.constexpr = gl.SliceLayout(1, rec_l)
        f = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, rec_l)), 0)
        val = gl.where(f == 0, gl.expand_dims(gl.convert_layout(best, row_l), 1),
                       gl.where(f == 1, gl.expand_dims(gl.convert_layout(token, row_l), 1),
                                gl.where(f == 2, gl.expand_dims(gl.convert_layout(logit, row_l), 1),
                                         gl.expand_dims(gl.convert_layout(lse, row_l), 1))))
        at = gl.expand_dims(gl.multiple_of(gl.convert_layout(rec, row_l), 4), 1) + f
        mask = gl.expand_dims(gl.convert_layout(mask_b, row_l), 1) & (f < 4)  # to [EPI_B, 4]
        return at, val, mask

    @gluon.jit
    def _store_peers(rec_ptr, peer_ptrs, parity_ptr, rec, best, token, logit, lse, mask_b,
                     NUM_PEERS: gl.constexpr, EPI_WARPS: gl.constexpr):
        """One 16-byte store per record into this rank's slot of every peer's buffer
        parity_ptr[0] (peer_ptrs [2, NUM_PEERS] int64 addresses; rec: element offsets, multiples
        of 4): over NVLink each partial-sector write would be its own transaction."""
        at, val, mask = _whole_records(rec, best, token, logit, lse, mask_b, EPI_WARPS)
        row = gl.load(parity_ptr) * NUM_PEERS
        for p in gl.static_range(NUM_PEERS):
            # the peer slot as an element offset from rec_ptr: a pointer made from an integer
            # loses its alignment (4-byte stores), rec_ptr's is known (16-byte stores)
            delta = (gl.load(peer_ptrs + row + p) - rec_ptr.to(gl.int64, bitcast=True)) >> 2
            gl.store(rec_ptr + gl.multiple_of(delta, 4) + at, val, mask=mask)

    @gluon.jit
    def _hold(view, layout: gl.constexpr, first_ptr, held_ptr, offs_b, mask_b, stride_mask, g0,
              row0, n_real):
        """The raw logit of the listed token flagged in first_ptr's word (at most one per
        word, so at most one of the four lanes at position q) to held_ptr's word."""
        Q: gl.constexpr = view.shape[0] // 4
        at = gl.expand_dims(offs_b, 0).to(gl.int64) * stride_mask + (g0 >> 5)
        bits = gl.load(first_ptr + at, mask=gl.expand_dims(mask_b, 0) & (row0 < n_real),
                       other=0) >> (g0 & 31)
        x = view.slice(0, Q, dim=0).load(layout)
        x = gl.where((bits & 2) != 0, view.slice(Q, Q, dim=0).load(layout), x)
        x = gl.where((bits & 4) != 0, view.slice(2 * Q, Q, dim=0).load(layout), x)
        x = gl.where((bits & 8) != 0, view.slice(3 * Q, Q, dim=0).load(layout), x)
        gl.store(held_ptr + at, x, mask=(bits & 15) != 0)

    @gluon.jit
    def _lane(view, a: gl.constexpr, layout: gl.constexpr, row0, scale, bias_ptr, n_real,
              HAS_BIAS: gl.constexpr, bits, HAS_MASK: gl.constexpr):
        """Transformed logits of lane a (tokens 4q + a), read from the tile in shared memory;
        HAS_MASK: -inf where bit a of `bits` (the mask word shifted to lane 0) is 0."""
        Q: gl.constexpr = view.shape[0] // 4
        x = view.slice(a * Q, Q, dim=0).load(layout)
        x = transform(x, row0 + a, scale, bias_ptr, n_real, HAS_BIAS)
        if HAS_MASK:
            x = gl.where(((bits >> a) & 1) != 0, x, float("-inf"))
        return x

    @gluon.jit
    def transform(x, rows, scale, bias_ptr, n_real, HAS_BIAS: gl.constexpr):
        """Transformed logits of the accumulators x of local vocabulary rows `rows`:
        (x + bias) · (1 / T), -inf beyond the vocabulary (NaN stays NaN)."""
        if HAS_BIAS:
            x += gl.load(bias_ptr + rows, mask=rows < n_real, other=0.0)
        x = x * scale
        return gl.where(rows < n_real, x, float("-inf"))

    @gluon.jit
    def best_lane(l0, l1, l2, l3, coef, r0, r1, r2, r3):
        """Per position: the best perturbed score over the four lanes (Philox words r0..r3)
        and its lane, the first on ties (lanes are in token order). coef: noise_coef.
        A NaN logit never wins and its score never counts: lane 0's becomes -inf, the others
        lose every comparison and the maximum (max.f32 returns the non-NaN operand) drops them."""
        zb = gl.maximum(_perturb(l0, coef, r0), float("-inf"))
        layout: gl.constexpr = zb.type.layout
        za = gl.zeros(zb.shape, gl.int32, layout)
        z = _perturb(l1, coef, r1)
        za = gl.where(z > zb, 1, za)
        zb = gl.maximum(z, zb)
        z = _perturb(l2, coef, r2)
        za = gl.where(z > zb, 2, za)
        zb = gl.maximum(z, zb)
        z = _perturb(l3, coef, r3)
        za = gl.where(z > zb, 3, za)
        return gl.maximum(z, zb), za

    @gluon.jit
    def sm_clock():
        """The SM's cycle counter (clock64): for profiling traces; the power cap's clock
        does not enter a difference of two."""
        return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64,
                                         is_pure=False, pack=1)

    @gluon.jit
    def noise_coef(inv_t):
        """Per column: NOISE_COEF, or 0 for a greedy column (inv_t == 0), for _perturb."""
        return gl.where(inv_t == 0.0, 0.0, NOISE_COEF)

    @gluon.jit
    def _exp_or_0(la, m):
        """exp(la - m), 0 for NaN logits (they are excluded from the log-mass)."""
        return gl.exp(gl.where(la != la, float("-inf"), la) - m)

    @gluon.jit
    def _perturb(la, coef, bits):
        """la + Gumbel noise in one FMA; la exactly where coef = 0 (greedy; the noise is
        finite). NaN logits stay NaN (best_lane drops them)."""
        return tl.fma(gumbel_log(bits), coef, la)

    @gluon.jit
    def _nan_max(a, b):
        return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    # B == 1 specialised together with one batch tile trips an assertion in Triton 3.6's
    # ConvertTritonGPUToLLVM (the column offsets fold to constants); B stays a runtime value
    @gluon.jit(do_not_specialize=["B"])
    def ws_records_kernel(
        w_desc, h_desc, bias_ptr, inv_temp_ptr, seed_ptr, offset_ptr, rec_ptr,
        B, n_real, vocab_start, num_samples, rec_stride_s, rec_stride_b, rec_stride_t,
        peer_ptrs, parity_ptr, num_tiles, num_b_tiles, k_steps, mask_ptr, stride_mask,
        first_ptr, held_ptr, side_ptr, stride_side, HAS_BIAS: gl.constexpr, TILE_MASS: gl.constexpr,
        STAGES: gl.constexpr, EPI_B: gl.constexpr,
        LOADER_REGS: gl.constexpr, MMA_REGS: gl.constexpr, MMA_WARPS: gl.constexpr = 4,
        NUM_PEERS: gl.constexpr = 0, HAS_MASK: gl.constexpr = False,
        CANDIDATES: gl.constexpr = 0, RAW_MASS: gl.constexpr = False, HELD: gl.constexpr = False,
        SIDE: gl.constexpr = False, SIDE_ROWS: gl.constexpr = False,
    ):
        """Records [S, B, T, 4] of the tiles (vocabulary × batch) of this program; see the
        module docstring. num_warps (the epilogue's warps) must be 4 or 8. NUM_PEERS > 0: the
        records go to every peer (P2P fan-out, as fused_sample_records_kernel's peer_ptrs and
        parity_ptr), not to rec_ptr. HAS_MASK: mask_ptr int32 [B, W] allows global id i of row
        b by bit i % 32 of word i // 32 (as fused_sample.tile_records_epilogue). CANDIDATES,
        RAW_MASS: the candidate and raw planes after the S sample planes (tpsample/records.py;
        sampling with replacement only). HELD: the listed tokens' raw logits to held_ptr
        (as fused_sample.tile_records_epilogue). SIDE: the transformed logits to side_ptr
        (fp32 [B, tiles * BLOCK_V], row stride stride_side), as there."""
        BLOCK_V: gl.constexpr = 4 * w_desc.block_type.shape[1]
        BLOCK_K: gl.constexpr = w_desc.block_type.shape[2]
        BLOCK_B: gl.constexpr = h_desc.block_type.shape[0]
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape,
                                           w_desc.layout)
        h_bufs = gl.allocate_shared_memory(h_desc.dtype, [STAGES, BLOCK_B, BLOCK_K], h_desc.layout)
        acc_buf = gl.allocate_shared_memory(gl.float32, [BLOCK_V, BLOCK_B],
                                            gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        acc_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        acc_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        mbarrier.init(acc_ready, count=1)
        mbarrier.init(acc_empty, count=1)
        gl.warp_specialize([
            (_epilogue, (acc_buf, acc_ready, acc_empty, bias_ptr, inv_temp_ptr, seed_ptr,
                         offset_ptr, rec_ptr, B, n_real, vocab_start, num_samples, rec_stride_s,
                         rec_stride_b, rec_stride_t, peer_ptrs, parity_ptr, num_tiles, num_b_tiles,
                         mask_ptr, stride_mask, first_ptr, held_ptr, side_ptr, stride_side,
                         HAS_BIAS, TILE_MASS, NUM_PEERS, BLOCK_V, BLOCK_B, EPI_B, gl.num_warps(),
                         HAS_MASK, CANDIDATES, RAW_MASS, HELD, SIDE, SIDE_ROWS)),
            (_mma, (w_desc, h_desc, w_bufs, h_bufs, ready, empty, acc_buf, acc_ready, acc_empty,
                    num_tiles, num_b_tiles, k_steps, B, BLOCK_V, BLOCK_B, BLOCK_K, STAGES,
                    MMA_WARPS)),
            (_loader, (w_desc, h_desc, w_bufs, h_bufs, ready, empty, acc_buf, acc_ready, acc_empty,
                       num_tiles, num_b_tiles, k_steps, B, BLOCK_V, BLOCK_B, BLOCK_K, STAGES,
                       MMA_WARPS)),
        ], [MMA_WARPS, 1], [MMA_REGS, LOADER_REGS])
