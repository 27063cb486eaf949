"""A graphed call's new hidden states, int offset and drawn seeds, without a launch each.

A CUDA graph reads its inputs where it was captured, so a call that replays it with new
hidden states, another int offset or seeds drawn per call (seed=None) had to write them into
the graph's own inputs first: a copy, a fill and a draw, one torch launch each (7-12 µs of
host time apiece, most of a decode step's). GraphArgs gives such a graph a first kernel that
reads them itself (kernels/call_args.py): per call the host stores the hidden states' address,
the offset (an int, or the address of a tensor) and the seeds (a drawn base:
tpsample/drawn_seeds.py, or a tensor's address) into one slot of a ring in pinned memory and
replays; the kernel copies and fills the graph's inputs from the slot the device has reached.

The caller's tensors are read when the graph runs, as a launch reads its arguments: stream
order keeps them valid, as it does for the caching allocator's memory.

Slots: the host writes slot n % RING_SLOTS for its n-th replay; the kernel of replay n reads
it and then stores n + 1 in the ring's `consumed` word. The host writes slot n only once the
device has consumed slot n - RING_SLOTS (it waits for the stream in the rare case it is that
far ahead). A ring outlives its graph: replays may still be queued, so rings return to a pool
that hands them out again only after the device has been synchronised once.
"""
from __future__ import annotations

import functools
import threading
import weakref

import torch

from . import drawn_seeds
from .kernels import call_args as CA

RING_SLOTS = 64
NAMES = ("hidden", "offset", "seed")
_CHUNK = 16  # rings per pinned allocation


class _Pool:
    """Rings (pinned [RING_SLOTS + 1, SLOT_WORDS] int64: the slots, then the consumed word)
    and their device counters, handed out per graph and taken back when it is gone."""

    def __init__(self):
        self.free: list = []
        self.returned: list = []
        self.lock = threading.Lock()

    def take(self, device: torch.device):
        with self.lock:
            if self.returned:  # (replays of their graphs may still be queued)
                for d in {state.device for _, state in self.returned}:
                    torch.cuda.synchronize(d)
                self.free += self.returned
                self.returned.clear()
            for i, (ring, state) in enumerate(self.free):
                if state.device == device:
                    del self.free[i]
                    break
            else:
                rings = torch.zeros(_CHUNK, RING_SLOTS + 1, CA.SLOT_WORDS.value, dtype=torch.int64,
                                    pin_memory=True)
                states = torch.zeros(_CHUNK, 4, dtype=torch.int64, device=device)
                self.free += [(rings[i], states[i]) for i in range(1, _CHUNK)]
                ring, state = rings[0], states[0]
        ring.zero_()
        state.zero_()
        return ring, state

    def give_back(self, pair) -> None:
        with self.lock:
            self.returned.append(pair)


POOL = _Pool()


# per-row inputs: (name, slot word, flag for a tensor's address, flag for a value)
_ROW_WORDS = (("offset", 2, CA.OFFSET_PTR.value, CA.OFFSET_VALUE.value),
              ("seed", 3, CA.SEED_PTR.value, CA.SEED_BASE.value))


class GraphArgs:
    """The ring of one graph. names: the inputs among NAMES the graph copies per call (the
    others are bound or absent); launch(inputs) runs the kernel (before the capture, once,
    and as the capture's first launch); write(tensors, values) before each replay."""

    def __init__(self, owner, inputs: dict, names: tuple[str, ...], device: torch.device):
        self.names = names
        self.ring, self.state = POOL.take(device)
        weakref.finalize(owner, POOL.give_back, (self.ring, self.state))
        self.words = self.ring.numpy()
        self.issued = 0
        self.device = device
        h = inputs.get("hidden") if "hidden" in names else None
        self.n_hidden = 0 if h is None else h.numel()
        self.B = next(inputs[n].shape[0] for n in names)

    def launch(self, inputs: dict) -> None:
        dummy = self.state  # (an int64 tensor for inputs the kernel does not touch)
        h = inputs["hidden"] if "hidden" in self.names else dummy
        programs = -(-self.n_hidden // CA.BLOCK.value)
        run = functools.partial(
            CA.call_args_kernel, self.ring.data_ptr(), self.ring[-1].data_ptr(), self.state, h,
            inputs["offset"] if "offset" in self.names else dummy,
            inputs["seed"] if "seed" in self.names else dummy, self.n_hidden, self.B,
            K=RING_SLOTS, HAS_HIDDEN="hidden" in self.names,
            HAS_OFFSET="offset" in self.names, HAS_SEED="seed" in self.names)
        CA.call_args_kernel[(1,)](*run.args, **run.keywords, HEAD=True, COPY=programs <= 1)
        if programs > 1:
            CA.call_args_kernel[(programs,)](*run.args, **run.keywords, HEAD=False, COPY=True)

    def write(self, tensors: dict, values: dict | None = None) -> None:
        """Store this replay's arguments in its slot: values {"offset": int, "seed": base}
        where the call has them as such, else the tensors' addresses. Waits for the stream
        where the device is RING_SLOTS replays behind."""
        n = self.issued
        words = self.words
        if n - int(words[-1, 0]) >= RING_SLOTS:
            torch.cuda.current_stream(self.device).synchronize()
        slot = words[n % RING_SLOTS]
        flags = 0
        if "hidden" in self.names:
            slot[0] = tensors["hidden"].data_ptr()
            flags |= CA.HIDDEN_PTR.value
        for name, word, by_ptr, by_value in _ROW_WORDS:
            if name in self.names:
                v = None if values is None else values.get(name)
                slot[word] = tensors[name].data_ptr() if v is None else drawn_seeds.signed(v)
                flags |= by_ptr if v is None else by_value
        slot[1] = flags
        self.issued = n + 1

    def skip(self) -> None:
        """Write a slot that changes nothing (the kernel's run before the capture)."""
        self.words[self.issued % RING_SLOTS, 1] = 0
        self.issued += 1


def for_graph(owner, inputs: dict, copied: tuple[str, ...], device: torch.device):
    """GraphArgs for a graph that copies any of NAMES per call (on CUDA), else None."""
    names = tuple(n for n in NAMES if n in copied)
    if not names or device.type != "cuda":
        return None
    return GraphArgs(owner, inputs, names, device)
