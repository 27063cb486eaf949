"""How often filtered sampling needs its exact fallback (tpsample/filters.py, 2. and 5.).

A certificate depends only on a row's logits and the filters, so this runs on the CPU: for
each logit distribution, rows with independent draws (token placement random over the
vocabulary), the candidate records of the torch path, and the share of rows whose kept set
(or top-n) is not certified: in a call that returns log-probs, and in one that returns
tokens only, whose rows the winner certificate may also clear.

    python -m tools.certificates [--vocab 151936] [--rows 64] [--json OUT.json]

Distributions (logits of one row, token placement random; mean softmax entropy printed):
    peaked     -3 ln(rank)    (a confident next token, ~0.7 nats)
    typical    -1.6 ln(rank)  (~2.7 nats: the range of LM next-token entropies)
    broad      -1.3 ln(rank)  (~4.6 nats)
    zipf       -1.1 ln(rank)  (~6.9 nats: a heavy tail, top-p 0.9 keeps much of V)
    gauss      N(0, 4^2)      (~5.4 nats, no heavy tail)
    flat       N(0, 0.3^2)    (near uniform, ~11.9 nats)
"""
from __future__ import annotations

import argparse
import json

import torch

from tpsample import filters as F
from tpsample import launchers
from tpsample import params as P
from tpsample import pipeline
from tpsample.torch_records import records_torch

FILTERS = {
    "top_k=50": dict(top_k=50),
    "top_k=2000": dict(top_k=2000),
    "top_p=0.9": dict(top_p=0.9),
    "top_p=0.95": dict(top_p=0.95),
    "min_p=0.05": dict(min_p=0.05),
    "k50 p0.9 min_p0.05": dict(top_k=50, top_p=0.9, min_p=0.05),
    "k20 p0.8": dict(top_k=20, top_p=0.8),
    "top_logprobs=20": dict(top_logprobs=20),
}


def logits(kind: str, V: int, g: torch.Generator) -> torch.Tensor:
    slopes = {"peaked": 3.0, "typical": 1.6, "broad": 1.3, "zipf": 1.1}
    if kind in slopes:
        x = -slopes[kind] * torch.log(torch.arange(1, V + 1, dtype=torch.float32))
        x = x[torch.randperm(V, generator=g)]
    elif kind == "gauss":
        x = 4.0 * torch.randn(V, generator=g)
    elif kind == "flat":
        x = 0.3 * torch.randn(V, generator=g)
    else:
        raise ValueError(kind)
    return x


def study(V: int, rows: int) -> dict:
    out = {}
    for kind in ("peaked", "typical", "broad", "zipf", "gauss", "flat"):
        g = torch.Generator().manual_seed(0)
        w = torch.stack([logits(kind, V, g) for _ in range(rows)], dim=1)  # [V, rows]
        h = torch.eye(rows)  # row b's logits are column b of w
        entropy = -(torch.softmax(w.T.double(), -1) * torch.log_softmax(w.T.double(), -1)).sum(-1)
        row = P.row_params(h, 1.0, torch.arange(rows), 0)
        rec = records_torch(h, w.contiguous(), bias=None, inv_temp=row.inv_temp, seed=row.seed,
                            offset=row.offset, num_samples=1, n_real=V, candidates=True)[None]
        rates = {}
        for name, kw in FILTERS.items():
            filt = P.filter_params(h, kw.get("top_k"), kw.get("top_p"), kw.get("min_p"),
                                   kw.get("top_logprobs", 0), 1, True, "processed", V)
            base = pipeline.merge_records(rec[:, :1], row, "max")
            res = F.reduce_candidates(rec, row, filt, 1, base)
            winner = base[0][:, 0] if launchers.winner_certificate("max", 1, filt, True) \
                else None
            only = F.reduce_candidates(rec, row, filt, 1, base, winner=winner)
            rates[name] = [float(res.fallback.float().mean()),
                           float(only.fallback.float().mean())]
        out[kind] = {"entropy_nats": float(entropy.mean()), "fallback": rates}
        print(f"{kind:7s} entropy {float(entropy.mean()):5.2f} nats  " +
              "  ".join(f"{n}: {r[0]:.2f} / {r[1]:.2f}" for n, r in rates.items()), flush=True)
    return out


def markdown(res: dict, V: int, rows: int) -> str:
    names = list(FILTERS)
    lines = [f"Share of rows that take the exact fallback, V = {V}, {rows} rows per distribution "
             f"(`python -m tools.certificates`), in a call with log-probs / one that returns "
             f"tokens only (the winner certificate):", "",
             "| logits | entropy (nats) | " + " | ".join(names) + " |",
             "|---" * (len(names) + 2) + "|"]
    for kind, r in res.items():
        lines.append(f"| {kind} | {r['entropy_nats']:.2f} | "
                     + " | ".join("{:.2f} / {:.2f}".format(*r['fallback'][n]) for n in names)
                     + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--json")
    a = p.parse_args(argv)
    res = study(a.vocab, a.rows)
    print(markdown(res, a.vocab, a.rows))
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
