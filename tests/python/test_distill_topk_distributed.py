"""Vocabulary-parallel distill with a top-k teacher (xent.TopK, docs/semantics.md §3.1, §5) on the
CPU with gloo.

2 and 3 processes hold uneven slices of the student's vocabulary (V = 1031, one slice 7 wide)
and the same teacher (global ids, some absent, one row empty, ids at both ends of the vocabulary
and inside the narrow slice). Every mass with every kind it accepts, each reduction, ignored
rows, no target, temperature (renormalize), softcap, the hard-label term with its weights,
label smoothing, z-loss and class weights, a 3-D batch with a normalizer, and a small vocabulary
whose ids cover whole rows (no tail category) are run sharded and compared with the
single-process distill on the whole vocabulary (itself checked against float64 in
test_distill_topk.py): the loss, the no-grad loss and the gradient of the local slice, in float32,
float64 and bfloat16. Errors: bad ids, options the masses refuse. One spawn per world size.
"""

import pytest
import torch
from gloo_group import close as _close
from gloo_group import needs_gloo, run_group, slice_of

ROWS, VOCAB, K = 37, 1031, 24
SPLITS = {2: [500, 531], 3: [400, 7, 624]}
SMALL_VOCAB = 11  # k = SMALL_VOCAB + 3 (3 absent entries in each row): rows naming every column
SMALL_SPLITS = {2: [5, 6], 3: [4, 1, 6]}
MASS_KINDS = {
    "renormalize": ("forward_kl", "reverse_kl", "jsd", "soft_ce", "tvd"),
    "tail": ("forward_kl", "reverse_kl", "jsd", "soft_ce", "tvd"),
    "ignore": ("forward_kl", "soft_ce"),
}
OPTIONS = {
    "temperature": {"temperature": 0.7},
    "softcap": {"softcap": 4.0},
    "hard": {
        "hard_weight": 0.6,
        "soft_weight": 0.8,
        "label_smoothing": 0.1,
        "z_loss": 1e-3,
        "class_weight": None,
    },
    "beta": {"beta": 0.3},
    "no_target": {},
}


def _slice_of(rank, world, splits=SPLITS):
    return slice_of(splits[world], rank)


def _teacher(gen, student, vocab, k):
    """The top-k of a teacher correlated with the student, shuffled, with absent entries, one
    empty row, and (for the big vocabulary) ids 0, V − 1 and ids in the 7-wide slice [400, 407)."""
    teacher = student.double() + 0.7 * torch.randn(student.shape, generator=gen).double()
    logprobs, ids = torch.log_softmax(teacher, -1).topk(k, -1)
    order = torch.argsort(torch.rand(ids.shape, generator=gen), -1)
    ids, logprobs = ids.gather(1, order), logprobs.gather(1, order)
    if vocab == VOCAB:
        ids[3, :] = -1
        ids[3, :3] = torch.tensor([0, VOCAB - 1, 403])
        ids[4, :7] = torch.arange(400, 407)
        ids[4, 7:] = -1
    ids[1, 5:] = -1
    ids[2, :] = -1
    ids[5, ::3] = -1
    logprobs = torch.log_softmax(teacher, -1).gather(1, ids.clamp(min=0))
    return ids, logprobs


def _option_sets(mass):
    yield ()
    for name in OPTIONS:
        if name != "temperature" or mass == "renormalize":
            yield (name,)
    yield ("softcap", "hard") + (("temperature",) if mass == "renormalize" else ())


def _cases():
    """(dtype, mass, kind, option names) of the test."""
    for mass, kinds in MASS_KINDS.items():
        for kind in kinds:
            for names in _option_sets(mass):
                yield torch.float32, mass, kind, names
            yield torch.float64, mass, kind, ("softcap", "hard")
    yield torch.bfloat16, "tail", "jsd", ("hard",)


