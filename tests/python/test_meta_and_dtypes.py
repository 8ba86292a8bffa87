"""Meta tensors go through the ops' fake kernels (shape and dtype inference, no data), and a
tensor of a dtype no op takes is refused with the dtypes that argument accepts."""

import pytest
import torch

import xent


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, device="meta", dtype=dtype)


def test_ops_infer_shapes_on_meta_tensors() -> None:
    rows, hidden, vocab = 6, 8, 11
    logits = _meta(rows, vocab, dtype=torch.bfloat16).requires_grad_()
    target = _meta(rows, dtype=torch.long)
    loss = xent.cross_entropy(logits, target)
    assert loss.device.type == "meta" and loss.shape == ()
    loss.backward()
    assert logits.grad.shape == logits.shape and logits.grad.device.type == "meta"
    assert xent.cross_entropy(logits, target, reduction="none").shape == (rows,)
    h, w = _meta(rows, hidden), _meta(vocab, hidden)
    assert xent.linear_cross_entropy(h, w, target).shape == ()
    teacher = _meta(rows, vocab)
    assert xent.distill(_meta(rows, vocab), teacher, target).shape == ()
    assert xent.linear_distill(h, w, target=target, teacher_logits=teacher).shape == ()
    assert xent.logprobs(_meta(rows, vocab), target).shape == (rows,)
    logprob, entropy = xent.linear_logprobs(h, w, target, return_entropy=True)
    assert logprob.shape == entropy.shape == (rows,)


@pytest.mark.parametrize(
    "call, expected",
    [
        (
            lambda: xent.cross_entropy(torch.randn(4, 9), torch.zeros(4, dtype=torch.uint8)),
            "target dtype unsupported: got uint8; expected int64 or int32",
        ),
        (
            lambda: xent.cross_entropy(torch.randn(4, 9), torch.zeros(4, dtype=torch.int16)),
            "target dtype unsupported: got int16; expected int64 or int32",
        ),
        (
            lambda: xent.cross_entropy(
                torch.ones(4, 9, dtype=torch.bool), torch.zeros(4, dtype=torch.long)
            ),
            "logits dtype unsupported: got bool; expected float32, bfloat16, float16 or float64",
        ),
    ],
)
def test_dtype_errors_name_what_the_argument_takes(call, expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        call()
