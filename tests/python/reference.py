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
    return reduce_distill(
        soft,
        student,
        target,
        softcap,
        soft_weight,
        hard_weight,
        ignore_index,
        reduction,
        label_smoothing,
        z_loss,
        class_weight,
    )


def reduce_distill(
    soft,
    student,
    target,
    softcap=None,
    soft_weight=1.0,
    hard_weight=0.0,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    z_loss=0.0,
    class_weight=None,
):
    """σ·reduce(per-row distillation losses) + α·CE(student, target) (docs/semantics.md §3)."""
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


def _category_loss(kind, log_p, log_q, beta, tvd_tie_band=0.0):
    """One row's loss of §3's table between two distributions given as log-probabilities."""
    p, q = log_p.exp(), log_q.exp()
    zero = log_p * 0
    if kind == "forward_kl":
        return torch.where(q > 0, q * (log_q - log_p), zero).sum()
    if kind == "soft_ce":
        return torch.where(q > 0, -q * log_p, zero).sum()
    if kind == "reverse_kl":
        return torch.where(p > 0, p * (log_p - log_q), zero).sum()
    if kind == "tvd":
        difference = q - p
        if tvd_tie_band > 0:  # near-ties at the kink's midpoint, as distill_rows
            tie = difference.abs() <= tvd_tie_band * torch.maximum(p, q)
            difference = torch.where(tie, difference * 0, difference)
        return 0.5 * difference.abs().sum()
    if kind == "jsd":
        if beta in (0.0, 1.0):
            return zero.sum()
        log_m = torch.logsumexp(
            torch.stack([log_q + math.log(beta), log_p + math.log(1 - beta)]), 0
        )
        kl_q = torch.where(q > 0, q * (log_q - log_m), zero).sum()
        kl_p = torch.where(p > 0, p * (log_p - log_m), zero).sum()
        return beta * kl_q + (1 - beta) * kl_p
    raise ValueError(kind)


def distill_topk_rows(
    student, ids, logprobs, kind, mass, temperature=1.0, beta=0.5, softcap=None, tvd_tie_band=0.0
):
    """Per-row losses against a top-k teacher (docs/semantics.md §3.1), row by row in float64,
    differentiable with respect to student by autograd."""
    s = softcapped(student.double(), softcap) / temperature
    log_ps = F.log_softmax(s, -1)
    rows = []
    for n in range(s.shape[0]):
        present = ids[n] >= 0
        S = ids[n][present].long()
        ell = logprobs[n][present].double()
        outside = torch.ones(s.shape[1], dtype=torch.bool)
        outside[S] = False
        if mass == "renormalize":
            if S.numel() == 0:
                rows.append(s[n].sum() * 0)
                continue
            log_p = F.log_softmax(s[n][S], -1)
            log_q = F.log_softmax(ell / temperature, -1)
        elif mass == "tail" and outside.any():
            log_p = torch.cat([log_ps[n][S], torch.logsumexp(log_ps[n][outside], 0).reshape(1)])
            q_tail = (1 - ell.exp().sum()).clamp(min=0)
            log_q = torch.cat([ell, q_tail.log().reshape(1)])
        else:  # ignore, or tail with the ids covering the vocabulary
            log_p, log_q = log_ps[n][S], ell
        rows.append(_category_loss(kind, log_p, log_q, beta, tvd_tie_band))
    return torch.stack(rows) if rows else s.sum(-1)


def distill_topk(
    student,
    ids,
    logprobs,
    target=None,
    mass="renormalize",
    kind="forward_kl",
    temperature=1.0,
    beta=0.5,
    softcap=None,
    tvd_tie_band=0.0,
    **reduce_options,
):
    """distill with a top-k teacher; reduce_options: those of reduce_distill."""
    soft = distill_topk_rows(
        student, ids, logprobs, kind, mass, temperature, beta, softcap, tvd_tie_band
    )
    return reduce_distill(soft, student, target, softcap, **reduce_options)


