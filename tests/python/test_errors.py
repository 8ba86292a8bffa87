"""Bad arguments surface as ValueError naming the argument and the offending value; environment
failures and misuse of autograd as RuntimeError."""

import pytest
import torch

import xent

X = torch.randn(5, 7)
Y = torch.tensor([0, 1, 2, 3, 4])
H = torch.randn(5, 3)
W = torch.randn(7, 3)
T = torch.randn(5, 7)

CASES = [
    # (call, argument named, offending value shown)
    (lambda: xent.cross_entropy(X, Y, label_smoothing=1.5), "label_smoothing", "1.5"),
    (lambda: xent.cross_entropy(X, Y, z_loss=-1.0), "z_loss", "-1"),
    (lambda: xent.cross_entropy(X, Y, softcap=0.0), "softcap", "0"),
    (lambda: xent.cross_entropy(X, Y, softcap=-2.0), "softcap", "-2"),
    (lambda: xent.cross_entropy(X, Y, logit_scale=0.0), "logit_scale", "0"),
    (lambda: xent.cross_entropy(X, Y, logit_scale=float("inf")), "logit_scale", "inf"),
    (lambda: xent.cross_entropy(X, torch.tensor([0, 1, 2, 3, 9])), "target", "9"),
    (lambda: xent.cross_entropy(X, torch.tensor([0, -1, 2, 3, 4])), "target", "-1"),
    (lambda: xent.cross_entropy(X, Y.float()), "target", "float32"),
    (lambda: xent.cross_entropy(X.to(torch.int8), Y), "logits", "int8"),
    (lambda: xent.cross_entropy(X, Y[:4]), "target", "(4,)"),
    (lambda: xent.cross_entropy(X[0], Y[0]), "logits", "1-D"),
    (lambda: xent.cross_entropy(torch.randn(5, 0), Y), "logits", "0"),
    (lambda: xent.cross_entropy(X, Y, class_weight=torch.ones(6)), "class_weight", "6"),
    (lambda: xent.cross_entropy(X, Y, class_weight=-torch.ones(7)), "class_weight", "-1"),
    (lambda: xent.cross_entropy(X, Y, row_weight=torch.ones(4)), "row_weight", "(4,)"),
    (
        lambda: xent.cross_entropy(X, Y, torch.ones(7), class_weight=torch.ones(7)),
        "class_weight",
        "both",
    ),
    (lambda: xent.cross_entropy(X, Y, reduction="avg"), "reduction", "avg"),
    (lambda: xent.nn.CrossEntropyLoss(reduction="avg")(X, Y), "reduction", "avg"),
    (lambda: xent.distill(X, T, Y, temperature=0.0), "temperature", "0"),
    (lambda: xent.distill(X, T, Y, kind="jsd", beta=2.0), "beta", "2"),
    (lambda: xent.distill(X, T, None, hard_weight=1.0), "target", "absent"),
    (lambda: xent.distill(X, torch.randn(5, 8), Y), "teacher_logits", "(5, 8)"),
    (lambda: xent.distill(X, T.double(), Y), "teacher", "float64"),
    (lambda: xent.distill(X, T, Y, kind="kl"), "kind", "kl"),
    (lambda: xent.distill(X, T, torch.tensor([0, 1, 2, 3, 70])), "target", "70"),
    (lambda: xent.linear_cross_entropy(H, torch.randn(7, 4), Y), "weight", "[7, 4]"),
    (lambda: xent.linear_cross_entropy(H, W, Y, torch.randn(6)), "bias", "[6]"),
    (lambda: xent.linear_cross_entropy(H, W.double(), Y), "weight", "float64"),
    (lambda: xent.linear_cross_entropy(H, W, Y, workspace_bytes=16), "workspace", "16"),
    (lambda: xent.linear_cross_entropy(H, W, Y, workspace_bytes=-5), "workspace_bytes", "-5"),
    (lambda: xent.linear_cross_entropy(H, W, Y, label_smoothing=-0.1), "label_smoothing", "-0.1"),
    (lambda: xent.linear_cross_entropy(H, W, torch.tensor([0, 1, 2, 3, 7])), "target", "7"),
    (
        lambda: xent.linear_distill(H, W, T, Y, teacher_hidden=H, teacher_weight=W),
        "teacher",
        "both",
    ),
    (lambda: xent.linear_distill(H, W, None, Y), "teacher", "neither"),
    (lambda: xent.linear_distill(H, W, T, Y, temperature=-1.0), "temperature", "-1"),
]


def _value_error(call) -> str:
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


@pytest.mark.parametrize(
    "call,argument,value", CASES, ids=[f"{i}-{case[1]}" for i, case in enumerate(CASES)]
)
def test_value_errors_name_the_argument(call, argument, value):
    message = _value_error(call)
    assert argument in message and value in message, message
    # The project's format: "<function>: <argument> <problem>: got <value>; expected <...>".
    assert ": got " in message and "; expected " in message, message


