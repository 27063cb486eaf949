"""Decoding with a megatron-core GPT model under tensor parallelism, tpsample sampling from the
model's own vocab-parallel LM-head shard (the logits are never formed), next to megatron-core's
stock path (the LM head's logits gathered over the TP group, softmax, torch.multinomial).

    torchrun --nproc-per-node=2 examples/mcore_decode.py                 # a small random model
    torchrun --nproc-per-node=2 examples/mcore_decode.py --check         # greedy = stock argmax
    torchrun --nproc-per-node=2 examples/mcore_decode.py --tpot --config qwen3-8b --out bench_out
    python examples/mcore_decode.py --report bench_out/tpot_*.json --doc docs/performance.md \
        --label "H100 megatron-core decode"

Needs CUDA and megatron-core (`pip install tpsample[megatron]`). The model is built from a
config with the local layer spec (no Transformer Engine; torch norms), random weights, bf16;
the KV cache is megatron-core's StaticInferenceContext (a static batch); steps run eagerly
(megatron-core captures static-batching steps in CUDA graphs only with flash decoding, which
needs the flash-attn package). Both paths take the decoder's output through GPTModel's
`output_processor` hook (megatron-core >= 0.17), so the transformer and its KV cache are the
same code in both; only the LM head and the sampling differ.
"""
import argparse
import contextlib
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

# Qwen3-like shapes (random weights): layers, hidden, heads, KV heads, FFN, vocabulary, tied.
CONFIGS = {
    "tiny": dict(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                 ffn_hidden_size=768, kv_channels=64, vocab=32000, tied=True),
    "qwen3-1.7b": dict(num_layers=28, hidden_size=2048, num_attention_heads=16, num_query_groups=8,
                       ffn_hidden_size=6144, kv_channels=128, vocab=151936, tied=True),
    "qwen3-8b": dict(num_layers=36, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                     ffn_hidden_size=12288, kv_channels=128, vocab=151936, tied=False),
}
PAD_MULTIPLE = 128  # megatron's make_vocab_size_divisible_by default, times the TP size


