"""How far one count-histogram pass over SELECT's window would narrow a top-p cut, and what
Triton's histogram costs per token.

    python -m tools.count_bins [--bins 1024,2048] [--heads gauss1,...,zipf1.6] [--no-sass]

The fast path (kernels/filter_cut.py) finds a flat row's cut in three HIST passes of 16 exact
mass sums. This simulates the alternative in float64 on the benchmark's heads
(launch/sweep.py: V = 151,936, one row each, random placement): SELECT's window from the
records (each tile's Gumbel-max winner and log-mass, as _guess_window, ±4 sd), then one pass
that only counts the row's tokens in NB equal bins of the window. A bin's mass lies between
its count times the weights of its two edges, so the cumulative mass from the window's top
(A(ghi), one exact sum) is bounded on both sides, and the bracket is the bins from the first
whose upper bound reaches p·Z to the first whose lower bound does: A(lo) >= p·Z > A(hi)
holds for certain, and its tokens are counted exactly. Printed per head, T and p: the
window's tokens, whether it holds the cut, and the bracket's tokens and bins per NB.

With --sass (default when Triton's NVIDIA backend is present) it also compiles, for sm_90,
a pass of `tl.histogram` over NB bins and a pass of 16 threshold sums (HIST's inner loop)
and prints SASS instructions per token of each loop.
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import tempfile

import torch

DEFAULT_HEADS = "gauss1,gauss2,gauss4,zipf1.0,zipf1.1,zipf1.3,zipf1.6"


def window(x: torch.Tensor, p: float, gen: torch.Generator, sd_k: float = 4.0,
           steps: int = 11) -> tuple[float, float]:
    """(glo, ghi): _guess_window's window for one row x [V] (V a multiple of 128), float64,
    from records drawn here (per tile a Gumbel-max winner's logit and the tile's mass)."""
    tiles = x.view(-1, 128)
    gumbel = -torch.log(-torch.log(torch.rand(tiles.shape, generator=gen, dtype=torch.float64)))
    xw = tiles.gather(-1, (tiles + gumbel).argmax(-1, keepdim=True))[:, 0]
    xmax = x.max()
    m = torch.exp(torch.logsumexp(tiles, -1) - xmax)
    sd = math.sqrt(float((m * m).sum()) * p * (1 - p))
    z = float(torch.exp(x - xmax).sum())
    lo = float(xmax) + math.log((1 - p) * z / x.numel()) - 0.5
    ends = []
    for goal in (float(m.sum()) * p + sd_k * sd, float(m.sum()) * p - sd_k * sd):
        bot, top = lo, float(xmax)
        for _ in range(steps):
            c = (bot + top) / 2
            bot, top = (c, top) if float(m[xw >= c].sum()) >= goal else (bot, c)
        ends.append((bot, top))
    return ends[0][0], ends[1][1]


def count_bracket(x: torch.Tensor, p: float, glo: float, ghi: float, bins: int,
                  lower_edge: float = 1.0) -> dict:
    """The bracket one count pass over [glo, ghi) leaves (module docstring): dict(tokens,
    bins, lo, hi), or None values when the window does not hold the cut's mass. lower_edge:
    which point of a bin, in bin widths below its top, weighs its tokens for the lower bound
    (1: its bottom edge, the bound; less: a wrong bound, for tests)."""
    xmax = float(x.max())
    target = p * float(torch.exp(x - xmax).sum())
    a_top = float(torch.exp(x[x >= ghi] - xmax).sum())
    w = (ghi - glo) / bins
    inside = (x >= glo) & (x < ghi)
    idx = ((ghi - x[inside]) / w).floor().long().clamp(0, bins - 1)  # bin 0 just below ghi
    c = torch.bincount(idx, minlength=bins).double()
    tops = ghi - w * torch.arange(bins, dtype=torch.float64)
    upper = a_top + (c * torch.exp(tops - xmax)).cumsum(0)
    lower = a_top + (c * torch.exp(tops - lower_edge * w - xmax)).cumsum(0)
    if a_top >= target or float(upper[-1]) < target:
        return dict(tokens=None, bins=None, lo=None, hi=None)
    k = int((upper >= target).nonzero()[0])
    reach = (lower >= target).nonzero()
    m = int(reach[0]) if len(reach) else bins - 1
    return dict(tokens=int(c[k:m + 1].sum()), bins=m - k + 1, lo=float(tops[m] - w),
                hi=float(tops[k]))


def simulate(heads: list[str], temps, ps, bins: list[int], V: int = 151936, seed: int = 0):
    from tpsample.launch.sweep import HEADS, profiles
    rows = profiles(V)
    names = list(HEADS)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for head in heads:
        for T in temps:
            for p in ps:
                x = rows[names.index(head)] / T
                glo, ghi = window(x, p, gen)
                xs = x.sort(descending=True).values
                e = torch.exp(xs - xs[0])
                cut = float(xs[(e.cumsum(0) - e) < p * float(e.sum())][-1])
                row = dict(head=head, T=T, p=p, window=int(((x >= glo) & (x < ghi)).sum()),
                           holds_cut=glo <= cut < ghi)
                for nb in bins:
                    row[nb] = count_bracket(x, p, glo, ghi, nb)
                out.append(row)
    return out


def sass_per_token(bins: list[int]) -> dict:
    """SASS instructions per token of a tl.histogram pass over each NB in `bins` and of a
    16-threshold sum pass (512-token slices, 8 warps, sm_90)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tools.sass import loop_bodies

    @triton.jit
    def count_pass(x_ptr, out_ptr, n, glo, ghi, NB: tl.constexpr, SUB: tl.constexpr):
        cols = tl.arange(0, SUB)
        h = tl.zeros((NB,), tl.int32)
        for v0 in range(0, n, SUB):
            x = tl.load(x_ptr + v0 + cols)
            b = tl.minimum(((ghi - x) * (NB / (ghi - glo))).to(tl.int32), NB - 1)
            h += tl.histogram(b, NB, mask=(x >= glo) & (x < ghi))
        tl.store(out_ptr + tl.arange(0, NB), h)

    @triton.jit
    def threshold_pass(x_ptr, out_ptr, n, glo, ghi, NB: tl.constexpr, SUB: tl.constexpr):
        cols = tl.arange(0, SUB)[:, None]
        t = glo + (ghi - glo) * (tl.arange(0, NB) / NB)
        acc = tl.zeros((SUB, NB), tl.float32)
        for v0 in range(0, n, SUB):
            x = tl.load(x_ptr + v0 + cols)
            acc += tl.where(x < ghi, tl.exp(x - ghi), 0.0) * (x >= t[None, :]).to(tl.float32)
        tl.store(out_ptr + tl.arange(0, NB), tl.sum(acc, axis=0))

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                            "nvdisasm")
    res = {}
    for name, fn, nb in [(f"count{nb}", count_pass, nb) for nb in bins] + \
            [("thresholds16", threshold_pass, 16)]:
        sig = dict(x_ptr="*fp32", out_ptr="*i32" if fn is count_pass else "*fp32", n="i32",
                   glo="fp32", ghi="fp32", NB="constexpr", SUB="constexpr")
        k = triton.compile(ASTSource(fn, sig, dict(NB=nb, SUB=512), {}),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            text = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True,
                                  check=True).stdout
        loop = max(loop_bodies(text), key=lambda c: sum(c.values()))
        res[name] = sum(loop.values()) / 2  # 512 tokens over 256 threads: two each
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bins", default="1024,2048")
    ap.add_argument("--heads", default=DEFAULT_HEADS)
    ap.add_argument("--temps", default="0.7,1.0,1.5")
    ap.add_argument("--ps", default="0.9,0.95,0.99")
    ap.add_argument("--no-sass", action="store_true")
    a = ap.parse_args(argv)
    bins = [int(b) for b in a.bins.split(",")]
    rows = simulate(a.heads.split(","), [float(t) for t in a.temps.split(",")],
                    [float(p) for p in a.ps.split(",")], bins)
    print("| head | T | p | window tokens | holds the cut | "
          + " | ".join(f"{nb} bins: bracket tokens (bins)" for nb in bins) + " |")
    print("|---|---|---|---|---|" + "---|" * len(bins))
    for r in rows:
        cells = [f"{r[nb]['tokens']} ({r[nb]['bins']})" for nb in bins]
        print(f"| {r['head']} | {r['T']} | {r['p']} | {r['window']} | {r['holds_cut']} | "
              + " | ".join(cells) + " |")
    for nb in bins:
        worst = {p: max((r[nb]["tokens"] or 0) for r in rows if r["p"] == p)
                 for p in sorted({r["p"] for r in rows})}
        print(f"{nb} bins: worst bracket per p {worst}; windows holding the cut "
              f"{sum(r['holds_cut'] for r in rows)} of {len(rows)}")
    if not a.no_sass:
        try:
            import triton.backends.nvidia  # noqa: F401
        except ImportError:
            return
        print("SASS instructions per token (sm_90):", sass_per_token(bins))


if __name__ == "__main__":
    main()
