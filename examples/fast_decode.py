"""Decode as serving engines run it: a gpt-fast-style decoder with a static KV cache, one CUDA
graph per decode step, tensor parallel, and two heads compared in the same run.

    python examples/fast_decode.py --config tiny --steps 8                     # CPU, TP1
    torchrun --nproc-per-node=2 examples/fast_decode.py --config tiny --check  # CPU (gloo) or GPUs
    torchrun --nproc-per-node=N examples/fast_decode.py --config qwen3-1.7b \\
        --batches 1,8,32,128 --prompt 512 --steps 128 --out DIR               # TPOT on GPUs

The shapes are the real models' (qwen3-1.7b: 28 layers, D 2048, 16 query / 8 KV heads of 128,
FFN 6144, V 151,936, tied embeddings; qwen3-8b: 36 layers, D 4096, 32 / 8 heads, FFN 12,288;
llama-3.1-8b: 32 layers, D 4096, 32 / 8 heads, FFN 14,336, V 128,256); the weights are random
bf16 (the time per step depends on the shapes, not the values). RMSNorm, RoPE, SwiGLU, grouped
query attention through torch's fused scaled_dot_product_attention over a static cache.
Tensor parallel as gpt-fast does it: QKV and the MLP's gate/up column-parallel, the attention
output and the MLP's down projection row-parallel, one all-reduce after each; the embedding and
the LM head vocabulary-parallel (tied: one shard for both).

Heads, same model and cache: "stock" (the shard's logits h @ W_r.T, all-gathered under TP,
softmax and torch.multinomial; with --top-p the torch sort path) and "tpsample"
(VocabParallelSampler, or tpsample.sample at TP1; the logits are never formed).
--check: greedy tokens of the two heads equal at every step, sampled tokens equal at TP1 and
under this world size for the same seed (run it at several --nproc-per-node), the graph's
replays equal eager steps; the model runs in fp32 there, on GPUs too (bf16 all-reduces and
bf16 logits move near-ties: bf16 tokens differ across TP degrees and from an exact argmax).
--compile [BACKEND]: the decode step's model forward through torch.compile (default inductor:
its fused norms, RoPE and SwiGLU, as gpt-fast runs it; "eager" only traces, for the CPU test),
captured with the head in the same CUDA graph; the heads stay eager. --out: per (batch, head)
TPOT from graph replays and wall time per step, the head's own GPU time, tokens/s, to
OUT/fast_decode_<config>_tp<N>[_p<top_p>][_compiled].json; --report
renders such runs as the TPOT table (tools/multigpu.sh decode OUT runs them all).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpsample


@dataclass(frozen=True)
class Config:
    layers: int
    dim: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qk_norm: bool
    rope_base: float = 1e6


CONFIGS = {
    "qwen3-1.7b": Config(28, 2048, 16, 8, 128, 6144, 151936, True, True),
    "qwen3-8b": Config(36, 4096, 32, 8, 128, 12288, 151936, False, True),
    "llama-3.1-8b": Config(32, 4096, 32, 8, 128, 14336, 128256, False, False, 5e5),
    "tiny": Config(2, 64, 4, 2, 16, 128, 1000, True, True),
}


def shard(n: int, rank: int, world: int) -> slice:
    """Rank r's part of n rows (the first n % world ranks one more)."""
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return slice(lo, lo + base + (rank < extra))


