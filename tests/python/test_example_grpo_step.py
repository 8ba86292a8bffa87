"""examples/grpo/grpo_step.py: GRPO steps on a tiny Hugging Face model (built from a config) whose
fused policy loss (xent.linear_policy_loss on the decoder's hidden states and the LM head) and
every parameter's gradient agree with the same loss in plain torch on materialised logits, and
whose optimizer step moves the policy in the advantages' direction."""

import pytest
from example_loader import load_example

pytest.importorskip("transformers")

# Error model, float64: both losses form the logits from the same float64 hidden states and
# differ only in summation order (products over H = 64, logsumexp over V = 97), a relative error
# of about H·u ≈ 1e-14 on each logit and so on the loss and the gradients; the loss itself can be
# ~100x smaller than its terms (group-normalised advantages sum to 0), so up to ~1e-12 relative
# (observed <= 3e-14). A wrong term (a clip bound, the KL, the entropy, the aggregation, a masked
# token counted) moves them by 1e-3 or more.
TOLERANCE = 1e-10


def _load():
    return load_example("grpo", "grpo_step")


@pytest.mark.parametrize("mask_truncated", [False, True], ids=["all", "mask_truncated"])
def test_grpo_step_matches_torch_and_follows_the_advantages(gen, mask_truncated):
    seed = int(gen.initial_seed() % 2**31)
    argv = ["--dtype", "float64", "--seed", str(seed)]
    report = _load().main(argv + (["--mask-truncated"] if mask_truncated else []))
    if report["tokens"] == 0:
        pytest.skip("every completion truncated: nothing to train on")
    first, second = report["steps"]
    for step in (first, second):
        assert step["max_relative_error"] <= TOLERANCE, step
    # The first step is on-policy (ratio 1, nothing clipped, the reference is the policy); the
    # second sees the first's update, so the clipped branches and the KL are part of the check.
    assert first["clip_fraction"] == 0.0 and abs(first["mean_ratio"] - 1.0) <= TOLERANCE
    assert second["clip_fraction"] > 0.0 and second["kl"] > 0.0, second
    # A policy-gradient step raises the mean log-probability of the completions with a positive
    # advantage relative to the negative ones (first order; all advantages 0 when every group's
    # completions scored the same).
    if report["advantages"].abs().max() > 0:
        assert first["alignment"] > 0.0, first