# Every argument the core (or the binding over it) can name, reached through each public
# function: the message must start with that function and the Python keyword, whatever the C++
# API calls them (ce_forward, workspace_budget, student, teacher.logits, ...).
I8 = torch.int8
NAMED = [
    # (call, function, keyword)
    (lambda: xent.cross_entropy(X.to(I8), Y), "cross_entropy", "logits"),
    (lambda: xent.cross_entropy(torch.randn(5, 0), Y), "cross_entropy", "logits"),
    (lambda: xent.cross_entropy(X, Y.float()), "cross_entropy", "target"),
    (lambda: xent.cross_entropy(X, Y + 5), "cross_entropy", "target"),
    (lambda: xent.cross_entropy(X, Y, label_smoothing=2.0), "cross_entropy", "label_smoothing"),
    (lambda: xent.cross_entropy(X, Y, z_loss=-1.0), "cross_entropy", "z_loss"),
    (lambda: xent.cross_entropy(X, Y, softcap=-1.0), "cross_entropy", "softcap"),
    (lambda: xent.cross_entropy(X, Y, logit_scale=0.0), "cross_entropy", "logit_scale"),
    (lambda: xent.cross_entropy(X, Y, class_weight=torch.ones(3)), "cross_entropy", "class_weight"),
    (
        lambda: xent.cross_entropy(X, Y, class_weight=-torch.ones(7)),
        "cross_entropy",
        "class_weight",
    ),
    (lambda: xent.linear_cross_entropy(H.to(I8), W, Y), "linear_cross_entropy", "hidden"),
    (lambda: xent.linear_cross_entropy(H, W[:, :2], Y), "linear_cross_entropy", "weight"),
    (lambda: xent.linear_cross_entropy(H, W[:0], Y), "linear_cross_entropy", "weight"),
    (lambda: xent.linear_cross_entropy(H, W, Y, torch.randn(3)), "linear_cross_entropy", "bias"),
    (
        lambda: xent.linear_cross_entropy(H, W, Y, torch.randn(7).double()),
        "linear_cross_entropy",
        "bias",
    ),
    (lambda: xent.linear_cross_entropy(H, W, Y.float()), "linear_cross_entropy", "target"),
    (lambda: xent.linear_cross_entropy(H, W, Y + 5), "linear_cross_entropy", "target"),
    (
        lambda: xent.linear_cross_entropy(H, W, Y, workspace_bytes=16),
        "linear_cross_entropy",
        "workspace_bytes",
    ),
    (lambda: xent.linear_cross_entropy(H, W, Y, z_loss=-1.0), "linear_cross_entropy", "z_loss"),
    (lambda: xent.linear_cross_entropy(H, W, Y, softcap=0.0), "linear_cross_entropy", "softcap"),
    (
        lambda: xent.linear_cross_entropy(H, W, Y, logit_scale=-1.0),
        "linear_cross_entropy",
        "logit_scale",
    ),
    (
        lambda: xent.linear_cross_entropy(H, W, Y, class_weight=torch.ones(2)),
        "linear_cross_entropy",
        "class_weight",
    ),
    (lambda: xent.distill(X.to(I8), T, Y), "distill", "student_logits"),
    (lambda: xent.distill(torch.randn(5, 0), torch.randn(5, 0), Y), "distill", "student_logits"),
    (lambda: xent.distill(X, T.double(), Y), "distill", "teacher_logits"),
    (lambda: xent.distill(X, T, Y + 5), "distill", "target"),
    (lambda: xent.distill(X, T, None, hard_weight=1.0), "distill", "target"),
    (lambda: xent.distill(X, T, Y, temperature=0.0), "distill", "temperature"),
    (lambda: xent.distill(X, T, Y, beta=1.5), "distill", "beta"),
    (lambda: xent.distill(X, T, Y, softcap=0.0), "distill", "softcap"),
    (lambda: xent.distill(X, T, Y, soft_weight=-1.0), "distill", "soft_weight"),
    (lambda: xent.distill(X, T, Y, hard_weight=-1.0), "distill", "hard_weight"),
    (
        lambda: xent.distill(X, T, Y, hard_weight=1.0, label_smoothing=2.0),
        "distill",
        "label_smoothing",
    ),
    (lambda: xent.distill(X, T, Y, z_loss=-1.0), "distill", "z_loss"),
    (lambda: xent.distill(X, T, Y, class_weight=torch.ones(2)), "distill", "class_weight"),
    (lambda: xent.linear_distill(H.to(I8), W, T, Y), "linear_distill", "student_hidden"),
    (lambda: xent.linear_distill(H, W[:, :2], T, Y), "linear_distill", "student_weight"),
    (
        lambda: xent.linear_distill(H, W, None, Y),
        "linear_distill",
        "teacher_logits or teacher_hidden",
    ),
    (
        lambda: xent.linear_distill(H, W, T, Y, teacher_hidden=H, teacher_weight=W),
        "linear_distill",
        "teacher_logits or teacher_hidden",
    ),
    (lambda: xent.linear_distill(H, W, T[:, :3], Y), "linear_distill", "teacher_logits"),
    (
        lambda: xent.linear_distill(H, W, None, Y, teacher_hidden=H[:2], teacher_weight=W),
        "linear_distill",
        "teacher_hidden",
    ),
    (
        lambda: xent.linear_distill(H, W, None, Y, teacher_hidden=H, teacher_weight=W[:3]),
        "linear_distill",
        "teacher_weight",
    ),
    (lambda: xent.linear_distill(H, W, T, Y + 5), "linear_distill", "target"),
    (
        lambda: xent.linear_distill(H, W, T, Y, workspace_bytes=16),
        "linear_distill",
        "workspace_bytes",
    ),
    (lambda: xent.linear_distill(H, W, T, Y, temperature=-1.0), "linear_distill", "temperature"),
    (lambda: xent.linear_distill(H, W, T, Y, kind="jsd", beta=-0.5), "linear_distill", "beta"),
    (lambda: xent.linear_distill(H, W, T, Y, soft_weight=-1.0), "linear_distill", "soft_weight"),
]