class Model:
    """The decoder's weights on this rank (random, seeded: equal full weights on every rank, each
    keeping its shard) and a static KV cache for `batch` rows of `max_seq` positions."""

    def __init__(self, cfg: Config, rank: int, world: int, device, dtype, batch: int,
                 max_seq: int):
        if cfg.heads % world or cfg.kv_heads % world:
            raise ValueError(f"{world} ranks must divide the {cfg.heads} query and "
                             f"{cfg.kv_heads} KV heads")
        self.cfg, self.rank, self.world = cfg, rank, world
        g = torch.Generator(device="cpu").manual_seed(0)
        hd, D = cfg.head_dim, cfg.dim
        self.h_local, self.kv_local = cfg.heads // world, cfg.kv_heads // world

        def rnd(*shape, scale):
            return (torch.randn(*shape, generator=g) * scale).to(device, dtype)
        self.vocab = shard(cfg.vocab, rank, world)
        emb = torch.randn(cfg.vocab, D, generator=g) * 0.5
        self.embed = emb[self.vocab].to(device, dtype).contiguous()
        head = emb if cfg.tied else torch.randn(cfg.vocab, D, generator=g) * 0.5
        self.head = (self.embed if cfg.tied
                     else (head[self.vocab] / D ** 0.5 * 2).to(device, dtype).contiguous())
        if cfg.tied:
            self.head_scale = 2 / D ** 0.5  # applied to the hidden state (the shard is shared)
        else:
            self.head_scale = 1.0
        q = slice(rank * self.h_local * hd, (rank + 1) * self.h_local * hd)
        kv = slice(rank * self.kv_local * hd, (rank + 1) * self.kv_local * hd)
        f = shard(cfg.ffn, rank, world)
        self.layers = []
        for _ in range(cfg.layers):
            wq = torch.randn(cfg.heads * hd, D, generator=g) / D ** 0.5
            wk = torch.randn(cfg.kv_heads * hd, D, generator=g) / D ** 0.5
            wv = torch.randn(cfg.kv_heads * hd, D, generator=g) / D ** 0.5
            wo = torch.randn(D, cfg.heads * hd, generator=g) / (cfg.heads * hd) ** 0.5
            gate = torch.randn(cfg.ffn, D, generator=g) / D ** 0.5
            up = torch.randn(cfg.ffn, D, generator=g) / D ** 0.5
            down = torch.randn(D, cfg.ffn, generator=g) / cfg.ffn ** 0.5
            self.layers.append(dict(
                wqkv=torch.cat([wq[q], wk[kv], wv[kv]]).to(device, dtype),
                wo=wo[:, q].contiguous().to(device, dtype),
                w13=torch.cat([gate[f], up[f]]).to(device, dtype),
                w2=down[:, f].contiguous().to(device, dtype),
                norm1=torch.ones(D, device=device, dtype=dtype),
                norm2=torch.ones(D, device=device, dtype=dtype),
                q_norm=torch.ones(hd, device=device, dtype=dtype),
                k_norm=torch.ones(hd, device=device, dtype=dtype),
                k=torch.zeros(batch, self.kv_local, max_seq, hd, device=device, dtype=dtype),
                v=torch.zeros(batch, self.kv_local, max_seq, hd, device=device, dtype=dtype)))
        self.norm = torch.ones(D, device=device, dtype=dtype)
        inv = 1.0 / cfg.rope_base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        ang = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv)
        self.cos, self.sin = ang.cos().to(device), ang.sin().to(device)
        self.dtype = dtype
        self.step_forward = self.forward  # the decode step's forward (compile() replaces it)

    def compile(self, backend: str) -> None:
        """The decode step's forward through torch.compile (static shapes: one graph per
        batch size, compiled at its first step; prefill stays eager)."""
        self.step_forward = torch.compile(self.forward, backend=backend, dynamic=False)

    def all_reduce(self, x):
        if self.world > 1:
            dist.all_reduce(x)
        return x

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: [B, T] → [B, T, D] (an all-reduce under TP)."""
        lo = self.vocab.start
        local = (tokens >= lo) & (tokens < self.vocab.stop)
        x = self.embed[(tokens - lo).clamp(0, self.embed.shape[0] - 1)]
        return self.all_reduce(x * local[..., None].to(x.dtype))

    def rope(self, x, pos):
        """x [B, h, T, hd] at positions pos [T]."""
        c, s = self.cos[pos][None, None], self.sin[pos][None, None]
        x1, x2 = x.float().chunk(2, -1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(x.dtype)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] at positions pos [T] (a prefill, or one decode step with T = 1): the
        final-norm hidden states of the last position [B, D], the cache updated."""
        cfg, hd = self.cfg, self.cfg.head_dim
        B, T = tokens.shape
        x = self.embed_tokens(tokens)
        n_q, n_kv = self.h_local * hd, self.kv_local * hd
        for L in self.layers:
            h = F.rms_norm(x, (cfg.dim,), L["norm1"])
            q, k, v = (h @ L["wqkv"].T).split([n_q, n_kv, n_kv], -1)
            q = q.view(B, T, self.h_local, hd).transpose(1, 2)
            k = k.view(B, T, self.kv_local, hd).transpose(1, 2)
            v = v.view(B, T, self.kv_local, hd).transpose(1, 2)
            if cfg.qk_norm:
                q, k = F.rms_norm(q, (hd,), L["q_norm"]), F.rms_norm(k, (hd,), L["k_norm"])
            q, k = self.rope(q, pos), self.rope(k, pos)
            kc, vc = L["k"][:B], L["v"][:B]  # (the cache holds the largest batch)
            kc[:, :, pos] = k
            vc[:, :, pos] = v
            S = kc.shape[2]
            mask = torch.arange(S, device=x.device)[None, :] <= pos[:, None]  # [T, S]
            o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)
            o = o.transpose(1, 2).reshape(B, T, n_q)
            x = x + self.all_reduce(o @ L["wo"].T)
            h = F.rms_norm(x, (cfg.dim,), L["norm2"])
            gate, up = (h @ L["w13"].T).chunk(2, -1)
            x = x + self.all_reduce((F.silu(gate) * up) @ L["w2"].T)
        return F.rms_norm(x[:, -1], (cfg.dim,), self.norm) * self.head_scale


