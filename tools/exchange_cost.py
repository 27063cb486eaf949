"""What the symmetric-memory exchange costs per call, on the GPUs at hand (one process per
rank under torchrun; one rank works too: the exchange then signals itself).

    torchrun --nproc-per-node=N -m tools.exchange_cost [--out DIR]
    python -m tools.exchange_cost --report DIR/exchange_cost_tp2.json [--doc F --label L]

Per (D, B): the per-call latency (CUDA events, a host sync per call, median of 200, max over
ranks) of the local matmul h @ W_r.T, of the sampler with the device-side signal and bounded
wait (kernels/exchange_wait.py, the shipped exchange), and of the same sampler with torch's
symmetric-memory barrier in its place (the exchange before it): the three alternate for
ROUNDS rounds and each keeps its best round (eager host time on a shared host drifts).
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

import tpsample
from tpsample.launch.bench import time_calls

ITERS, WARMUP, ROUNDS = 200, 20, 3
BOUND = (1.2, 0.020)  # the target for the shipped exchange: within 1.2 x the matmul + 20 µs


def markdown(meta: dict) -> str:
    """One row per (D, B): the three latencies, the A/B ratio and the target's bound."""
    k, extra = BOUND
    lines = [f"{meta['device']}, TP{meta['rows'][0]['world']}; ms per call (host sync per call, "
             "median of 200, max over ranks, best of 3 alternating rounds); bound = "
             f"{k} × matmul + {extra * 1e3:g} µs.", "",
             "| D | B | matmul | signal wait (shipped) | torch barrier | wait / barrier "
             "| bound | wait within bound |", "|---|---|---|---|---|---|---|---|"]
    for r in meta["rows"]:
        bound = k * r["mm"] + extra
        lines.append(f"| {r['D']} | {r['B']} | {r['mm']:.3f} | {r['signal_wait']:.3f} | "
                     f"{r['torch_barrier']:.3f} | {r['signal_wait'] / r['torch_barrier']:.3f} | "
                     f"{bound:.3f} | {'yes' if r['signal_wait'] <= bound else 'no'} |")
    return "\n".join(lines) + "\n"


def init_ranks() -> tuple[int, int]:
    """(rank, world) of this torchrun process, its GPU selected, NCCL initialised (NVLink
    multicast off unless the environment says otherwise)."""
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    return dist.get_rank(), dist.get_world_size()


def weight_shards(shapes: str, world: int):
    """For each "DxV" in the comma list: (D, V, this rank's random bf16 LM-head shard
    [ceil(V / world), D], the generator that drew it: seeded, so every run draws the same)."""
    for shape in shapes.split(","):
        D, V = (int(x) for x in shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        per = -(-V // world)
        yield D, V, (torch.randn(per, D, device="cuda", generator=g) * 0.02).bfloat16(), g


def sampler_on(w: torch.Tensor, world: int, transport: str):
    """A VocabParallelSampler on shard w of a world-way split (no host checks, B <= 256)."""
    return tpsample.VocabParallelSampler(w, vocab_size=w.shape[0] * world, transport=transport,
                                         check_inputs=False, max_batch=256)


def torch_barrier(transport):
    """The exchange as it was: torch's symmetric-memory barrier on the records buffer."""
    def exchange(mine, full):
        transport.handle.barrier(channel=0, timeout_ms=int(transport.timeout.total_seconds() * 1e3))
    return exchange


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="4096x151936,8192x128256")
    p.add_argument("--batch", default="1,16,64,256")
    p.add_argument("--out", default=None)
    p.add_argument("--report", metavar="JSON", help="render an exchange_cost_tp<N>.json, no run")
    p.add_argument("--doc", help="markdown file whose section --label the report rewrites")
    p.add_argument("--label", default="exchange cost")
    args = p.parse_args(argv)
    if args.report:
        body = markdown(json.load(open(args.report)))
        if args.doc:
            from tpsample.launch.bench import write_doc
            write_doc(args.doc, args.label, body)
        print(body)
        return
    rank, world = init_ranks()
    rows = []
    for D, V, w, g in weight_shards(args.shapes, world):
        sampler = sampler_on(w, world, "symm_mem")
        t = sampler.transport
        ours, old = t.exchange, torch_barrier(t)
        for B in (int(b) for b in args.batch.split(",")):
            h = torch.randn(B, D, device="cuda", generator=g).bfloat16()
            seeds = torch.arange(B, device="cuda")
            call = lambda: sampler(h, seed=seeds)  # noqa: E731
            dev = h.device
            row = {"D": D, "V": V, "B": B, "world": world}
            for _ in range(ROUNDS):  # the three alternate; each keeps its best round's median
                row.setdefault("mm", []).append(time_calls(lambda: h @ w.T, dev, ITERS, WARMUP))
                for name, exchange in (("signal_wait", ours), ("torch_barrier", old)):
                    t.exchange = exchange
                    row.setdefault(name, []).append(time_calls(call, dev, ITERS, WARMUP))
            t.exchange = ours
            sampler.check_exchange()
            row = {k: (min(v) if isinstance(v, list) else v) for k, v in row.items()}
            rows.append(row)
            if rank == 0:
                print(f"D={D} B={B:4d} world={world}: mm {row['mm']:.3f}  signal_wait "
                      f"{row['signal_wait']:.3f}  torch_barrier {row['torch_barrier']:.3f} ms  "
                      f"(ratio {row['signal_wait'] / row['torch_barrier']:.3f})", flush=True)
        sampler = None
    if rank == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"exchange_cost_tp{world}.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