def linear_logits(hidden, weight, bias=None, round_to=None):
    """h·Wᵀ + b in float64 from the values the op sees; optionally rounded like a chunk is."""
    logits = hidden.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    if round_to is not None and round_to not in (torch.float32, torch.float64):
        logits = logits.to(round_to).double()
    return logits


def fp32_tvd_tie_band(*logits):
    """tvd_tie_band for an op computing in fp32: log p = v − lse loses about one ulp of the largest
    |logit|, so probabilities that close (relative) may land on either side of tvd's kink (the C++
    check's error model, distill_check.cpp)."""
    largest = max(t.detach().abs().max().item() for t in logits)
    return 8 * 2.0**-23 * (largest + 8.0)


def tvd_tie_slack(loss_of, inputs, upstream, band):
    """Per input, how far an fp32 op's tvd gradient may stand from the float64 one through
    near-ties alone: a near-tie may land on either side of the kink in fp32, so twice the relative
    move of the float64 gradient when every tie within `band` (fp32_tvd_tie_band) sits at the
    kink's midpoint (the C++ check's error model, distill_check.cpp). loss_of(band): the float64
    loss of `inputs` with that tvd_tie_band."""
    exact = torch.autograd.grad(loss_of(0.0), inputs, upstream)
    midpoint = torch.autograd.grad(loss_of(band), inputs, upstream)
    return [2 * rel_error(m, e) for m, e in zip(midpoint, exact)]


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


