"""The per-call arguments of a graphed call, read by the graph itself (tpsample/graph_args.py).

A CUDA graph reads fixed addresses, so a call with new hidden states, a new int offset or
drawn seeds used to write them into the graph's own inputs first: a copy, a fill and a draw,
one torch launch and 7-12 µs of host time each. Instead the host writes one slot of a ring in
pinned memory (a few int64 stores) and the graph's first kernel reads it:

    slot words  0  the hidden states' address (HIDDEN_PTR)
                1  flags
                2  the offset tensor's address (OFFSET_PTR) or the int offset (OFFSET_VALUE)
                3  the seed tensor's address (SEED_PTR) or a drawn base (SEED_BASE: row b's
                   seed is tpsample/drawn_seeds.row_seed(base, b))

One program takes slot `state[0] % K` (state[0]: the replays this graph has run, on the
device), fills the offset and seeds from it, advances state[0] and stores it in the ring's
`consumed` word (pinned: the host reads it to know which slots it may write again). Hidden
states larger than one program's block are copied by a second launch, from the address the
first left in device memory. A slot whose flags are 0 changes nothing (the run before the
capture).
"""
import triton
import triton.language as tl

# (constexprs: the kernel reads them; the host reads .value)
SLOT_WORDS = tl.constexpr(8)
HIDDEN_PTR, OFFSET_PTR, OFFSET_VALUE, SEED_PTR, SEED_BASE = (
    tl.constexpr(1), tl.constexpr(2), tl.constexpr(4), tl.constexpr(8), tl.constexpr(16))
GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)  # (tpsample/drawn_seeds.py: the same constants)
MIX_M1 = tl.constexpr(0xBF58476D1CE4E5B9)
MIX_M2 = tl.constexpr(0x94D049BB133111EB)
BLOCK = tl.constexpr(4096)  # hidden-state elements per program
ROWS = tl.constexpr(1024)  # rows per step of the offset / seed loop


@triton.jit
def mix64(z):
    """SplitMix64's finaliser on uint64 (wrapping multiplies, logical shifts)."""
    z = (z ^ (z >> 30)) * MIX_M1
    z = (z ^ (z >> 27)) * MIX_M2
    return z ^ (z >> 31)


@triton.jit
def _rows(word, flags, BY_VALUE: tl.constexpr, BY_PTR: tl.constexpr, out, B,
          SEED: tl.constexpr):
    """out[b] for b < B from one slot word: by value (the int itself, or with SEED the seed
    derived from a drawn base) or from the int64 tensor at the address it holds."""
    if (flags & (BY_VALUE | BY_PTR)) != 0:
        w = tl.load(word, volatile=True)
        r = tl.arange(0, ROWS)
        for start in range(0, B, ROWS):
            m = start + r < B
            if (flags & BY_VALUE) != 0:
                if SEED:
                    z = w.to(tl.uint64, bitcast=True) + (start + r + 1).to(tl.uint64) * GOLDEN
                    v = (mix64(z) >> 2).to(tl.int64, bitcast=True)
                else:
                    v = tl.full([ROWS], 0, tl.int64) + w
            else:
                v = tl.load(w.to(tl.pointer_type(tl.int64)) + start + r, mask=m)
            tl.store(out + start + r, v, mask=m)


@triton.jit
def call_args_kernel(ring, consumed, state, hidden_out, offset_out, seed_out, n_hidden, B,
                     K: tl.constexpr, HAS_HIDDEN: tl.constexpr, HAS_OFFSET: tl.constexpr,
                     HAS_SEED: tl.constexpr, HEAD: tl.constexpr, COPY: tl.constexpr):
    """ring, consumed: int64 addresses (pinned host memory: [K, SLOT_WORDS] and one word);
    state: int64 [4] on the device (the replays run, then the slot's flags and hidden-state
    address for the COPY launch); hidden_out [n_hidden], offset_out / seed_out int64 [B]: the
    graph's inputs (unused where their HAS_ is off).
    HEAD (one program): reads the slot, fills the offset and seeds, advances the count; with
    COPY also copies the hidden states (they fit one program's BLOCK). Without HEAD (a second
    launch, cdiv(n_hidden, BLOCK) programs): copies them from the address HEAD left in state.
    (Host memory is read by one program only: every program that read the slot itself cost
    ~8 µs, one after another, H200.)"""
    pid = tl.program_id(0)
    if HEAD:
        c = tl.load(state)
        slot = ring.to(tl.pointer_type(tl.int64)) + (c % K) * SLOT_WORDS
        flags = tl.load(slot + 1, volatile=True)  # (host memory the host rewrites: uncached)
        src = tl.load(slot, volatile=True)
    else:
        flags = tl.load(state + 1)
        src = tl.load(state + 2)
    if HAS_HIDDEN:
        if COPY:
            if (flags & HIDDEN_PTR) != 0:
                i = pid * BLOCK + tl.arange(0, BLOCK)
                m = i < n_hidden
                tl.store(hidden_out + i, tl.load(src.to(hidden_out.dtype) + i, mask=m), mask=m)
        else:
            tl.store(state + 1, flags)
            tl.store(state + 2, src)
    if HEAD:
        if HAS_OFFSET:
            _rows(slot + 2, flags, OFFSET_VALUE, OFFSET_PTR, offset_out, B, False)
        if HAS_SEED:
            _rows(slot + 3, flags, SEED_BASE, SEED_PTR, seed_out, B, True)
        tl.store(state, c + 1)
        tl.atomic_xchg(consumed.to(tl.pointer_type(tl.int64)), c + 1, sem="release", scope="sys")
