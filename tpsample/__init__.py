"""tpsample: exact fused LM-head sampling (FlashSampling) for single GPU and tensor parallel."""
from .api import SampleOutput, sample
from .online import OnlineSampler
from .parallel import VocabParallelSampler
from .transport import ExchangeTimeout
from . import merge, noise, reference

__all__ = ["sample", "SampleOutput", "OnlineSampler", "VocabParallelSampler", "ExchangeTimeout",
           "merge", "noise", "reference"]
__version__ = "0.1.0"
