"""torch.compile(fullgraph=True) traces through every op (no graph break) and agrees with eager;
the fake kernels agree with the real ones (torch.library.opcheck)."""

import pytest
import reference as ref
import torch

import xent
from xent._ops import ops


def _compiled_matches_eager(fn, tensors, grads_of):
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    results = []
    for f in (fn, compiled):
        inputs = [t.detach().clone().requires_grad_(i in grads_of) for i, t in enumerate(tensors)]
        loss = f(*inputs)
        loss.backward()
        results.append((loss.detach(), [inputs[i].grad for i in grads_of]))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
    for compiled_grad, eager_grad in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-5, atol=1e-6)


def test_compile_cross_entropy(device, gen):
    logits = ref.randn(gen, 2, 9, 301, device=device)
    target = ref.targets(gen, 18, 301, device).reshape(2, 9)

    def fn(x):
        result = xent.cross_entropy(
            x * 1.5, target, label_smoothing=0.1, z_loss=1e-3, return_stats=True
        )
        return result.loss + 0.1 * result.lse.mean()

    _compiled_matches_eager(fn, [logits], grads_of=[0])


def test_compile_linear_cross_entropy(device, gen):
    h = ref.randn(gen, 2, 11, 40, device=device)
    w = ref.randn(gen, 257, 40, device=device, scale=0.2)
    target = ref.targets(gen, 22, 257, device).reshape(2, 11)

    def fn(h, w):
        per_row = xent.linear_cross_entropy(
            torch.tanh(h), w, target, reduction="none", softcap=10.0
        )
        return per_row.sum() + xent.linear_cross_entropy(h, w, target)

    _compiled_matches_eager(fn, [h, w], grads_of=[0, 1])


def test_compile_linear_cross_entropy_accumulate_into(device, gen):
    h = ref.randn(gen, 2, 11, 40, device=device)
    w = ref.randn(gen, 257, 40, device=device, scale=0.2)
    target = ref.targets(gen, 22, 257, device).reshape(2, 11)
    prefill = ref.randn(gen, 257, 40, device=device)

    def fn(h, w, buffer):
        # The correction of the forward-added gradient (upstream 0.5) and the recompute of
        # reduction none both add into the buffer inside the compiled backward.
        per_row = xent.linear_cross_entropy(h, w, target, reduction="none", accumulate_into=buffer)
        mean = xent.linear_cross_entropy(h, w, target, accumulate_into=buffer)
        return 0.5 * mean + per_row.sum()

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    results = []
    for f in (fn, compiled):
        hidden, weight = h.clone().requires_grad_(), w.clone().requires_grad_()
        buffer = prefill.clone()
        loss = f(hidden, weight, buffer)
        loss.backward()
        assert weight.grad is None
        results.append((loss.detach(), hidden.grad, buffer))
    for compiled_value, eager_value in zip(results[1], results[0]):
        torch.testing.assert_close(compiled_value, eager_value, rtol=1e-5, atol=1e-6)
    assert not torch.equal(results[1][2], prefill)


def test_compile_distill(device, gen):
    student = ref.randn(gen, 13, 301, device=device)
    teacher = ref.randn(gen, 13, 301, device=device)
    target = ref.targets(gen, 13, 301, device)

    def fn(s, t):
        return xent.distill(s, t, target, kind="jsd", temperature=2.0, hard_weight=0.5)

    _compiled_matches_eager(fn, [student, teacher], grads_of=[0])


def test_compile_linear_distill(device, gen):
    h = ref.randn(gen, 17, 40, device=device)
    w = ref.randn(gen, 257, 40, device=device, scale=0.2)
    teacher = ref.randn(gen, 17, 257, device=device)

    def fn(h, w):
        return xent.linear_distill(h, w, teacher, kind="reverse_kl", reduction="sum")

    _compiled_matches_eager(fn, [h, w], grads_of=[0, 1])


def test_compile_module_with_dynamic_shapes(device, gen):
    module = xent.nn.CrossEntropyLoss(label_smoothing=0.05)
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    for rows in (7, 19, 33):
        logits = ref.randn(gen, rows, 129, device=device).requires_grad_()
        target = ref.targets(gen, rows, 129, device)
        torch.testing.assert_close(compiled(logits, target), module(logits, target))