def build_model(name: str, tp: int, max_len: int, seed: int = 0):
    """A megatron-core GPTModel [bf16, on this rank's GPU] with the shapes of CONFIGS[name]; its
    vocabulary padded as megatron pads it. Returns (model, unpadded vocabulary)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig
    c = dict(CONFIGS[name])
    vocab, tied = c.pop("vocab"), c.pop("tied")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        **c, normalization="RMSNorm", qk_layernorm=True, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=True, params_dtype=torch.bfloat16, attention_backend=AttnBackend.local,
        tensor_model_parallel_size=tp)
    multiple = PAD_MULTIPLE * tp
    model = GPTModel(config=config,
                     transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=True,
                                                                     normalization="RMSNorm"),
                     vocab_size=math.ceil(vocab / multiple) * multiple,
                     max_sequence_length=max_len, position_embedding_type="rope",
                     rotary_base=1_000_000, share_embeddings_and_output_weights=tied)
    return model.cuda().bfloat16().eval(), vocab  # bf16 norms too, as Float16Module does


def tpsample_head(sampler, temperature, seeds):
    """An output_processor: tpsample on the LM-head shard, the last position of [s, b, h]."""
    def head(step):
        def processor(hidden_states, **_):
            return sampler(hidden_states, temperature=temperature, seed=seeds, offset=step)
        return processor
    return head


def stock_head(vocab, temperature):
    """An output_processor: megatron-core's stock path. The output layer's logits of the last
    position, gathered over the TP group ([b, V_padded]), cut to the vocabulary, then argmax
    (T = 0) or softmax(l / T) and torch.multinomial in fp32. Every TP rank draws from the same
    gathered logits with the same default CUDA generator, so they agree, as megatron relies on."""
    def head(step):
        def processor(hidden_states, output_layer, output_weight, **_):
            logits, _ = output_layer(hidden_states[-1:], weight=output_weight,
                                     runtime_gather_output=True)
            logits = logits[-1, :, :vocab].float()
            if temperature == 0:
                return logits.argmax(-1)
            return torch.multinomial(torch.softmax(logits / temperature, -1), 1).squeeze(1)
        return processor
    return head


class Timed:
    """Wraps a head: CUDA events around it on each step (the GPU time from the decoder's
    output to the next tokens), to give the LM head + sampling share of a step."""

    def __init__(self, head):
        self.head, self.events = head, []

    def __call__(self, step):
        inner = self.head(step)

        def processor(**kw):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = inner(**kw)
            end.record()
            self.events.append((start, end))
            return out
        return processor

    def ms(self, skip: int) -> float:
        return sum(s.elapsed_time(e) for s, e in self.events[skip:])


def generate(model, prompts: torch.Tensor, new_tokens: int, head, decode_context=None):
    """prompts int64 [B, P] (the same on every TP rank) -> tokens int64 [B, new_tokens] and the
    decode steps' mean wall time in ms (a CUDA sync after the last step only). The prefill
    gives the first token; each later one is a decode step on the KV cache. decode_context:
    a context manager around the decode steps (a profiler)."""
    from megatron.core.inference.contexts import StaticInferenceContext
    B, P = prompts.shape
    ctx = StaticInferenceContext(max_batch_size=B, max_sequence_length=P + new_tokens)
    causal = torch.ones(P, P, device=prompts.device).tril().view(1, 1, P, P) < 0.5
    positions = torch.arange(P, device=prompts.device).expand(B, P)
    tokens = model(prompts, positions, causal, inference_context=ctx, output_processor=head(0))
    ctx.increment_sequence_len_offset(P)
    out = [tokens]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with decode_context if decode_context is not None else contextlib.nullcontext():
        for step in range(1, new_tokens):
            pos = torch.full((B, 1), P + step - 1, device=prompts.device)
            tokens = model(tokens[:, None], pos, None, inference_context=ctx,
                           output_processor=head(step))
            ctx.increment_sequence_len_offset(1)
            out.append(tokens)
        torch.cuda.synchronize()
    decode_ms = (time.perf_counter() - t0) * 1e3
    return torch.stack(out, 1), decode_ms / max(new_tokens - 1, 1)


def same_on_all_ranks(t: torch.Tensor) -> bool:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return all(torch.equal(p, parts[0]) for p in parts)


def check_greedy(model, sampler, vocab, prompts, new_tokens):
    """Greedy tokens of tpsample against the stock path's argmax, step by step on the same
    hidden states (teacher-forced on the stock token, so one near tie does not fork the rest).
    The stock logits are bf16 (the output layer's dtype): a token may differ only where the two
    tokens' bf16 logits are within one bf16 step of each other (a rounding tie)."""
    from megatron.core.inference.contexts import StaticInferenceContext
    B, P = prompts.shape
    ctx = StaticInferenceContext(max_batch_size=B, max_sequence_length=P + new_tokens)
    causal = torch.ones(P, P, device=prompts.device).tril().view(1, 1, P, P) < 0.5
    positions = torch.arange(P, device=prompts.device).expand(B, P)
    seeds = torch.arange(B, device=prompts.device)
    found = {"steps": 0, "equal": 0, "near_ties": 0, "wrong": 0}

    def processor(hidden_states, output_layer, output_weight, **_):
        logits, _ = output_layer(hidden_states[-1:], weight=output_weight, runtime_gather_output=True)
        logits = logits[-1, :, :vocab]
        stock = logits.argmax(-1)
        ours = sampler(hidden_states, temperature=0.0, seed=seeds)
        top, at_ours = logits.gather(1, stock[:, None]), logits.gather(1, ours[:, None])
        ulp = torch.finfo(torch.bfloat16).eps * top.float().abs().clamp_min(1e-3)
        near = (top.float() - at_ours.float()).squeeze(1) <= 2 * ulp.squeeze(1)
        found["steps"] += 1
        found["equal"] += int((ours == stock).sum())
        found["near_ties"] += int(((ours != stock) & near).sum())
        found["wrong"] += int(((ours != stock) & ~near).sum())
        found["ranks_agree"] = found.get("ranks_agree", True) and same_on_all_ranks(ours)
        return stock

    tokens = model(prompts, positions, causal, inference_context=ctx, output_processor=processor)
    ctx.increment_sequence_len_offset(P)
    for step in range(1, new_tokens):
        pos = torch.full((B, 1), P + step - 1, device=prompts.device)
        tokens = model(tokens[:, None], pos, None, inference_context=ctx, output_processor=processor)
        ctx.increment_sequence_len_offset(1)
    return found


def device_runs(prof) -> dict[str, list[float]]:
    """The device kernels and copies of a profile: name -> durations in µs, in start order."""
    from torch.autograd import DeviceType
    runs = {}
    for e in sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                    key=lambda e: e.time_range.start):
        runs.setdefault(e.name, []).append(e.time_range.elapsed_us())
    return runs


