"""Filtered calls under tensor parallelism on the sweep's heads: the plain TP call, top_k 50,
top_p 0.9 and min_p 0.1 (flat rows take the exact fallback's fast path from the side output
gathered over symmetric memory), median ms per call, max over ranks, with the bytes a rank
receives per call against an all-gather of the fp32 logits.

    torchrun --nproc-per-node=N -m tools.tp_filtered [--D 4096 --V 151936]
        [--heads zipf2.0,zipf1.3,gauss1] [--batches 1,16,64,256] [--out DIR] [--ab-graphs]
        [--ab-split]

--ab-graphs: each filter also timed with its repeated calls re-issuing their launches (as
TPSAMPLE_GRAPHS=plain; <filter>_reissued), in the same run; the filter column keeps the
process's setting (by default top-p / min-p calls through their CUDA graph).
--ab-split: top-p and min-p also timed on a second sampler whose fallback does not split the
flagged rows between ranks (launchers.SPLIT_ROWS off while it records its launches: every
rank gathers and cuts every flagged row; <filter>_unsplit), in the same run, and its tokens
compared with the split sampler's (<filter>_same_tokens).

Bytes received per rank: the peers' records and, of the flagged rows' side-output shards,
those of the rows this rank redoes: all of them, or about 1/world of them (rows split evenly)
plus 3 words for each of the others' outputs where the call splits them.

Timing as the benchmark's TP cells (tpsample.launch.bench.time_calls: CUDA events around an
eager call with a host sync, the ranks aligned by a one-element all-reduce before each).
"""
import argparse
import json
import os

import torch
import torch.distributed as dist

import tpsample
from tpsample import knobs, launchers, records
from tpsample.launch.bench import time_calls
from tpsample.launch.sweep import hidden, row_seeds, sweep_head

FILTERS = {"k50": dict(top_k=50), "p0.9": dict(top_p=0.9), "m0.1": dict(min_p=0.1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--D", type=int, default=4096)
    ap.add_argument("--V", type=int, default=151936)
    ap.add_argument("--heads", default="zipf2.0,zipf1.3,gauss1")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=".")
    ap.add_argument("--ab-graphs", action="store_true")
    ap.add_argument("--ab-split", action="store_true")
    a = ap.parse_args()
    rank = int(os.environ["RANK"])
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    world = dist.get_world_size()
    w, U = sweep_head(a.D, a.V, torch.bfloat16, dev)
    per = -(-a.V // world)
    shard = w[rank * per:(rank + 1) * per].contiguous()
    sampler = tpsample.VocabParallelSampler(shard, vocab_size=a.V, transport="symm_mem",
                                            check_inputs=False)
    unsplit = (tpsample.VocabParallelSampler(shard, vocab_size=a.V, transport="symm_mem",
                                             check_inputs=False) if a.ab_split else None)

    def call_unsplit(h, kw, seed):
        launchers.SPLIT_ROWS = False  # (read when a call's launches are recorded)
        try:
            return unsplit(h, seed=seed, **kw)
        finally:
            launchers.SPLIT_ROWS = True
    res = []
    for head in a.heads.split(","):
        for B in map(int, a.batches.split(",")):
            h = hidden(U, head, B, torch.bfloat16)
            seed = row_seeds(B, h.device)
            row = {"head": head, "B": B, "world": world}
            row["plain"] = time_calls(lambda: sampler(h, seed=seed), dev, a.iters)
            for name, kw in FILTERS.items():
                before = sampler.pipeline.fallback_rows
                sampler(h, seed=seed, **kw)
                torch.cuda.synchronize()
                flagged = sampler.pipeline.fallback_rows - before
                row[name] = time_calls(lambda kw=kw: sampler(h, seed=seed, **kw), dev, a.iters)
                if a.ab_graphs:
                    with knobs.overridden(GRAPHS_FILTERED=False):
                        row[name + "_reissued"] = time_calls(
                            lambda kw=kw: sampler(h, seed=seed, **kw), dev, a.iters)
                split = ("k" not in name and world > 1
                         and B >= launchers.SPLIT_MIN_ROWS * world)
                if a.ab_split and split:
                    row[name + "_unsplit"] = time_calls(
                        lambda kw=kw: call_unsplit(h, kw, seed), dev, a.iters)
                    row[name + "_same_tokens"] = bool(torch.equal(sampler(h, seed=seed, **kw),
                                                                  call_unsplit(h, kw, seed)))
                # received per rank: the peers' records (the sample and candidate planes) and
                # the side-output shards of the flagged rows it redoes (module docstring)
                tiles = -(-per // records.TILE)
                planes = 1 + records.CANDIDATE_PLANES
                redone = -(-flagged // world) if split else flagged
                row[name + "_bytes"] = ((world - 1) * (planes * B * tiles * 16 + redone * per * 4)
                                        + (flagged - redone) * 3 * 4 * split)
                row[name + "_flagged"] = flagged
            row["allgather_logits_bytes"] = (world - 1) * B * per * 4
            res.append(row)
            if rank == 0:
                print(f"TP{world} {head} B={B}: plain {row['plain']:.3f} ms | " + " | ".join(
                    f"{n} {row[n] / row['plain']:.2f}x"
                    + (f" (re-issued {row[n + '_reissued'] / row['plain']:.2f}x)"
                       if a.ab_graphs else "")
                    + (f" (unsplit {row[n + '_unsplit'] / row['plain']:.2f}x, same tokens "
                       f"{row[n + '_same_tokens']})" if n + "_unsplit" in row else "")
                    + f" ({row[n + '_flagged']} rows, "
                    f"{row[n + '_bytes'] / 1e6:.2f} MB)" for n in FILTERS)
                    + f" | all-gather of logits {row['allgather_logits_bytes'] / 1e6:.1f} MB",
                    flush=True)
    if rank == 0:
        print(summary(res), flush=True)
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"tp_filtered_tp{world}.json"), "w") as f:
            json.dump(res, f, indent=1)
    dist.destroy_process_group()


def summary(rows: list[dict]) -> str:
    """The run's last line: per filter, the worst cell (ratio to the plain TP call, its head
    and B) and the typical one (the median cell); with --ab-split, the split's worst ratio to
    the unsplit call and whether every compared cell had the same tokens."""
    world = rows[0]["world"] if rows else 0
    parts = []
    for n in FILTERS:
        cells = sorted((r[n] / r["plain"], r["head"], r["B"]) for r in rows if n in r)
        if cells:
            w, mid = cells[-1], cells[len(cells) // 2]
            parts.append(f"{n} worst {w[0]:.2f}x ({w[1]}, B={w[2]}), median {mid[0]:.2f}x")
    ab = [(r[n] / r[n + "_unsplit"], r[n + "_same_tokens"]) for r in rows for n in FILTERS
          if n + "_unsplit" in r]
    if ab:
        parts.append(f"split / unsplit worst {max(x for x, _ in ab):.2f}x, "
                     f"same tokens in {sum(t for _, t in ab)} of {len(ab)} cells")
    return f"TP{world} summary: " + "; ".join(parts)


if __name__ == "__main__":
    main()
