"""examples/distill/served_teacher.py runs, drops the teacher's ids the student lacks, and its
fused loss and gradients agree with the plain-PyTorch float64 formula."""

from example_loader import load_example


def _example():
    return load_example("distill", "served_teacher")


def test_served_teacher_example_agrees_on_cpu():
    errors, dropped = _example().main(["--device", "cpu"])
    assert dropped > 0
    # fp32 logits of 64-term products, a 1000-column softmax: a few fp32 ulps of the loss, and
    # the gradients' norms to the products' fp32 rounding.
    assert errors["loss"] <= 1e-5
    assert errors["grad_hidden"] <= 1e-4 and errors["grad_weight"] <= 1e-4


def test_topk_tensors_pads_and_drops():
    module = _example()
    ids, logprobs = module.topk_tensors([{3: -0.1, 12: -2.5}, {7: -0.5, 2: -1.0, 1: -3.0}], 3, 10)
    assert ids.tolist() == [[3, -1, -1], [7, 2, 1]]
    assert abs(logprobs[0, 0].item() + 0.1) < 1e-7
    assert logprobs[0, 1].item() == 0.0
