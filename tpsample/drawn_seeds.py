"""The row seeds of a call with seed=None, drawn without a device launch.

On CUDA outside a CUDA-graph capture, a call with seed=None takes one 64-bit base from the
generator (torch's default CUDA generator, or a VocabParallelSampler's own) and derives every
row's seed from it:

    base     = mix64(mix64(initial_seed) + philox_offset)      (mod 2**64)
    seed[b]  = mix64(base + (b + 1) * GOLDEN) >> 2             (in [0, 2**62))

mix64 is SplitMix64's finaliser (a bijection of 64-bit words), GOLDEN = 0x9E3779B97F4A7C15;
the generator's Philox offset then moves on by 4, its smallest step, so no two calls (and no
torch op drawing after them) take the same offset. The draw is a host computation: a CUDA
graph that replays the call derives the seeds from the base itself (kernels/call_args.py), so
a decode loop with seed=None pays no launch for its seeds, and the full path (this module,
numpy) gives the same values. torch.manual_seed(s) makes the draws repeat; ranks whose
generators are in step draw the same seeds. On the CPU, and inside the caller's CUDA-graph
capture (whose replays must each draw anew: torch's graph-safe Philox state), the seeds are
drawn with torch.randint as before.
"""
from __future__ import annotations

import numpy as np
import torch

SEED_HIGH = 1 << 62
GOLDEN = 0x9E3779B97F4A7C15
MIX_M1 = 0xBF58476D1CE4E5B9
MIX_M2 = 0x94D049BB133111EB
MASK64 = (1 << 64) - 1
OFFSET_STEP = 4  # (the CUDA generator's offsets are multiples of 4)


def mix64(z: int) -> int:
    """SplitMix64's finaliser on a Python int in [0, 2**64)."""
    z = ((z ^ (z >> 30)) * MIX_M1) & MASK64
    z = ((z ^ (z >> 27)) * MIX_M2) & MASK64
    return z ^ (z >> 31)


def next_base(generator: torch.Generator) -> int:
    """The base of one call's seeds from a CUDA generator (in [0, 2**64)); moves the
    generator's offset on by OFFSET_STEP."""
    off = generator.get_offset()
    generator.set_offset(off + OFFSET_STEP)
    return mix64((mix64(generator.initial_seed() & MASK64) + off) & MASK64)


def row_seed(base: int, b: int) -> int:
    """Row b's seed from a base (the reference, Python ints)."""
    return mix64((base + (b + 1) * GOLDEN) & MASK64) >> 2


def row_seeds(base: int, B: int) -> np.ndarray:
    """int64 [B]: row_seed(base, b) for every row (numpy, wrapping uint64 arithmetic)."""
    z = np.uint64(base) + (np.arange(1, B + 1, dtype=np.uint64) * np.uint64(GOLDEN))
    z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX_M2)
    return ((z ^ (z >> np.uint64(31))) >> np.uint64(2)).astype(np.int64)


def signed(word: int) -> int:
    """A uint64 as the int64 with its bits (what an int64 slot of the ring holds)."""
    return word - (1 << 64) if word >= 1 << 63 else word


def draw(B: int, device: torch.device, generator: torch.Generator | None = None,
         in_capture: bool = False) -> torch.Tensor:
    """int64 [B] row seeds on device for a call with seed=None (see the module docstring);
    generator None: torch's default generator of the device."""
    if device.type != "cuda" or in_capture:
        return torch.randint(0, SEED_HIGH, (B,), dtype=torch.int64, device=device,
                             generator=generator)
    base = next_base(default_generator(device) if generator is None else generator)
    host = torch.from_numpy(row_seeds(base, B)).pin_memory()
    return host.to(device, non_blocking=True)  # (the host allocator keeps `host` until copied)


def default_generator(device: torch.device) -> torch.Generator:
    """torch's default CUDA generator of device (initialised)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.default_generators[index]