class StockHead:
    """The shard's logits, all-gathered under TP, then softmax + torch.multinomial (or the
    argmax at T = 0; with top_p: a full sort, the cut, then multinomial)."""

    def __init__(self, model: Model, top_p: float | None):
        self.m, self.top_p = model, top_p
        self.sizes = [shard(model.cfg.vocab, r, model.world) for r in range(model.world)]
        self.width = max(s.stop - s.start for s in self.sizes)

    def __call__(self, hidden: torch.Tensor, temperature: float, step: torch.Tensor):
        m = self.m
        logits = (hidden @ m.head.T).float()
        if m.world > 1:
            pad = torch.full((logits.shape[0], self.width), float("-inf"), device=logits.device)
            pad[:, :logits.shape[1]] = logits
            parts = [torch.empty_like(pad) for _ in range(m.world)]
            dist.all_gather(parts, pad)
            logits = torch.cat([p[:, :s.stop - s.start] for p, s in zip(parts, self.sizes)], 1)
        if temperature == 0:
            return logits.argmax(-1)
        logits = logits / temperature
        if self.top_p is not None:
            s, idx = logits.sort(-1, descending=True)
            p = s.softmax(-1)
            s = s.masked_fill(p.cumsum(-1) - p >= self.top_p, float("-inf"))
            return idx.gather(1, torch.multinomial(s.softmax(-1), 1))[:, 0]
        return torch.multinomial(logits.softmax(-1), 1)[:, 0]


class TpsampleHead:
    """VocabParallelSampler on the head shard (tpsample.sample at TP1)."""

    def __init__(self, model: Model, top_p: float | None, seed: int):
        self.m, self.top_p, self.seed = model, top_p, seed
        if model.world > 1:
            self.sampler = tpsample.VocabParallelSampler(
                model.head, vocab_size=model.cfg.vocab, vocab_start=model.vocab.start,
                check_inputs=False)

    def __call__(self, hidden: torch.Tensor, temperature: float, step: torch.Tensor):
        kw = dict(temperature=temperature, seed=self.seed, offset=step, top_p=self.top_p)
        if self.m.world > 1:
            return self.sampler(hidden, **kw)
        return tpsample.sample(hidden, self.m.head, **kw)


