"""Can a CUDA graph skip a filtered call's empty fallback launches here, and what would it buy?

    python -m tools.conditional_node [--launches 10] [--replays 300] [--out DIR]

A one-GPU filtered call launches its exact fallback's steps in every call (up to ten:
kernels/filter_cut.py and the rows kernel); where no row is flagged each program only scans
the flags. This experiment captures a stand-in of that tail in torch CUDA graphs, with the
library's node (tpsample/fallback_gate.py), and times their replays with no row flagged:

    plain   a flag kernel, then --launches probe launches (2 programs of 8 warps per SM,
            each reading the flag, as the steps scan theirs)
    gated   the flag kernel, a one-thread kernel that sets a conditional handle from the flag,
            and the probes in the body of an IF node (captured from a second stream)
    none    the flag kernel alone (the floor)

with the probes launched plainly and as programmatic dependents (PDL, as the steps are).
The node is made through cuda.bindings, its one-thread set kernel by NVRTC and nvJitLink
(tpsample/fallback_gate.py says why). Checks first that the body runs exactly when the flag is set (each
probe program 0 counts itself when the flag is set). Prints a table; --out writes JSON.
"""
import argparse
import json
import os

import torch
import triton
import triton.language as tl

from tpsample.fallback_gate import NodeMaker


@triton.jit
def flag_kernel(want_ptr, flag_ptr):
    tl.store(flag_ptr, tl.load(want_ptr))


@triton.jit
def probe_kernel(flag_ptr, count_ptr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if tl.load(flag_ptr) != 0:
        if tl.program_id(0) == 0:
            tl.atomic_add(count_ptr, 1)


def capture(kind: str, launches: int, pdl: bool, want, flag, count, maker):
    programs = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    opts = dict(num_warps=8, **({"launch_pdl": True} if pdl else {}))
    flag_kernel[(1,)](want, flag)  # (compiled outside the capture)
    probe_kernel[(programs,)](flag, count, PDL=pdl, **opts)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        flag_kernel[(1,)](want, flag)
        node = maker(flag) if kind == "gated" else None
        if node is not None:
            node.enter()
        for _ in range(launches if kind != "none" else 0):
            probe_kernel[(programs,)](flag, count, PDL=pdl, **opts)
        if node is not None:
            node.leave()
    return g


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launches", type=int, default=10)
    ap.add_argument("--replays", type=int, default=300)
    ap.add_argument("--out")
    a = ap.parse_args()
    maker = NodeMaker(torch.device("cuda", torch.cuda.current_device()))
    want = torch.zeros(1, dtype=torch.uint8, device="cuda")
    flag = torch.zeros(1, dtype=torch.uint8, device="cuda")
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    rows, result = [], {}
    for pdl in (False, True):
        graphs = {k: capture(k, a.launches, pdl, want, flag, count, maker)
                  for k in ("none", "plain", "gated")}
        for k, g in graphs.items():  # the body runs exactly when the flag is set
            for w in (1, 0, 1, 0, 0):
                want.fill_(w)
                count.zero_()
                g.replay()
                torch.cuda.synchronize()
                ran = int(count.item())
                expect = w * a.launches * (k != "none")
                assert ran == expect, f"{k} pdl={pdl} flag={w}: {ran} probes ran, want {expect}"
        want.fill_(0)
        for k, g in graphs.items():
            for _ in range(20):
                g.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(3):
                torch.cuda.synchronize()
                start.record()
                for _ in range(a.replays):
                    g.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3 / a.replays)
            us = sorted(times)[1]
            result[f"{k}{'_pdl' if pdl else ''}"] = us
            rows.append((k, pdl, us))
    print(f"{torch.cuda.get_device_name()}, {a.launches} probe launches, flag clear, "
          f"µs per replay (median of 3 x {a.replays}):")
    print("| graph | PDL probes | µs | over none |")
    print("|---|---|---|---|")
    for k, pdl, us in rows:
        base = result["none_pdl" if pdl else "none"]
        print(f"| {k} | {pdl} | {us:.2f} | {us - base:+.2f} |")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "conditional_node.json"), "w") as f:
            json.dump(dict(result, launches=a.launches, device=torch.cuda.get_device_name()), f)


if __name__ == "__main__":
    main()