def _sequence_lists(rows, valid, sequence_ids=None, cu_seqlens=None, row_shape=None):
    """The valid token positions of each sequence (empty sequences dropped), in plain Python."""
    if sequence_ids is not None:
        ids = sequence_ids.reshape(-1).tolist()
    elif cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        ids = [0] * rows
        for s in range(len(bounds) - 1):
            for t in range(bounds[s], bounds[s + 1]):
                ids[t] = s
    elif row_shape is not None and len(row_shape) == 2:
        ids = [t // row_shape[1] for t in range(rows)]
    else:
        return None
    members = {}
    for t in range(rows):
        if valid[t]:
            members.setdefault(ids[t], []).append(t)
    return list(members.values())


def policy_loss(
    logits,
    target,
    advantages,
    old_logprobs=None,
    ref_logprobs=None,
    rollout_logprobs=None,
    loss_type="grpo",
    clip_low=0.2,
    clip_high=None,
    dual_clip=None,
    kl_coef=0.0,
    kl_estimator="k3",
    entropy_coef=0.0,
    tis_cap=None,
    sapo_tau_pos=1.0,
    sapo_tau_neg=1.05,
    temperature=1.0,
    softcap=None,
    ignore_index=-100,
    loss_mask=None,
    aggregation=None,
    sequence_ids=None,
    cu_seqlens=None,
    normalizer=None,
):
    """docs/semantics.md §7 in float64, differentiable in logits (autograd gives the reference
    gradient): the valid tokens picked out one by one, the sequences as Python lists, every
    formula written from its definition. Returns a dict: loss, the statistics, and `scale`, the
    sum of the magnitudes of what the loss adds up (Σ|g_t·L_t| + Σ|∂loss/∂ℓ_t| + Σ|∂loss/∂H_t|),
    against which a test bounds the rounding of the loss."""
    row_shape = tuple(target.shape)
    x = logits.reshape(-1, logits.shape[-1])
    y = target.reshape(-1).cpu()
    rows = y.shape[0]
    valid = y != ignore_index
    if loss_mask is not None:
        valid = valid & (loss_mask.reshape(-1).cpu() != 0)
    y = torch.where(valid, y, torch.full_like(y, ignore_index))
    lp_all, h_all = logprobs(x, y, temperature, ignore_index, softcap)
    index = valid.nonzero().squeeze(1).tolist()
    lp, h = lp_all[index], h_all[index]

    def pick(values):
        return None if values is None else values.reshape(-1).cpu().double()[index]

    adv, old, ref_lp, rollout = (
        pick(advantages),
        pick(old_logprobs),
        pick(ref_logprobs),
        pick(rollout_logprobs),
    )
    if old is None:
        old = lp.detach()
    high = clip_low if clip_high is None else clip_high
    low_bound, high_bound = 1.0 - clip_low, 1.0 + high
    aggregation = aggregation or {"dr_grpo": "token_sum_norm", "gspo": "seq_mean_token_mean"}.get(
        loss_type, "token_mean"
    )
    sequences = _sequence_lists(rows, valid.tolist(), sequence_ids, cu_seqlens, row_shape)
    position = {t: i for i, t in enumerate(index)}  # token → its place among the valid ones
    sequences = [[position[t] for t in members] for members in sequences or []]

    ratio = torch.exp(lp - old)
    rho = ratio
    if loss_type == "gspo":
        parts = [None] * len(index)
        for members in sequences:
            s = torch.exp((lp[members] - old[members]).mean())
            for i in members:
                parts[i] = s
        rho = torch.stack(parts) if parts else ratio
    clipped_low = torch.zeros(len(index), dtype=torch.bool)
    clipped_high = torch.zeros(len(index), dtype=torch.bool)
    if loss_type in ("grpo", "bnpo", "dapo", "dr_grpo", "gspo"):
        term = -torch.minimum(rho * adv, torch.clamp(rho, low_bound, high_bound) * adv)
        clipped_low = (adv < 0) & (rho < low_bound)
        clipped_high = (adv > 0) & (rho > high_bound)
        if dual_clip is not None:
            dual = (adv < 0) & (rho > dual_clip)
            term = torch.where(adv < 0, torch.minimum(term, -dual_clip * adv), term)
            clipped_high = clipped_high | dual
    elif loss_type == "cispo":
        term = -torch.clamp(ratio, low_bound, high_bound).detach() * adv * lp
        clipped_low, clipped_high = ratio < low_bound, ratio > high_bound
    elif loss_type == "sapo":
        tau = torch.where(
            adv > 0, torch.full_like(adv, sapo_tau_pos), torch.full_like(adv, sapo_tau_neg)
        )
        term = -adv * (4.0 / tau) * torch.sigmoid(tau * (rho - 1.0))
    else:
        raise ValueError(loss_type)
    if rollout is not None:
        term = term * torch.clamp(torch.exp(old - rollout), max=tis_cap).detach()
    kl = torch.zeros_like(lp)
    if ref_lp is not None:
        log_r = ref_lp - lp  # log(π_ref / π) on a token sampled from π
        kl = {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": torch.exp(log_r) - log_r - 1.0}[
            kl_estimator
        ]
    per_token = term + kl_coef * kl - entropy_coef * h

    count = len(index)
    if aggregation == "token_mean":
        weights = [1.0 / (normalizer if normalizer is not None else max(count, 1))] * count
    elif aggregation == "token_sum_norm":
        weights = [1.0 / normalizer] * count
    else:
        divisor = normalizer if normalizer is not None else max(len(sequences), 1)
        weights = [0.0] * count
        for members in sequences:
            for i in members:
                per_sequence = len(members) if aggregation == "seq_mean_token_mean" else 1
                weights[i] = 1.0 / (per_sequence * divisor)
    weights = torch.tensor(weights, dtype=torch.float64)
    loss = (weights * per_token).sum()
    if count:
        grad_lp, grad_h = torch.autograd.grad(loss, [lp, h], retain_graph=True, allow_unused=True)
        sensitivity = sum(g.abs().sum() for g in (grad_lp, grad_h) if g is not None)
    else:
        sensitivity = 0.0
    scale = (weights * per_token).abs().sum().item() + float(sensitivity)

    def mean(values):
        return (
            values.detach().double().sum() / count
            if count
            else torch.zeros((), dtype=torch.float64)
        )

    return dict(
        loss=loss,
        logprob=lp_all.detach().reshape(row_shape),
        entropy=h_all.detach().reshape(row_shape),
        clip_fraction_low=mean(clipped_low),
        clip_fraction_high=mean(clipped_high),
        kl=mean(kl),
        ratio=mean(rho),
        scale=scale,
    )