def decode(model: Model, head, prompt: torch.Tensor, steps: int, temperature: float,
           graph: bool, replays: int = 0):
    """Prefill the prompt [B, P], then `steps` decode steps (each one CUDA graph when graph):
    the generated tokens [B, steps] and a dict: the decode steps' wall ms per step and, with
    graph and replays > 0, the GPU ms per step of `replays` back-to-back replays (CUDA
    events) and the allocated bytes before and after them."""
    B, P = prompt.shape
    dev = prompt.device
    hidden = model.forward(prompt, torch.arange(P, device=dev))
    step_t = torch.full((B,), P, dtype=torch.int64, device=dev)  # the noise offset per row
    tok = head(hidden, temperature, step_t)
    static_tok = tok.clone()
    pos = torch.tensor([P], device=dev)

    def one_step():
        h = model.step_forward(static_tok[:, None], pos)
        return head(h, temperature, step_t)
    out = [tok]
    g = None
    if graph:
        g, graph_out = capture(one_step)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps - 1):
        static_tok.copy_(out[-1])
        pos.fill_(P + i)
        step_t.fill_(P + 1 + i)
        if g is not None:
            g.replay()
            nxt = graph_out.clone()
        else:
            nxt = one_step()
        out.append(nxt)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    times = dict(wall_ms=(time.perf_counter() - t0) / max(steps - 1, 1) * 1e3)
    if g is not None and replays:
        before = torch.cuda.memory_allocated()
        times.update(gpu_ms=replay_ms(g, replays), bytes_before=before,
                     bytes_after=torch.cuda.memory_allocated())
    return torch.stack(out, 1), times


def capture(fn, calls: int = 1, warmup: int = 2):
    """fn called `warmup` times on a side stream (compiling and recording outside the
    capture), then `calls` calls captured in one CUDA graph → (graph, the last output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            out = fn()
    return g, out


def replay_ms(g, replays: int) -> float:
    """GPU ms per replay of g over `replays` back-to-back replays (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def graph_ms(fn, calls: int = 50, replays: int = 10) -> float:
    """GPU ms per call of fn: `calls` calls captured in one CUDA graph, replayed `replays` times.
    A fixed count, unlike triton's do_bench_cudagraph, which sizes its graph from each rank's
    own estimate: under TP every rank must capture as many collectives, or the replays'
    all-gathers and exchanges never pair up (a hang)."""
    g, _ = capture(fn, calls, warmup=3)
    g.replay()
    return replay_ms(g, replays) / calls


def init(device_arg: str | None):
    world = int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available() and device_arg != "cpu"
    if cuda:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if world > 1 or "RANK" in os.environ:
        dist.init_process_group("nccl" if cuda else "gloo",
                                timeout=None if cuda else datetime.timedelta(seconds=300))
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return rank, world, dev


def check(cfg, rank, world, dev, dtype, args) -> dict:
    """Greedy: the two heads' tokens equal at every step; sampled: tpsample's tokens for the
    seed (to compare across --nproc-per-node); graph replays equal eager steps (CUDA)."""
    B, P, steps = 2, args.prompt, args.steps
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, cfg.vocab, (B, P), generator=g).to(dev)
    res = {}
    model = Model(cfg, rank, world, dev, dtype, B, P + steps + 1)
    if args.compile:
        model.compile(args.compile)
    greedy = {}
    for name, head in (("stock", StockHead(model, None)), ("tpsample", TpsampleHead(model, None, 1))):
        greedy[name], _ = decode(model, head, prompt, steps, 0.0, False)
    res["greedy_equal"] = bool(torch.equal(greedy["stock"], greedy["tpsample"]))
    sampled, _ = decode(model, TpsampleHead(model, args.top_p, 7), prompt, steps, 0.8, False)
    res["sampled"] = sampled.tolist()
    if dev.type == "cuda":
        head = TpsampleHead(model, args.top_p, 7)
        if world > 1 and args.top_p is not None and not head.sampler.pipeline.gather_fallback:
            res["graph_skipped"] = ("filtered calls over this transport synchronise with the "
                                    "host (not capturable)")
            return res
        graphed, t = decode(model, head, prompt, steps, 0.8, True, replays=1000)
        res["graph_equals_eager"] = bool(torch.equal(graphed, sampled))
        res["memory_growth_bytes"] = t["bytes_after"] - t["bytes_before"]
        # the sampler's own caches over 1,000 eager calls (a graph replay allocates nothing)
        h = (torch.randn(B, cfg.dim, generator=torch.Generator().manual_seed(1))
             * model.head_scale).to(dev, dtype)
        step = torch.zeros(B, dtype=torch.int64, device=dev)
        for _ in range(10):
            head(h, 0.8, step)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for _ in range(1000):
            step += 1
            head(h, 0.8, step)
        torch.cuda.synchronize()
        res["eager_head_growth_bytes"] = torch.cuda.memory_allocated() - before
    return res


