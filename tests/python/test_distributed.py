"""Vocabulary-parallel xent over torch.distributed (docs/semantics.md §5) on the CPU with gloo.

2 and 3 processes each hold an uneven slice of the vocabulary (V = 1031); every option of §1 is
run sharded and compared with the single-process xent result on the whole vocabulary: the loss,
the statistics and the gradient (of the local slice for ce; ∂hidden, the local rows of ∂W and
∂bias for linear_cross_entropy). distill: every kind with each option of §3 (temperature,
softcap, β, the hard term with smoothing and z-loss, class weights, no target) and all at once,
every reduction, fp32 and fp64, loss and the gradient of the local student slice. All cases run inside one spawn per world size, so the suite
pays the process start-up twice.
"""

import pytest
import torch
import torch.distributed as dist
from gloo_group import close as _close
from gloo_group import needs_gloo, run_group, sharded_head, slice_of

ROWS, VOCAB, HIDDEN = 37, 1031, 67
SPLITS = {2: [500, 531], 3: [400, 7, 624]}
OPTIONS = {
    "label_smoothing": 0.1,
    "z_loss": 1e-3,
    "softcap": 3.0,
    "logit_scale": 0.7,
    "class_weight": None,  # built per case
    "row_weight": None,
}
STATS = ("lse", "logprob", "entropy", "argmax", "accuracy", "z_loss")


def _option_sets():
    yield ()
    for name in OPTIONS:
        yield (name,)
    yield tuple(OPTIONS)


def _kwargs(gen, names):
    kwargs = {}
    for name in names:
        if name == "class_weight":
            kwargs[name] = torch.rand(VOCAB, generator=gen) + 0.5
        elif name == "row_weight":
            kwargs[name] = torch.rand(ROWS, generator=gen) * 2 - 0.5
        else:
            kwargs[name] = OPTIONS[name]
    return kwargs


def _targets(gen):
    target = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    target[::5] = -100
    target[1] = 0
    target[2] = VOCAB - 1
    return target


def _compare_result(tag, got, expected):
    _close(f"{tag} loss", got.loss, expected.loss)
    for name in STATS:
        a, b = getattr(got, name), getattr(expected, name)
        if name == "argmax":
            assert torch.equal(a, b), f"{tag} argmax differs"
        else:
            _close(f"{tag} {name}", a, b)


def _slice_of(rank, world):
    return slice_of(SPLITS[world], rank)


def _ce_cases(rank, world, group):
    import xent

    begin, end = _slice_of(rank, world)
    case = 0
    cases = [(torch.float32, names) for names in _option_sets()]
    cases.append((torch.float64, tuple(OPTIONS)))
    for dtype, names in cases:
        for reduction in ("none", "sum", "mean"):
            case += 1
            gen = torch.Generator().manual_seed(1000 + case)
            logits = torch.randn(ROWS, VOCAB, generator=gen, dtype=torch.float64) * 2
            logits = logits.to(dtype)
            target = _targets(gen)
            for n in range(0, ROWS, 3):
                if target[n] >= 0:
                    logits[n, target[n]] += 6
            kwargs = _kwargs(gen, names)
            upstream = torch.randn(ROWS if reduction == "none" else (), generator=gen)
            tag = f"ce {dtype} {names} {reduction}"

            full = logits.clone().requires_grad_()
            expected = xent.cross_entropy(
                full, target, reduction=reduction, return_stats=True, **kwargs
            )
            (expected.loss * upstream).sum().backward()

            local = logits[:, begin:end].clone().requires_grad_()
            sharded_kwargs = dict(kwargs)
            if "class_weight" in kwargs:
                sharded_kwargs["class_weight"] = kwargs["class_weight"][begin:end]
            if names == tuple(OPTIONS):  # the explicit layout once per reduction and dtype
                sharded_kwargs.update(vocab_offset=begin, vocab_size=VOCAB)
            got = xent.cross_entropy(
                local,
                target,
                reduction=reduction,
                return_stats=True,
                process_group=group,
                **sharded_kwargs,
            )
            (got.loss * upstream).sum().backward()
            _compare_result(tag, got, expected)
            _close(f"{tag} grad", local.grad, full.grad[:, begin:end])

            # Without autograd (no grad wanted) the loss is the same.
            with torch.no_grad():
                plain = xent.cross_entropy(
                    local.detach(),
                    target,
                    reduction=reduction,
                    process_group=group,
                    **sharded_kwargs,
                )
            _close(f"{tag} no-grad loss", plain, expected.loss)


