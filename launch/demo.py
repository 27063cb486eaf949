"""First thing to run: a few decode steps of vocabulary-parallel sampling.

    torchrun --nproc-per-node=2 -m tpsample.launch.demo [--steps 4] [--batch 4]

Each rank builds its shard of a random LM head [V, D] (CPU + gloo when there is no GPU per
rank, else CUDA + NCCL with symmetric memory where P2P works), samples a few decode steps
with tpsample.VocabParallelSampler, and rank 0 prints: the transport, the tokens (identical
on every rank: checked), that they equal tpsample.sample on the full weight for the same
seeds (TP invariance of the pathwise max merge), and the per-call latency.
"""
from __future__ import annotations

import argparse
import datetime
import logging
import os
import statistics
import time

for _var in ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS"):  # never NVLink multicast
    os.environ.setdefault(_var, "0" if _var == "NCCL_NVLS_ENABLE" else "1")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tpsample  # noqa: E402


def setup():
    local = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available() and torch.cuda.device_count() >= world:
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        return torch.device("cuda", local)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # the sampler's timeout_s (300 s): a timed-out gloo all-gather ends with it
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    return torch.device("cpu")


def shard_rows(V: int, rank: int, world: int) -> tuple[int, int]:
    base, extra = divmod(V, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def full_weight(V: int, D: int, dtype, device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(0)
    return (torch.randn(V, D, generator=g, device=device) / D ** 0.5 * 4).to(dtype)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dim", type=int, default=None, help="D (default 256 on CPU, 4096 on GPU)")
    ap.add_argument("--vocab", type=int, default=None, help="V (default 32000 on CPU, 151936 on GPU)")
    args = ap.parse_args(argv)
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    gpu = device.type == "cuda"
    D = args.dim or (4096 if gpu else 256)
    V = args.vocab or (151936 if gpu else 32000)
    dtype = torch.bfloat16 if gpu else torch.float32

    W = full_weight(V, D, dtype, device)  # every rank builds the same matrix, keeps its rows
    lo, hi = shard_rows(V, rank, world)
    sampler = tpsample.VocabParallelSampler(W[lo:hi].contiguous(), vocab_size=V)
    g = torch.Generator(device=device).manual_seed(1)
    seeds = torch.arange(args.batch, dtype=torch.int64, device=device) + 100
    times = []
    for step in range(args.steps):
        h = torch.randn(args.batch, D, generator=g, device=device).to(dtype)
        t0 = time.perf_counter()
        out = sampler(h, temperature=0.8, seed=seeds, offset=step, return_logprobs=True)
        if gpu:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        gathered = [torch.empty_like(out.tokens) for _ in range(world)]
        dist.all_gather(gathered, out.tokens)
        same_on_ranks = all(torch.equal(t, out.tokens) for t in gathered)
        single = tpsample.sample(h, W[:V], temperature=0.8, seed=seeds, offset=step)
        if rank == 0:
            print(f"step {step}: tokens {out.tokens.tolist()}  logprobs "
                  f"{[round(x, 3) for x in out.logprobs.tolist()]}  identical on {world} ranks: "
                  f"{same_on_ranks}  == single-device sample: {torch.equal(single, out.tokens)}")
    if rank == 0:
        print(f"transport={sampler.transport.name} world={world} device={device.type} D={D} V={V} "
              f"B={args.batch}: median {statistics.median(times):.3f} ms per call "
              f"(first call {times[0]:.1f} ms includes compilation)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
