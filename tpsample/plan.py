"""Which kernels run for a call, and why: a pure function from the call's shape to a Plan.

    print(tpsample.explain(256, 4096, 151936, device="h100"))

make_plan takes what decides the kernels — the device kind, B, D, the shard's rows V, the
dtype, the merge, the number of samples, whether log-masses are needed and the memory
layout — and returns a frozen Plan: the stage-1 strategy with its block sizes, where they
came from (a shipped table or a default), every fallback taken on the way with its reason,
and the stage-2 launch. Nothing here touches a GPU, so every rule is testable on the CPU.

Stage-1 strategies (kernels/):
    fused   the matmul inside the Triton kernel, logits never leave registers
            (fused_sample.fused_sample_records_kernel); B <= 64
    ws      Hopper, warp-specialized Gluon kernel (gluon_sample.py); B >= 64
    pp      Hopper, ping-pong Gluon kernel, [128, 128] tiles (gluon_pingpong.py); B >= 128;
            with EXTRA_B, 129 to 128 + EXTRA_B rows in [128, 128 + 32 / 64] tiles
    logits  cuBLAS writes fp32 logits, one Triton pass turns them into records; where ws
            or pp do not apply
    torch   the chunked torch path (tpsample/torch_records.py): CPU tensors
The shipped tables (configs/*.json, written by tools/tune.py) pick per batch bucket and,
for thin heads, per max D; other GPUs and fp32 heads get the defaults below.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from . import knobs, records

CONFIG_DIR = Path(__file__).parent / "configs"
STRATEGIES = ("fused", "ws", "pp", "logits", "torch")
GROUP_MERGES = ("logmass", "cdf")
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

# what replaces a strategy that does not apply
PP_TO_WS = dict(strategy="ws", BLOCK_B=128, NUM_STAGES=5, EPI_B=64, num_warps=8)
CDF_PP = dict(strategy="pp", BLOCK_B=128, NUM_STAGES=5, num_warps=4)  # cdf where a table says ws
# where a pp config with a second row tile (EXTRA_B: 129-192 rows) does not apply: 64-row
# blocks (the H200 table's choice there before that tile existed)
WIDE_TO_WS = dict(strategy="ws", BLOCK_B=64, EPI_B=32, NUM_STAGES=6, num_warps=4)
TO_LOGITS = dict(strategy="logits", BLOCK_B=64, num_warps=8)
# the records pass with candidate planes: its per-tile top-4 wants narrow row blocks (H100,
# D = 4096, stage 1 at B = 64 / 256: 0.521 / 0.759 ms against 0.559 / 0.887 with TO_LOGITS)
TO_LOGITS_CANDIDATES = dict(strategy="logits", BLOCK_B=16, num_warps=4)
# filtered calls at B > 32 where a table says fused: ws's candidate epilogue runs beside the
# matmul, the fused kernel's after it (H100, D = 8192, stage 1 at B = 64: 0.741 vs 0.755 ms;
# at B = 32 the fused kernel's 0.714 beats ws's 0.734; tools.probe --candidates)
FUSED_TO_WS_CANDIDATES = dict(strategy="ws", BLOCK_B=32, NUM_STAGES=8, EPI_B=32, num_warps=4)

# Gluon kernel defaults (a table may override them)
WS_BLOCK_K = 64


@dataclass(frozen=True)
class DeviceKind:
    """What the plan needs to know of a device. `DeviceKind.of(device)` reads it off a real
    one; `DeviceKind.named("h100")` describes a GPU model without one (explain, tests)."""
    type: str = "cpu"           # "cuda" or "cpu"
    table: str | None = None    # shipped table: "h100", "h200" or None
    capability: tuple[int, int] = (0, 0)
    sms: int = 1
    gluon_missing: str | None = "not a CUDA device"  # why the Gluon kernels cannot run (None: they can)
    interpret: bool = False     # Triton kernels under TRITON_INTERPRET=1 (CPU tensors)

    @property
    def hopper(self) -> bool:
        return self.capability[0] == 9

    @property
    def label(self) -> str:
        if self.type != "cuda":
            return "cpu (Triton interpreter)" if self.interpret else "cpu"
        cc = f"sm_{self.capability[0]}{self.capability[1]}"
        return f"{self.table or 'cuda'} ({cc}, {self.sms} SMs)"

    @staticmethod
    def of(device: torch.device) -> "DeviceKind":
        if device.type != "cuda":
            return DeviceKind(interpret=_interpret())
        return _cuda_kind(device.index if device.index is not None else torch.cuda.current_device())

    @staticmethod
    def named(name: str) -> "DeviceKind":
        """A GPU model by its table name ("h100", "h200"), with this process's Triton."""
        sms = {"h100": 132, "h200": 132}
        if name not in sms:
            raise ValueError(f"device must be 'h100', 'h200', 'cpu' or a torch.device, got {name!r}")
        return DeviceKind("cuda", name, (9, 0), sms[name], gluon_missing=_gluon_missing(),
                          interpret=False)