def tpot(cfg, rank, world, dev, dtype, args) -> list:
    """Per batch and head: wall and GPU time per decode step, the head's own GPU time."""
    rows = []
    model = Model(cfg, rank, world, dev, dtype, max(args.batches), args.prompt + args.steps + 1)
    if args.compile:
        model.compile(args.compile)
    for B in args.batches:
        g = torch.Generator().manual_seed(B)
        prompt = torch.randint(0, cfg.vocab, (B, args.prompt), generator=g).to(dev)
        for name, head in (("stock", StockHead(model, args.top_p)),
                           ("tpsample", TpsampleHead(model, args.top_p, 1))):
            graph = dev.type == "cuda"
            _, t = decode(model, head, prompt, args.steps, 1.0, graph, replays=args.steps)
            # the same h on every rank (the sampler's contract), scaled as forward's output
            h = (torch.randn(B, cfg.dim, generator=torch.Generator().manual_seed(B))
                 * model.head_scale).to(dev, dtype)
            step = torch.zeros(B, dtype=torch.int64, device=dev)
            head_ms = None
            if graph:
                head_ms = graph_ms(lambda: head(h, 1.0, step))
            row = dict(B=B, head=name, wall_ms=t["wall_ms"], gpu_ms=t.get("gpu_ms"),
                       head_ms=head_ms, tokens_per_s=B / t["wall_ms"] * 1e3)
            rows.append(row)
            if rank == 0:
                print(f"B={B} {name}: " + " ".join(f"{k}={v:.4g}" for k, v in row.items()
                                                   if isinstance(v, float)), flush=True)
    return rows


