"""TP: the side-output gather one row per step (BLOCK_R=1) vs blocks of rows, same run."""
import json, os
import torch, torch.distributed as dist
import tpsample
from tpsample import launchers as L
from tpsample.launch.bench import time_calls
from tpsample.launch.sweep import sweep_head, hidden
rank = int(os.environ["RANK"]); dev = torch.device("cuda", rank); torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev); world = dist.get_world_size()
D, V = 4096, 151936
w, U = sweep_head(D, V, torch.bfloat16, dev)
per = -(-V // world)
shard = w[rank * per:(rank + 1) * per].contiguous()
ARM = [16]
orig = L.run_named
def rn(fn, grid, opts, **kw):
    if "FROM_SIDE" in kw and kw["FROM_SIDE"]:
        kw["BLOCK_R"] = ARM[0]
    return orig(fn, grid, opts, **kw)
L.run_named = rn
res = []
for head in ("gauss1", "zipf1.3"):
    for B in (16, 64, 256):
        h = hidden(U, head, B, torch.bfloat16)
        row = {"head": head, "B": B}
        for arm in (1, 16, 32, 16):
            ARM[0] = arm
            s = tpsample.VocabParallelSampler(shard, vocab_size=V, transport="symm_mem", check_inputs=False)
            if "plain" not in row:
                row["plain"] = time_calls(lambda: s(h, seed=1), dev, 30)
            for name, kw in (("p0.9", dict(top_p=0.9)), ("m0.1", dict(min_p=0.1))):
                row[f"{name}_R{arm}"] = time_calls(lambda kw=kw: s(h, seed=1, **kw), dev, 30)
            ref = s(h, seed=5, top_p=0.9)
            row.setdefault("tok", []).append(int((ref.double() * torch.arange(1, B + 1, device=dev)).sum()))
            del s
        res.append(row)
        if rank == 0:
            print(head, B, "plain %.3f" % row["plain"], " ".join(f"{k} {v / row['plain']:.2f}x" for k, v in row.items() if k[:2] in ("p0", "m0")), "tokens equal:", len(set(row["tok"])) == 1, flush=True)
if rank == 0:
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "gather_ab.json"), "w"), indent=1)
dist.destroy_process_group()