def _interpret() -> bool:
    from triton import knobs as triton_knobs
    return bool(triton_knobs.runtime.interpret)


def _gluon_missing() -> str | None:
    from .kernels import gluon_compat
    if not knobs.GLUON:
        return "TPSAMPLE_GLUON=0"
    return gluon_compat.unavailable_reason()


@functools.lru_cache(maxsize=None)
def _cuda_kind(index: int) -> DeviceKind:
    props = torch.cuda.get_device_properties(index)
    name = props.name
    table = "h200" if "H200" in name else "h100" if "H100" in name else None
    cap = (props.major, props.minor)
    missing = _gluon_missing() if cap[0] == 9 else f"{name} is not a Hopper GPU (sm_90)"
    return DeviceKind("cuda", table, cap, props.multi_processor_count, missing, False)


@dataclass(frozen=True)
class Layout:
    """The memory facts of a call that decide which kernels can take it."""
    vocab_start: int = 0      # global id of the shard's first row
    tma: bool = True          # hidden's and weight's rows 16-byte aligned (pointers and row strides)
    peers: int = 0            # records stored into this many peers' buffers (0: kept local)

    @staticmethod
    def of(hidden: torch.Tensor, weight: torch.Tensor, vocab_start: int = 0,
           peers: int = 0) -> "Layout":
        def aligned(t):
            return t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
        return Layout(vocab_start, aligned(hidden) and aligned(weight), peers)


@dataclass(frozen=True)
class Plan:
    """The resolved launch plan of one call shape. `config` holds the stage-1 kernel's
    parameters (block sizes, stages, warps; for the fused kernel also where the noise is
    drawn); `reduce` stage 2's (BLOCK_R, BLOCK_N, num_warps)."""
    backend: str                    # "triton" or "torch"
    strategy: str                   # one of STRATEGIES
    config: tuple = ()              # sorted (name, value) pairs
    reduce: tuple = (1, 4, 4)
    B: int = 0
    D: int = 0
    V: int = 0
    tiles: int = 0
    slots: int = 1
    num_samples: int = 1
    dtype: str = "bf16"
    merge: str = "max"
    need_mass: bool = True
    pdl: bool = False               # stage 2 as a programmatic dependent launch (Hopper+)
    layout: Layout = field(default_factory=Layout)
    device: str = "cpu"
    source: str = ""                # where the config came from
    fallbacks: tuple = ()           # ("wanted -> took", why) pairs, in order
    trace: bool = False             # pp only: per-tile SM clocks into a trace buffer (tools/probe.py)
    candidates: bool = False        # candidate planes for filters / top log-probs (filters.py)
    replacement: bool = True        # False: sample planes hold each tile's best S scores
    raw_mass: bool = False          # the raw plane holds the tile log-masses at T = 1
    masked: bool = False            # an allowed-token mask / listed tokens (constraints.py)

    @property
    def cfg(self) -> dict:
        return dict(self.config)

    @property
    def cdf(self) -> bool:
        return self.merge == "cdf"

    def __str__(self) -> str:
        lay = self.layout
        lines = [
            f"tpsample plan: B={self.B} D={self.D} V={self.V} {self.dtype} merge={self.merge} "
            f"num_samples={self.num_samples} need_mass={self.need_mass} on {self.device}"
            + (" candidates" if self.candidates else "")
            + ("" if self.replacement else " without replacement")
            + (" constrained" if self.masked else ""),
            f"  layout: vocab_start={lay.vocab_start} tma_aligned={lay.tma} peers={lay.peers} "
            f"tiles={self.tiles} slots={self.slots}",
            f"  stage 1: {self.strategy} " + " ".join(f"{k}={v}" for k, v in self.config),
            f"    from: {self.source}",
        ]
        for step, why in self.fallbacks:
            lines.append(f"    fallback {step}: {why}")
        r, n, w = self.reduce
        lines.append(f"  stage 2: {'torch merge' if self.backend == 'torch' else 'reduce_records'}"
                     + ("" if self.backend == "torch" else
                        f" BLOCK_R={r} BLOCK_N={n} num_warps={w}{' PDL' if self.pdl else ''}"))
        if self.candidates:
            lines.append("    then the candidate reduce (tpsample/filters.py)"
                         + (" in torch" if self.backend == "torch" else "")
                         + " and the fallback for rows without a certificate")
        return "\n".join(lines)


