"""tools/compare_torch.py with a top-k teacher (docs/semantics.md §3.1): the anchors' formula
against the tests' float64 reference, runs on the CPU of distill and linear_distill with every
mass and every implementation that runs there, the topk suite, and the arguments it refuses."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import reference as ref
import torch

import xent

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))  # the tool imports its loss functions from there
_spec = importlib.util.spec_from_file_location("compare_torch", ROOT / "tools" / "compare_torch.py")
compare_torch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_torch)
torch_losses = sys.modules["torch_losses"]
_spec = importlib.util.spec_from_file_location("check_records", ROOT / "tools" / "check_records.py")
check_records = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_records)

MASS_KINDS = [
    (mass, kind)
    for mass in ("renormalize", "tail", "ignore")
    for kind in xent.DISTILL_KINDS
    if mass != "ignore" or kind in ("forward_kl", "soft_ce")
]


def _shape(gen, low, high):
    return int(torch.randint(low, high, (1,), generator=gen))


@pytest.mark.parametrize("mass,kind", MASS_KINDS)
def test_anchor_formula_against_the_float64_reference(gen, mass, kind):
    """distill_topk_rows (the eager, compile and chunked anchors' loss, and the tool's float64
    reference) against tests/python/reference.py, loss and gradient, in float64 and in fp32."""
    rows, vocab = _shape(gen, 5, 40), _shape(gen, 50, 700)
    k = _shape(gen, 1, min(60, vocab + 1))  # k <= V
    student = ref.randn(gen, rows, vocab, scale=2.0, dtype=torch.float64).requires_grad_()
    teacher = student.detach() + 0.6 * torch.randn(
        student.shape, generator=gen, dtype=torch.float64
    )
    logprobs, ids = torch.log_softmax(teacher, -1).topk(k, -1)
    logprobs = logprobs.float()
    expected = ref.distill_topk_rows(student, ids, logprobs, kind, mass)
    (expected_grad,) = torch.autograd.grad(expected.sum(), student)
    got = torch_losses.distill_topk_rows(student, ids, logprobs, kind, mass)
    (grad,) = torch.autograd.grad(got.sum(), student)
    assert ref.rel_error(got, expected) < 1e-12
    assert ref.rel_error(grad, expected_grad) < 1e-10
    fp32 = student.detach().float().requires_grad_()
    got32 = torch_losses.distill_topk_rows(fp32, ids, logprobs, kind, mass)
    (grad32,) = torch.autograd.grad(got32.sum(), fp32)
    assert ref.rel_error(got32, expected) < 1e-5
    assert ref.rel_error(grad32, expected_grad) < 1e-4


def test_ids_covering_the_vocabulary_have_no_tail(gen):
    student = ref.randn(gen, 6, 23, dtype=torch.float64)
    teacher = student + 0.5 * torch.randn(student.shape, generator=gen, dtype=torch.float64)
    logprobs, ids = torch.log_softmax(teacher, -1).topk(23, -1)
    for kind in xent.DISTILL_KINDS:
        got = torch_losses.distill_topk_rows(student, ids, logprobs.float(), kind, "tail")
        expected = ref.distill_topk_rows(student, ids, logprobs.float(), kind, "tail")
        assert torch.isfinite(got).all() and ref.rel_error(got, expected) < 1e-9


def _run(tmp_path, argv):
    out = tmp_path / "records.json"
    assert compare_torch.main([*argv, "--device", "cpu", "--json", str(out)]) == 0
    return json.loads(out.read_text()), out


@pytest.mark.parametrize("op", ["distill", "linear_distill"])
@pytest.mark.parametrize("mass", ["renormalize", "tail", "ignore"])
def test_runs_on_the_cpu(tmp_path, monkeypatch, gen, op, mass):
    """Every implementation that runs on the CPU writes its record; each loss agrees with the
    float64 loss of the same inputs; the libraries without a top-k teacher say so."""
    n, h, v = _shape(gen, 9, 70), _shape(gen, 3, 40), _shape(gen, 70, 600)
    k = _shape(gen, 1, 65)
    kind = "soft_ce" if mass == "ignore" else ["forward_kl", "jsd", "tvd"][_shape(gen, 0, 3)]
    impls = "eager,chunked,liger,cce,quack,xent_torch,xent_linear_ce"
    argv = [f"--op={op}", f"--n={n}", f"--h={h}", f"--v={v}", f"--kind={kind}"]
    argv += [f"--teacher-topk={k}", f"--topk-mass={mass}", f"--impls={impls}", "--dtype=fp32"]
    records, path = _run(tmp_path, [*argv, "--repeat=2", "--warmup=0"])
    by_impl = {r["impl"]: r for r in records}
    ran = ["eager", "xent_torch"] + (
        ["chunked", "xent_linear_ce"] if op == "linear_distill" else []
    )
    assert sorted(by_impl) == sorted(ran + ["liger", "cce", "quack"])
    for impl in ("liger", "cce", "quack"):
        assert by_impl[impl]["error"] == "no top-k teacher"
    for impl in ran:
        record = by_impl[impl]
        assert record["error"] is None, record["error"]
        assert record["time_ms"]["samples"] == 2
        assert (record["teacher_topk"], record["topk_mass"], record["kind"]) == (k, mass, kind)
        if impl != "xent_linear_ce":
            assert record["loss_rel_err"] < 1e-4, (impl, record["loss_rel_err"])
        if op == "linear_distill":
            assert record["ratio_kind"] == "gemm" and record["ratio_to_linear_ce"] > 0
        else:
            assert record["ratio_kind"] == "bandwidth"
            assert record["min_bytes"] == 2 * n * v * 4  # the student read, its gradient written
    if op == "linear_distill":
        assert by_impl["xent_linear_ce"]["ratio_to_linear_ce"] == 1.0
        assert by_impl["xent_linear_ce"]["loss_rel_err"] is None  # another loss
    # The records hold what docs/performance.md asks of a record.
    monkeypatch.setattr(sys, "argv", ["check_records.py", str(path)])
    assert check_records.main() == 0


def test_compile_anchor_on_the_cpu(tmp_path, gen):
    pytest.importorskip("torch._inductor")
    v = _shape(gen, 70, 300)
    argv = ["--op=linear_distill", "--n=33", "--h=17", f"--v={v}", "--teacher-topk=9"]
    argv += ["--topk-mass=tail", "--impls=compile", "--repeat=1", "--warmup=0", "--dtype=fp32"]
    try:
        records, _ = _run(tmp_path, argv)
    except Exception as error:  # pragma: no cover - a machine without a C++ compiler for inductor
        pytest.skip(f"torch.compile unavailable: {error}")
    (record,) = records
    if record["error"] and "compile" in record["error"].lower():
        pytest.skip(record["error"])
    assert record["error"] is None and record["loss_rel_err"] < 1e-4


def test_lists_of_k_masses_and_budgets_make_one_case_each():
    args = compare_torch.parse_args(
        "--op linear_distill --n 64 --h 32 --v 1000 --teacher-topk 8,64 --topk-mass tail,ignore "
        "--budget-mib 64,128".split()
    )
    cases = compare_torch.single_shape_cases(args)
    assert [(c["teacher_topk"], c["topk_mass"], c["budget_bytes"] >> 20) for c in cases] == [
        (k, mass, mib) for k in (8, 64) for mass in ("tail", "ignore") for mib in (64, 128)
    ]
    # The anchors at the first budget of each teacher; xent and linear_ce's reference at each.
    assert ["impls" in c for c in cases] == [False, True] * 4
    assert all(c["impls"] == ("xent_torch", "xent_linear_ce") for c in cases if "impls" in c)
    default = compare_torch.parse_args("--op distill --n 8 --v 10 --teacher-topk 3".split())
    assert default.topk_mass == ["renormalize"]


def test_topk_suite():
    cases = compare_torch.suite_cases("topk")
    distill = [c for c in cases if c["op"] == "distill"]
    assert {(c["n"], c["v"], c["topk_mass"]) for c in distill} == {
        (n, v, mass)
        for n, v in ((16384, 32768), (4096, 131072), (2048, 262144))
        for mass in ("renormalize", "tail")
    }
    assert all(c["teacher_topk"] == 64 and c["dtype"] == "bf16" for c in distill)
    linear = [c for c in cases if c["op"] == "linear_distill"]
    assert {(c["teacher_topk"], c["topk_mass"]) for c in linear} == {
        (k, mass) for k in (64, 256) for mass in ("tail", "renormalize")
    }
    for c in linear:
        assert (c["n"], c["h"], c["v"], c["kind"]) == (8192, 4096, 128256, "forward_kl")
        assert {"compile", "chunked", "xent_torch", "xent_linear_ce"} <= set(c["impls"])
        # No teacher product: F is linear_ce's.
        assert compare_torch.gemm_floor_flops(c) == compare_torch.gemm_floor_flops(
            dict(c, op="linear_ce")
        )
    assert len(cases) == len(distill) + len(linear) == 10
    assert not any(c.get("teacher_topk") for c in compare_torch.suite_cases("perf"))


@pytest.mark.parametrize(
    "argv,message",
    [
        ("--op distill --n 8 --v 10 --teacher-topk 11", "k = 11; expected 1 <= k <= V = 10"),
        ("--op distill --n 8 --v 10 --teacher-topk 0", "--teacher-topk: got k = 0"),
        ("--op distill --n 8 --v 10 --teacher-topk 2,x", "--teacher-topk: got '2,x'"),
        ("--op ce --n 8 --v 10 --teacher-topk 4", "for --op distill or linear_distill, not ce"),
        ("--op linear_ce --n 8 --h 4 --v 10 --teacher-topk 4", "not linear_ce"),
        (
            "--op distill --n 8 --v 10 --teacher-topk 4 --topk-mass ignore --kind jsd",
            "ignore with --kind jsd; ignore takes forward_kl or soft_ce",
        ),
        ("--op distill --n 8 --v 10 --teacher-topk 4 --topk-mass rest", "got 'rest'"),
        ("--op distill --n 8 --v 10 --topk-mass tail", "--topk-mass: only with --teacher-topk"),
        ("--suite topk --teacher-topk 4", "for a single shape"),
        ("--op distill --n 8 --v 10 --teacher-topk 4 --mode bwd", "with --mode fwdbwd or fwd"),
    ],
)
def test_bad_topk_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        compare_torch.parse_args(argv.split())
    assert message in capsys.readouterr().err


def test_plots_keep_topk_records_apart():
    """A top-k record is its own case for the plots' newest-record choice, and no distill picture
    of full teachers draws it."""
    spec = importlib.util.spec_from_file_location(
        "plot_results", ROOT / "tools" / "plot_results.py"
    )
    plot_results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_results)
    full = dict(op="distill", impl="xent_torch", kind="forward_kl", n=8, h=0, v=64)
    full.update(dtype="bfloat16", mode="fwdbwd")
    topk = dict(full, teacher_topk=4, topk_mass="tail")
    kept = plot_results.latest([full, topk, dict(topk, topk_mass="renormalize")])
    assert len(kept) == 3
    assert plot_results.plain_fwdbwd(kept, "distill") == [full]
