"""tpsample: exact fused LM-head sampling (FlashSampling) for single GPU and tensor parallel."""
from .api import SampleOutput, sample
from .online import OnlineSampler
from . import merge, noise, reference

__all__ = ["sample", "SampleOutput", "OnlineSampler", "merge", "noise", "reference"]
__version__ = "0.1.0"
