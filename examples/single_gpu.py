"""Sample a few tokens with tpsample.sample and check them against the reference.

    python examples/single_gpu.py
"""
import torch

import tpsample
from tpsample.reference import reference_sample

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
B, D, V = 4, 256, 5000
torch.manual_seed(0)
hidden = torch.randn(B, D, device=device, dtype=dtype)
weight = (torch.randn(V, D, device=device) / 4).to(dtype)
temperature = torch.tensor([0.0, 0.7, 1.0, 1.5], device=device)  # row 0 greedy
seeds = torch.tensor([1, 2, 3, 4], device=device)

out = tpsample.sample(hidden, weight, temperature=temperature, seed=seeds, offset=0,
                      num_samples=2, return_logprobs=True)
ref = reference_sample(hidden, weight, temperature=temperature, seed=seeds, offset=0, num_samples=2)
print("tokens   ", out.tokens.tolist())
print("reference", ref.tokens.tolist())
print("logprobs ", [[round(x, 4) for x in row] for row in out.logprobs.tolist()])
print("log Z    ", [round(x, 4) for x in out.logz.tolist()])
