"""float64 references of docs/semantics.md §1–§4 written with torch.nn.functional, plus input helpers.

Gradients of the references come from autograd on these float64 expressions, so they are an
independent check of the fused kernels' hand-derived gradients.
"""

import math

import torch
import torch.nn.functional as F


def softcapped(x, softcap, scale=1.0):
    z = x * scale
    return softcap * torch.tanh(z / softcap) if softcap is not None else z


def ce_rows(
    logits,
    target,
    class_weight=None,
    ignore_index=-100,
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
    logit_scale=1.0,
):
    """Per-row (ℓ_n, ζ_n, valid_n) in float64 for 2-D logits."""
    x = softcapped(logits.double(), softcap, logit_scale)
    weight = class_weight.double() if class_weight is not None else None
    # F.cross_entropy(reduction="none") is the per-row ℓ of docs/semantics.md §1 with PyTorch's smoothing and
    # class-weight convention, and 0 for ignored rows.
    loss = F.cross_entropy(
        x,
        target,
        weight=weight,
        ignore_index=ignore_index,
        reduction="none",
        label_smoothing=label_smoothing,
    )
    valid = target != ignore_index
    lse = torch.logsumexp(x, dim=-1)
    zeta = torch.where(valid, z_loss * lse * lse, torch.zeros_like(lse))
    return loss, zeta, valid, x


def reduce_ce(loss, zeta, valid, target, reduction, class_weight=None, row_weight=None):
    r = row_weight.double() if row_weight is not None else torch.ones_like(loss)
    if reduction == "none":
        return torch.where(valid, r * (loss + zeta), torch.zeros_like(loss))
    if reduction == "sum":
        return (r * (loss + zeta))[valid].sum()
    n_valid = valid.sum()
    if class_weight is not None:
        denominator = class_weight.double()[target[valid]].sum()
    else:
        denominator = n_valid.double()
    main = (r * loss)[valid].sum() / denominator if denominator > 0 else loss.sum() * 0
    z_part = (r * zeta)[valid].sum() / n_valid if n_valid > 0 else zeta.sum() * 0
    return main + z_part


def cross_entropy(
    logits,
    target,
    class_weight=None,
    row_weight=None,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
    logit_scale=1.0,
):
    loss, zeta, valid, _ = ce_rows(
        logits, target, class_weight, ignore_index, label_smoothing, z_loss, softcap, logit_scale
    )
    return reduce_ce(loss, zeta, valid, target, reduction, class_weight, row_weight)


def ce_stats(
    logits,
    target,
    ignore_index=-100,
    softcap=None,
    logit_scale=1.0,
    z_loss=0.0,
    reduction="mean",
    row_weight=None,
):
    """lse, logprob, entropy, argmax, accuracy, z_loss_value of docs/semantics.md §1 (float64)."""
    with torch.no_grad():
        x = softcapped(logits.double(), softcap, logit_scale)
        valid = target != ignore_index
        lse = torch.logsumexp(x, dim=-1)
        logp = x - lse[:, None]
        safe_target = torch.where(valid, target, torch.zeros_like(target))
        logprob = logp.gather(1, safe_target[:, None]).squeeze(1)
        entropy = -(logp.exp() * logp).sum(-1)
        argmax = x.argmax(-1)
        zero = torch.zeros_like(lse)
        correct = (argmax == target) & valid
        accuracy = correct.sum().double() / valid.sum() if valid.any() else zero.sum()
        zeta = torch.where(valid, z_loss * lse * lse, zero)
        z_value = reduce_ce(
            torch.zeros_like(zeta), zeta, valid, target, reduction, row_weight=row_weight
        )
        return dict(
            lse=torch.where(valid, lse, zero),
            logprob=torch.where(valid, logprob, zero),
            entropy=torch.where(valid, entropy, zero),
            argmax=torch.where(valid, argmax, torch.full_like(argmax, -1)),
            accuracy=accuracy,
            z_loss=z_value,
        )


