"""Distilling a student from a served teacher's top-k log-probabilities with xent.

Inference servers with an OpenAI-compatible API (vLLM, SGLang and others) return, for every
position of a prompt or a completion, the teacher's k most likely next tokens with their
log-probabilities (`prompt_logprobs=k`, `logprobs=k`, `top_logprobs`). That is all a distillation
step needs: xent takes them as `xent.TopK(ids, logprobs, mass)` and fuses the loss with the
student's LM head, so neither model's (N, V) logits are held in memory.

- Alignment: the entry at position t is the teacher's distribution of the token at t + 1, the
  token the student's hidden state at t predicts; the last position has none (target -100).
- Vocabularies: the teacher's ids must be the student's tokens (a shared tokenizer). Ids the
  student's head does not have (a teacher padded to another size, added special tokens) are
  dropped here (id -1, an absent entry); with mass="tail" their probability joins the tail.
- mass: "tail" keeps the teacher's mass outside its top-k as one more category against the
  student's mass outside the same ids; "renormalize" compares both distributions on the ids only
  (docs/semantics.md §3.1 has every formula).

This script makes up a teacher's response (a small teacher model's top-k, as a server would send
it), builds the tensors, and checks xent's fused loss and gradients against the same loss written
in plain PyTorch on materialised float64 logits:

    python examples/distill/served_teacher.py              # CPU
    python examples/distill/served_teacher.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse

import torch

import xent


def topk_tensors(positions, k, student_vocab):
    """(ids, logprobs) of shape (T, k) from a server's per-position top-k: `positions[t]` maps a
    token id to its log-probability (as vLLM returns them; from an OpenAI-style list of
    {token_id, logprob} entries, build the dict first). Missing entries and ids outside the
    student's vocabulary become id -1 (absent)."""
    ids = torch.full((len(positions), k), -1, dtype=torch.int64)
    logprobs = torch.zeros(len(positions), k, dtype=torch.float32)
    for t, entries in enumerate(positions):
        kept = [(i, lp) for i, lp in entries.items() if 0 <= i < student_vocab][:k]
        for j, (token, logprob) in enumerate(kept):
            ids[t, j] = token
            logprobs[t, j] = logprob
    return ids, logprobs


def served_teacher_response(teacher_logits, k):
    """What a server sends back for a sequence: per position, the top-k {token id: logprob}."""
    logprobs, ids = torch.log_softmax(teacher_logits.double(), -1).topk(k, -1)
    return [dict(zip(i.tolist(), lp.tolist())) for i, lp in zip(ids, logprobs)]


def tail_forward_kl(logits, ids, logprobs, target):
    """The same loss in plain PyTorch: forward KL over the k ids and a tail category, averaged
    over the positions with a target."""
    log_p = torch.log_softmax(logits, -1)
    present = ids >= 0
    ell = torch.where(present, logprobs.to(log_p.dtype), torch.zeros_like(log_p[:, :1]))
    q = torch.where(present, ell.exp(), torch.zeros_like(ell))
    log_p_ids = log_p.gather(1, ids.clamp(min=0))
    members = torch.zeros(log_p.shape, dtype=torch.int64).scatter_add_(
        1, ids.clamp(min=0), present.long()
    )
    outside = members == 0
    log_p_tail = torch.logsumexp(log_p.masked_fill(~outside, float("-inf")), -1)
    q_tail = (1 - q.sum(-1)).clamp(min=0)
    kl_ids = torch.where(present, q * (ell - log_p_ids), torch.zeros_like(q)).sum(-1)
    kl_tail = torch.where(
        q_tail > 0, q_tail * (q_tail.clamp(min=1e-300).log() - log_p_tail), torch.zeros_like(q_tail)
    )
    valid = target != -100
    return torch.where(valid, kl_ids + kl_tail, torch.zeros_like(kl_ids)).sum() / valid.sum()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--k", type=int, default=20)
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)

    # The student: hidden states of a sequence and its LM head; the next tokens as targets.
    hidden = torch.randn(args.tokens, args.hidden, generator=g)
    weight = torch.randn(args.vocab, args.hidden, generator=g) / args.hidden**0.5 * 2
    tokens = torch.randint(0, args.vocab, (args.tokens + 1,), generator=g)
    target = tokens[1:].clone()
    target[-1] = -100  # the last position predicts past the sequence

    # The teacher, served: its head is padded by 8 rows the student does not have, and the
    # server answers with each position's top-k.
    teacher_logits = hidden @ weight.T + 0.5 * torch.randn(args.tokens, args.vocab, generator=g)
    padded = torch.cat([teacher_logits, torch.randn(args.tokens, 8, generator=g) + 2], -1)
    response = served_teacher_response(padded, args.k)
    ids, logprobs = topk_tensors(response, args.k, args.vocab)

    # The step: the loss fused with the head, gradients to the hidden states and the head.
    h = hidden.to(device, dtype).requires_grad_()
    w = weight.to(device, dtype).requires_grad_()
    teacher = xent.TopK(ids.to(device), logprobs.to(device), "tail")
    loss = xent.linear_distill(h, w, target=target.to(device), teacher=teacher)
    loss.backward()

    # The same loss on materialised float64 logits, from the values the op saw.
    h64 = h.detach().cpu().double().requires_grad_()
    w64 = w.detach().cpu().double().requires_grad_()
    expected = tail_forward_kl(h64 @ w64.T, ids, logprobs, target)
    expected.backward()
    errors = {
        "loss": abs(loss.item() - expected.item()) / abs(expected.item()),
        "grad_hidden": ((h.grad.cpu().double() - h64.grad).norm() / h64.grad.norm()).item(),
        "grad_weight": ((w.grad.cpu().double() - w64.grad).norm() / w64.grad.norm()).item(),
    }
    dropped = int((ids < 0).sum())
    print(f"{dropped} of {ids.numel()} top-k entries name tokens the student does not have")
    print(f"loss {loss.item():.6f} (plain PyTorch, float64: {expected.item():.6f})")
    for name, error in errors.items():
        print(f"  {name}: relative error {error:.2e}")
    return errors, dropped


if __name__ == "__main__":
    main()