CORE_ONLY = (
    "_forward",
    "_backward",
    "workspace_budget",
    "teacher.",
    "student)",
    "student [",
    " teacher ",
)


@pytest.mark.parametrize(
    "call,function,keyword", NAMED, ids=[f"{i}-{case[1]}-{case[2]}" for i, case in enumerate(NAMED)]
)
def test_core_errors_name_the_python_function_and_keyword(call, function, keyword):
    message = _value_error(call)
    assert message.startswith(f"{function}: {keyword} "), message
    assert not any(name in message for name in CORE_ONLY), message


def test_translate_leaves_other_messages_alone():
    from xent._errors import translate

    assert translate("distill", "distill: kind unknown: got 'x'; expected ...") == (
        "distill: kind unknown: got 'x'; expected ..."
    )
    assert translate(
        "linear_distill",
        "linear_distill_forward: teacher.hidden has wrong shape: "
        "got [2, 3]; expected [5] rows (the rows of student_hidden)",
    ) == (
        "linear_distill: teacher_hidden has wrong shape: got [2, 3]; expected [5] rows (the rows "
        "of student_hidden)"
    )
    assert translate(
        "linear_cross_entropy",
        "linear_ce_forward: grads.weight has wrong dtype "
        "for accumulate_weight: got bfloat16; expected float32",
    ) == (
        "linear_cross_entropy: accumulate_into has wrong dtype for accumulate_weight: got "
        "bfloat16; expected float32"
    )
    assert translate(
        "distill",
        "distill_backward: teacher has wrong dtype: got float64; "
        "expected float32 (the dtype of student)",
    ) == (
        "distill: teacher_logits has wrong dtype: got float64; expected float32 (the dtype of "
        "student_logits)"
    )


def test_errors_also_raised_when_gradients_are_wanted():
    x = X.clone().requires_grad_()
    with pytest.raises(ValueError, match="label_smoothing"):
        xent.cross_entropy(x, Y, label_smoothing=2.0)
    w = W.clone().requires_grad_()
    with pytest.raises(ValueError, match="target"):
        xent.linear_cross_entropy(H, w, torch.tensor([0, 1, 2, 3, 8]))


def test_double_backward_is_a_runtime_error():
    for loss_of in (
        lambda x: xent.cross_entropy(x, Y),
        lambda x: xent.distill(x, T, Y, kind="tvd"),
    ):
        x = X.clone().requires_grad_()
        (grad,) = torch.autograd.grad(loss_of(x), x, create_graph=True)
        with pytest.raises(RuntimeError, match="double backward is not supported"):
            grad.pow(2).sum().backward()


def test_first_order_create_graph_still_works():
    # create_graph=True alone is fine (e.g. other parts of the model want it); only
    # differentiating xent's gradient again raises.
    x = X.clone().requires_grad_()
    (grad,) = torch.autograd.grad(xent.cross_entropy(x, Y), x, create_graph=True)
    torch.testing.assert_close(grad, torch.autograd.grad(xent.cross_entropy(x, Y), x)[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_out_of_range_target_is_nan_and_flagged():
    logits = torch.randn(4, 11, device="cuda")
    target = torch.tensor([0, 3, 11, 5], device="cuda")
    loss = xent.cross_entropy(logits, target, reduction="none")
    assert torch.isnan(loss[2]) and torch.isfinite(loss[[0, 1, 3]]).all()
    with pytest.raises((ValueError, RuntimeError), match="target"):
        xent.check_errors(logits.device)
    xent.check_errors(logits.device)  # reported once, then cleared
