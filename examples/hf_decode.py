"""Decode with a Hugging Face transformers causal LM, sampling each next token with tpsample
from the decoder's last hidden state and the model's LM-head weight (no [B, V] logits).

    python examples/hf_decode.py                                # a small random Llama-style model
    python examples/hf_decode.py --model Qwen/Qwen3-0.6B --text "The capital of France is"

Without --model the model is built from a config with random weights (offline); with it,
from a checkpoint that transformers can load on this machine. Last, the same loop at
temperature 0 is checked against transformers' own greedy generate().
"""
import argparse
import time

import torch

try:
    import transformers
except ModuleNotFoundError as e:  # the optional extra
    raise SystemExit("examples/hf_decode.py needs transformers: pip install 'tpsample[hf]'") from e

import tpsample
from tpsample import hf


def build(args, device):
    if args.model:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    else:
        config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=256)
        torch.manual_seed(0)
        model, tokenizer = transformers.AutoModelForCausalLM.from_config(config), None
    return model.to(device).eval(), tokenizer


@torch.no_grad()
def decode(model, ids, steps, temperature, top_k, top_p, seed):
    """tokens [B, steps]: each step samples from the last hidden state with tpsample."""
    weight, bias = hf.lm_head(model)
    seeds = torch.arange(ids.shape[0], device=ids.device) + seed
    hidden, cache = hf.last_hidden(model, ids)
    out = []
    for step in range(steps):
        tokens = tpsample.sample(hidden, weight, bias=bias, temperature=temperature,
                                 top_k=top_k, top_p=top_p, seed=seeds, offset=step)
        out.append(tokens)
        hidden, cache = hf.last_hidden(model, tokens[:, None], cache)
    return torch.stack(out, 1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a checkpoint transformers can load (default: random model)")
    p.add_argument("--text", help="the prompt (with --model; default: random token ids)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.text and not args.model:
        p.error("--text needs --model (the random model has no tokenizer)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = build(args, device)
    if args.text:
        ids = tokenizer([args.text] * args.batch, return_tensors="pt").input_ids.to(device)
    else:
        g = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len), generator=g)
        ids = ids.to(device)
    t0 = time.perf_counter()
    tokens = decode(model, ids, args.steps, args.temperature, args.top_k, args.top_p, args.seed)
    seconds = time.perf_counter() - t0
    for row in tokens.tolist():
        print(tokenizer.decode(row) if tokenizer else row)
    print(f"{args.steps} steps x {args.batch} rows in {seconds:.2f} s on {device.type}")
    greedy = decode(model, ids, args.steps, 0.0, None, None, args.seed)
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=args.steps)[:, ids.shape[1]:]
    print(f"greedy tokens equal transformers' generate: {same_until_eos(greedy, reference, model)}")


def same_until_eos(tokens, reference, model):
    """Whether each row of tokens equals reference's up to its first end-of-sequence token
    (where generate() stops that row and pads the rest)."""
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    for row, ref in zip(tokens.tolist(), reference.tolist()):
        n = next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))
        if row[:n] != ref[:n]:
            return False
    return True


if __name__ == "__main__":
    main()
