"""A Megatron-style tensor-parallel decode loop with tpsample as its sampler.

    torchrun --nproc-per-node=2 examples/tp_decode.py

A toy TP model: vocab-parallel embedding (all-reduce), a column-parallel + row-parallel MLP
block (all-reduce), a final norm, and the vocab-parallel LM head — whose logits are never
formed: VocabParallelSampler samples from the shard directly and every rank receives the
same next tokens, which feed the next step's embedding lookup on every rank.
"""
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpsample

V, D, FFN, B, STEPS = 8000, 256, 1024, 3, 6


def main():
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", 1))
    if cuda:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # gloo: the group's timeout = the sampler's timeout_s (300 s), so a timed-out
    # all-gather ends with it
    dist.init_process_group("nccl" if cuda else "gloo",
                            timeout=None if cuda else datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    g = torch.Generator().manual_seed(0)  # same full weights on every rank; each keeps its shard
    rows = V // world  # V divisible by world here; tpsample itself also takes uneven shards
    lo, hi = rank * rows, (rank + 1) * rows
    emb = (torch.randn(V, D, generator=g) * 0.5)[lo:hi].to(dev)
    w_up = (torch.randn(FFN, D, generator=g) / D ** 0.5)[rank * FFN // world:(rank + 1) * FFN // world].to(dev)
    w_down = (torch.randn(D, FFN, generator=g) / FFN ** 0.5)[:, rank * FFN // world:(rank + 1) * FFN // world].to(dev)
    lm_head = (torch.randn(V, D, generator=g) / D ** 0.5 * 4)[lo:hi].contiguous().to(dev)
    sampler = tpsample.VocabParallelSampler(lm_head, vocab_size=V, check_inputs=False)

    tokens = torch.tensor([1, 2, 3], device=dev)
    seeds = torch.tensor([11, 12, 13], dtype=torch.int64, device=dev)
    history = [tokens]
    for step in range(STEPS):
        local = (tokens >= lo) & (tokens < hi)  # vocab-parallel embedding lookup
        x = torch.where(local[:, None], emb[(tokens - lo).clamp(0, rows - 1)], torch.zeros(B, D, device=dev))
        dist.all_reduce(x)
        y = F.gelu(x @ w_up.T) @ w_down.T  # column- then row-parallel MLP
        dist.all_reduce(y)
        hidden = F.layer_norm(x + y, (D,))
        tokens = sampler(hidden, temperature=0.9, seed=seeds, offset=step)
        history.append(tokens)
    if rank == 0:
        print("generated token ids per row:", torch.stack(history, dim=1).tolist())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
