"""Split a memo hit's host time by stage (one GPU), plain vs top_p, interleaved."""
import collections, json, os, statistics, time
import torch
import tpsample
from tpsample import api, call_graphs, call_memo, params as P

OUT = os.environ.get("OUT", "/tmp/out"); os.makedirs(OUT, exist_ok=True)
dev = torch.device("cuda", 0)
acc = collections.defaultdict(list)
ON = [False]

def wrap(obj, name, label):
    f = getattr(obj, name)
    def w(*a, **k):
        t0 = time.perf_counter_ns(); r = f(*a, **k); t1 = time.perf_counter_ns()
        if ON[0]: acc[label].append((t1 - t0) / 1e3)
        return r
    setattr(obj, name, w)

wrap(api, "signature", "signature")
wrap(api._MEMO, "call", "memo.call")
def run(self, tensors, returned, fills=None):
    t = [time.perf_counter_ns()]
    inputs = self.inputs
    with self.lock:
        t.append(time.perf_counter_ns())
        for name in self.copied:
            if fills is not None and name in fills:
                fills[name](inputs[name]); continue
            inputs[name].copy_(tensors[name])
        t.append(time.perf_counter_ns())
        self.graph.replay()
        t.append(time.perf_counter_ns())
        out = {name: self.outputs[name].clone() for name in returned}
        t.append(time.perf_counter_ns())
    t.append(time.perf_counter_ns())
    if ON[0]:
        for lab, a, b in zip(("run.lock", "run.copies", "run.replay", "run.clone", "run.unlock"), t, t[1:]):
            acc[lab].append((b - a) / 1e3)
        acc["graph.run"].append((t[-1] - t[0]) / 1e3)
    return out
call_graphs.CallGraph.run = run
wrap(call_graphs.CallGraph, "binds", "graph.binds")
wrap(api.P, "package", "package")
_Orig = torch.cuda.CUDAGraph
class G:
    def __init__(self): self.g = _Orig()
    def capture_begin(self, *a, **k): return self.g.capture_begin(*a, **k)
    def capture_end(self): return self.g.capture_end()
    def replay(self):
        t0 = time.perf_counter_ns(); self.g.replay(); t1 = time.perf_counter_ns()
        if ON[0]: acc["replay"].append((t1 - t0) / 1e3)
call_graphs.torch.cuda.CUDAGraph = G

D, V = 4096, 151936
W = torch.randn(V, D, device=dev, dtype=torch.bfloat16) * 0.02
cases = {}
for label, B, kw, seedkind in [("plain", 1, {}, "t"), ("top_p", 1, {"top_p": 0.9}, "t"),
                               ("plain_loop", 1, {}, "none"), ("plain64", 64, {}, "t")]:
    h = torch.randn(B, D, device=dev, dtype=torch.bfloat16)
    seed = torch.randint(0, 2**62, (B,), device=dev); off = torch.zeros(B, dtype=torch.int64, device=dev)
    if seedkind == "t":
        fn = (lambda h=h, seed=seed, off=off, kw=kw: tpsample.sample(h, W, seed=seed, offset=off, **kw))
    else:
        fn = (lambda h=h, kw=kw: tpsample.sample(h, W, seed=None, offset=7, **kw))
    for _ in range(6): fn()
    cases[label] = fn
torch.cuda.synchronize()
res = {}
for label in cases: res[label] = collections.defaultdict(list)
for it in range(200):
    for label, fn in cases.items():
        acc.clear(); torch.cuda.synchronize()
        h0 = api._MEMO.hits
        ON[0] = True
        t0 = time.perf_counter_ns(); fn(); t1 = time.perf_counter_ns()
        ON[0] = False
        if it >= 40:
            r = res[label]; r["total"].append((t1 - t0) / 1e3); r["hit"].append(api._MEMO.hits - h0)
            for k, v in acc.items(): r[k].append(sum(v))
torch.cuda.synchronize()
table = {}
keys = ["total", "signature", "memo.call", "graph.binds", "graph.run", "run.lock", "run.copies", "run.replay", "replay", "run.clone", "package", "hit"]
print("| call | " + " | ".join(keys) + " |")
for label, r in res.items():
    table[label] = {k: statistics.median(v) for k, v in r.items()}
    print("| " + label + " | " + " | ".join("%.1f" % table[label].get(k, float("nan")) for k in keys) + " |")
json.dump(table, open(os.path.join(OUT, "memo_probe.json"), "w"), indent=1)

# replay then clone, outside the memo, per graph
for label in ("plain", "top_p", "plain64"):
    pass
cg = {}
for pipe in api._PIPELINES.values():
    pass
# per-op costs interleaved
x = torch.zeros(64, dtype=torch.int64, device=dev); y = torch.zeros(64, dtype=torch.int64, device=dev)
ops = {"clone": lambda: x.clone(), "fill": lambda: x.fill_(3), "copy": lambda: y.copy_(x),
       "empty": lambda: torch.empty(64, dtype=torch.int64, device=dev),
       "randint_out": lambda: torch.randint(0, 2**62, (64,), dtype=torch.int64, device=dev, out=y),
       "is_capturing": lambda: torch.cuda.is_current_stream_capturing(),
       "current_stream": lambda: torch.cuda.current_stream(0),
       "empty_like+copy": lambda: torch.empty_like(x).copy_(x)}
o = collections.defaultdict(list)
for it in range(300):
    for k, f in ops.items():
        torch.cuda.synchronize(); t0 = time.perf_counter_ns(); f(); t1 = time.perf_counter_ns()
        if it > 50: o[k].append((t1 - t0) / 1e3)
print(" ".join("%s=%.1f" % (k, statistics.median(v)) for k, v in o.items()))