def _run_case(xent, group, rank, world, seed, case, shape):
    """One sharded call against the single-process one: loss, no-grad loss, local gradient."""
    dtype, mass, kind, names, reduction, vocab, splits = case
    begin, end = _slice_of(rank, world, splits)
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(*shape, vocab, generator=gen, dtype=torch.float64) * 2
    ids, logprobs = _teacher(gen, student.reshape(-1, vocab), vocab, K if vocab == VOCAB else vocab)
    if vocab == SMALL_VOCAB:
        ids = torch.cat([ids, torch.full((ids.shape[0], 3), -1)], 1)
        logprobs = torch.cat([logprobs, torch.zeros(ids.shape[0], 3, dtype=logprobs.dtype)], 1)
        order = torch.argsort(torch.rand(ids.shape, generator=gen), -1)
        ids, logprobs = ids.gather(1, order), logprobs.gather(1, order)
    ids, logprobs = ids.reshape(*shape, -1), logprobs.reshape(*shape, -1)
    if dtype != torch.float64:
        logprobs = logprobs.float()
    student = student.to(dtype)
    target = torch.randint(0, vocab, shape, generator=gen)
    target.view(-1)[::5] = -100
    target = None if "no_target" in names else target
    kwargs = {}
    for name in names:
        kwargs.update(OPTIONS[name])
    if "class_weight" in kwargs:
        kwargs["class_weight"] = torch.rand(vocab, generator=gen) + 0.5
    upstream = torch.randn(shape if reduction == "none" else (), generator=gen)
    teacher = xent.TopK(ids, logprobs, mass)
    tag = f"{dtype} {mass} {kind} {names} {reduction} V={vocab} shape={shape}"

    full = student.clone().requires_grad_()
    expected = xent.distill(
        full, target=target, teacher=teacher, kind=kind, reduction=reduction, **kwargs
    )
    (expected * upstream).sum().backward()

    sharded = dict(kwargs)
    if "class_weight" in kwargs:
        sharded["class_weight"] = kwargs["class_weight"][begin:end]
    if reduction == "sum" or vocab != VOCAB:  # the explicit layout
        sharded.update(vocab_offset=begin, vocab_size=vocab)
    local = student[..., begin:end].clone().requires_grad_()
    call = dict(target=target, teacher=teacher, kind=kind, reduction=reduction, **sharded)
    got = xent.distill(local, process_group=group, **call)
    (got * upstream).sum().backward()
    with torch.no_grad():
        plain = xent.distill(local.detach(), process_group=group, **call)
    if dtype == torch.bfloat16:  # one rounding of each gradient element to bfloat16
        _close(f"{tag} loss", got, expected)
        scale = full.grad.float().abs().amax().item()
        _close(f"{tag} grad", local.grad.float(), full.grad[..., begin:end].float(), 0, scale / 64)
        return
    _close(f"{tag} loss", got, expected)
    _close(f"{tag} no-grad loss", plain, expected)
    displacement = _tvd_tie_displacement(case, student, ids, logprobs, target, upstream, kwargs)
    if displacement == 0:
        _close(f"{tag} grad", local.grad, full.grad[..., begin:end])
        return
    # A near-tie of tvd may land on either side in each of the two fp32 ops: each is within twice
    # the midpoint's displacement of the exact gradient.
    difference = (local.grad.double() - full.grad[..., begin:end].double()).norm().item()
    bound = 2e-5 * full.grad[..., begin:end].double().norm().item() + 4 * displacement
    assert difference <= bound, f"{tag} grad: ‖difference‖ {difference} > {bound} (near-ties)"


def _tvd_tie_displacement(case, student, ids, logprobs, target, upstream, options):
    """‖∂ at tvd's kink midpoint − ∂ exact‖ of the whole float64 reference gradient for float32 tvd
    cases (0 for the others, and when no category is that close to its kink)."""
    import reference as ref

    dtype, mass, kind, _, reduction, vocab, _ = case
    if kind != "tvd" or dtype != torch.float32:
        return 0.0
    s64 = student.double().reshape(-1, vocab).requires_grad_()
    flat = (ids.reshape(s64.shape[0], -1), logprobs.double().reshape(s64.shape[0], -1))
    rows = None if target is None else target.reshape(-1)
    upstream = upstream.double().reshape(-1) if reduction == "none" else upstream.double()

    def grad_of(band):
        loss = ref.distill_topk(
            s64, *flat, rows, mass, kind=kind, reduction=reduction, tvd_tie_band=band, **options
        )
        return torch.autograd.grad(loss, [s64], upstream)[0]

    exact = grad_of(0.0)
    displacement = (grad_of(ref.fp32_tvd_tie_band(student)) - exact).norm().item()
    return displacement if displacement > 1e-9 * exact.norm().item() else 0.0  # float64 rounding


def _distill_cases(rank, world, group, base_seed):
    import xent

    seed = base_seed
    for dtype, mass, kind, names in _cases():
        for reduction in ("none", "sum", "mean"):
            seed += 1
            case = (dtype, mass, kind, names, reduction, VOCAB, SPLITS)
            _run_case(xent, group, rank, world, seed, case, (ROWS,))
    for mass, kinds in MASS_KINDS.items():
        for kind in kinds:  # ids covering whole rows: no tail category there
            seed += 1
            case = (torch.float64, mass, kind, ("hard",), "mean", SMALL_VOCAB, SMALL_SPLITS)
            _run_case(xent, group, rank, world, seed, case, (ROWS,))
    seed += 1  # a (B, T, V) batch with a normalizer
    case = (torch.float32, "tail", "reverse_kl", ("hard",), "sum", VOCAB, SPLITS)
    _run_case(xent, group, rank, world, seed, case, (3, 5))
    begin, end = _slice_of(rank, world)
    gen = torch.Generator().manual_seed(seed + 1)
    student = torch.randn(2, 4, VOCAB, generator=gen)
    ids, logprobs = _teacher(gen, student.reshape(8, VOCAB), VOCAB, K)
    teacher = xent.TopK(ids.reshape(2, 4, K), logprobs.float().reshape(2, 4, K), "tail")
    full = student.clone().requires_grad_()
    expected = xent.distill(full, teacher=teacher, kind="jsd", reduction="sum", normalizer=6.0)
    expected.backward()
    local = student[..., begin:end].clone().requires_grad_()
    got = xent.distill(
        local, teacher=teacher, kind="jsd", reduction="sum", normalizer=6.0, process_group=group
    )
    got.backward()
    _close("3-D normalizer loss", got, expected)
    _close("3-D normalizer grad", local.grad, full.grad[..., begin:end])


