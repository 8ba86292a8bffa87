"""examples/grpo/grpo_loss.py runs and its fused GRPO loss agrees with the materialised one."""

from example_loader import load_example


def test_grpo_example_agrees_on_cpu():
    errors = load_example("grpo", "grpo_loss").main(["--device", "cpu", "--temperature", "0.8"])
    assert max(errors.values()) <= 1e-4