@functools.lru_cache(maxsize=None)
def load_table(name: str) -> tuple[dict, dict]:
    """A shipped table: ({bucket: config}, {max_d: {bucket: config}})."""
    data = json.loads((CONFIG_DIR / f"{name}.json").read_text())
    return ({int(b): c for b, c in data["buckets"].items()},
            {int(d): {int(b): c for b, c in over.items()}
             for d, over in data.get("by_max_d", {}).items()})


def table_config(buckets: dict, by_max_d: dict, B: int, D: int) -> tuple[dict, str]:
    """The config for (B, D): the bucket is the smallest >= B (else the largest); the
    override of the smallest max_d >= D replaces that bucket's config where it has one."""
    bucket = min((b for b in buckets if b >= B), default=max(buckets))
    for max_d in sorted(d for d in by_max_d if d >= D):
        if bucket in by_max_d[max_d]:
            return dict(by_max_d[max_d][bucket]), f"bucket {bucket}, D <= {max_d} override"
    return dict(buckets[bucket]), f"bucket {bucket}"


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def default_config(device: DeviceKind, B: int, dtype: torch.dtype) -> tuple[dict, str]:
    if device.type != "cuda":  # the interpreter pays per program: few, large tiles
        return (dict(strategy="fused", BLOCK_B=min(max(16, next_pow2(B)), 256), BLOCK_D=64,
                     NUM_STAGES=1, num_warps=4), "interpreter default (few, large tiles)")
    why = ("default: fp32 head (the tables are for 16-bit heads)" if dtype == torch.float32
           else "default: no table for this GPU")
    if B > 64:  # Hopper's warp-specialized kernel; elsewhere it falls back to cuBLAS + records
        return dict(strategy="ws", BLOCK_B=128, NUM_STAGES=4, EPI_B=64, num_warps=8), why
    block_b = min(max(16, next_pow2(B)), 64)
    return (dict(strategy="fused", BLOCK_B=block_b, BLOCK_D=64 if dtype == torch.float32 else 128,
                 NUM_STAGES=4, num_warps=4 if block_b <= 16 else 8), why)


def gluon_refusal(device: DeviceKind, dtype: torch.dtype, V: int, layout: Layout,
                  pp: bool) -> str | None:
    """Why the Gluon kernel (ws, or pp if `pp`) cannot take this call, or None."""
    if device.type != "cuda":
        return "CPU tensors"
    if device.gluon_missing:
        return device.gluon_missing
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{DTYPE_NAMES.get(dtype, dtype)} head (wgmma takes bf16/fp16)"
    if not layout.tma:
        return "hidden or weight rows not 16-byte aligned (TMA)"
    if V % 4 or layout.vocab_start % 4:
        return "V_rows and vocab_start must be multiples of 4 (W is read as four row lanes)"
    if pp and V % 32:
        return "V_rows must be a multiple of 32 (W is read as [2, V/32, 2, 8, D])"
    return None