def runs_per_rank(prof) -> list[dict[str, list[float]]]:
    """device_runs of this rank's profile, gathered from every TP rank."""
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, device_runs(prof))
    return per_rank


def launched_together_us(per_rank: list[dict[str, list[float]]]) -> tuple[float, int]:
    """The device time of the same steps on TP ranks as if the ranks had launched them together
    (as under CUDA graphs): each kernel's k-th run counted at the rank where it was shortest.
    In eager decoding one rank's host runs ahead of the other's, and its collectives (NCCL's,
    the sampler's exchange) spin until the late peer arrives, which at TP2 adds tens of ms of
    host skew per step; the rank that arrived last waited least, and a compute kernel takes
    the same time on every rank. A name whose run count differs across ranks counts its
    smallest total. Returns (µs, how many names had differing counts); one rank: the plain sum."""
    total, differing = 0.0, 0
    for name in set().union(*per_rank):
        runs = [r.get(name, []) for r in per_rank]
        if all(len(x) == len(runs[0]) for x in runs):
            total += sum(min(k) for k in zip(*runs))
        else:
            total += min(sum(x) for x in runs)
            differing += 1
    return total, differing


def gpu_ms_per_step(model, prompts, new_tokens, head) -> dict:
    """The GPU time of one decode step, from a profiled run's kernels and copies:
    `gpu_step_ms`, the ranks launched together (launched_together_us); `gpu_busy_ms`, the
    plain sum on the busiest rank, collectives' waits for a late peer included. Unlike the wall
    time of an eager step, which megatron-core's host work dominates, `gpu_step_ms` is what
    the step costs where launches are not the bottleneck (CUDA graphs, as serving engines
    run it)."""
    from torch.profiler import ProfilerActivity, profile
    prof = profile(activities=[ProfilerActivity.CUDA])
    generate(model, prompts, new_tokens, head, decode_context=prof)
    per_rank = runs_per_rank(prof)
    together, differing = launched_together_us(per_rank)
    steps = new_tokens - 1
    return {"gpu_step_ms": together / 1e3 / steps,
            "gpu_busy_ms": max(sum(map(sum, r.values())) for r in per_rank) / 1e3 / steps,
            "kernel_names_differing": differing}


def head_ms(fn, iters=50, warmup=5) -> float:
    """Median ms of fn() alone (CUDA events, a sync per call), the max over the TP ranks."""
    from tpsample.launch.bench import time_calls
    return time_calls(fn, torch.device("cuda", torch.cuda.current_device()), iters, warmup)