def _linear_cases(rank, world, group):
    import xent

    begin, end = _slice_of(rank, world)
    case = 0
    # Every option set in one chunk; every option at once also in several row chunks, in the
    # default schedule (gradient per chunk in the forward for sum/mean; two passes for none and
    # for mean with class weights and z-loss), and in the two-pass one (grad_in_forward=False),
    # its logits recomputed in the backward or kept (sum).
    cases = [(names, None, True) for names in _option_sets()]
    cases.append((tuple(OPTIONS), 20 * VOCAB * 4, True))
    cases.append((tuple(OPTIONS), 20 * VOCAB * 4, False))
    cases.append((("class_weight", "label_smoothing"), 20 * VOCAB * 4, True))
    for names, workspace_bytes, in_forward in cases:
        for reduction in ("none", "sum", "mean"):
            cache = workspace_bytes is not None and reduction == "sum" and not in_forward
            case += 1
            gen = torch.Generator().manual_seed(5000 + case)
            hidden = torch.randn(ROWS, HIDDEN, generator=gen)
            weight = torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN**0.5 * 2
            bias = torch.randn(VOCAB, generator=gen) * 0.1
            target = _targets(gen)
            kwargs = _kwargs(gen, names)
            upstream = torch.randn(ROWS if reduction == "none" else (), generator=gen)
            tag = f"linear_ce {names} {reduction} budget={workspace_bytes} {in_forward}"

            h_full = hidden.clone().requires_grad_()
            w_full = weight.clone().requires_grad_()
            b_full = bias.clone().requires_grad_()
            expected = xent.linear_cross_entropy(
                h_full, w_full, target, b_full, reduction=reduction, return_stats=True, **kwargs
            )
            (expected.loss * upstream).sum().backward()

            h = hidden.clone().requires_grad_()
            w = weight[begin:end].clone().requires_grad_()
            b = bias[begin:end].clone().requires_grad_()
            sharded_kwargs = dict(kwargs)
            if "class_weight" in kwargs:
                sharded_kwargs["class_weight"] = kwargs["class_weight"][begin:end]
            got = xent.linear_cross_entropy(
                h,
                w,
                target,
                b,
                reduction=reduction,
                return_stats=True,
                process_group=group,
                workspace_bytes=workspace_bytes,
                cache_logits=cache,
                grad_in_forward=in_forward,
                **sharded_kwargs,
            )
            (got.loss * upstream).sum().backward()
            _compare_result(tag, got, expected)
            _close(f"{tag} grad hidden", h.grad, h_full.grad, rtol=1e-4, atol=1e-5)
            _close(f"{tag} grad weight", w.grad, w_full.grad[begin:end], rtol=1e-4, atol=1e-5)
            _close(f"{tag} grad bias", b.grad, b_full.grad[begin:end], rtol=1e-4, atol=1e-5)

    # reduce_hidden_grad=False: each rank's ∂hidden is partial; their sum is the full one.
    gen = torch.Generator().manual_seed(9000)
    hidden = torch.randn(ROWS, HIDDEN, generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN**0.5
    target = _targets(gen)
    h_full = hidden.clone().requires_grad_()
    xent.linear_cross_entropy(h_full, weight, target).backward()
    h = hidden.clone().requires_grad_()
    xent.linear_cross_entropy(
        h, weight[begin:end], target, process_group=group, reduce_hidden_grad=False
    ).backward()
    partial = h.grad.clone()
    dist.all_reduce(partial, group=group)
    _close("partial grad hidden, summed", partial, h_full.grad, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(h.grad, h_full.grad), "reduce_hidden_grad=False reduced anyway"


DISTILL_KINDS = ("forward_kl", "reverse_kl", "jsd", "soft_ce", "tvd")
DISTILL_OPTIONS = {
    "temperature": {"temperature": 2.0},
    "softcap": {"softcap": 4.5},
    "beta": {"beta": 0.25},
    "hard": {
        "hard_weight": 0.375,
        "soft_weight": 0.625,
        "label_smoothing": 0.125,
        "z_loss": 0.0625,
    },
    "class_weight": {"hard_weight": 0.5, "label_smoothing": 0.1, "class_weight": None},
    "no_target": {},
}


def _distill_option_sets():
    yield ()
    for name in DISTILL_OPTIONS:
        yield (name,)
    yield ("temperature", "softcap", "hard", "class_weight")


def _distill_cases(rank, world, group):
    import xent

    begin, end = _slice_of(rank, world)
    case = 0
    cases = [
        (torch.float32, kind, names) for kind in DISTILL_KINDS for names in _distill_option_sets()
    ]
    cases += [(torch.float64, kind, ("temperature", "hard")) for kind in DISTILL_KINDS]
    for dtype, kind, names in cases:
        for reduction in ("none", "sum", "mean"):
            case += 1
            gen = torch.Generator().manual_seed(3000 + case)
            student = torch.randn(ROWS, VOCAB, generator=gen, dtype=torch.float64) * 2
            teacher = student + torch.randn(ROWS, VOCAB, generator=gen, dtype=torch.float64)
            student, teacher = student.to(dtype), teacher.to(dtype)
            target = None if "no_target" in names else _targets(gen)
            kwargs = {}
            for name in names:
                kwargs.update(DISTILL_OPTIONS[name])
            if "class_weight" in kwargs:
                kwargs["class_weight"] = torch.rand(VOCAB, generator=gen) + 0.5
            upstream = torch.randn(ROWS if reduction == "none" else (), generator=gen)
            tag = f"distill {kind} {dtype} {names} {reduction}"

            full = student.clone().requires_grad_()
            expected = xent.distill(full, teacher, target, kind=kind, reduction=reduction, **kwargs)
            (expected * upstream).sum().backward()

            local = student[:, begin:end].clone().requires_grad_()
            sharded_kwargs = dict(kwargs)
            if "class_weight" in kwargs:
                sharded_kwargs["class_weight"] = kwargs["class_weight"][begin:end]
            if reduction == "sum":  # the explicit layout once per case
                sharded_kwargs.update(vocab_offset=begin, vocab_size=VOCAB)
            got = xent.distill(
                local,
                teacher[:, begin:end],
                target,
                kind=kind,
                reduction=reduction,
                process_group=group,
                **sharded_kwargs,
            )
            (got * upstream).sum().backward()
            _close(f"{tag} loss", got, expected)
            _close(f"{tag} grad", local.grad, full.grad[:, begin:end])

            with torch.no_grad():
                plain = xent.distill(
                    local.detach(),
                    teacher[:, begin:end],
                    target,
                    kind=kind,
                    reduction=reduction,
                    process_group=group,
                    **sharded_kwargs,
                )
            _close(f"{tag} no-grad loss", plain, expected)

    # normalizer (reduction sum) and a 3-D (B, T, V) batch, sharded like the 2-D one.
    gen = torch.Generator().manual_seed(3999)
    student = torch.randn(2, 5, VOCAB, generator=gen)
    teacher = torch.randn(2, 5, VOCAB, generator=gen)
    full = student.clone().requires_grad_()
    expected = xent.distill(full, teacher, kind="jsd", reduction="sum", normalizer=7.0)
    expected.backward()
    local = student[..., begin:end].clone().requires_grad_()
    got = xent.distill(
        local,
        teacher[..., begin:end],
        kind="jsd",
        reduction="sum",
        normalizer=7.0,
        process_group=group,
    )
    got.backward()
    _close("distill 3-D normalizer loss", got, expected)
    _close("distill 3-D normalizer grad", local.grad, full.grad[..., begin:end])


def _error_cases(rank, world, group):
    import xent

    begin, end = _slice_of(rank, world)
    logits = torch.randn(ROWS, end - begin)
    target = _targets(torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="vocab_offset"):
        xent.distill(
            logits, logits, target, process_group=group, vocab_offset=VOCAB, vocab_size=VOCAB
        )
    with pytest.raises(ValueError, match="teacher"):
        xent.distill(logits, logits[:, :-1], target, process_group=group)
    with pytest.raises(ValueError, match="vocab_offset"):
        xent.cross_entropy(
            logits, target, process_group=group, vocab_offset=VOCAB, vocab_size=VOCAB
        )
    weight = sharded_head(world, VOCAB, HIDDEN)
    if weight is None:
        return
    with pytest.raises(TypeError, match="DTensor"):
        xent.linear_cross_entropy(torch.randn(ROWS, HIDDEN), weight, target, process_group=group)


def _new_group_cases(rank, world, group):
    """Groups made and destroyed one after another over the same ranks, the last rank's slice the
    same size each time but at another offset of another vocabulary: each call finds its own
    group's layout (layouts are learned per group object, not per address, which a later group
    may reuse), and a destroyed group leaves no entry behind."""
    import gc

    import xent
    import xent._vocab_parallel as vocab_parallel

    gen = torch.Generator().manual_seed(77)
    known = len(vocab_parallel._GROUP_FACTS)
    for first in (500, 300, 11):
        splits = [first] + SPLITS[world][1:]
        vocab = sum(splits)
        logits = torch.randn(ROWS, vocab, generator=gen, dtype=torch.float64)
        target = torch.randint(0, vocab, (ROWS,), generator=gen)
        expected = xent.cross_entropy(logits, target, reduction="none")
        other = dist.new_group(list(range(world)))
        begin, end = slice_of(splits, rank)
        got = xent.cross_entropy(
            logits[:, begin:end], target, reduction="none", process_group=other
        )
        _close(f"new group {splits} loss", got, expected)
        dist.destroy_process_group(other)
        del other
        gc.collect()
        assert len(vocab_parallel._GROUP_FACTS) == known, "a destroyed group's layout was kept"


def _all_cases(rank, world, group):
    _ce_cases(rank, world, group)
    _linear_cases(rank, world, group)
    _distill_cases(rank, world, group)
    _error_cases(rank, world, group)
    _new_group_cases(rank, world, group)


@needs_gloo
@pytest.mark.parametrize("world", [2, 3])
def test_vocabulary_parallel_matches_single_process(world):
    run_group(world, _all_cases)
