"""Stage 1 and stage 2 called directly (plan + launchers), as the pipeline calls them, for
tests that check records and reductions on their own."""
import torch

from tpsample import launchers, records
from tpsample.params import RowParams
from tpsample.plan import DeviceKind, Layout, make_plan, with_options


def near_tie_ok(ref, tokens, scale):
    """Rows where tokens differ from the reference must be fp32 near-ties of the reference's
    own perturbed scores (|z_a - z_b| within rounding of logits of size `scale`)."""
    for b, s in (tokens != ref.tokens).nonzero().tolist():
        z = ref.scores[b, s]
        gap = (z[ref.tokens[b, s]] - z[tokens[b, s]]).abs().item()
        assert gap <= 1e-5 * scale, f"row {b} sample {s}: tokens differ with score gap {gap}"
    return int((tokens != ref.tokens).sum())


def stage1_plan(h, w, *, num_samples=1, vocab_start=0, tiles=None, config=None, peers=0,
                need_mass=True, cdf=False):
    config = dict(config) if config is not None else None
    trim = config.pop("TRIM", True) if config else True
    plan = make_plan(DeviceKind.of(h.device), B=h.shape[0], D=h.shape[1], V=w.shape[0],
                     dtype=h.dtype, merge="cdf" if cdf else "max", num_samples=num_samples,
                     need_mass=need_mass, layout=Layout.of(h, w, vocab_start, peers),
                     tiles=tiles, config=config)
    if not trim:
        plan = with_options(plan, config=tuple((k, 0 if k == "HALVINGS" else v)
                                               for k, v in plan.config))
    return plan


def fused_records(h, w, *, bias, inv_temp, seed, offset, num_samples, n_real, vocab_start=0,
                  out=None, tiles=None, config=None, peer_ptrs=None, parity=None,
                  need_mass=True, cdf=False):
    """Records [S, B, T, 4] of (a shard of) the LM head by the plan's (or `config`'s) kernel."""
    T = tiles if tiles is not None else records.num_tiles(w.shape[0])
    plan = stage1_plan(h, w, num_samples=num_samples, vocab_start=vocab_start, tiles=T,
                       config=config, peers=0 if peer_ptrs is None else peer_ptrs.shape[-1],
                       need_mass=need_mass, cdf=cdf)
    if out is None:
        out = torch.empty(num_samples, h.shape[0], T, 4, dtype=torch.float32, device=h.device)
    fanout = (peer_ptrs, parity) if peer_ptrs is not None else None
    return launchers.stage1(plan, h, w, bias, RowParams(inv_temp, seed, offset), out,
                            n_real=n_real, vocab_start=vocab_start, fanout=fanout)


def reduce_records(recs, inv_temp, seed, offset, merge, parity=None, parity_stride=0, launch=None):
    """Stage 2 of records [slots, S, B, T, 4] → tokens [B, S], logprobs [B, S], logz [B]."""
    slots, S, B, T, _ = recs.shape
    plan = make_plan(DeviceKind.of(recs.device), B=B, D=1, V=T * records.TILE, dtype=torch.float32,
                     merge=merge, num_samples=S, slots=slots, tiles=T, config=dict(
                         strategy="fused", BLOCK_B=16, BLOCK_D=16, NUM_STAGES=1, num_warps=4))
    if launch is not None:
        plan = with_options(plan, reduce=tuple(launch))
    return launchers.stage2(plan, recs, RowParams(inv_temp, seed, offset), parity, parity_stride)
