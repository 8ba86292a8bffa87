"""tools/compare_torch.py's case lists: the linear_ce rows of the suites run on random and on
peaked logits alike (the 64 MiB rows included), --distribution picks one of them, and flags that
only a single shape can take are refused with a suite."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("compare_torch", ROOT / "tools" / "compare_torch.py")
compare_torch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_torch)


def _linear_ce(cases, label):
    return [c for c in cases if c["op"] == "linear_ce" and c["label"] == label]


@pytest.mark.parametrize("label", ["perf-linear", "perf-linear 64 MiB"])
def test_linear_rows_on_both_distributions(label):
    rows = _linear_ce(compare_torch.suite_cases("perf-linear"), label)
    shapes = {(c["n"], c["h"], c["v"]) for c in rows}
    assert shapes == set(compare_torch.LINEAR_SHAPES)
    for distribution in ("random", "peaked"):
        assert {
            (c["n"], c["h"], c["v"]) for c in rows if c.get("distribution") == distribution
        } == shapes
    if label.endswith("64 MiB"):
        assert all(c["budget_bytes"] == 64 << 20 for c in rows)


@pytest.mark.parametrize("distribution", ["random", "peaked"])
def test_distribution_selects_from_a_suite(distribution):
    args = compare_torch.parse_args(["--suite", "perf-linear", "--distribution", distribution])
    cases = compare_torch.selected_suite_cases(args)
    linear = [c for c in cases if c["op"] == "linear_ce"]
    # The default-budget and 64 MiB rows of that distribution; the fp32-weight rows run on
    # random logits only.
    fp32_rows = 2 * len(compare_torch.LINEAR_SHAPES) if distribution == "random" else 0
    assert len(linear) == 2 * len(compare_torch.LINEAR_SHAPES) + fp32_rows
    assert all(c.get("distribution", "random") == distribution for c in linear)
    assert any(c["op"] == "linear_distill" for c in cases)  # other ops are not filtered
    # Labels and distribution together; without --distribution both run.
    args = compare_torch.parse_args(
        ["--suite", "perf-linear", "--labels", "perf-linear 64 MiB", "--distribution", distribution]
    )
    assert len(compare_torch.selected_suite_cases(args)) == len(compare_torch.LINEAR_SHAPES)
    args = compare_torch.parse_args(["--suite", "perf-linear", "--labels", "perf-linear 64 MiB"])
    assert len(compare_torch.selected_suite_cases(args)) == 2 * len(compare_torch.LINEAR_SHAPES)


def test_a_label_with_a_dollar_is_matched_whole():
    """'perf-linear$' keeps the default-budget rows alone, not every label it begins."""
    args = compare_torch.parse_args(["--suite", "perf-linear", "--labels", "perf-linear$"])
    cases = compare_torch.selected_suite_cases(args)
    assert {c["label"] for c in cases} == {"perf-linear"}
    assert len(cases) == 2 * len(compare_torch.LINEAR_SHAPES)
    args = compare_torch.parse_args(
        ["--suite", "perf-linear", "--labels", "perf-linear$,perf-linear 64 MiB"]
    )
    assert {c["label"] for c in compare_torch.selected_suite_cases(args)} == {
        "perf-linear",
        "perf-linear 64 MiB",
    }


@pytest.mark.parametrize("flag", [["--budget-mib", "64"], ["--weight", "fp32"]])
def test_single_shape_flags_refused_with_a_suite(flag, capsys):
    with pytest.raises(SystemExit):
        compare_torch.parse_args(["--suite", "perf-linear", *flag])
    assert flag[0] in capsys.readouterr().err


def test_rounds_interleave_the_libraries(monkeypatch):
    """--rounds times every library of a case in turn, round after round, each with its own
    functions (the closures of one library must not call another's), and keeps every sample."""
    pytest.importorskip("torch")
    # A module of its own, with tools/ importable so that it finds its loss functions.
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    spec = importlib.util.spec_from_file_location(
        "compare_torch_rounds", ROOT / "tools" / "compare_torch.py"
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    calls = []
    real_eager_loss = tool.eager_loss

    def tagged_eager_loss(case):
        inner = real_eager_loss(case)

        def loss(x):
            calls.append("eager")
            return inner(x)

        return loss

    def tagged_library_loss(impl, case):
        inner = real_eager_loss(case)

        def loss(x):
            calls.append(impl)
            return inner(x) * 1.0

        return loss

    monkeypatch.setattr(tool, "eager_loss", tagged_eager_loss)
    monkeypatch.setattr(tool, "library_loss", tagged_library_loss)
    args = tool.parse_args(
        [
            "--op",
            "ce",
            "--n",
            "16",
            "--v",
            "64",
            "--device",
            "cpu",
            "--impls",
            "eager,xent_torch",
            "--rounds",
            "3",
            "--repeat",
            "6",
            "--warmup",
            "1",
        ]
    )
    args.repeat, args.warmup = 6, 1
    case = dict(op="ce", n=16, h=0, v=64, dtype="bf16", mode="fwdbwd", kind="forward_kl", label="")
    records = tool.measure_case(case, args.impls, args, None, "test")
    assert [r["impl"] for r in records] == ["eager", "xent_torch"]
    assert all(r["error"] is None and r["time_ms"]["samples"] == 6 for r in records)
    # After each library's first call: three rounds, each a warm-up (one, then at most two) and
    # two timed steps of eager, then the same of xent_torch.
    timed = calls[2:]
    per_round = ["eager"] * 3 + ["xent_torch"] * 3
    assert timed == per_round * 3, timed


def test_floor_flops_count_the_products_the_floor_times():
    """F times h·Wᵀ (twice with a teacher) and, with a backward, G·W and Gᵀ·h: 2·N·H·V each."""
    shape = dict(n=37, h=67, v=1031)
    one = 2 * 37 * 67 * 1031
    assert compare_torch.gemm_floor_flops(dict(shape, op="linear_ce", mode="fwdbwd")) == 3 * one
    assert compare_torch.gemm_floor_flops(dict(shape, op="linear_ce", mode="fwd")) == one
    assert (
        compare_torch.gemm_floor_flops(dict(shape, op="linear_distill", mode="fwdbwd")) == 4 * one
    )
    assert compare_torch.gemm_floor_flops(dict(shape, op="ce", mode="fwdbwd")) is None


def test_records_name_uncommitted_code_dirty(tmp_path, monkeypatch):
    import shutil
    import subprocess

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    monkeypatch.delenv("XENT_COMMIT", raising=False)

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.txt").write_text("one")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first")
    head = subprocess.run(
        ["git", "-C", str(tmp_path), "rev-parse", "HEAD"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert compare_torch.git_commit(str(tmp_path)) == head
    (tmp_path / "untracked.txt").write_text("not part of the code")
    assert compare_torch.git_commit(str(tmp_path)) == head
    (tmp_path / "a.txt").write_text("two")
    assert compare_torch.git_commit(str(tmp_path)) == head + "-dirty"
    monkeypatch.setenv("XENT_COMMIT", "named")
    assert compare_torch.git_commit(str(tmp_path)) == "named"


def test_linear_curve_suite_places_every_budget_beside_the_anchors():
    cases = compare_torch.suite_cases("linear-curve")
    budgets = {mib << 20 for mib in compare_torch.CURVE_BUDGETS_MIB}
    assert budgets == {m << 20 for m in (64, 128, 256, 512, 1024, 2048, 4096)}
    for distribution in ("random", "peaked"):
        for shape in compare_torch.LINEAR_SHAPES:
            here = [
                c
                for c in cases
                if (c["n"], c["h"], c["v"]) == shape and c["distribution"] == distribution
            ]
            assert all(c["op"] == "linear_ce" and c["mode"] == "fwdbwd" for c in here)
            xent = [c for c in here if c["impls"] == ("xent_torch",)]
            assert {c.get("budget_bytes") for c in xent} == budgets | {None}
            anchors = [c for c in here if c["impls"] == compare_torch.CURVE_ANCHORS]
            assert len(anchors) == 1 and anchors[0].get("budget_bytes") is None
    # Too long for the docs/performance.md run: only asked for by name.
    assert not any(c["label"].startswith("linear-curve") for c in compare_torch.suite_cases("perf"))
    args = compare_torch.parse_args(["--suite", "linear-curve", "--distribution", "peaked"])
    assert {c["distribution"] for c in compare_torch.selected_suite_cases(args)} == {"peaked"}


def _curve_record(impl, ratio, peak, budget=None, distribution="random"):
    return dict(
        op="linear_ce",
        mode="fwdbwd",
        kind="forward_kl",
        dtype="bf16",
        n=8192,
        h=4096,
        v=128256,
        options="plain",
        reduction="mean",
        budget_bytes=budget,
        distribution=distribution,
        device="GPU X",
        impl=impl,
        label="linear-curve xent" if budget else "linear-curve anchors",
        time_ms=dict(median=10.0 * ratio, p20=9.9 * ratio, p80=10.1 * ratio, samples=20),
        ratio=ratio,
        peak_extra_bytes=peak,
    )


def test_curve_plot_from_a_record(tmp_path):
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location(
        "plot_results", ROOT / "tools" / "plot_results.py"
    )
    plot_results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_results)
    records = [
        _curve_record("xent_torch", 1.5 - 0.05 * i, (64 << 20) * 2**i, (64 << 20) * 2**i)
        for i in range(7)
    ]
    records += [_curve_record("compile", 0.98, 2 << 30), _curve_record("liger", 1.36, 63 << 20)]
    records += [_curve_record("xent_torch", 1.02, 3 << 30, distribution="peaked")]
    (tmp_path / "curve-gpu-2026-01-01.json").write_text(json.dumps(records))
    out = tmp_path / "img"
    assert plot_results.main(["--results", str(tmp_path), "--out", str(out)]) == 0
    picture = out / "linear_ce_curve_gpu-x.png"
    assert picture.exists() and picture.stat().st_size > 10_000
    # Records of other suites draw no curve.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    other = [dict(r, label="perf-linear") for r in records]
    assert plot_results.plot_linear_curve(plt, other, "GPU X", str(out)) == []
    # linear_distill's plane from its own suite's records, in a picture of its own.
    distill = [
        dict(
            r, op="linear_distill", label=r["label"].replace("linear-curve", "linear-distill-curve")
        )
        for r in records
    ]
    written = plot_results.plot_linear_distill_curve(plt, distill, "GPU X", str(out))
    assert [Path(w).name for w in written] == ["linear_distill_curve_gpu-x.png"]
    assert plot_results.plot_linear_distill_curve(plt, records, "GPU X", str(out)) == []


def test_budgets_and_weight_grad_accumulations_make_one_case_each():
    args = compare_torch.parse_args(
        "--n 64 --h 32 --v 1000 --budget-mib 64,256 --weight-grad-accumulation "
        "fp32,weight_dtype --impls liger,xent_torch".split()
    )
    cases = compare_torch.single_shape_cases(args)
    assert [(c["budget_bytes"] >> 20, c["weight_grad_accumulation"]) for c in cases] == [
        (64, "fp32"),
        (64, "weight_dtype"),
        (256, "fp32"),
        (256, "weight_dtype"),
    ]
    assert "impls" not in cases[0]
    assert all(c["impls"] == ("xent_torch",) for c in cases[1:])
    single = compare_torch.single_shape_cases(
        compare_torch.parse_args("--n 8 --h 4 --v 10".split())
    )
    assert len(single) == 1 and "budget_bytes" not in single[0]


@pytest.mark.parametrize(
    "flag",
    [
        ["--budget-mib", "64,x"],
        ["--budget-mib", "0"],
        ["--weight-grad-accumulation", "bf16"],
        ["--weight-grad-accumulation", "fp32", "--op", "ce"],
    ],
)
def test_bad_budget_or_accumulation_lists_are_refused(flag, capsys):
    with pytest.raises(SystemExit):
        compare_torch.parse_args(["--n", "8", "--h", "4", "--v", "10", *flag])
    assert flag[0] in capsys.readouterr().err


def test_linear_distill_curve_places_every_budget_beside_its_anchor():
    """Issue 54's plane for linear_distill: at each docs/performance.md shape the compiled
    anchor once, xent's default, and xent at each budget of linear_ce's curve, all forward KL
    with the teacher as hidden states (F: four products)."""
    cases = compare_torch.suite_cases("linear-distill-curve")
    assert {c["op"] for c in cases} == {"linear_distill"}
    assert {c["kind"] for c in cases} == {"forward_kl"}
    for shape in compare_torch.LINEAR_SHAPES:
        here = [c for c in cases if (c["n"], c["h"], c["v"]) == shape]
        budgets = sorted(c["budget_bytes"] >> 20 for c in here if c.get("budget_bytes"))
        assert budgets == sorted(compare_torch.CURVE_BUDGETS_MIB)
        assert [c["impls"] for c in here if c["label"].endswith("anchors")] == [("compile",)]
        assert sum(c["label"].endswith("default") for c in here) == 1
    case = dict(cases[0], teacher_topk=None)
    assert compare_torch.gemm_floor_flops(case) == 2 * case["n"] * case["h"] * case["v"] * 4
