"""examples/grpo/grpo_loss.py runs and its fused GRPO loss agrees with the materialised one."""

import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "..", "examples", "grpo", "grpo_loss.py")


def test_grpo_example_agrees_on_cpu():
    spec = importlib.util.spec_from_file_location("grpo_loss", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    errors = module.main(["--device", "cpu", "--temperature", "0.8"])
    assert max(errors.values()) <= 1e-4
