"""Environment knobs: every TPSAMPLE_* variable tpsample reads, read and validated once here.

    python -m tpsample.knobs        # lists them with their current values

A bad value raises ValueError naming the variable at import. A TPSAMPLE_* variable that is
not a knob (a misspelling, or a switch that no longer exists) gets one warning.
"""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class Knob:
    name: str
    default: str
    choices: tuple[str, ...]
    doc: str


KNOBS = (
    Knob("TPSAMPLE_REPLAY", "1", ("0", "1"),
         "1: a call with the shapes, strides, alignments and options of an earlier one "
         "re-issues that call's compiled launches (no plan lookup, no Triton dispatch); "
         "0: every call goes through Triton's dispatcher (debugging)"),
    Knob("TPSAMPLE_DIRECT_LAUNCH", "1", ("0", "1"),
         "1: on Triton 3.6 replayed launches call the launcher's C function with their "
         "arguments expanded once (host TMA descriptors re-encoded only where per call); "
         "0: through Triton's launcher (debugging; the same launches)"),
    Knob("TPSAMPLE_GRAPHS", "1", ("0", "plain", "1"),
         "1: from the third eager call with the same replay key, a call replays its "
         "launches as one CUDA graph (tpsample/call_graphs.py): plain calls, and filtered "
         "calls whose exact fallback runs on the device (always for top-p / min-p without "
         "top-k or top log-probs; others while their fallback stays there); plain: plain "
         "calls only; 0: the launches one by one"),
    Knob("TPSAMPLE_MEMO", "1", ("0", "1"),
         "1: a call that repeats an earlier graphed call's arguments (new hidden states, an "
         "int offset and drawn seeds aside) goes straight to that call's CUDA graph, "
         "without re-validating them (tpsample/call_memo.py); 0: every call takes the full "
         "path"),
    Knob("TPSAMPLE_REUSE_OUTPUTS", "1", ("0", "1"),
         "1: a call through its CUDA graph returns the outputs of one of the graph's "
         "output slots, written in place, once no tensor refers to that slot's earlier "
         "outputs (no copy; tpsample/call_graphs.py); 0: copies of the graph's outputs "
         "every call"),
    Knob("TPSAMPLE_GRAPH_ARGS", "1", ("0", "1"),
         "1: a call's CUDA graph reads new hidden states, an int offset and drawn seeds from "
         "a slot in pinned memory the call writes (tpsample/graph_args.py: no launch for "
         "them); 0: they are copied into the graph's inputs, one launch each"),
    Knob("TPSAMPLE_FALLBACK_GATE", "1", ("0", "1"),
         "1: in a filtered call's CUDA graph (one GPU) the exact fallback's launches run "
         "inside a conditional node, skipped when the call flags no row (needs cuda.bindings; "
         "tpsample/fallback_gate.py); 0: they run in every replay"),
    Knob("TPSAMPLE_LAZY_SIDE", "1", ("0", "1"),
         "1: a one-GPU call with top-p / min-p rows without a top-k writes its rows' fp32 "
         "logits for the exact fallback only while recent calls flagged rows, and otherwise "
         "recomputes a flagged row's logits (tpsample/fallback_choice.py side_output); 0: it "
         "always writes them"),
    Knob("TPSAMPLE_GLUON", "1", ("0", "1"),
         "0: never the Hopper Gluon kernels (ws, pp); the cuBLAS + records-pass path runs "
         "where the plan would take them"),
    Knob("TPSAMPLE_CHECK_TENSORS", "1", ("0", "1"),
         "1: the contents of tensor arguments (temperature, top_k / top_p / min_p, logit_adjust, "
         "repetition_penalty) are range-checked with one host synchronisation per call; 0: "
         "never (as during CUDA-graph capture): an invalid temperature gives a degenerate row, "
         "an id outside the vocabulary is ignored like padding"),
)
_BY_NAME = {k.name: k for k in KNOBS}

# switches that were removed: the measured default is what runs now
RETIRED = {
    "TPSAMPLE_WS": "use TPSAMPLE_GLUON=0",
    "TPSAMPLE_CDF_GLUON": "merge='cdf' takes the ping-pong kernel wherever it applies",
    "TPSAMPLE_EXACT_LOGS": "the noise's logs are fixed (tpsample/noise.py gives their error)",
    "TPSAMPLE_LIBDEVICE_INNER_LOG": "the noise's logs are fixed",
    "TPSAMPLE_PHILOX_MUL": "Philox's multiplies are one mul.wide.u32 each on the GPU",
    "TPSAMPLE_WIDE_MUL": "Philox's multiplies are one mul.wide.u32 each on the GPU",
    "TPSAMPLE_PHILOX_HALVES": "Philox's multiplies are one mul.wide.u32 each on the GPU",
    "TPSAMPLE_PP_UNROLL": "the ping-pong records loop takes one chunk per pass",
}


def _read(knob: Knob) -> str:
    value = os.environ.get(knob.name, knob.default).strip()
    if value not in knob.choices:
        raise ValueError(f"{knob.name} must be one of {', '.join(knob.choices)}, got {value!r}")
    return value


def _warn_unknown() -> None:
    for name in sorted(os.environ):
        if name.startswith("TPSAMPLE_") and name not in _BY_NAME:
            why = RETIRED.get(name, "not a tpsample knob; see python -m tpsample.knobs")
            warnings.warn(f"{name} is ignored: {why}", RuntimeWarning, stacklevel=3)


VALUES = {k.name: _read(k) for k in KNOBS}
_warn_unknown()

REPLAY = VALUES["TPSAMPLE_REPLAY"] == "1"
DIRECT_LAUNCH = VALUES["TPSAMPLE_DIRECT_LAUNCH"] == "1"
GRAPHS = VALUES["TPSAMPLE_GRAPHS"] != "0"
GRAPHS_FILTERED = VALUES["TPSAMPLE_GRAPHS"] == "1"
MEMO = VALUES["TPSAMPLE_MEMO"] == "1"
REUSE_OUTPUTS = VALUES["TPSAMPLE_REUSE_OUTPUTS"] == "1"
GRAPH_ARGS = VALUES["TPSAMPLE_GRAPH_ARGS"] == "1"
FALLBACK_GATE = VALUES["TPSAMPLE_FALLBACK_GATE"] == "1"
LAZY_SIDE = VALUES["TPSAMPLE_LAZY_SIDE"] == "1"
GLUON = VALUES["TPSAMPLE_GLUON"] == "1"
CHECK_TENSORS = VALUES["TPSAMPLE_CHECK_TENSORS"] == "1"
SWITCHES = ("REPLAY", "DIRECT_LAUNCH", "GRAPHS", "GRAPHS_FILTERED", "MEMO", "REUSE_OUTPUTS",
            "GRAPH_ARGS", "FALLBACK_GATE", "LAZY_SIDE", "GLUON", "CHECK_TENSORS")


@contextlib.contextmanager
def overridden(**values):
    """Within the block, the module's switches take these values (names as above, e.g.
    overridden(MEMO=False)); restored after. For tools and tests that compare two settings in
    one process: knobs are read per call, so the next call sees the change."""
    module = sys.modules[__name__]
    for name in values:
        if name not in SWITCHES:
            raise ValueError(f"unknown knob switch {name!r}; one of {', '.join(SWITCHES)}")
    before = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(module, name, value)


def describe() -> str:
    """One line per knob: name, current value, default, what it does."""
    return "\n".join(f"{k.name}={VALUES[k.name]} (default {k.default}): {k.doc}" for k in KNOBS)


if __name__ == "__main__":
    print(describe())
