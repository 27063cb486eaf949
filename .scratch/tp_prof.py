"""Per-kernel GPU time of filtered calls on flat rows: one GPU (rank 0 alone) and TP (every rank)."""
import collections, json, os, sys
import torch, torch.distributed as dist
import tpsample
from tpsample.launch.sweep import sweep_head, hidden
from torch.profiler import profile, ProfilerActivity

rank = int(os.environ.get("RANK", 0)); world = int(os.environ.get("WORLD_SIZE", 1))
dev = torch.device("cuda", rank); torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev)
D, V = 4096, 151936
W, U = sweep_head(D, V, torch.bfloat16, dev)
OUT = os.environ.get("OUT", "/tmp/out"); os.makedirs(OUT, exist_ok=True)
rows = V // world
shard = W[rank * rows:(rank + 1) * rows].contiguous()
s = tpsample.VocabParallelSampler(shard, vocab_size=V, transport="symm_mem", check_inputs=False)
res = {}

def prof(label, fn, n=20):
    for _ in range(8): fn()
    torch.cuda.synchronize(); dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            fn(); torch.cuda.synchronize()
    acc = collections.defaultdict(float); cnt = collections.Counter()
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            acc[e.name[:70]] += e.device_time_total / n if hasattr(e, "device_time_total") else e.cuda_time_total / n
            cnt[e.name[:70]] += 1
    res[label] = sorted(((k, round(v, 1), cnt[k] // n) for k, v in acc.items()), key=lambda x: -x[1])
    if rank == 0:
        print(f"== {label}: total {sum(v for _, v, _ in res[label]):.1f} us")
        for k, v, c in res[label][:14]:
            print(f"   {v:8.1f} us x{c}  {k}")

for head in ("gauss1", "zipf1.3"):
    for B in (64,):
        h = hidden(U, head, B, torch.bfloat16)
        seed = torch.arange(B, device=dev) + 1
        if rank == 0:
            prof(f"1gpu {head} B{B} plain", lambda: tpsample.sample(h, W, seed=seed), ) if False else None
        prof(f"tp{world} {head} B{B} plain", lambda: s(h, seed=seed))
        prof(f"tp{world} {head} B{B} top_p0.9", lambda: s(h, seed=seed, top_p=0.9))
        prof(f"tp{world} {head} B{B} min_p0.1", lambda: s(h, seed=seed, min_p=0.1))
dist.barrier()
if rank == 0:
    for head in ("gauss1",):
        h = hidden(U, head, 64, torch.bfloat16); seed = torch.arange(64, device=dev) + 1
        for lab, kw in (("plain", {}), ("top_p0.9", dict(top_p=0.9))):
            for _ in range(8): tpsample.sample(h, W, seed=seed, **kw)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                for _ in range(20):
                    tpsample.sample(h, W, seed=seed, **kw); torch.cuda.synchronize()
            acc = collections.defaultdict(float)
            for e in p.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    acc[e.name[:70]] += e.device_time_total / 20
            print(f"== 1gpu {head} B64 {lab}: total {sum(acc.values()):.1f}")
            for k, v in sorted(acc.items(), key=lambda x: -x[1])[:14]:
                print(f"   {v:8.1f} us  {k}")
    json.dump(res, open(os.path.join(OUT, "tp_prof.json"), "w"), indent=1)
dist.barrier()
dist.destroy_process_group()
