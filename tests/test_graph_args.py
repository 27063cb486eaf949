"""tpsample/graph_args.py and kernels/call_args.py (interpreted on the CPU: the ring is an
ordinary CPU tensor there, the kernel is the graph's replay), and tpsample/drawn_seeds.py."""
import numpy as np
import pytest
import torch

from conftest import KERNEL_OK
from tpsample import drawn_seeds as DS
from tpsample import graph_args as GA
from tpsample.kernels import call_args as CA

pytestmark = pytest.mark.skipif(not KERNEL_OK, reason="needs CUDA or TRITON_INTERPRET=1")


def test_row_seeds_follow_the_reference_and_stay_in_range():
    for base in (0, 1, 12345, (1 << 63) - 1, 1 << 63, (1 << 64) - 1):
        got = DS.row_seeds(base, 9).tolist()
        assert got == [DS.row_seed(base, b) for b in range(9)]
        assert all(0 <= s < DS.SEED_HIGH for s in got) and len(set(got)) == 9
    assert DS.row_seeds(5, 4).tolist() != DS.row_seeds(6, 4).tolist()
    assert DS.mix64(0) == 0 and DS.mix64(1) != 1  # (the finaliser; SplitMix64's known value:)
    assert DS.mix64((0 + DS.GOLDEN) & DS.MASK64) == 0xE220A8397B1DCDAF


class FakeCudaGenerator:
    """What next_base reads of a CUDA generator: its seed and Philox offset."""

    def __init__(self, seed, offset=0):
        self.seed, self.offset = seed, offset

    def initial_seed(self):
        return self.seed

    def get_offset(self):
        return self.offset

    def set_offset(self, offset):
        assert offset % 4 == 0
        self.offset = offset


def test_next_base_moves_the_offset_and_depends_on_seed_and_offset():
    g = FakeCudaGenerator(7)
    bases = [DS.next_base(g) for _ in range(3)]
    assert g.offset == 3 * DS.OFFSET_STEP and len(set(bases)) == 3
    assert DS.next_base(FakeCudaGenerator(7)) == bases[0]  # the same state, the same base
    assert DS.next_base(FakeCudaGenerator(8)) != bases[0]
    assert DS.next_base(FakeCudaGenerator(7, 4)) == bases[1]


def test_the_cpu_draw_is_torch_randint_on_the_generator():
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    want = torch.randint(0, DS.SEED_HIGH, (5,), dtype=torch.int64, generator=g1)
    assert torch.equal(DS.draw(5, torch.device("cpu"), g2), want)


class Stream:
    def __init__(self):
        self.synchronized = 0

    def synchronize(self):
        self.synchronized += 1


def cpu_args(monkeypatch, names, B, D, dtype=torch.bfloat16):
    """GraphArgs over CPU tensors (the pool's pinned ring and device counter as CPU tensors)
    and the graph's inputs it writes."""
    ring = torch.zeros(GA.RING_SLOTS + 1, CA.SLOT_WORDS.value, dtype=torch.int64)
    state = torch.zeros(4, dtype=torch.int64)
    monkeypatch.setattr(GA.POOL, "take", lambda device: (ring, state))
    inputs = dict(hidden=torch.zeros(B, D, dtype=dtype), offset=torch.zeros(B, dtype=torch.int64),
                  seed=torch.zeros(B, dtype=torch.int64))
    return GA.GraphArgs(Owner(), inputs, names, torch.device("cpu")), inputs


class Owner:
    """A graph's stand-in (its ring goes back to the pool when it is collected)."""


