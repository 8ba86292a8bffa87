"""CUDA-only behaviour: agreement with the CPU backend on identical inputs, CUDA-graph capture
(no host synchronisation inside the ops), the current stream, and memory of the fused form."""

import pytest
import reference as ref
import torch

import xent

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


def _same_on_cpu_and_cuda(fn, tensors, tol):
    results = []
    for device in ("cpu", "cuda"):
        inputs = [t.detach().to(device).requires_grad_(t.is_floating_point()) for t in tensors]
        loss = fn(*inputs)
        loss.sum().backward()
        results.append([loss.detach().cpu()] + [t.grad.cpu() for t in inputs if t.grad is not None])
    for cpu_value, cuda_value in zip(*results):
        assert ref.rel_error(cuda_value, cpu_value) <= tol


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_every_op_agrees_with_the_cpu_backend(gen, reduction):
    rows, hidden, vocab = 67, 96, 3001
    x = ref.randn(gen, rows, vocab, scale=2.0)
    t = ref.randn(gen, rows, vocab, scale=2.0)
    h = ref.randn(gen, rows, hidden)
    w = ref.randn(gen, vocab, hidden, scale=0.1)
    y = ref.targets(gen, rows, vocab)
    options = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3, softcap=20.0)
    _same_on_cpu_and_cuda(lambda x, y: xent.cross_entropy(x, y, **options), [x, y], 1e-5)
    _same_on_cpu_and_cuda(
        lambda x, t, y: xent.distill(x, t.detach(), y, kind="jsd", reduction=reduction),
        [x, t, y],
        1e-5,
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    _same_on_cpu_and_cuda(
        lambda h, w, y: xent.linear_cross_entropy(h, w, y, **options), [h, w, y], 1e-4
    )
    _same_on_cpu_and_cuda(
        lambda h, w, t, y: xent.linear_distill(
            h, w, t.detach(), y, kind="reverse_kl", reduction=reduction
        ),
        [h, w, t, y],
        1e-4,
    )
    _same_on_cpu_and_cuda(
        lambda x, y: _policy_terms(xent.logprobs(x, y, temperature=0.7, return_entropy=True)),
        [x, y],
        1e-5,
    )
    _same_on_cpu_and_cuda(
        lambda h, w, y: _policy_terms(
            xent.linear_logprobs(h, w, y, temperature=0.7, return_entropy=True)
        ),
        [h, w, y],
        1e-4,
    )


def _policy_terms(logprob_and_entropy):
    """Per-row logprob and entropy in one differentiable value with both gradients nonzero."""
    logprob, entropy = logprob_and_entropy
    return 0.7 * logprob + entropy


def _capture(step):
    """Warms `step` up on a side stream, captures it in a CUDA graph, returns (graph, outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


@pytest.mark.parametrize(
    "op",
    [
        "cross_entropy",
        "linear_cross_entropy",
        "distill",
        "linear_distill",
        "linear_logprobs",
        "policy_loss",
        "linear_policy_loss",
    ],
)
def test_cuda_graph_capture_and_replay(gen, op):
    rows, hidden, vocab = 256, 128, 8192
    x = ref.randn(gen, rows, vocab, device="cuda", dtype=torch.bfloat16).requires_grad_()
    t = ref.randn(gen, rows, vocab, device="cuda", dtype=torch.bfloat16)
    h = ref.randn(gen, rows, hidden, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = ref.randn(
        gen, vocab, hidden, device="cuda", dtype=torch.bfloat16, scale=0.1
    ).requires_grad_()
    y = ref.targets(gen, rows, vocab, "cuda")
    # Per-token data of the policy losses around a typical logprob, so ratios spread over the
    # clip range: advantages, old and reference logprobs.
    data = [ref.randn(gen, rows, device="cuda") for _ in range(3)]

    def refresh_data():
        advantages, old, reference = data
        old.copy_(torch.randn_like(old) * 0.3 - 9.5)
        reference.copy_(old + torch.randn_like(old) * 0.1)

    refresh_data()
    policy = dict(clip_high=0.28, kl_coef=0.04, entropy_coef=0.01, temperature=0.7)

    def policy_options():
        return dict(advantages=data[0], old_logprobs=data[1], ref_logprobs=data[2], **policy)

    calls = {
        "cross_entropy": (lambda: xent.cross_entropy(x, y, z_loss=1e-4), [x]),
        "linear_cross_entropy": (lambda: xent.linear_cross_entropy(h, w, y), [h, w]),
        "distill": (lambda: xent.distill(x, t, y, kind="forward_kl"), [x]),
        "linear_distill": (lambda: xent.linear_distill(h, w, t, y), [h, w]),
        "linear_logprobs": (
            lambda: _policy_terms(
                xent.linear_logprobs(h, w, y, temperature=0.7, return_entropy=True)
            ).sum(),
            [h, w],
        ),
        "policy_loss": (lambda: xent.policy_loss(x, y, **policy_options()), [x]),
        "linear_policy_loss": (
            lambda: xent.linear_policy_loss(h, w, y, **policy_options()),
            [h, w],
        ),
    }
    loss_of, inputs = calls[op]

    def step():
        loss = loss_of()
        return (loss,) + torch.autograd.grad(loss, inputs)

    graph, captured = _capture(step)
    # New values in the same buffers: the replay must see them (nothing was baked in).
    with torch.no_grad():
        for tensor in (x, t, h, w):
            tensor.copy_(torch.randn_like(tensor) * (0.1 if tensor is w else 1.0))
        y.copy_(ref.targets(gen, rows, vocab, "cuda"))
        data[0].copy_(torch.randn_like(data[0]))
        refresh_data()
    graph.replay()
    torch.cuda.synchronize()
    expected = step()
    for got, want in zip(captured, expected):
        assert ref.rel_error(got, want) <= 1e-5


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_cuda_graph_capture_of_accumulate_into(gen, scale):
    """Under capture the backward cannot read the upstream gradient, so it always runs the
    correction of the forward-added weight gradient: a replay adds scale·∂W for either scale."""
    rows, hidden, vocab = 256, 128, 8192
    h = ref.randn(gen, rows, hidden, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = ref.randn(
        gen, vocab, hidden, device="cuda", dtype=torch.bfloat16, scale=0.1
    ).requires_grad_()
    y = ref.targets(gen, rows, vocab, "cuda")
    buffer = torch.zeros(vocab, hidden, device="cuda")

    def step():
        loss = xent.linear_cross_entropy(h, w, y, accumulate_into=buffer)
        return (loss,) + torch.autograd.grad(scale * loss, [h])

    graph, captured = _capture(step)
    buffer.zero_()
    graph.replay()
    torch.cuda.synchronize()
    replayed = buffer.clone()
    buffer.zero_()
    expected = step()  # eager: reads the upstream gradient
    assert ref.rel_error(replayed, buffer) <= 1e-5 and buffer.abs().sum() > 0
    for got, want in zip(captured, expected):
        assert ref.rel_error(got, want) <= 1e-5
    assert w.grad is None


def test_ops_run_on_the_current_stream(gen):
    x = ref.randn(gen, 512, 4099, device="cuda")
    y = ref.targets(gen, 512, 4099, "cuda")
    expected = xent.cross_entropy(x, y)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        loss = xent.cross_entropy(x, y)
    torch.cuda.current_stream().wait_stream(stream)
    torch.testing.assert_close(loss, expected)


def test_fused_form_stays_within_its_workspace_budget():
    rows, hidden, vocab = 4096, 256, 65536
    h = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * 0.05).requires_grad_()
    y = torch.randint(0, vocab, (rows,), device="cuda")
    budget = 128 << 20
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    xent.linear_cross_entropy(h, w, y, workspace_bytes=budget).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    gradients = (h.numel() + w.numel()) * 2
    accumulator = vocab * hidden * 4  # fp32 ∂W accumulated across chunks (docs/semantics.md §2)
    # The gradients (formed in the forward, scaled in place by the backward), the fp32
    # accumulator and the chunk buffers within the budget, with a little slack; the bf16 logits
    # alone would be 512 MiB, their fp32 upcast 1 GiB.
    allowed = gradients + accumulator + budget + (32 << 20)
    assert extra <= allowed, (extra, allowed)
