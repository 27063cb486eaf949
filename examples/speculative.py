"""Speculative decoding with n-gram drafts, verified by tpsample.verify_drafts.

    python examples/speculative.py [--steps 200] [--drafts 4] [--temperature 0.7]

A toy target (random weights, said so): the hidden state at a position is a function of the
previous token and the position, so the next-token distribution depends on the text so far.
Drafts are prompt-lookup n-grams: the S tokens that followed the last earlier occurrence of
the current token. Every verification samples position t of the text with (seed, offset =
t), as plain decoding samples step t, so the speculative loop writes exactly the tokens of
the plain loop; drafts change only how many target passes it takes. Both loops run and are
compared.
"""
import argparse

import torch

import tpsample

D, V = 64, 512


def target(device):
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(V, D, generator=g)
    pos = torch.randn(64, D, generator=g) * 0.1
    lm_head = torch.randn(V, D, generator=g) * 1.2
    return embed.to(device), pos.to(device), lm_head.to(device)


def hidden_at(model, tokens: torch.Tensor, start: int) -> torch.Tensor:
    """The target's hidden states [len(tokens), D] for positions start, start + 1, ...:
    position t sees token t - 1 (tokens[0] is the token before `start`)."""
    embed, pos, _ = model
    t = torch.arange(start, start + tokens.shape[0], device=tokens.device)
    return torch.tanh(embed[tokens] * 1.5 + pos[t % pos.shape[0]])


def ngram_drafts(text: list[int], S: int) -> list[int]:
    """The S tokens after the last earlier occurrence of the text's last token (none: [])."""
    last = text[-1]
    for i in range(len(text) - 2, -1, -1):
        if text[i] == last:
            return text[i + 1:i + 1 + S]
    return []


def plain(model, prompt, steps, T, seed):
    text = list(prompt)
    for _ in range(steps):
        t = len(text)
        h = hidden_at(model, torch.tensor(text[-1:], device=model[0].device), t)
        text.append(int(tpsample.sample(h, model[2], temperature=T, seed=seed, offset=t)[0]))
    return text


def speculative(model, prompt, steps, T, seed, S):
    text = list(prompt)
    passes = accepted = 0
    while len(text) < len(prompt) + steps:
        t = len(text)
        draft = ngram_drafts(text, S)
        ids = torch.tensor([-1] * S, device=model[0].device)
        if draft:
            ids[:len(draft)] = torch.tensor(draft)
        seen = torch.tensor(text[-1:] + draft + [0] * (S - len(draft)), device=ids.device)
        h = hidden_at(model, seen, t)[None]  # [1, S + 1, D]
        out = tpsample.verify_drafts(h, model[2], ids[None], temperature=T, seed=seed,
                                     offset=t)
        n = int(out.num_accepted[0])
        text += out.tokens[0, :n + 1].tolist()
        passes += 1
        accepted += n
    return text[:len(prompt) + steps], passes, accepted


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--drafts", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = target(device)
    prompt = [1, 2, 3]
    want = plain(model, prompt, a.steps, a.temperature, a.seed)
    got, passes, accepted = speculative(model, prompt, a.steps, a.temperature, a.seed, a.drafts)
    print(f"{a.steps} tokens in {passes} target passes ({accepted} drafts accepted, "
          f"{a.steps / passes:.2f} tokens per pass) against {a.steps} plain steps")
    print("text:", got[:40], "...")
    print("same tokens as plain decoding:", got == want)
    if got != want:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