def test_each_replay_reads_its_own_slot_round_the_ring(monkeypatch):
    """Replays n = 0 … 2·RING_SLOTS + 2 (the kernel as the graph; a 4-slot ring), each with new hidden
    states (5 × 1,700 bf16: three programs), an offset given as an int or as a tensor, and
    seeds as a drawn base or a tensor: the graph's inputs hold that call's values after its
    replay, and the consumed word counts the replays."""
    monkeypatch.setattr(GA, "RING_SLOTS", 4)  # (round the ring twice in few launches)
    B, D = 5, 1700
    args, inputs = cpu_args(monkeypatch, ("hidden", "offset", "seed"), B, D)
    assert -(-B * D // CA.BLOCK.value) == 3
    args.skip()  # (the run before the capture)
    args.launch(inputs)
    assert int(args.words[-1, 0]) == 1 and inputs["hidden"].abs().sum() == 0
    gen = torch.Generator().manual_seed(0)
    for n in range(1, 2 * GA.RING_SLOTS + 3):
        h = torch.randn(B, D, generator=gen).bfloat16()
        off = torch.randint(-50, 50, (B,), generator=gen)
        seed = torch.randint(0, 1 << 40, (B,), generator=gen)
        values = {}
        if n % 2:
            values["offset"] = int(off[0])
            off = off[:1].expand(B)
        if n % 3:
            values["seed"] = base = (n * 0x9E3779B97F4A7C15) % (1 << 64)
            seed = torch.from_numpy(DS.row_seeds(base, B))
        args.write(dict(hidden=h, offset=off.contiguous(), seed=seed), values)
        args.launch(inputs)
        assert torch.equal(inputs["hidden"], h), n
        assert torch.equal(inputs["offset"], off), n
        assert torch.equal(inputs["seed"], seed), n
        assert int(args.words[-1, 0]) == n + 1 and args.issued == n + 1


def test_inputs_a_graph_binds_are_left_alone(monkeypatch):
    """A graph that copies only the hidden states (seed and offset bound): the kernel writes
    nothing else, whatever the slot's other words hold."""
    B, D = 3, 8
    args, inputs = cpu_args(monkeypatch, ("hidden",), B, D, torch.float32)
    inputs["seed"].fill_(11)
    inputs["offset"].fill_(12)
    h = torch.randn(B, D)
    args.write(dict(hidden=h, seed=None, offset=None), {"seed": 5, "offset": 6})
    args.launch(inputs)
    assert torch.equal(inputs["hidden"], h)
    assert inputs["seed"].tolist() == [11] * B and inputs["offset"].tolist() == [12] * B


def test_the_host_waits_for_the_stream_only_a_ring_ahead(monkeypatch):
    """Slot n is written again only once replay n - RING_SLOTS has read it: with the device
    that far behind (no kernel run here), the next write synchronises the stream first."""
    stream = Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(GA, "RING_SLOTS", 4)
    args, inputs = cpu_args(monkeypatch, ("offset",), 2, 4)
    for n in range(GA.RING_SLOTS):
        args.write({}, {"offset": n})
    assert stream.synchronized == 0
    args.launch(inputs)  # (replay 0 reads slot 0: it may be written again)
    assert inputs["offset"].tolist() == [0, 0]
    args.write({}, {"offset": -1})
    assert stream.synchronized == 0
    args.write({}, {"offset": -2})  # (slot 1: replay 1 has not run)
    assert stream.synchronized == 1
    args.words[-1, 0] = 3  # (as if the device had run replays 1 and 2)
    args.write({}, {"offset": -3})
    assert stream.synchronized == 1


def test_kernel_seeds_equal_numpys_for_large_bases_and_many_rows(monkeypatch):
    """Row seeds derived in the kernel (uint64 wrap, logical shifts) equal drawn_seeds.row_seeds
    past the kernel's 1,024-row step, for bases with the top bit set."""
    B = 1500
    args, inputs = cpu_args(monkeypatch, ("seed",), B, 1)
    for base in ((1 << 64) - 3, 1 << 63, 977):
        args.write({}, {"seed": base})
        args.launch(inputs)
        assert np.array_equal(inputs["seed"].numpy(), DS.row_seeds(base, B)), base


COMPILE = r'''
import itertools
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tpsample.kernels import call_args as K
done = 0
for dt, hh, ho, hs in itertools.product(("*bf16", "*fp16", "*fp32"), (False, True),
                                        (False, True), (False, True)):
    if not (hh or ho or hs):
        continue
    for head, copy in ((True, True), (True, False), (False, True)):
        if not head and not hh:
            continue
        sig = dict(ring="i64", consumed="i64", state="*i64", hidden_out=dt, offset_out="*i64",
                   seed_out="*i64", n_hidden="i32", B="i32", K="constexpr",
                   HAS_HIDDEN="constexpr", HAS_OFFSET="constexpr", HAS_SEED="constexpr",
                   HEAD="constexpr", COPY="constexpr")
        c = dict(K=64, HAS_HIDDEN=hh, HAS_OFFSET=ho, HAS_SEED=hs, HEAD=head, COPY=copy)
        triton.compile(ASTSource(K.call_args_kernel, sig, c, {}),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        done += 1
print(done)
'''


def test_the_kernel_compiles_for_sm90(tmp_path):
    """The interpreter runs the kernel's Python (a global that is not a constexpr, a name
    bound on one side of a runtime branch pass there): every variant the graphs launch
    compiles with Triton's frontend and ptxas, in a process without the interpreter."""
    import os
    import subprocess
    import sys
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = subprocess.run([sys.executable, "-c", COMPILE], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert int(out.stdout.split()[-1]) == 3 * (7 * 2 + 4)  # (+ the copy launch with hidden)
