"""Where an eager call's host time goes: per call kind, the host µs from entry to return
with the device drained (median), eager and CUDA-graph device-inclusive ms, and cProfile's
most expensive Python functions (µs per call, self time).

    python -m tools.host_cost [--batches 1,64] [--out DIR] [--ab-memo]      # one GPU
    torchrun --nproc-per-node=N -m tools.host_cost [--batches 1,64]          # + TP N
    python -m tools.host_cost --report LABEL=DIR/host_cost.json ...         # markdown table

Under torchrun rank 0 also times the one-GPU calls (the other ranks wait), then every rank
times the VocabParallelSampler calls over symmetric memory (max over ranks)."""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time

import torch
import torch.distributed as dist

import tpsample

D, V = 4096, 151936  # D: --dims sets it per pass


HOST_ITERS = 200


def host_us(fn, iters: int = HOST_ITERS) -> float:
    us = []
    for _ in range(iters + 10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        us.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(us[10:])


def device_ms(fn, iters: int = 100) -> float:
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ms = []
    for _ in range(iters + 5):
        torch.cuda.synchronize()
        ev[0].record()
        fn()
        ev[1].record()
        torch.cuda.synchronize()
        ms.append(ev[0].elapsed_time(ev[1]))
    return statistics.median(ms[5:])


def graph_of(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def profile(fn, iters: int = 300, top: int = 18) -> list:
    pr = cProfile.Profile()
    torch.cuda.synchronize()
    pr.enable()
    for _ in range(iters):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(pr)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [(f"{os.path.basename(k[0])}:{k[1]}:{k[2]}", round(v[2] / iters * 1e6, 2), v[0] // iters)
            for k, v in rows]


VERIFY_S = 3  # drafts per request of the verify kinds: B // 4 requests (at least one)


def verify_kinds(verify, B: int, dev) -> dict:
    """verify(hidden [b, S + 1, D], draft_tokens [b, S], **kw): speculative verification of
    b = max(1, B // 4) requests of VERIFY_S drafts (one-hot and full draft distributions,
    an int offset per call as a loop passes), with the tensor-content checks off (their
    host synchronisation would time the device)."""
    from tpsample import knobs
    b = max(1, B // (VERIFY_S + 1))
    g = torch.Generator(device=dev).manual_seed(2)
    h3 = torch.randn(b, VERIFY_S + 1, D, generator=g, device=dev, dtype=torch.bfloat16)
    draft = torch.randint(0, V, (b, VERIFY_S), generator=g, device=dev)
    q = torch.softmax(torch.randn(b, VERIFY_S, V, generator=g, device=dev), -1)
    step = [0]

    def call(**kw):
        step[0] += 1
        with knobs.overridden(CHECK_TENSORS=False):
            return verify(h3, draft, seed=1234, offset=step[0], **kw).tokens
    return {"verify_onehot": lambda: call(), "verify_probs": lambda: call(draft_probs=q)}


def kinds(call, B: int, dev, world: int, verify=None) -> dict:
    """The call kinds at B rows; verify (see verify_kinds) adds verify_onehot and
    verify_probs."""
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(B, D, generator=g, device=dev, dtype=torch.bfloat16)
    seed = torch.full((B,), 1234, dtype=torch.int64, device=dev)
    step = torch.full((B,), 7, dtype=torch.int64, device=dev)
    mask = torch.full((B, (V + 31) // 32), -1, dtype=torch.int32, device=dev)
    hs = [h, h.clone()]
    turn = [0]
    out = torch.empty(B, dtype=torch.int64, device=dev)  # (out=: the loop's tokens buffer)

    def fresh_h():  # a decode loop's hidden states: another tensor than the call before
        turn[0] ^= 1
        return hs[turn[0]]
    def next_step():  # a decode loop's int offset: the step
        turn[1] += 1
        return turn[1]
    turn.append(0)
    held = [None]

    def keep(result):  # a loop that holds a step's tokens until the next call returns
        held[0] = result
        return result
    return {
        "plain": lambda: call(h, seed=seed, offset=step),
        "plain_keep": lambda: keep(call(h, seed=seed, offset=step)),
        "plain_fresh_h": lambda: call(fresh_h(), seed=seed, offset=step),
        "plain_out": lambda: call(h, seed=seed, offset=step, out=out),
        "plain_scalar_seed": lambda: call(h, seed=1234, offset=7),
        "logprobs": lambda: call(h, seed=seed, offset=step, return_logprobs=True),
        "top_k50": lambda: call(h, seed=seed, offset=step, top_k=50),
        "top_p0.9": lambda: call(h, seed=seed, offset=step, top_p=0.9),
        "top_p0.9_out": lambda: call(h, seed=seed, offset=step, top_p=0.9, out=out),
        "kpm": lambda: call(h, seed=seed, offset=step, top_k=50, top_p=0.9, min_p=0.05),
        "mask": lambda: call(h, seed=seed, offset=step, allowed_mask=mask),
        # a decode loop: new states, the step as an int offset, seeds
        # drawn per call (seed=None: not capturable by the caller, so no graph column)
        "loop": lambda: call(fresh_h(), offset=next_step()),
        "loop_out": lambda: call(fresh_h(), offset=next_step(), out=out),
        "loop_keep": lambda: keep(call(fresh_h(), offset=next_step())),
        **(verify_kinds(verify, B, dev) if verify is not None else {}),
    }


def measure(fns: dict, world: int, rank: int, tag: str, B: int, graphs: bool,
            profiled: bool = True, only=None, memo=None) -> list:
    """memo: the CallMemo the calls go through; each row then has memo_share, the share of
    its host-timed calls the memo served (0 where they took the full path)."""
    out = []
    for name, fn in fns.items():
        if only and name.removesuffix("_nomemo").removesuffix("_noargs") not in only:
            continue
        for _ in range(5):
            fn()
        out0 = fn()
        tok = out0 if isinstance(out0, torch.Tensor) else out0[0]
        hits = None if memo is None else memo.hits
        r = {"call": f"{tag}_{name}", "B": B, "host_us": host_us(fn)}
        if memo is not None:
            r["memo_share"] = (memo.hits - hits) / (HOST_ITERS + 10)
        r.update(eager_ms=device_ms(fn),
                 tokens=int((tok.double() * torch.arange(1, tok.numel() + 1, device=tok.device)
                             .view(tok.shape)).sum()))
        if graphs and not name.startswith("loop"):
            try:
                g = graph_of(fn)
                r["graph_ms"] = device_ms(g.replay)
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                r["graph_error"] = str(e)[:120]
        r["profile"] = profile(fn) if profiled else []
        if world > 1:
            t = torch.tensor([r["host_us"], r["eager_ms"], r.get("graph_ms", 0.0)], device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            r["host_us"], r["eager_ms"], r["graph_ms"] = t.tolist()
        if rank == 0:
            print(f"{r['call']:>28} B={B:<4} host {r['host_us']:6.1f} us  eager {r['eager_ms']:.4f} "
                  f"graph {r.get('graph_ms', float('nan')):.4f} ms"
                  + (f"  memo {r['memo_share']:.0%}" if "memo_share" in r else ""), flush=True)
            for f, us, n in r["profile"][:12]:
                print(f"      {us:7.2f} us x{n:<3} {f}")
        out.append(r)
    return out


def memo_arms(fns: dict) -> dict:
    """Each call kind also with TPSAMPLE_MEMO off (<kind>_nomemo, measured first): the
    memo's A/B in the same run."""
    from tpsample import knobs

    def off(fn):
        def call():
            with knobs.overridden(MEMO=False):
                return fn()
        return call
    out = {}
    for name, fn in fns.items():
        out[name + "_nomemo"] = off(fn)
        out[name] = fn
    return out


def args_arms(fns: dict, reset) -> dict:
    """Each call kind also with TPSAMPLE_GRAPH_ARGS off (<kind>_noargs, measured first): the
    A/B of tpsample/graph_args.py in the same run. A graph keeps the setting it was captured
    with, so reset() drops every graph and memo entry whenever the calls switch arms."""
    from tpsample import knobs
    arm = [None]

    def with_args(fn, on: bool):
        def call():
            if arm[0] is not on:
                reset()
                arm[0] = on
            with knobs.overridden(GRAPH_ARGS=on):
                return fn()
        return call
    out = {}
    for name, fn in fns.items():
        out[name + "_noargs"] = with_args(fn, False)
        out[name] = with_args(fn, True)
    return out


def floor_ops(B: int, dev) -> dict:
    """Host µs of the operations any call needs at least: an output allocation, a kernel
    launch through torch, a copy of the hidden states, a CUDA-graph replay."""
    h = torch.randn(B, D, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(h)
    x = torch.zeros(B, device=dev)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g.capture_begin()
        x.add_(1)
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    return {"empty": host_us(lambda: torch.empty(B, dtype=torch.int64, device=dev)),
            "add_": host_us(lambda: x.add_(1)), "copy_h": host_us(lambda: dst.copy_(h)),
            "graph_replay": host_us(g.replay), "clone": host_us(lambda: x.clone())}


AB_SUFFIXES = (("_nomemo", "memo"), ("_noargs", "graph args"))


def host_cell(r: dict, label: str) -> str:
    """Host µs; with the memo on, and the share of the timed calls it served."""
    share = r.get("memo_share")
    tail = (f" ({share:.0%} memo)" if share is not None
            and label.endswith(("memo on", "graph args on")) else "")
    return f"{r['host_us']:.1f}{tail}"


def report(arms: list[str]) -> str:
    """A markdown table of saved runs (LABEL=PATH each, e.g. the same command with
    TPSAMPLE_GRAPHS=0 and =1; one run with --ab-memo gives the arms "memo off" and "memo
    on", one with --ab-args "graph args off" and "on"): host µs and eager / graph ms per call kind and B, and under TP the bound
    1.2 × mm_local + 20 µs beside the eager ms."""
    runs = []
    for arm in arms:
        label, path = arm.split("=", 1)
        with open(path) as f:
            runs.append((label, json.load(f)))
    floor = [r for r in runs[0][1] if r["call"] == "floor"]
    rows: dict = {}
    mm: dict = {}
    labels: list = []
    for label, res in runs:
        # (the arms of one run: --ab-memo's <kind>_nomemo, --ab-args's <kind>_noargs)
        ab = next((suffix for suffix, _ in AB_SUFFIXES
                   if any(r["call"].endswith(suffix) for r in res)), None)
        for r in res:
            if r["call"] == "floor":
                continue
            if r["call"].endswith("mm_local"):
                mm[(r.get("D", 4096), r["B"])] = r["eager_ms"]
                continue
            call, lab = r["call"], label
            if ab:
                off = call.endswith(ab)
                call = call.removesuffix(ab)
                lab = f"{label} {dict(AB_SUFFIXES)[ab]} {'off' if off else 'on'}".strip()
            if lab not in labels:
                labels.append(lab)
            rows.setdefault((r.get("D", 4096), call, r["B"]), {})[lab] = r
    labels.sort(key=lambda lab: (lab.rsplit(" ", 1)[0], not lab.endswith("off")))
    head = ["D", "call", "B"] + [f"host µs {lab}" for lab in labels] + \
        [f"eager / graph ms {lab}" for lab in labels] + (["TP bound ms"] if mm else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (d, call, b), by in rows.items():
        cells = [str(d), call, str(b)]
        cells += [host_cell(by[lab], lab) if lab in by else "" for lab in labels]
        cells += [f"{by[lab]['eager_ms']:.3f} / " + (f"{by[lab]['graph_ms']:.3f}" if by[lab].get(
            "graph_ms") else "–") if lab in by else "" for lab in labels]
        if mm:
            bound = mm.get((d, b)) if not call.startswith("tp1_") else None
            cells.append("" if bound is None else f"{1.2 * bound + 0.020:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    if floor:
        lines.append("")
        lines.append("Floor (host µs): " + ", ".join(
            f"{k} {floor[0][k]:.1f}" for k in ("empty", "add_", "copy_h", "graph_replay",
                                               "clone")) + ".")
    return "\n".join(lines)


def reset_one_gpu() -> None:
    """tpsample.sample's graphs and memo entries dropped (captured again by later calls)."""
    for pipe in tpsample.api._PIPELINES.values():
        if pipe.graphs is not None:
            pipe.graphs.clear()
    tpsample.api._MEMO.clear()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", nargs="+", default=None, metavar="LABEL=JSON")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--kinds", default="", help="comma-separated call kinds (default: all)")
    ap.add_argument("--tp-only", action="store_true",
                    help="under torchrun, only the VocabParallelSampler calls")
    ap.add_argument("--ab-memo", action="store_true",
                    help="each kind also with TPSAMPLE_MEMO off (<kind>_nomemo), same run")
    ap.add_argument("--ab-args", action="store_true",
                    help="each kind also with TPSAMPLE_GRAPH_ARGS off (<kind>_noargs), same run")
    ap.add_argument("--dims", default="4096", help="hidden sizes D, comma-separated")
    args = ap.parse_args()
    if args.report:
        print(report(args.report))
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(dev)
    if world > 1:
        dist.init_process_group("nccl", device_id=dev)
    global D
    res = []
    batches = [int(b) for b in args.batches.split(",")]
    only = set(k for k in args.kinds.split(",") if k)
    if rank == 0:
        floor = floor_ops(64, dev)
        print("floor (host us): " + ", ".join(f"{k} {v:.1f}" for k, v in floor.items()))
        res.append({"call": "floor", "B": 64, "D": D, "host_us": 0.0, "eager_ms": 0.0,
                    "tokens": 0, **floor})
    for D in (int(d) for d in args.dims.split(",")):
        g = torch.Generator(device=dev).manual_seed(1)
        W = torch.randn(V, D, generator=g, device=dev, dtype=torch.bfloat16).mul_(D ** -0.5)
        if rank == 0 and not (args.tp_only and world > 1):
            for B in batches:
                fns = kinds(lambda h, **kw: tpsample.sample(h, W, **kw), B, dev, 1,
                            lambda h3, d, **kw: tpsample.verify_drafts(h3, W, d, **kw))
                if args.ab_args:
                    fns = args_arms(fns, reset_one_gpu)
                res += [dict(r, D=D) for r in measure(
                    memo_arms(fns) if args.ab_memo else fns, 1, 0, "tp1",
                    B, not args.no_graph, not args.no_profile, only, tpsample.api._MEMO)]
        if world > 1:
            dist.barrier()
            rows = V // world
            shard = W[rank * rows:(rank + 1) * rows].contiguous()
            s = tpsample.VocabParallelSampler(shard, vocab_size=V, transport="symm_mem",
                                              check_inputs=False)
            for B in batches:
                h = torch.randn(B, D, device=dev, dtype=torch.bfloat16)
                mm = device_ms(lambda: h @ shard.T)
                t = torch.tensor([mm], device=dev)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                res.append({"call": f"tp{world}_mm_local", "B": B, "D": D, "host_us": 0.0,
                            "eager_ms": t.item(), "tokens": 0})
                fns = kinds(s, B, dev, world, s.verify_drafts)
                if args.ab_args:
                    fns = args_arms(fns, lambda: (s.memo.clear(), s.pipeline.graphs.clear()))
                res += [dict(r, D=D) for r in measure(
                    memo_arms(fns) if args.ab_memo else fns, world, rank, f"tp{world}", B,
                    not args.no_graph, not args.no_profile, only, s.memo)]
            del s, shard
    if rank == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_cost.json"), "w") as f:
            json.dump(res, f, indent=1)
        print("\nsummary (host us / eager ms / graph ms / token checksum; TP: the bound "
              "1.2 x mm_local + 0.020 ms):")
        mm = {(r["D"], r["B"]): r["eager_ms"] for r in res if r["call"].endswith("mm_local")}
        for r in res:
            if r["call"] == "floor":
                continue
            bound = mm.get((r["D"], r["B"]))
            tail = "" if bound is None or r["call"].endswith("mm_local") else (
                f"  bound {1.2 * bound + 0.020:.4f} {'ok' if r['eager_ms'] <= 1.2 * bound + 0.020 else 'MISS'}")
            print(f"  D={r['D']:<5} {r['call']:>22} B={r['B']:<4} {r['host_us']:6.1f}  "
                  f"{r['eager_ms']:.4f}  {r.get('graph_ms', float('nan')):.4f}  {r['tokens']}"
                  + tail)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
