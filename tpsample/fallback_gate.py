"""A one-GPU filtered call's exact fallback, skipped in its CUDA graph when no row needs it.

A filtered call whose fallback runs on the device launches the fallback's kernels in every
call, flagged rows or not (kernels/filter_cut.py: up to nine steps, then the rows kernel of
kernels/filter_fallback.py): where no row is flagged, each program of each launch only scans
the flags. Where the candidates certify every row (kept sets of a few hundred tokens, the
usual case) those launches are all the fallback costs. In the call's own CUDA graph
(tpsample/call_graphs.py) they are captured into the body of a conditional node instead
(CUDA >= 12.4; torch's CUDAGraph.begin_capture_to_if_node), which runs only when the
call's gate is set; torch's one-thread kernel before it reads the gate into the node's
condition.

The gate: bool [1], one per pipeline and stream, false at the start of every call. The
filter kernel (kernels/filter_records.py, GATE) sets it when it flags a row, and the
fallback's last kernel (fallback_rows_kernel, GATE) clears it; a call whose body is skipped
never set it. A stream runs its calls in order, so a graph's condition is its own filter
kernel's, and a gate per stream keeps calls on other streams out of it. Calls outside a
graph launch every kernel as before (the gate is set and cleared, read by nobody); the
kernels in the body still test the flags themselves, so a gate that stayed set would cost
only the launches it could have skipped.

TPSAMPLE_FALLBACK_GATE=0 captures the launches without the conditional node. A capture
that fails after opening one (a driver or torch without what the node needs) turns the
gate off for the process, with one warning, and is tried again without it
(tpsample/call_graphs.py).
"""
from __future__ import annotations

import contextlib
import threading
import warnings

import torch

from . import knobs

# torch exposes conditional nodes on its graphs (torch.cond in CUDA graphs uses them)
SUPPORTED = hasattr(getattr(torch._C, "_CUDAGraph", None), "begin_capture_to_if_node")

_CAPTURE = threading.local()  # .graph: the CUDAGraph being captured here; .opened: a stack;
# .any: whether the last capture on this thread opened a node
FAILED: str | None = None  # the error of a capture with a node: no more nodes in this process


class Gates:
    """The gates of one pipeline, one per stream (a raw stream handle; None off CUDA)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.by_stream: dict = {}

    def get(self, stream) -> torch.Tensor:
        gate = self.by_stream.get(stream)
        if gate is None:
            gate = self.by_stream[stream] = torch.zeros(1, dtype=torch.bool, device=self.device)
        return gate


@contextlib.contextmanager
def capturing(graph):
    """Within the block, `graph` (a torch.cuda.CUDAGraph) is being captured on this thread:
    open_body puts the launches up to close_body into a conditional node of it."""
    before = getattr(_CAPTURE, "graph", None), getattr(_CAPTURE, "opened", None)
    _CAPTURE.graph = graph if SUPPORTED and knobs.FALLBACK_GATE and FAILED is None else None
    _CAPTURE.opened = []
    _CAPTURE.any = False
    try:
        yield
    finally:
        _CAPTURE.graph, _CAPTURE.opened = before


def open_body(gate: torch.Tensor) -> torch.Tensor:
    """Inside capturing(): the launches from here to close_body run only when gate is set
    (their conditional node depends on the launches before). Elsewhere nothing. A torch
    step of a recorded call (tpsample/replay.py run_step): a replayed call re-runs it."""
    graph = getattr(_CAPTURE, "graph", None)
    opened = graph is not None and gate.is_cuda
    if opened:
        _CAPTURE.any = True
        graph.begin_capture_to_if_node(gate)
    if graph is not None:
        _CAPTURE.opened.append(opened)
    return gate


def close_body(gate: torch.Tensor) -> torch.Tensor:
    """Ends what open_body began (its pair in the same recorded call)."""
    if getattr(_CAPTURE, "graph", None) is not None and _CAPTURE.opened.pop():
        _CAPTURE.graph.end_capture_to_conditional_node()
    return gate


def failed_with_node(error: Exception) -> bool:
    """After a failed capture on this thread: whether it had opened a conditional node. If
    so, no later capture in this process opens one (one warning), and the caller may try
    the capture again."""
    global FAILED
    if not getattr(_CAPTURE, "any", False):
        return False
    _CAPTURE.any = False
    FAILED = f"{type(error).__name__}: {error}"
    warnings.warn(f"tpsample: a CUDA-graph capture with a conditional node failed ({FAILED}); "
                  "filtered calls' graphs run their exact fallback's launches in every replay "
                  "instead", RuntimeWarning, stacklevel=3)
    return True