def logprobs(logits, target, temperature=1.0, ignore_index=-100, softcap=None):
    """(logprob, entropy) per row in float64, differentiable: log_softmax(softcap(x/T))[y] and
    −Σ p·log p, written from their definitions (no shared statistics), 0 for ignored rows."""
    x = softcapped(logits.double(), softcap, 1.0 / temperature)
    logp = F.log_softmax(x, dim=-1)
    valid = target != ignore_index
    safe_target = torch.where(valid, target, torch.zeros_like(target))
    logprob = logp.gather(1, safe_target[:, None]).squeeze(1)
    entropy = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros_like(logprob)
    return torch.where(valid, logprob, zero), torch.where(valid, entropy, zero)


def distill_rows(student, teacher, kind, temperature=1.0, beta=0.5, softcap=None, tvd_tie_band=0.0):
    s = softcapped(student.double(), softcap) / temperature
    t = softcapped(teacher.double(), softcap) / temperature
    log_ps, log_pt = F.log_softmax(s, -1), F.log_softmax(t, -1)
    if kind == "forward_kl":
        return F.kl_div(log_ps, log_pt, log_target=True, reduction="none").sum(-1)
    if kind == "reverse_kl":
        return F.kl_div(log_pt, log_ps, log_target=True, reduction="none").sum(-1)
    if kind == "soft_ce":
        return -(log_pt.exp() * log_ps).sum(-1)
    if kind == "tvd":
        difference = log_pt.exp() - log_ps.exp()
        if tvd_tie_band > 0:
            # Near-ties (|p_t − p_s| within the band, relative) at the kink's midpoint: gradient
            # 0 there, the mean of the two sides an op in lower precision may take.
            tie = difference.abs() <= tvd_tie_band * torch.maximum(log_pt.exp(), log_ps.exp())
            difference = torch.where(tie, difference * 0, difference)
        return 0.5 * difference.abs().sum(-1)
    if kind == "jsd":
        if beta in (0.0, 1.0):
            return (s * 0).sum(-1)
        log_m = torch.logsumexp(
            torch.stack([log_pt + math.log(beta), log_ps + math.log(1 - beta)]), dim=0
        )
        kl_t = F.kl_div(log_m, log_pt, log_target=True, reduction="none").sum(-1)
        kl_s = F.kl_div(log_m, log_ps, log_target=True, reduction="none").sum(-1)
        return beta * kl_t + (1 - beta) * kl_s
    raise ValueError(kind)


def distill(
    student,
    teacher,
    target=None,
    kind="forward_kl",
    temperature=1.0,
    beta=0.5,
    softcap=None,
    soft_weight=1.0,
    hard_weight=0.0,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    z_loss=0.0,
    class_weight=None,
    tvd_tie_band=0.0,
):
    soft = distill_rows(student, teacher, kind, temperature, beta, softcap, tvd_tie_band)
    if target is None:
        valid = torch.ones(soft.shape[0], dtype=torch.bool)
    else:
        valid = target != ignore_index
    soft = torch.where(valid, soft, torch.zeros_like(soft))
    if reduction == "none":
        total = soft_weight * soft
    elif reduction == "sum":
        total = soft_weight * soft.sum()
    else:
        total = soft_weight * (soft.sum() / valid.sum() if valid.any() else soft.sum() * 0)
    if hard_weight != 0.0:
        hard = cross_entropy(
            student,
            target,
            class_weight,
            None,
            ignore_index,
            reduction,
            label_smoothing,
            z_loss,
            softcap,
        )
        total = total + hard_weight * hard
    return total


def linear_logits(hidden, weight, bias=None, round_to=None):
    """h·Wᵀ + b in float64 from the values the op sees; optionally rounded like a chunk is."""
    logits = hidden.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    if round_to is not None and round_to not in (torch.float32, torch.float64):
        logits = logits.to(round_to).double()
    return logits


def rel_error(actual, expected):
    """‖actual − expected‖ / ‖expected‖ in float64 (absolute when the reference is 0)."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    denominator = expected.norm()
    difference = (actual - expected).norm()
    return (difference / denominator).item() if denominator > 0 else difference.item()


def randn(gen, *shape, dtype=torch.float32, device="cpu", scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)


def targets(gen, rows, vocab, device="cpu", ignore_index=-100, ignored_fraction=0.2):
    target = torch.randint(0, vocab, (rows,), generator=gen)
    ignored = torch.rand(rows, generator=gen) < ignored_fraction
    target[ignored] = ignore_index
    return target.to(device)