def make_plan(device: DeviceKind, *, B: int, D: int, V: int, dtype: torch.dtype,
              merge: str = "max", num_samples: int = 1, need_mass: bool = True,
              layout: Layout = Layout(), tiles: int | None = None, slots: int = 1,
              backend: str = "triton", config: dict | None = None, candidates: bool = False,
              replacement: bool = True, raw_mass: bool = False, masked: bool = False) -> Plan:
    """Resolve one call shape into a Plan (see the module docstring). V: rows of this
    (shard of the) LM head; tiles: the tiles per slot (>= its own, under TP the largest
    shard's); slots: the ranks whose records stage 2 reduces. config: an explicit stage-1
    config (tools, tests) instead of the table; the fallbacks still apply. candidates,
    replacement: the call's filtered-sampling needs (tpsample/filters.py); masked: the call
    has an allowed-token mask or listed tokens (tpsample/constraints.py)."""
    if merge == "cdf" and not need_mass:
        raise ValueError("merge='cdf' needs the tile log-masses (need_mass=True)")
    if not replacement and merge != "max":
        raise ValueError(f"replacement=False needs merge='max' (Gumbel-top-S), got {merge!r}")
    tiles = records.num_tiles(V) if tiles is None else tiles
    common = dict(B=B, D=D, V=V, tiles=tiles, slots=slots, num_samples=num_samples,
                  dtype=DTYPE_NAMES.get(dtype, str(dtype)), merge=merge, need_mass=need_mass,
                  layout=layout, device=device.label, candidates=candidates,
                  replacement=replacement, raw_mass=raw_mass, masked=masked)
    if backend == "torch":
        return Plan("torch", "torch", source="backend='torch' (CPU path)", **common)

    fallbacks = []
    if config is not None:
        cfg, source = dict(config), "explicit config"
    elif device.type == "cuda" and device.table and dtype != torch.float32:
        cfg, where = table_config(*load_table(device.table), B, D)
        source = f"{device.table} table, {where}"
    else:
        cfg, source = default_config(device, B, dtype)
    if cfg.get("strategy") not in STRATEGIES[:4]:
        raise ValueError(f"config strategy must be one of {STRATEGIES[:4]}, got {cfg.get('strategy')!r}")

    def fall(to: dict, why: str):
        fallbacks.append((f"{cfg['strategy']} -> {to['strategy']}", why))
        return dict(to)

    if (candidates and replacement and merge != "cdf" and cfg["strategy"] == "fused" and B > 32
            and config is None and not gluon_refusal(device, dtype, V, layout, pp=False)):
        cfg = fall(FUSED_TO_WS_CANDIDATES, "candidates at B > 32: ws's epilogue runs beside "
                   "the matmul")
    if cfg["strategy"] == "pp":
        if cfg.get("BLOCK_B", 128) != 128:
            raise ValueError(f"config BLOCK_B of the ping-pong kernel must be 128, got {cfg['BLOCK_B']!r}")
        if cfg.get("EXTRA_B", 0) not in (0, 32, 64):
            raise ValueError(f"config EXTRA_B of the ping-pong kernel must be 0, 32 or 64, got "
                             f"{cfg['EXTRA_B']!r}")
        why = gluon_refusal(device, dtype, V, layout, pp=True)
        wide = bool(cfg.get("EXTRA_B")) and 128 < B <= 128 + cfg["EXTRA_B"]
        if wide and not why:
            why = ("the ping-pong kernel's second row tile takes one sample, without candidates "
                   "or a mask" if num_samples != 1 or candidates or not replacement or masked
                   else "the ping-pong kernel's 64-row second tile spills with the log-masses "
                   "(54 words, Triton 3.6)" if B > 160 and need_mass and merge != "cdf"
                   else None)
        if why:  # (ws's own refusal below takes it on to the records pass)
            cfg = fall(WIDE_TO_WS if wide else PP_TO_WS, why)
    if merge == "cdf" and cfg["strategy"] in ("pp", "ws"):  # ws has no cdf epilogue
        why = gluon_refusal(device, dtype, V, layout, pp=True)
        if num_samples != 1:
            cfg = fall(TO_LOGITS, "the ping-pong kernel's cdf records take one sample")
        elif B <= 64 and config is None:
            # measured (H200, B = 64): pp 1.06-1.12x the hybrid's time, the fused kernel 1.24-1.53x
            cfg = fall(TO_LOGITS, "cdf at B <= 64: the cuBLAS + records pass is the fastest")
        elif why:
            cfg = fall(TO_LOGITS, why)
        elif cfg["strategy"] == "ws":
            cfg = fall(CDF_PP, "the warp-specialized kernel has no cdf epilogue")
    if cfg["strategy"] == "ws":
        why = gluon_refusal(device, dtype, V, layout, pp=False)
        if why:
            cfg = fall(TO_LOGITS, why)
    if (candidates or not replacement) and cfg["strategy"] in ("ws", "pp"):
        if not replacement or merge == "cdf":
            cfg = fall(TO_LOGITS_CANDIDATES, "the Gluon kernels have no without-replacement or "
                       "cdf candidate epilogue")
        elif cfg["strategy"] == "pp":
            why = gluon_refusal(device, dtype, V, layout, pp=False)
            cfg = fall(TO_LOGITS_CANDIDATES if why else PP_TO_WS,
                       why or "the ping-pong kernel has no candidate epilogue")
    if masked and cfg["strategy"] == "pp":
        why = gluon_refusal(device, dtype, V, layout, pp=False)
        cfg = fall(TO_LOGITS if why or merge == "cdf" else PP_TO_WS,
                   why or "the ping-pong kernel has no mask epilogue"
                   + (" (and ws no cdf epilogue)" if merge == "cdf" else ""))

    cfg = _resolve(cfg, device, B, D, dtype, merge, num_samples, layout, replacement)
    if candidates and cfg["strategy"] == "ws":
        # the candidate epilogue keeps four more lanes of the chunk in registers: 64-column
        # chunks spill (110 spill instructions at BLOCK_B 128, 8 warps; Triton 3.6), 32 none
        cfg["EPI_B"] = min(cfg["EPI_B"], 32)
    group = merge in GROUP_MERGES
    N = slots * tiles
    if device.type == "cuda":  # one (sample, row) per program, all its records in one pass
        # (a Gumbel per record with a group merge: 8 warps hide its latency better)
        reduce = (1, min(4096, max(4, next_pow2(N))), 8 if group else 4)
    else:  # the interpreter pays per program, not per element
        block_n = min(1024, max(4, next_pow2(N)))
        reduce = (min(max(16384 // block_n, 1), next_pow2(B * num_samples)), block_n, 4)
    return Plan("triton", cfg.pop("strategy"), tuple(sorted(cfg.items())), reduce,
                pdl=device.type == "cuda" and device.capability[0] >= 9, source=source,
                fallbacks=tuple(fallbacks), **common)


def _resolve(cfg: dict, device: DeviceKind, B: int, D: int, dtype, merge: str, num_samples: int,
             layout: Layout, replacement: bool = True) -> dict:
    """The strategy's launch parameters with everything derivable from the shape filled in."""
    cfg = dict(cfg)
    strategy = cfg["strategy"]
    if strategy in ("ws", "pp"):
        cfg.setdefault("BLOCK_K", WS_BLOCK_K)
        cfg.setdefault("NUM_STAGES", 5)
        if strategy == "pp":  # the rows past 128 in a second accumulator where they fit
            # (not with the cdf records: their epilogue spills with it, Triton 3.6 and 3.9)
            rest, most = B - 128, cfg.pop("EXTRA_B", 0)
            if 0 < rest <= most and num_samples == 1 and merge != "cdf":
                cfg["EXTRA_B"] = max(32, next_pow2(rest))
        if strategy == "ws":
            cfg.setdefault("EPI_B", 64)
        return cfg
    # fused and logits: drop padding columns before the noise where B < BLOCK_B
    cfg["HALVINGS"] = max((cfg["BLOCK_B"] // next_pow2(B)).bit_length() - 1, 0) if B > 0 else 0
    if strategy == "logits":
        return cfg
    cfg["FP32_DOT"] = dtype == torch.float32 or device.type != "cuda"
    cfg["EVEN_D"] = D % cfg["BLOCK_D"] == 0
    cfg["W_DESC"] = bool(cfg.pop("TMA", False)) and layout.tma
    step = cfg.pop("NOISE_STEP", None)  # draw the noise in the main loop, under the loads
    chunks = cfg.pop("NOISE_CHUNKS", 1)  # in 1, 2 or 4 row blocks ...
    every = cfg.pop("NOISE_EVERY", 2)  # ... this many D steps apart
    if chunks not in (1, 2, 4):
        raise ValueError(f"config NOISE_CHUNKS must be 1, 2 or 4, got {chunks!r}")
    if (step is not None and num_samples == 1 and layout.vocab_start % 4 == 0 and merge != "cdf"
            and replacement):
        steps = cdiv(D, cfg["BLOCK_D"])
        # all blocks must land inside the loop: shrink the spacing, then the first step
        every = min(every, (steps - 1) // (chunks - 1)) if chunks > 1 else 0
        cfg.update(NOISE_AT=min(int(step * steps), steps - 1 - (chunks - 1) * every),
                   NOISE_CHUNKS=chunks, NOISE_EVERY=every)
    return cfg


def explain(B: int, D: int, V: int, *, dtype: torch.dtype = torch.bfloat16, device=None,
            merge: str = "max", num_samples: int = 1, return_logprobs: bool = False,
            vocab_start: int = 0, world: int = 1, peers: int = 0, aligned: bool = True,
            filtered: bool = False, replacement: bool = True, constrained: bool = False) -> Plan:
    """The Plan tpsample would use for a call: print it to see which kernels run and why.

    B, D, V: batch, hidden size, rows of the (shard of the) LM head. device: None (the
    current CUDA device, else the CPU), a torch.device, "cpu", or a GPU model by its table
    name ("h100", "h200": the plan this Triton would give there). merge, num_samples,
    return_logprobs: as in tpsample.sample (under TP pass the sampler's logprobs flag).
    vocab_start, world: the shard's first id and the TP degree; peers: ranks the records
    are stored into directly (symmetric memory: world; else 0); aligned: whether hidden's
    and weight's rows are 16-byte aligned; filtered: the call sets top_k / top_p / min_p /
    top_logprobs or logprobs_mode="raw"; replacement: as in tpsample.sample; constrained:
    the call passes allowed_mask or logit_adjust. Arguments sample() also takes are checked
    as sample() checks them (the same errors, naming the argument)."""
    from .params import FLOAT_DTYPES, check_options
    for name, value, low in (("B", B, 1), ("D", D, 1), ("V", V, 1), ("world", world, 1),
                             ("vocab_start", vocab_start, 0), ("peers", peers, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    check_options(num_samples, merge)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, str) and device in ("h100", "h200"):
        kind = DeviceKind.named(device)
    else:
        try:
            kind = DeviceKind.of(torch.device(device))
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device must be None, a torch.device, 'cpu', 'cuda[:i]', 'h100' or "
                             f"'h200', got {device!r}") from e
    backend = "triton" if kind.type == "cuda" or kind.interpret else "torch"
    return make_plan(kind, B=B, D=D, V=V, dtype=dtype, merge=merge, num_samples=num_samples,
                     need_mass=return_logprobs or merge != "max" or filtered or not replacement,
                     layout=Layout(vocab_start, aligned, peers), slots=world, backend=backend,
                     candidates=filtered or not replacement, replacement=replacement,
                     masked=constrained)


def with_options(plan: Plan, **changes) -> Plan:
    """A copy of `plan` with fields replaced (tools: pdl=False, trace=True, reduce=...)."""
    return replace(plan, **changes)
