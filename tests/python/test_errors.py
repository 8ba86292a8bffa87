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
    (lambda: xent.cross_entropy(X, Y, torch.ones(7), class_weight=torch.ones(7)),
     "class_weight", "both"),
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
    (lambda: xent.linear_cross_entropy(H, W, Y, label_smoothing=-0.1), "label_smoothing",
     "-0.1"),
    (lambda: xent.linear_cross_entropy(H, W, torch.tensor([0, 1, 2, 3, 7])), "target", "7"),
    (lambda: xent.linear_distill(H, W, T, Y, teacher_hidden=H, teacher_weight=W), "teacher",
     "both"),
    (lambda: xent.linear_distill(H, W, None, Y), "teacher", "neither"),
    (lambda: xent.linear_distill(H, W, T, Y, temperature=-1.0), "temperature", "-1"),
]


@pytest.mark.parametrize("call,argument,value", CASES,
                         ids=[f"{i}-{case[1]}" for i, case in enumerate(CASES)])
def test_value_errors_name_the_argument(call, argument, value):
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert argument in message and value in message, message
    # The project's format: "<function>: <argument> <problem>: got <value>; expected <...>".
    assert ": got " in message and "; expected " in message, message


def test_errors_also_raised_when_gradients_are_wanted():
    x = X.clone().requires_grad_()
    with pytest.raises(ValueError, match="label_smoothing"):
        xent.cross_entropy(x, Y, label_smoothing=2.0)
    w = W.clone().requires_grad_()
    with pytest.raises(ValueError, match="target"):
        xent.linear_cross_entropy(H, w, torch.tensor([0, 1, 2, 3, 8]))


def test_double_backward_is_a_runtime_error():
    for loss_of in (lambda x: xent.cross_entropy(x, Y),
                    lambda x: xent.distill(x, T, Y, kind="tvd")):
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