def _error_cases(rank, world, group):
    import xent

    begin, end = _slice_of(rank, world)
    gen = torch.Generator().manual_seed(7)
    student = torch.randn(ROWS, VOCAB, generator=gen)
    ids, logprobs = _teacher(gen, student, VOCAB, K)
    logprobs = logprobs.float()
    local = student[:, begin:end].clone().requires_grad_()
    target = torch.randint(0, VOCAB, (ROWS,), generator=gen)

    def call(teacher, **kwargs):
        return xent.distill(local, target=target, teacher=teacher, process_group=group, **kwargs)

    twice = ids.clone()
    twice[6, 4] = twice[6, 1]
    with pytest.raises(ValueError, match=r"teacher.ids has a duplicate id: got ids\[6, 4\]"):
        call(xent.TopK(twice, logprobs))
    beyond = ids.clone()
    beyond[8, 2] = VOCAB
    with pytest.raises(ValueError, match=r"teacher.ids out of range: got ids\[8, 2\] = 1031"):
        call(xent.TopK(beyond, logprobs))
    with pytest.raises(ValueError, match="teacher.ids wrong dtype"):
        call(xent.TopK(ids.float(), logprobs))
    with pytest.raises(ValueError, match="temperature"):
        call(xent.TopK(ids, logprobs, "tail"), temperature=0.5)
    with pytest.raises(ValueError, match="kind"):
        call(xent.TopK(ids, logprobs, "ignore"), kind="jsd")
    with pytest.raises(ValueError, match="inplace_backward"):
        call(xent.TopK(ids, logprobs), inplace_backward=True)
    with pytest.raises(ValueError, match="softcap out of range"):
        call(xent.TopK(ids, logprobs), softcap=-1.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        call(xent.TopK(ids, logprobs), label_smoothing=2.0)
    with pytest.raises(ValueError, match="logprobs"):
        call(xent.TopK(ids, logprobs.abs() + 1))
    wrong = target.clone()
    wrong[3] = VOCAB
    with pytest.raises(ValueError, match=r"target out of range: got target\[3\] = 1031"):
        xent.distill(local, target=wrong, teacher=xent.TopK(ids, logprobs), process_group=group)
    with pytest.raises(ValueError, match="target missing"):
        xent.distill(local, teacher=xent.TopK(ids, logprobs), hard_weight=0.5, process_group=group)
    with pytest.raises(ValueError, match="vocab_offset"):
        call(xent.TopK(ids, logprobs), vocab_offset=VOCAB, vocab_size=VOCAB)
    _bad_rows_on_a_gpu(xent, group, local, target, twice, beyond, logprobs)
    with pytest.raises(TypeError, match="process_group"):
        xent.linear_distill(
            torch.randn(ROWS, 8),
            torch.randn(end - begin, 8),
            target=target,
            teacher=xent.TopK(ids, logprobs),
            process_group=group,
        )


def _bad_rows_on_a_gpu(xent, group, local, target, twice, beyond, logprobs):
    """What a GPU does with bad ids (no host check): the row's loss is NaN, and so is its
    gradient where §3.1's reaches (every column under tail); the other rows are untouched."""
    import xent._sharded_topk as sharded

    checked = sharded._raise_bad_id
    sharded._raise_bad_id = lambda *args: None
    try:
        for ids, row in ((twice, 6), (beyond, 8)):
            local.grad = None
            loss = xent.distill(
                local,
                target=target,
                teacher=xent.TopK(ids, logprobs, "tail"),
                reduction="none",
                process_group=group,
            )
            loss.sum().backward()
            others = torch.arange(ROWS) != row
            assert torch.isnan(loss[row]) and torch.isfinite(loss[others]).all()
            assert torch.isnan(local.grad[row]).all()
            assert torch.isfinite(local.grad[others]).all()
    finally:
        sharded._raise_bad_id = checked
    local.grad = None


def _all_cases(rank, world, group, base_seed):
    _distill_cases(rank, world, group, base_seed)
    _error_cases(rank, world, group)


@needs_gloo
@pytest.mark.parametrize("world", [2, 3])
def test_topk_distill_vocabulary_parallel_matches_single_process(world, gen):
    base_seed = int(torch.randint(0, 2**30, (), generator=gen))
    run_group(world, _all_cases, (base_seed,))
