"""Input builders shared by tests: LM heads whose logits have a chosen shape."""
import torch

from tpsample.reference import transformed_logits


def lm_head_case(kind: str, V: int, D: int = 32, dtype=torch.float32, device="cpu", seed: int = 0):
    """Return (h [D], W [V, D]) whose logits h.W^T follow `kind`: flat, peaked or zipf."""
    g = torch.Generator().manual_seed(seed)
    if kind == "flat":
        x = 0.3 * torch.randn(V, generator=g)
    elif kind == "peaked":
        x = torch.randn(V, generator=g)
        x[torch.randint(V, (3,), generator=g)] += torch.tensor([5.0, 4.0, 3.0])
    elif kind == "zipf":
        x = -1.1 * torch.log(torch.arange(1, V + 1, dtype=torch.float32))
        x = x[torch.randperm(V, generator=g)] + 3.0
    else:
        raise ValueError(kind)
    w = 0.05 * torch.randn(V, D, generator=g)
    w[:, 0] += x
    h = 0.2 * torch.randn(D, generator=g)
    h[0] = 1.0
    return h.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)


def exact_probs(h, w, *, temperature=1.0, bias=None, vocab_size=None) -> torch.Tensor:
    """float64 softmax of the transformed logits of one row h [D] → [V]."""
    l = h.double() @ w.double().T
    if bias is not None:
        l = l + bias.double()
    if temperature != 0:
        l = l / temperature
    if vocab_size is not None:
        l[vocab_size:] = float("-inf")
    return torch.softmax(l, dim=-1)


def random_inputs(B, D, V, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, D, generator=g)
    w = torch.randn(V, D, generator=g) / D ** 0.5 * 3
    return h.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)


__all__ = ["lm_head_case", "exact_probs", "random_inputs", "transformed_logits"]