def report(paths: list[str], doc: str | None, label: str) -> str:
    """The TPOT table (and a plot next to doc) from fast_decode_*_tp<N>.json runs: per config,
    TP degree and batch, the GPU ms per step of both heads (graph replays), the measured gain,
    the stock head's share of the step, the gain predicted from the heads' own GPU times
    ((stock head - tpsample head) / stock step), wall ms per step and tokens/s."""
    runs = [json.load(open(p)) for p in paths]
    lines = ["| config | step | top_p | TP | B | stock GPU ms | tpsample GPU ms | measured gain "
             "| head share | predicted gain | stock wall ms | tpsample wall ms "
             "| tpsample tokens/s |", "|---" * 13 + "|"]
    points = []
    for run in sorted(runs, key=lambda r: (r["config"], bool(r.get("compiled")),
                                           r.get("top_p") or 0, r["world"])):
        top_p = run.get("top_p")
        step = "compiled" if run.get("compiled") else "eager ops"
        by = {(r["B"], r["head"]): r for r in run["rows"]}
        for B in sorted({r["B"] for r in run["rows"]}):
            st, tp = by.get((B, "stock")), by.get((B, "tpsample"))
            if st is None or tp is None:
                continue
            gpu = st.get("gpu_ms") is not None and tp.get("gpu_ms") is not None
            heads = st.get("head_ms") is not None and tp.get("head_ms") is not None
            gain = 1 - tp["gpu_ms"] / st["gpu_ms"] if gpu else None
            pred = (st["head_ms"] - tp["head_ms"]) / st["gpu_ms"] if gpu and heads else None
            share = st["head_ms"] / st["gpu_ms"] if gpu and heads else None

            def f(x, pct=False):
                return "–" if x is None else (f"{100 * x:+.1f} %" if pct else f"{x:.3f}")
            lines.append(f"| {run['config']} | {step} | {top_p or '–'} | {run['world']} | {B} | "
                         f"{f(st.get('gpu_ms'))} | "
                         f"{f(tp.get('gpu_ms'))} | {f(gain, True)} | "
                         f"{'–' if share is None else f'{100 * share:.1f} %'} | {f(pred, True)} | "
                         f"{f(st['wall_ms'])} | {f(tp['wall_ms'])} | {tp['tokens_per_s']:.0f} |")
            if gain is not None and pred is not None:
                points.append((f"{run['config']}{' compiled' if run.get('compiled') else ''}"
                               f"{f' top_p {top_p}' if top_p else ''} TP{run['world']}",
                               B, gain, pred))
    text = "\n".join(lines)
    if doc and points:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            fig, ax = plt.subplots(figsize=(7, 4))
            for name in sorted({p[0] for p in points}):
                pts = sorted((p for p in points if p[0] == name), key=lambda p: p[1])
                line, = ax.plot([p[1] for p in pts], [100 * p[2] for p in pts], marker="o",
                                label=f"{name} measured")
                ax.plot([p[1] for p in pts], [100 * p[3] for p in pts], ls="--",
                        color=line.get_color(), label=f"{name} predicted")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch")
            ax.set_ylabel("GPU time per step saved (%)")
            ax.legend(fontsize=7)
            from tpsample.launch.bench import save_beside_doc
            img = save_beside_doc(fig, doc, label.lower().replace(" ", "_"))
            text += f"\n\n![{label}]({img})"
        except ImportError:
            pass
    return text


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                    help="the decode step's forward through torch.compile (default inductor)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--report", nargs="+", metavar="JSON", help="render runs, no decoding")
    ap.add_argument("--doc", help="with --report: the markdown file whose section --label "
                    "this table rewrites")
    ap.add_argument("--label", default="fast decode")
    args = ap.parse_args(argv)
    if args.report:
        text = report(args.report, args.doc, args.label)
        print(text)
        if args.doc:
            from tpsample.launch.bench import write_doc
            write_doc(args.doc, args.label, text)
        return
    args.batches = [int(b) for b in args.batches.split(",")]
    rank, world, dev = init(args.device)
    cfg = CONFIGS[args.config]
    # --check compares tokens (across heads, TP degrees, graph and eager): fp32 everywhere
    dtype = torch.bfloat16 if dev.type == "cuda" and not args.check else torch.float32
    if args.check:
        res = check(cfg, rank, world, dev, dtype, args)
        if rank == 0:
            print(f"greedy tokens equal the stock head's: {res['greedy_equal']}")
            print(f"sampled tokens (tp{world}): {res['sampled']}")
            if "graph_skipped" in res:
                print(f"graph replays not checked: {res['graph_skipped']}")
            if "graph_equals_eager" in res:
                print(f"graph replays equal eager steps: {res['graph_equals_eager']}")
                print(f"memory growth over 1000 replays: {res['memory_growth_bytes']} bytes")
                print("memory growth over 1000 eager head calls: "
                      f"{res['eager_head_growth_bytes']} bytes")
    else:
        rows = tpot(cfg, rank, world, dev, dtype, args)
        if rank == 0 and args.out:
            os.makedirs(args.out, exist_ok=True)
            name = f"fast_decode_{args.config}_tp{world}"
            name += f"_p{args.top_p}" if args.top_p is not None else ""
            name += "_compiled" if args.compile else ""
            with open(os.path.join(args.out, name + ".json"), "w") as f:
                json.dump(dict(config=args.config, world=world, rows=rows,
                               prompt=args.prompt, steps=args.steps, top_p=args.top_p,
                               compiled=args.compile,
                               device=(torch.cuda.get_device_name(dev) if dev.type == "cuda"
                                       else "cpu")), f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
