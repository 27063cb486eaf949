"""Where an eager call's time goes, per rank: host time, each kernel's start and length.

    torchrun --nproc-per-node=N -m tools.timeline [--shapes DxV,..] [--batch 1,..] [--out DIR]
    python -m tools.timeline --report DIR/timeline_tp2.json

Per (D, B) and variant (the local matmul h @ W_r.T; the sampler over symmetric memory, and
over NCCL with --nccl, without and with the stamp of TORCH_NCCL_ASYNC_ERROR_HANDLING=2;
with --constrained also its calls with a random-half allowed mask and with 64 listed
tokens per row, whose contents are checked on the host unless TPSAMPLE_CHECK_TENSORS=0),
`--calls` eager calls are profiled the way tools.exchange_cost times them (the device drained
before each call, one call at a time). For each call, in the profiler's clock, relative to
the call's host entry: when the call returned on the host, when it entered each CUDA API
call (launches, copies, waits), and for each GPU activity (kernel, copy, set) when it started
and how long it ran. The report gives medians over the calls, per rank: a kernel starting
long after its predecessor ended means the GPU waited for the host; a long exchange wait
means the peer's stage 1 ended late (its host started later, or its kernel ran longer). The
profiler adds a few µs of host time per launch, so absolute host times are upper bounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

from tools.exchange_cost import init_ranks, sampler_on, weight_shards

GPU_TYPES = (torch.autograd.DeviceType.CUDA,)


def profile_calls(fn, calls: int, warmup: int = 10) -> list[dict]:
    """calls eager calls of fn under the profiler: per call {host_us, gpu: [(name, start, dur)]}
    with times in µs from the call's host entry."""
    from torch.profiler import ProfilerActivity, profile, record_function
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            torch.cuda.synchronize()
            with record_function("timeline_call"):
                fn()
            torch.cuda.synchronize()
    events = prof.events()
    marks = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.name == "timeline_call" and e.device_type not in GPU_TYPES)
    gpu = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                 if e.device_type in GPU_TYPES)
    api = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                 if e.device_type not in GPU_TYPES and e.name.startswith(("cuda", "cu")))
    out = []
    for i, (t0, t1) in enumerate(marks):
        t_next = marks[i + 1][0] if i + 1 < len(marks) else float("inf")
        ops = [(name, s - t0, e - s) for s, e, name in gpu if t0 <= s < t_next]
        api_calls = [(name, s - t0, e - s) for s, e, name in api if t0 <= s < t1]
        out.append({"host_us": t1 - t0, "gpu": ops, "api": api_calls})
    return out


def summarise(per_call: list[dict]) -> dict:
    """Medians over calls of the host time, each GPU op's start and length (ops matched by
    position; calls with another op count are left out) and the end of the last one."""
    n_ops = statistics.mode(len(c["gpu"]) for c in per_call)
    same = [c for c in per_call if len(c["gpu"]) == n_ops]
    med = statistics.median
    ops = [{"name": same[0]["gpu"][k][0][:60],
            "start_us": med(c["gpu"][k][1] for c in same),
            "dur_us": med(c["gpu"][k][2] for c in same)} for k in range(n_ops)]
    n_api = statistics.mode(len(c["api"]) for c in same)
    api_same = [c for c in same if len(c["api"]) == n_api]
    api = [{"name": api_same[0]["api"][k][0][:40],
            "start_us": med(c["api"][k][1] for c in api_same),
            "dur_us": med(c["api"][k][2] for c in api_same)} for k in range(n_api)]
    return {"calls": len(same), "host_us": med(c["host_us"] for c in same), "api": api,
            "end_us": med(c["gpu"][-1][1] + c["gpu"][-1][2] for c in same) if n_ops else 0.0,
            "ops": ops}


def render(meta: dict) -> str:
    lines = [f"{meta['device']}, TP{meta['world']}; µs from the call's host entry, medians "
             f"of {meta['calls']} profiled eager calls (device drained before each)."]
    for row in meta["rows"]:
        for rank, variants in enumerate(row["ranks"]):
            for name, s in variants.items():
                lines.append(f"\nD={row['D']} B={row['B']} rank {rank} {name}: host "
                             f"{s['host_us']:.1f}, GPU end {s['end_us']:.1f} ({s['calls']} calls)")
                prev_end = 0.0
                for op in s["ops"]:
                    gap = op["start_us"] - prev_end
                    lines.append(f"  start {op['start_us']:8.1f}  dur {op['dur_us']:8.1f}  "
                                 f"(gap {gap:7.1f})  {op['name']}")
                    prev_end = op["start_us"] + op["dur_us"]
                lines.append("  host: " + ", ".join(f"{a['name']} @{a['start_us']:.1f}"
                                                    f"+{a['dur_us']:.1f}" for a in s["api"]))
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="4096x151936,8192x128256")
    p.add_argument("--batch", default="1,64,256")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--nccl", action="store_true",
                   help="also the sampler over NCCL, without and with its per-call stamp")
    p.add_argument("--constrained", action="store_true",
                   help="also each sampler's calls with an allowed mask (a random half) and with "
                        "logit_adjust (64 random ids per row)")
    p.add_argument("--out", default=None)
    p.add_argument("--report", metavar="JSON", help="print a timeline_tp<N>.json, no run")
    args = p.parse_args(argv)
    if args.report:
        print(render(json.load(open(args.report))))
        return
    rank, world = init_ranks()
    rows = []
    for D, V, w, g in weight_shards(args.shapes, world):
        make = lambda t: sampler_on(w, world, t)  # noqa: E731
        samplers = {"symm_mem": make("symm_mem")}
        if args.nccl:
            samplers["nccl"] = make("nccl")
            # the per-call stamp the NCCL transport adds where a process outlives an abort
            # (read when the sampler is built; the group's own mode does not change its cost)
            before = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
            samplers["nccl_stamped"] = make("nccl")
            if before is None:
                del os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
            else:
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = before
        for B in (int(b) for b in args.batch.split(",")):
            h = torch.randn(B, D, device="cuda", generator=g).bfloat16()
            seeds = torch.arange(B, device="cuda")
            variants = {"mm": lambda: h @ w.T}
            for t, s in samplers.items():
                variants[f"tp_{t}"] = (lambda s=s: s(h, seed=seeds))
            if args.constrained:  # the same on every rank: a generator seeded by B
                cg = torch.Generator(device="cuda").manual_seed(B)
                words = -(-w.shape[0] * world // 32)
                mask = torch.randint(-2 ** 31, 2 ** 31, (B, words), dtype=torch.int64,
                                     device="cuda", generator=cg).to(torch.int32)
                adjust = (torch.randint(0, V, (B, 64), device="cuda", generator=cg),
                          torch.randn(B, 64, device="cuda", generator=cg))
                for t, s in samplers.items():
                    variants[f"tp_{t}_mask"] = (lambda s=s: s(h, seed=seeds, allowed_mask=mask))
                    variants[f"tp_{t}_adj64"] = (lambda s=s: s(h, seed=seeds,
                                                               logit_adjust=adjust))
            mine = {name: summarise(profile_calls(fn, args.calls)) for name, fn in variants.items()}
            for s in samplers.values():
                s.check_exchange()
            gathered = [None] * world
            dist.all_gather_object(gathered, mine)
            rows.append({"D": D, "V": V, "B": B, "ranks": gathered})
            if rank == 0:
                print(render({"device": torch.cuda.get_device_name(), "world": world,
                              "calls": args.calls, "rows": rows[-1:]}), flush=True)
        samplers = None
    if rank == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"timeline_tp{world}.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "world": world,
                       "calls": args.calls, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