def _opcheck_cases(device, gen):
    rows, hidden, vocab = 6, 5, 11
    x = ref.randn(gen, rows, vocab, device=device)
    t = ref.randn(gen, rows, vocab, device=device)
    h = ref.randn(gen, rows, hidden, device=device)
    w = ref.randn(gen, vocab, hidden, device=device)
    b = ref.randn(gen, vocab, device=device)
    y = ref.targets(gen, rows, vocab, device)
    g = torch.ones(rows, device=device)
    half = torch.tensor(0.5, device=device)
    h16, w16 = h.to(torch.bfloat16), w.to(torch.bfloat16)
    ce = (-100, "none", 0.1, 1e-3, 5.0, 1.0)
    distill = ("forward_kl", 2.0, 0.5, None, 1.0, 0.5, -100, "none", 0.0, 0.0)
    lse = ops.ce_forward(x, y, None, None, *ce, False)[1]
    lse_rows = ops.linear_ce_forward(
        h, w, b, y, None, None, *ce, 0, False, False, False, False, False, False, None, None
    )[1]
    buffer = torch.randn(vocab, hidden, generator=gen).to(device)  # accumulate_into
    entropy = ops.ce_forward(x, y, None, None, *ce, True)[3]
    ids = t.topk(3, -1).indices
    logprobs = torch.log_softmax(t.float(), -1).gather(1, ids)
    topk = (ids, logprobs, y, None, "renormalize")
    return [
        (ops.ce_forward, (x, y, None, None, *ce, True)),
        (ops.ce_forward, (x, y, None, None, -100, "mean", 0.0, 0.0, None, 1.0, False)),
        (ops.ce_backward, (x, y, lse, g, None, None, *ce)),
        (ops.ce_forward_grad, (x, y, None, None, -100, "mean", 0.1, 1e-3, 5.0, 1.0, True, half)),
        (
            ops.ce_forward_grad_inplace,
            (x.clone(), y, None, None, -100, "sum", 0.0, 0.0, None, 1.0, False, None),
        ),
        (ops.scale_, (x.clone(), half)),
        (
            ops.linear_ce_forward,
            (
                h,
                w,
                b,
                y,
                None,
                None,
                -100,
                "sum",
                0.0,
                0.0,
                None,
                1.0,
                0,
                False,
                True,
                True,
                True,
                True,
                False,
                half,
                None,
            ),
        ),
        (
            ops.linear_ce_forward,
            (
                h16,
                w16,
                None,
                y,
                None,
                None,
                -100,
                "mean",
                0.0,
                0.0,
                None,
                1.0,
                0,
                False,
                False,
                True,
                True,
                False,
                False,
                None,
                torch.float32,
            ),
        ),
        (
            ops.linear_ce_forward,
            (h, w, b, y, None, None, *ce, 0, True, False, False, False, False, True, None, None),
        ),
        (
            ops.linear_ce_backward,
            (h, w, None, y, None, g, None, None, *ce, 0, False, True, True, False, None, None),
        ),
        (
            ops.linear_ce_backward,
            (h, w, None, y, None, g, None, None, *ce, 0, False, True, True, False, h @ w.T, None),
        ),
        (
            ops.linear_ce_backward,
            (
                h16,
                w16,
                None,
                y,
                None,
                g,
                None,
                None,
                *ce,
                0,
                False,
                True,
                True,
                False,
                None,
                torch.float32,
            ),
        ),
        (
            ops.linear_ce_forward,
            (
                h16,
                w16,
                b.bfloat16(),
                y,
                None,
                None,
                -100,
                "sum",
                0.0,
                0.0,
                None,
                1.0,
                0,
                False,
                False,
                True,
                True,
                True,
                False,
                half,
                None,
                buffer.clone(),
            ),
        ),
        (
            ops.linear_ce_backward,
            (
                h,
                w,
                b,
                y,
                None,
                g,
                None,
                None,
                *ce,
                0,
                False,
                True,
                True,
                True,
                None,
                None,
                buffer.clone(),
            ),
        ),
        (
            ops.linear_ce_accumulate_correction,
            (
                h,
                w,
                b,
                y,
                lse_rows,
                half,
                None,
                None,
                None,
                *ce[:1],
                "mean",
                *ce[2:],
                0,
                False,
                buffer.clone(),
            ),
        ),
        (ops.ce_logprob_backward, (x, y, lse, entropy, g, g, -100, None, 1.5)),
        (ops.ce_logprob_backward, (x, y, lse, entropy, g, None, -100, 3.0, 1.0)),
        (
            ops.linear_logprob_backward,
            (
                h,
                w,
                b,
                y,
                lse,
                entropy,
                g,
                g,
                -100,
                None,
                1.5,
                0,
                False,
                True,
                True,
                True,
                None,
                None,
            ),
        ),
        (
            ops.linear_logprob_backward,
            (
                h,
                w,
                None,
                y,
                lse,
                entropy,
                g,
                None,
                -100,
                None,
                1.0,
                0,
                True,
                False,
                True,
                False,
                None,
                None,
            ),
        ),
        (
            ops.linear_logprob_backward,
            (
                h,
                w,
                None,
                y,
                lse,
                entropy,
                g,
                g,
                -100,
                None,
                1.5,
                0,
                False,
                True,
                True,
                False,
                h @ w.T,
                None,
            ),
        ),
        (
            ops.linear_logprob_backward,
            (
                h16,
                w16,
                None,
                y,
                lse,
                entropy,
                g,
                g,
                -100,
                None,
                1.5,
                0,
                False,
                True,
                True,
                False,
                None,
                torch.float32,
            ),
        ),
        (ops.distill_forward, (x, t, y, None, *distill)),
        (ops.distill_backward, (x, t, y, g, None, *distill)),
        (ops.distill_topk_forward, (x, *topk, *distill)),
        (ops.distill_topk_forward_grad, (x, *topk, *distill[:7], "mean", 0.0, 0.0, half)),
        (
            ops.distill_topk_forward_grad_inplace,
            (x.clone(), *topk, *distill[:7], "sum", 0.0, 0.0, None),
        ),
        (ops.distill_topk_backward, (x, ids, logprobs, y, g, None, "renormalize", *distill)),
        (ops.distill_forward_grad, (x, t, y, None, *distill[:7], "mean", 0.0, 0.0, half)),
        (
            ops.distill_forward_grad_inplace,
            (x.clone(), t, y, None, *distill[:7], "sum", 0.0, 0.0, None),
        ),
        (
            ops.linear_distill_forward,
            (h, w, t, None, None, y, None, *distill, 0, False, True, False),
        ),
        (
            ops.linear_distill_backward,
            (h, w, None, h, w, y, g, None, *distill, 0, False, True, True),
        ),
    ]


def test_fake_kernels_agree_with_real_ones(device, gen):
    if not hasattr(torch.library, "opcheck"):
        pytest.skip("torch.library.opcheck needs torch >= 2.4")
    for op, args in _opcheck_cases(device, gen):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
