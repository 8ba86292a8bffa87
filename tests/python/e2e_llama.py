"""End-to-end: a small Llama trained with and without xent.hf.patch, same init, same data.

The model is built from a config (random init, nothing downloaded) with a word-level vocabulary of
the Tiny Shakespeare text padded to --vocab entries (>= 32000), and trained for --steps AdamW steps
under bf16 autocast, once with the model's own loss and once patched. Prints both loss curves,
their largest relative gap, the peak memory and the step time of each; exits 1 when the curves
differ by more than bf16 tolerance or the patched run does not use less memory.

    python tests/python/e2e_llama.py --text data/tinyshakespeare.txt [--json out.json]
"""

import argparse
import collections
import copy
import json
import sys
import time

import torch

import xent


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", default="data/tinyshakespeare.txt")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.03,
        help="largest relative gap allowed between the two loss curves",
    )
    parser.add_argument("--json", help="write the measurements here")
    return parser.parse_args(argv)


def word_tokens(path, vocab_size):
    """Whitespace words of the text as ids; the vocabulary is every word by frequency, padded
    with unused entries up to vocab_size (the unused rows still count in every softmax)."""
    with open(path, encoding="utf-8") as handle:
        words = handle.read().split()
    counts = collections.Counter(words)
    vocabulary = ["<unk>"] + [word for word, _ in counts.most_common(vocab_size - 1)]
    index = {word: i for i, word in enumerate(vocabulary)}
    ids = torch.tensor([index.get(word, 0) for word in words], dtype=torch.long)
    return ids, len(vocabulary)


def batches(ids, batch, seq, steps, seed=0):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=generator)
        yield torch.stack([ids[s : s + seq] for s in starts.tolist()])


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 64 * 64 + 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def train(base_model, ids, args, patched):
    device = torch.device(args.device)
    model = copy.deepcopy(base_model).to(device)
    if patched:
        xent.hf.patch(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    losses, times = [], []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    for step, input_ids in enumerate(batches(ids, args.batch, args.seq, args.steps)):
        input_ids = input_ids.to(device)
        start = time.perf_counter()
        with autocast:
            out = model(input_ids=input_ids, labels=input_ids)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.item())  # synchronises: the step is done
        times.append(time.perf_counter() - start)
        if patched:
            assert out.logits is None
        print(
            f"  {'xent' if patched else 'torch'} step {step:3d} loss {losses[-1]:.5f}",
            file=sys.stderr,
            flush=True,
        )
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    del model, optimizer
    return dict(
        losses=losses,
        peak_bytes=peak,
        step_ms_median=sorted(times[2:] or times)[len(times[2:] or times) // 2] * 1e3,
    )


def main(argv=None):
    args = parse_args(argv)
    ids, used_words = word_tokens(args.text, args.vocab)
    base = build_model(args)
    print(
        f"Llama {sum(p.numel() for p in base.parameters()) / 1e6:.1f}M parameters, "
        f"V={args.vocab} ({used_words} words of the text), {args.batch}x{args.seq} tokens a "
        f"step, {args.steps} steps, device {args.device}",
        flush=True,
    )
    reference = train(base, ids, args, patched=False)
    fused = train(base, ids, args, patched=True)

    gaps = [abs(a - b) / abs(b) for a, b in zip(fused["losses"], reference["losses"])]
    print(f"{'step':>4} {'torch loss':>11} {'xent loss':>11} {'rel gap':>9}")
    for step, (a, b, gap) in enumerate(zip(reference["losses"], fused["losses"], gaps)):
        if step % 5 == 0 or step == len(gaps) - 1:
            print(f"{step:4d} {a:11.5f} {b:11.5f} {gap:9.2e}")
    print(f"largest relative gap {max(gaps):.2e} (tolerance {args.tolerance})")
    for name, run in (("torch", reference), ("xent", fused)):
        peak = f"{run['peak_bytes'] / 2**20:.0f} MiB" if run["peak_bytes"] is not None else "n/a"
        print(f"{name:>5}: peak memory {peak}, median step {run['step_ms_median']:.1f} ms")

    ok = max(gaps) <= args.tolerance
    if reference["peak_bytes"] is not None:
        ok = ok and fused["peak_bytes"] < reference["peak_bytes"]
    if args.json:
        record = dict(
            args=vars(args),
            torch=reference,
            xent=fused,
            max_rel_gap=max(gaps),
            device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            torch_version=torch.__version__,
            passed=ok,
        )
        with open(args.json, "w") as handle:
            json.dump(record, handle, indent=1)
    print("e2e:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
