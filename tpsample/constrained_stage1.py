"""Stage 1 of a call with constraints, and the per-call tensors its replay substitutes.

A masked call passes the allowed mask to stage 1; a call with listed tokens (logit_adjust)
first runs launchers.listed_prep, then stage 1 over the mask without them, then the extra
tile of listed records (tpsample/constraints.py has the argument)."""
from __future__ import annotations

import torch

from . import constraints as C
from . import launchers
from .params import RowParams
from .plan import Plan


def constraint_tensors(c: C.Constraints, hidden: torch.Tensor, words: int) -> dict:
    """The per-call tensors of a call's constraints (replay substitutes them): the allowed
    mask, the listed ids / values / penalties, and a launchers.ListedScratch (the mask the
    tile pass reads with the listed tokens' bits cleared, the words' first listed tokens,
    their logits kept by the tile pass, the others' dot products)."""
    out = {}
    if c.mask is not None:
        out["allowed_mask"] = c.mask
    if c.listed:
        scratch = launchers.listed_scratch(hidden, c, words if c.mask is None else c.mask.shape[1])
        out.update(adjust_ids=c.ids, adjust_values=c.values,
                   **{_LISTED_NAMES[i]: t for i, t in enumerate(scratch)})
        if c.penalty is not None:
            out["penalty"] = c.penalty
    return out


_LISTED_NAMES = tuple(f"listed_{f}" for f in launchers.ListedScratch._fields)


def listed_scratch(per_call: dict):
    """The call's launchers.ListedScratch (the same tensors as in per_call), or None."""
    if _LISTED_NAMES[0] not in per_call:
        return None
    return launchers.ListedScratch(*(per_call[n] for n in _LISTED_NAMES))


def constraint_key(c: C.Constraints) -> tuple:
    """What a replay depends on in the constraints: which are present and their shapes."""
    if c is C.NO_CONSTRAINTS:
        return _NO_CONSTRAINT_KEY
    return tuple(None if t is None else tuple(t.shape) for t in c)


_NO_CONSTRAINT_KEY = (None,) * len(C.NO_CONSTRAINTS)


def stage1_constrained(plan: Plan, hidden, weight, bias, params: RowParams, out_view,
                       per_call: dict, c: C.Constraints, *, n_real: int, vocab_start: int,
                       fanout, trace=None) -> None:
    """launchers.stage1; with listed tokens first launchers.listed_prep (the mask it reads:
    the allowed mask without them; which of them it keeps; the others' dot products) and
    after it the extra tile (the last tile of out_view), see tpsample/constraints.py."""
    if c.listed:
        T = out_view.shape[2] - 1
        scratch = listed_scratch(per_call)
        launchers.listed_prep(hidden, weight, c, scratch, n_real=n_real,
                              vocab_start=vocab_start, pdl=plan.pdl)
        launchers.stage1(plan, hidden, weight, bias, params, out_view, n_real=n_real,
                         vocab_start=vocab_start, fanout=fanout, trace=trace,
                         mask=scratch.eff, tiles=T, held=(scratch.first, scratch.held),
                         side=per_call.get("side"))
        launchers.listed_records(plan, bias, params, c, scratch, out_view, T, n_real=n_real,
                                 vocab_start=vocab_start, fanout=fanout)
    else:
        launchers.stage1(plan, hidden, weight, bias, params, out_view, n_real=n_real,
                         vocab_start=vocab_start, fanout=fanout, trace=trace, mask=c.mask,
                         side=per_call.get("side"))