def head_gpu_ms(fn, iters=20, warmup=3) -> float:
    """The GPU time of one head call alone (its kernels and copies, the TP ranks launched
    together as in launched_together_us): the prediction for the GPU time per step, which a
    host-synchronised call's wall time is not at TP > 1 (there it adds the ranks' host skew)."""
    from tpsample.launch.bench import profile_cuda
    return launched_together_us(runs_per_rank(profile_cuda(fn, iters, warmup)))[0] / 1e3 / iters


def tpot_point(model, sampler, vocab, B, prompt_len, new_tokens, temperature, repeats):
    """TPOT (ms per decode step, the max over ranks) of both paths at batch B, alternating
    runs; the LM head + sampling's share of a step; and the two heads timed alone on hidden
    states [B, h] (the microbenchmark's prediction of the TPOT gain)."""
    g = torch.Generator(device="cuda").manual_seed(1234 + B)
    prompts = torch.randint(0, vocab, (B, prompt_len), device="cuda", generator=g)
    seeds = torch.arange(B, device="cuda") + 7
    paths = {"stock": stock_head(vocab, temperature),
             "tpsample": tpsample_head(sampler, temperature, seeds)}
    res = {name: {"tpot": [], "head_share": []} for name in paths}
    for rep in range(repeats + 1):  # the first round warms up (allocations, autotuning): 4 steps
        for name, head in (paths.items() if rep % 2 == 0 else reversed(paths.items())):
            timed = Timed(head)
            dist.barrier()
            _, ms = generate(model, prompts, new_tokens if rep else min(new_tokens, 4), timed)
            if rep:
                t = torch.tensor([ms], device="cuda")
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                res[name]["tpot"].append(float(t))
                res[name]["head_share"].append(timed.ms(skip=1) / (ms * (new_tokens - 1)))
    h = model.config.hidden_size
    hidden = torch.randn(1, B, h, device="cuda", dtype=torch.bfloat16)
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    alone = {"stock": lambda: paths["stock"](0)(hidden_states=hidden, output_layer=model.output_layer,
                                                output_weight=weight),
             "tpsample": lambda: paths["tpsample"](0)(hidden_states=hidden)}
    point = {"B": B}
    for name in paths:
        point[name] = {"tpot_ms": statistics.median(res[name]["tpot"]),
                       "tpot_runs": res[name]["tpot"],
                       "head_share": statistics.median(res[name]["head_share"]),
                       "head_alone_ms": head_ms(alone[name]),
                       "head_gpu_ms": head_gpu_ms(alone[name]),
                       **gpu_ms_per_step(model, prompts, new_tokens, paths[name])}
    stock, ours = point["stock"], point["tpsample"]
    saved = stock["head_alone_ms"] - ours["head_alone_ms"]
    point["measured_gain"] = 1 - ours["tpot_ms"] / stock["tpot_ms"]
    point["predicted_gain"] = saved / stock["tpot_ms"]
    point["gpu_gain"] = 1 - ours["gpu_step_ms"] / stock["gpu_step_ms"]
    point["gpu_predicted_gain"] = (stock["head_gpu_ms"] - ours["head_gpu_ms"]) / stock["gpu_step_ms"]
    return point


