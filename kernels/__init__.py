"""Triton kernels of tpsample (installed as tpsample.kernels). No torch.distributed here."""
from .fused_sample import (fused_sample_records_kernel,
                           fused_sample_records_persistent_kernel, gumbel_noise,
                           logits_records_kernel)
from . import gluon_pingpong, gluon_sample  # Hopper-only, warp-specialized (Gluon)
from .reduce_records import reduce_records_kernel

__all__ = ["fused_sample_records_kernel", "fused_sample_records_persistent_kernel",
           "gluon_pingpong", "gluon_sample", "gumbel_noise", "logits_records_kernel", "reduce_records_kernel"]
