"""The exact fallback from the host: a filtered call's rows without a certificate, redone
from their full logits with torch (one host synchronisation per call).

The pipeline takes it when rows keep falling back and no side output holds their logits
(tpsample/fallback_choice.py), and over transports that cannot gather rows on the device
(NCCL, gloo): every rank all-gathers the flagged rows' logit shards and applies the
full-row semantics (filters.filtered_rows)."""
from __future__ import annotations

import torch

from . import constraints as C
from . import filters as F
from . import launchers, records
from .filters import filtered_rows, row_is_filtered
from .params import Filters, RowParams
from .torch_records import transform


def redo_rows_on_host(out: F.FilteredOutput, transport, hidden, weight, bias, params: RowParams,
                      filters: Filters, n_real: int, vocab_start: int, T: int, S: int,
                      constraints: C.Constraints = C.NO_CONSTRAINTS,
                      side: torch.Tensor | None = None):
    """5. of tpsample/filters.py: the rows without a certificate, from their full logits
    (under TP every rank gathers the rows' logit shards: the flags agree on every rank,
    computed from the same records). out: stage 2's outputs (launchers.filtered_outputs;
    the flagged rows are rewritten in place); side: the transformed logits stage 1 wrote
    (used unless the call lists tokens, whose adjusted logits are not in them). Returns
    (tokens [B, S], logprobs [B, S], logz [B], top or None, how many rows were redone);
    one host synchronisation (the flags)."""
    tokens, logprobs, logz, top_tok, top_lp, flag, _ = out
    tokens, logprobs = tokens.view(-1, S), logprobs.view(-1, S)  # (a replay's are [B])
    rows = flag.cpu().nonzero()[:, 0]  # the host synchronisation: one [B] copy
    transport.check()  # synchronised: a failed device-side exchange raises now
    if rows.numel():
        R = rows.numel()
        rows = rows.to(hidden.device)
        n_pad = T * records.TILE
        local = torch.full((R + 1, n_pad), float("-inf"), device=hidden.device)
        inv = params.inv_temp[rows]
        V_rows = weight.shape[0]
        valid = (torch.arange(V_rows, device=hidden.device) < n_real)[None, :]
        if side is not None and not constraints.listed:
            local[:R, :V_rows] = side[rows, :V_rows]
        elif constraints.any:
            raw = launchers.logits_fp32(hidden[rows], weight)
            raw = C.apply_dense(raw if bias is None else raw + bias, vocab_start,
                                constraints, rows, n_real)
            local[:R, :V_rows] = transform(raw, None, inv, valid)
        else:
            local[:R, :V_rows] = transform(launchers.logits_fp32(hidden[rows], weight), bias,
                                           inv, valid)
        local[R] = torch.arange(vocab_start, vocab_start + n_pad, device=hidden.device,
                                dtype=torch.float32)
        every = transport.all_gather(local)  # [world, R + 1, n_pad]
        l = every[:, :R].permute(1, 0, 2).reshape(R, -1)
        ids = every[:, R].reshape(-1).long()
        f_tok, f_lp, f_lz, f_top, f_top_lp = filtered_rows(
            l, inv, params.seed[rows], params.offset[rows], F.take_rows(filters, rows), S,
            ids=ids)
        filtered = row_is_filtered(filters, params.inv_temp)[rows]
        sel = filtered[:, None]
        tokens[rows] = torch.where(sel, f_tok, tokens[rows])
        logprobs[rows] = torch.where(sel, f_lp.float(), logprobs[rows])
        logz[rows] = torch.where(filtered, f_lz.float(), logz[rows])
        top_tok[rows] = f_top
        top_lp[rows] = f_top_lp.float()
    top = (top_tok, top_lp) if filters.top_n else None
    return tokens, logprobs, logz, top, rows.numel()
