"""Triton and Gluon kernels of tpsample (installed as tpsample.kernels). No torch.distributed here.

    fused_sample    stage 1: the fused LM-head + noise kernel and the records pass over logits
    gluon_sample    stage 1 on Hopper: the warp-specialized kernel ("ws")
    gluon_pingpong  stage 1 on Hopper: the ping-pong kernel ("pp")
    reduce_records  stage 2: records → tokens, log-probs, log Z
"""
from . import fused_sample, gluon_pingpong, gluon_sample, reduce_records

__all__ = ["fused_sample", "gluon_pingpong", "gluon_sample", "reduce_records"]