def render(runs: list) -> str:
    """Markdown: one table per config, rows (TP, B)."""
    lines = []
    by_config = {}
    for run in runs:
        by_config.setdefault(run["config"], []).append(run)
    for config, rs in by_config.items():
        meta = rs[0]
        lines += [f"**{config}** ({meta['shape']}; prompt {meta['prompt_len']}, "
                  f"{meta['new_tokens']} generated, T = {meta['temperature']}; {meta['device']})", "",
                  "| TP | B | TPOT stock / tpsample (ms) | TPOT gain (predicted) "
                  "| GPU time per step stock / tpsample (ms) | GPU-time gain (predicted) "
                  "| head + sampling share of the step, stock / tpsample "
                  "| head alone (wall), stock / tpsample (ms) "
                  "| head alone (GPU), stock / tpsample (ms) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for run in sorted(rs, key=lambda r: r["tp"]):
            for p in run["points"]:
                s, t = p["stock"], p["tpsample"]
                gpu = (f"{s['gpu_step_ms']:.2f} / {t['gpu_step_ms']:.2f} | "
                       f"{100 * p['gpu_gain']:.1f} % ({100 * p['gpu_predicted_gain']:.1f} %)"
                       if "gpu_gain" in p else "— | —")
                lines.append(f"| {run['tp']} | {p['B']} | {s['tpot_ms']:.2f} / {t['tpot_ms']:.2f} | "
                             f"{100 * p['measured_gain']:.1f} % ({100 * p['predicted_gain']:.1f} %) | "
                             f"{gpu} | {100 * s['head_share']:.1f} % / {100 * t['head_share']:.1f} % | "
                             f"{s['head_alone_ms']:.3f} / {t['head_alone_ms']:.3f} | "
                             + (f"{s['head_gpu_ms']:.3f} / {t['head_gpu_ms']:.3f} |"
                                if "head_gpu_ms" in s else "— |"))
        lines.append("")
    return "\n".join(lines)


def plot(runs: list, path: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    configs = sorted({r["config"] for r in runs})
    # top: the GPU time per step (the signal) against its prediction; bottom: the eager wall
    # TPOT, host-bound and noisy, on its own scale so it does not flatten the top row
    fig, axes = plt.subplots(2, len(configs), figsize=(5.5 * len(configs), 7), squeeze=False)
    for col, config in enumerate(configs):
        top, bottom = axes[0][col], axes[1][col]
        for run in sorted((r for r in runs if r["config"] == config), key=lambda r: r["tp"]):
            bs = [p["B"] for p in run["points"]]
            if all("gpu_gain" in p for p in run["points"]):
                line, = top.plot(bs, [100 * p["gpu_gain"] for p in run["points"]], "s-",
                                 label=f"TP{run['tp']} measured")
                top.plot(bs, [100 * p["gpu_predicted_gain"] for p in run["points"]], "x--",
                         color=line.get_color(), label=f"TP{run['tp']} predicted (heads alone)")
            bottom.plot(bs, [100 * p["measured_gain"] for p in run["points"]], "o:",
                        label=f"TP{run['tp']}")
        top.set(title=f"{config}: GPU time per decode step", ylabel="gain over stock (%)")
        bottom.set(title=f"{config}: wall-clock TPOT (eager, host-bound)", xlabel="batch",
                   ylabel="gain over stock (%)")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.axhline(0, color="grey", lw=0.5)
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def report(paths: list, doc: str | None, label: str):
    runs = [json.load(open(p)) for p in paths]
    body = render(runs)
    if doc:
        from tpsample.launch.bench import slug, write_doc
        img_dir = os.path.join(os.path.dirname(doc), "img")
        os.makedirs(img_dir, exist_ok=True)
        img = plot(runs, os.path.join(img_dir, f"{slug(label)}.png"))
        if img:
            body += f"\n![{label}](img/{os.path.basename(img)})\n"
        write_doc(doc, label, body)
    print(body)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny", help=f"one of {', '.join(CONFIGS)} (comma list with --tpot)")
    p.add_argument("--batch", default="4", help="B (comma list with --tpot, e.g. 1,8,32,128)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--check", action="store_true", help="greedy tokens against the stock argmax")
    p.add_argument("--tpot", action="store_true", help="time per output token, stock vs tpsample")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per path and batch (--tpot)")
    p.add_argument("--out", default="bench_out", help="--tpot writes tpot_<config>_tp<N>.json here")
    p.add_argument("--report", nargs="+", metavar="JSON", help="render --tpot files, no run")
    p.add_argument("--doc", help="markdown file whose section --label the report rewrites")
    p.add_argument("--label", default="Megatron-core decode TPOT")
    args = p.parse_args(argv)
    if args.report:
        return report(args.report, args.doc, args.label)
    for name in args.config.split(","):
        if name not in CONFIGS:
            p.error(f"--config: unknown config {name!r} (have {', '.join(CONFIGS)})")
    batches = [int(b) for b in args.batch.split(",")]
    try:
        import megatron.core  # noqa: F401  (the optional extra)
    except ModuleNotFoundError as e:
        raise SystemExit("examples/mcore_decode.py needs megatron-core: "
                         "pip install 'tpsample[megatron]'") from e
    if not torch.cuda.is_available():
        raise SystemExit("examples/mcore_decode.py needs CUDA (megatron-core's attention forward)")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    rank, tp = dist.get_rank(), dist.get_world_size()
    from tpsample.mcore import MegatronSampler
    max_len = args.prompt_len + args.new_tokens
    for name in args.config.split(","):
        model, vocab = build_model(name, tp, max_len)
        sampler = MegatronSampler(model, vocab_size=vocab, max_batch=max(batches),
                                  check_inputs=False)
        with torch.no_grad():
            if args.check:
                for B in batches:
                    g = torch.Generator(device="cuda").manual_seed(B)
                    prompts = torch.randint(0, vocab, (B, args.prompt_len), device="cuda", generator=g)
                    found = check_greedy(model, sampler, vocab, prompts, args.new_tokens)
                    if rank == 0:
                        print(f"{name} TP{tp} B={B}: {found}")
                    if found["wrong"] or not found["ranks_agree"]:
                        raise SystemExit(f"greedy tokens differ from the stock argmax: {found}")
            elif args.tpot:
                c = CONFIGS[name]
                run = dict(config=name, tp=tp, prompt_len=args.prompt_len,
                           new_tokens=args.new_tokens, temperature=args.temperature,
                           device=torch.cuda.get_device_name(), points=[],
                           shape=f"{c['num_layers']} layers, hidden {c['hidden_size']}, "
                                 f"V {c['vocab']}, {'tied' if c['tied'] else 'untied'}, bf16")
                path = os.path.join(args.out, f"tpot_{name}_tp{tp}.json")
                for B in batches:
                    point = tpot_point(model, sampler, vocab, B, args.prompt_len, args.new_tokens,
                                       args.temperature, args.repeats)
                    run["points"].append(point)
                    if rank == 0:  # after every point: a run cut short keeps what it measured
                        os.makedirs(args.out, exist_ok=True)
                        json.dump(run, open(path, "w"), indent=1)
                        print(f"{name} TP{tp} B={B}: TPOT stock {point['stock']['tpot_ms']:.2f} ms, "
                              f"tpsample {point['tpsample']['tpot_ms']:.2f} ms, gain "
                              f"{100 * point['measured_gain']:.1f} % (predicted "
                              f"{100 * point['predicted_gain']:.1f} %); GPU time per step "
                              f"{point['stock']['gpu_step_ms']:.2f} / "
                              f"{point['tpsample']['gpu_step_ms']:.2f} ms, gain "
                              f"{100 * point['gpu_gain']:.1f} % (predicted "
                              f"{100 * point['gpu_predicted_gain']:.1f} %); wrote {path}", flush=True)
            else:
                B = batches[0]
                g = torch.Generator(device="cuda").manual_seed(0)
                prompts = torch.randint(0, vocab, (B, args.prompt_len), device="cuda", generator=g)
                seeds = torch.arange(B, device="cuda")
                tokens, ms = generate(model, prompts, args.new_tokens,
                                      tpsample_head(sampler, args.temperature, seeds))
                assert same_on_all_ranks(tokens), "TP ranks disagree"
                if rank == 0:
                    print(f"{name} TP{tp}: {ms:.2f} ms per decode step; tokens per row:")
                    for row in tokens.tolist():
                        print(" ", row)
        del model, sampler
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
