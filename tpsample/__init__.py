"""tpsample: exact fused LM-head sampling (FlashSampling) for single GPU and tensor parallel.

    sample(hidden, weight, ...)          one device                  (tpsample/api.py)
    verify_drafts(hidden, weight, ...)   speculative-draft verification (tpsample/verify.py)
    VocabParallelSampler(shard, ...)     a vocabulary-parallel head  (tpsample/parallel.py)
    OnlineSampler(B, ...)                logits arriving in chunks   (tpsample/online.py)
    explain(B, D, V, ...)                which kernels run, and why  (tpsample/plan.py)
"""
from . import merge, noise, reference
from .api import sample, verify_drafts
from .constraints import penalty_adjustments
from .online import OnlineSampler
from .parallel import VocabParallelSampler
from .params import SampleOutput
from .verify import VerifyOutput
from .plan import Plan, explain
from .transport import ExchangeTimeout

__all__ = ["sample", "verify_drafts", "VerifyOutput", "penalty_adjustments", "SampleOutput", "OnlineSampler", "VocabParallelSampler", "ExchangeTimeout",
           "explain", "Plan", "merge", "noise", "reference"]
__version__ = "0.2.0"
