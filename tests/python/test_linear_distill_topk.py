"""linear_distill with a top-k teacher (docs/semantics.md §3.1, §4) against distill with the same
teacher on h·Wᵀ in float64, at budgets that force many row chunks."""

import pytest
import torch

import xent

MASS_KINDS = [
    (mass, kind)
    for mass in ("renormalize", "tail", "ignore")
    for kind in ("forward_kl", "reverse_kl", "jsd", "soft_ce", "tvd")
    if mass != "ignore" or kind in ("forward_kl", "soft_ce")
]


def _teacher(n, v, k, generator, mass, device="cpu"):
    ids = torch.stack([torch.randperm(v, generator=generator)[:k] for _ in range(n)])
    ids[0, k // 2 :] = -1  # a row with fewer than k entries
    logits = torch.randn(n, v, generator=generator, dtype=torch.float64) * 2
    logprobs = torch.log_softmax(logits, -1).gather(1, ids.clamp(min=0))
    return xent.TopK(ids.to(device), logprobs.to(device), mass)


def _case(g, n=37, h=19, v=101, k=7):
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.5
    target = torch.randint(0, v, (n,), generator=g)
    target[3] = -100
    return g, hidden, weight, target


def _both(hidden, weight, target, teacher, upstream=None, **options):
    results = []
    for fused in (True, False):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        if fused:
            loss = xent.linear_distill(h, w, None, target, teacher=teacher, **options)
        else:
            fused_only = ("workspace_bytes", "grad_in_forward")
            options = {key: value for key, value in options.items() if key not in fused_only}
            loss = xent.distill(h @ w.t(), None, target, teacher=teacher, **options)
        (loss * upstream if upstream is not None else loss).sum().backward()
        results.append((loss.detach(), h.grad, w.grad))
    return results


@pytest.mark.parametrize("mass,kind", MASS_KINDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("budget", [101 * 8 * 5, 1 << 30])
@pytest.mark.parametrize("grad_in_forward", [True, False])
def test_matches_distill_on_logits(mass, kind, reduction, budget, grad_in_forward, gen):
    g, hidden, weight, target = _case(gen)
    teacher = _teacher(hidden.shape[0], weight.shape[0], 7, g, mass)
    upstream = torch.rand(hidden.shape[0], generator=g, dtype=torch.float64)
    options = dict(kind=kind, reduction=reduction, workspace_bytes=budget, softcap=20.0)
    if not grad_in_forward:
        options["grad_in_forward"] = False
    (lf, hf, wf), (lr, hr, wr) = _both(
        hidden, weight, target, teacher, upstream if reduction == "none" else None, **options
    )
    torch.testing.assert_close(lf, lr, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(hf, hr, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(wf, wr, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("mass", ["renormalize", "tail", "ignore"])
def test_hard_label_class_weight_z_loss_mean(mass, gen):
    """mean's two divisors (N_valid for the soft part and z_loss, Σ r_n for the CE) across chunks."""
    g, hidden, weight, target = _case(gen)
    teacher = _teacher(hidden.shape[0], weight.shape[0], 5, g, mass)
    class_weight = torch.rand(weight.shape[0], generator=g, dtype=torch.float64) + 0.1
    options = dict(
        kind="forward_kl",
        hard_weight=0.7,
        soft_weight=0.4,
        z_loss=1e-2,
        label_smoothing=0.1,
        class_weight=class_weight,
        workspace_bytes=101 * 8 * 3,
    )
    (lf, hf, wf), (lr, hr, wr) = _both(hidden, weight, target, teacher, **options)
    for got, want in ((lf, lr), (hf, hr), (wf, wr)):
        assert got.dtype == want.dtype == torch.float64
    torch.testing.assert_close(lf, lr, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(hf, hr, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(wf, wr, rtol=1e-9, atol=1e-12)


def test_all_rows_ignored_mean_is_zero(gen):
    g, hidden, weight, target = _case(gen)
    teacher = _teacher(hidden.shape[0], weight.shape[0], 5, g, "tail")
    target[:] = -100
    (lf, hf, wf), _ = _both(hidden, weight, target, teacher, workspace_bytes=4096)
    assert float(lf) == 0.0 and not hf.any() and not wf.any()


def test_three_dim_rows_and_no_target(gen):
    g, hidden, weight, _ = _case(gen, n=12)
    teacher = _teacher(12, weight.shape[0], 4, g, "renormalize")
    teacher3 = xent.TopK(teacher.ids.view(3, 4, 4), teacher.logprobs.view(3, 4, 4), "renormalize")
    loss = xent.linear_distill(
        hidden.view(3, 4, -1), weight, teacher=teacher3, reduction="none", workspace_bytes=2000
    )
    reference = xent.distill(hidden @ weight.t(), teacher=teacher, reduction="none")
    assert loss.shape == (3, 4)
    torch.testing.assert_close(loss.reshape(-1), reference, rtol=1e-10, atol=1e-12)
    for reduction in ("mean", "sum"):
        loss = xent.linear_distill(
            hidden, weight, teacher=teacher, reduction=reduction, workspace_bytes=2000
        )
        reference = xent.distill(hidden @ weight.t(), teacher=teacher, reduction=reduction)
        torch.testing.assert_close(loss, reference, rtol=1e-10, atol=1e-12)


def test_teacher_given_twice_fails(gen):
    g, hidden, weight, target = _case(gen)
    teacher = _teacher(hidden.shape[0], weight.shape[0], 4, g, "tail")
    with pytest.raises(ValueError, match="given twice"):
        xent.linear_distill(hidden, weight, hidden @ weight.t(), target, teacher=teacher)


@pytest.mark.parametrize("budget", [101 * 8 * 5, 1 << 30])
def test_gradient_formed_in_forward_backpropagates_once(budget, gen):
    # Formed in the forward and scaled in place by the backward, as linear_cross_entropy's: a
    # second backward through the same graph is refused, not silently scaled twice; with
    # grad_in_forward=False each backward recomputes it. Both at several chunks and at one.
    g, hidden, weight, target = _case(gen)
    teacher = _teacher(hidden.shape[0], weight.shape[0], 4, g, "tail")
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    loss = xent.linear_distill(h, w, None, target, teacher=teacher, workspace_bytes=budget)
    (2.5 * loss).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="ran twice"):
        loss.backward()
    first = (h.grad.clone(), w.grad.clone())
    h.grad, w.grad = None, None
    loss = xent.linear_distill(
        h, w, None, target, teacher=teacher, workspace_bytes=budget, grad_in_forward=False
    )
    (2.5 * loss).backward(retain_graph=True)
    torch.testing.assert_close((h.grad, w.grad), first, rtol=1e-12, atol=1e-14)
    loss.backward()
    torch.testing.assert_close((h.grad, w.grad), (first[0] * 1.4, first[1] * 1.4))


def test_shape_mismatch_fails(gen):
    g, hidden, weight, target = _case(gen)
    teacher = _teacher(hidden.shape[0] - 1, weight.shape[0], 4, g, "tail")
    with pytest.raises(ValueError, match="shape mismatch"):
        xent.linear_distill(hidden, weight, None, target, teacher=teacher)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mass,kind", MASS_KINDS)
def test_cuda_bf16_against_float64(mass, kind, gen):
    g, hidden, weight, target = _case(gen, n=300, h=64, v=1001, k=16)
    teacher = _teacher(300, 1001, 16, g, mass)
    hb, wb = hidden.to(torch.bfloat16), weight.to(torch.bfloat16)
    cuda_teacher = xent.TopK(teacher.ids.cuda(), teacher.logprobs.float().cuda(), mass)
    h = hb.cuda().requires_grad_(True)
    w = wb.cuda().requires_grad_(True)
    loss = xent.linear_distill(
        h, w, None, target.cuda(), teacher=cuda_teacher, kind=kind, workspace_bytes=1001 * 8 * 64
    )
    loss.backward()
    (lr, hr, wr), _ = _both(hb.double(), wb.double(), target, teacher, kind=kind)
    torch.testing.assert_close(loss.double().cpu(), lr, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(h.grad.double().cpu(), hr, rtol=5e-2, atol=2e-3)
    torch.testing.assert_close(w.grad.double().cpu(), wr, rtol=5e-2, atol=2e-3)
