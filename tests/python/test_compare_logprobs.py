"""tools/compare_logprobs.py on the CPU at a tiny shape: every implementation computes the same
objective (with and without gradients), and --no-grad places each forward against the bare
logits product."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "compare_logprobs", ROOT / "tools" / "compare_logprobs.py"
)
compare_logprobs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_logprobs)

SHAPE = ["--device", "cpu", "--n", "48", "--h", "24", "--v", "517", "--dtype", "fp32"]


def _run(tmp_path, *extra):
    out = tmp_path / "records.json"
    assert (
        compare_logprobs.main(
            [*SHAPE, "--repeat", "1", "--warmup", "0", *extra, "--json", str(out)]
        )
        == 0
    )
    return {r["impl"]: r for r in json.loads(out.read_text())}


@pytest.mark.parametrize("budget", [None, "1"])
def test_no_grad_forwards_agree_and_face_the_product(tmp_path, budget):
    extra = ["--no-grad"] + (["--budget-mib", budget] if budget else [])
    records = _run(tmp_path, *extra, "--impls", "product,xent_logprob,xent,eager")
    assert not any(r["error"] for r in records.values())
    assert all(r["mode"] == "fwd" for r in records.values())
    assert records["product"]["time_vs_product"] == 1.0
    assert all(r["time_vs_product"] > 0 for r in records.values())
    # The entropy-weighted objective of xent's fused forward and of materialised logits.
    assert records["xent"]["value"] == pytest.approx(records["eager"]["value"], rel=1e-4)
    expected = None if budget is None else int(budget) << 20
    assert all(r["budget_bytes"] == expected for r in records.values())


def test_training_objectives_agree(tmp_path):
    impls = "xent,xent_cache,xent_nocache,xent_cache_1g,eager,linear_ce,products3"
    records = _run(tmp_path, "--impls", impls)
    assert not any(r["error"] for r in records.values())
    assert records["xent"]["mode"] == "fwdbwd"
    for impl in ("xent_cache", "xent_nocache", "xent_cache_1g", "eager"):
        assert records[impl]["value"] == pytest.approx(records["xent"]["value"], rel=1e-4)
    assert records["linear_ce"]["time_vs_linear_ce"] == 1.0
    assert records["products3"]["time_vs_products3"] == 1.0


def test_policy_losses_agree(tmp_path):
    # xent's fused policy loss, its torch.compile and chunked-torch anchors compute one formula.
    records = _run(tmp_path, "--impls", "linear_policy,compile_policy,chunked_policy")
    assert not any(r["error"] for r in records.values())
    assert all(r["op"] == r["impl"] for r in records.values())
    for impl in ("compile_policy", "chunked_policy"):
        assert records[impl]["value"] == pytest.approx(records["linear_policy"]["value"], rel=1e-4)
