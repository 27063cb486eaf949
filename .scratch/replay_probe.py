"""Where a memo hit's host time goes (one GPU): graph.replay vs raw cudaGraphLaunch, the
graph's nodes/edges, per-op costs, N-node synthetic graphs."""
import ctypes, glob, json, os, statistics, sys, time
import torch, triton, triton.language as tl
import tpsample
from tpsample import api, call_graphs

OUT = os.environ.get("OUT", "/tmp/out")
os.makedirs(OUT, exist_ok=True)
dev = torch.device("cuda", 0)
res = {}

def host(fn, n=300, drain=True):
    ts = []
    for i in range(n):
        if drain:
            torch.cuda.synchronize()
        t0 = time.perf_counter_ns(); fn(); t1 = time.perf_counter_ns()
        ts.append((t1 - t0) / 1e3)
    torch.cuda.synchronize()
    return statistics.median(ts[n // 5:])

# raw cudaGraphLaunch through ctypes
cudart = None
for pat in ["/usr/local/lib/python3*/*-packages/nvidia/cu13/lib/libcudart.so*",
            "/usr/local/lib/python3*/*-packages/nvidia/cuda_runtime/lib/libcudart.so*",
            "/usr/local/cuda*/lib64/libcudart.so*"] + [os.path.join(os.path.dirname(torch.__file__), "lib", "libcudart*")]:
    for p in glob.glob(pat):
        try:
            cudart = ctypes.CDLL(p); res["cudart"] = p; break
        except OSError:
            pass
    if cudart: break
print("cudart", res.get("cudart"))

# keep graphs for dumping
_Orig = torch.cuda.CUDAGraph
def KeepGraph(*a, **k):
    return _Orig(keep_graph=True)

D, V = 4096, 151936
W = torch.randn(V, D, device=dev, dtype=torch.bfloat16) * 0.02
rows = []
for label, B, kw in [("plain B1", 1, {}), ("plain B64", 64, {}), ("top_p0.9 B1", 1, {"top_p": 0.9})]:
    api._PIPELINES.clear()
    call_graphs.torch.cuda.CUDAGraph = KeepGraph
    h = torch.randn(B, D, device=dev, dtype=torch.bfloat16)
    seed = torch.randint(0, 2**62, (B,), device=dev); off = torch.zeros(B, dtype=torch.int64, device=dev)
    for _ in range(6):
        tpsample.sample(h, W, seed=seed, offset=off, **kw)
    torch.cuda.synchronize()
    call_graphs.torch.cuda.CUDAGraph = _Orig
    pipe = next(iter(api._PIPELINES.values()))
    cg = pipe.last_graph[1]
    g = cg.graph
    r = {"call": label}
    r["memo_call_us"] = host(lambda: tpsample.sample(h, W, seed=seed, offset=off, **kw))
    r["replay_us"] = host(g.replay)
    r["replay_busy_us"] = host(g.replay, n=60, drain=False)
    try:
        ex = g.raw_cuda_graph_exec()
        stream = torch.cuda.current_stream().cuda_stream
        cudart.cudaGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        r["raw_launch_us"] = host(lambda: cudart.cudaGraphLaunch(ctypes.c_void_p(ex), ctypes.c_void_p(stream)))
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            r["replay_other_stream_us"] = host(g.replay)
    except Exception as e:
        r["raw_err"] = repr(e)
    try:
        p = os.path.join(OUT, label.replace(" ", "_") + ".dot")
        g.debug_dump(p)
        txt = open(p).read()
        r["dot_bytes"] = len(txt)
        r["nodes_kernel"] = txt.count("KERNEL")
        r["nodes_memset"] = txt.count("MEMSET")
        r["nodes_memcpy"] = txt.count("MEMCPY")
        r["edges"] = txt.count("->")
        r["programmatic"] = txt.lower().count("programmatic")
    except Exception as e:
        r["dump_err"] = repr(e)
    r["copied"] = list(cg.copied); r["bound"] = list(cg.bound)
    out = cg.outputs["tokens"]
    r["clone_us"] = host(lambda: out.clone())
    hin = cg.inputs.get("hidden")
    if hin is not None and "hidden" in cg.copied:
        r["copy_hidden_us"] = host(lambda: hin.copy_(h))
    r["fill_us"] = host(lambda: off.fill_(3))
    r["empty_us"] = host(lambda: torch.empty(B, dtype=torch.int64, device=dev))
    rows.append(r); print(r, flush=True)

# synthetic: N tiny triton kernels / torch ops in one graph (captured on a side stream)
@triton.jit
def _noop(x_ptr, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(x_ptr + o, tl.load(x_ptr + o, mask=o < n) + 1, mask=o < n)

x = torch.zeros(1024, device=dev)
_noop[(1,)](x, 1024, BLOCK=1024)
for N in (1, 2, 4, 8, 16):
    for kind in ("triton", "torch", "triton_pdl"):
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                g.capture_begin()
                for i in range(N):
                    if kind == "torch":
                        x.add_(1)
                    elif kind == "triton":
                        _noop[(1,)](x, 1024, BLOCK=1024)
                    else:
                        _noop[(1,)](x, 1024, BLOCK=1024, launch_pdl=True)
                g.capture_end()
            torch.cuda.current_stream().wait_stream(side)
            g.replay(); torch.cuda.synchronize()
            r = {"call": f"synthetic {kind} x{N}", "replay_us": host(g.replay)}
        except Exception as e:
            r = {"call": f"synthetic {kind} x{N}", "err": repr(e)[:200]}
        rows.append(r); print(r, flush=True)

json.dump(rows, open(os.path.join(OUT, "replay_probe.json"), "w"), indent=1)
print()
print("| call | memo call | replay | replay busy | raw launch | other stream | kernels | edges | prog | clone | copy h | fill | empty |")
for r in rows:
    f = lambda k: ("%.1f" % r[k]) if isinstance(r.get(k), float) else str(r.get(k, "-"))
    print("|", " | ".join([r["call"]] + [f(k) for k in ("memo_call_us", "replay_us", "replay_busy_us", "raw_launch_us", "replay_other_stream_us", "nodes_kernel", "edges", "programmatic", "clone_us", "copy_hidden_us", "fill_us", "empty_us")]), "|")
