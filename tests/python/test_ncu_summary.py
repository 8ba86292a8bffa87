"""tools/ncu_summary.py on captures in the layout of `ncu --csv --page raw`: the header of launch
attributes and metric names, the units row, one line per kernel launch, and ncu's quirks
(profiler lines, thousands separators, "n/a", units scaled differently per column)."""

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"
SYNTHETIC = DATA / "ncu_raw_synthetic_linear.csv"

_spec = importlib.util.spec_from_file_location("ncu_summary", ROOT / "tools" / "ncu_summary.py")
ncu_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncu_summary)


def test_numbers_and_units():
    assert ncu_summary.parse_number("1,234.5") == 1234.5
    assert ncu_summary.parse_number(" 37.5 ") == 37.5
    assert ncu_summary.parse_number("12%") == 12.0
    for missing in ("n/a", "", "  ", None, "(256, 1, 1)", "nan"):
        assert ncu_summary.parse_number(missing) is None
    to_base = ncu_summary.to_base
    assert to_base(2.0, "msecond") == 2000.0  # kernel times in µs
    assert to_base(1500.0, "nsecond") == 1.5
    assert to_base(3.0, "usecond") == 3.0
    assert to_base(1.0, "second") == 1e6
    assert to_base(1.0, "Tbyte/second") == pytest.approx(1000.0)  # byte rates in GB/s
    assert to_base(250.0, "Mbyte/second") == pytest.approx(0.25)
    assert to_base(4e12, "byte/second") == pytest.approx(4000.0)
    assert to_base(2.0, "Kbyte/block") == 2000.0  # byte counts in bytes
    assert to_base(4.0, "Kibyte") == 4096.0
    assert to_base(1.5, "Gbyte") == 1.5e9
    assert to_base(37.5, "%") == 37.5
    assert to_base(0.59, "inst/cycle") == 0.59
    assert to_base(None, "usecond") is None


def test_short_kernel_names():
    short = ncu_summary.short_kernel_name
    assert (
        short(
            "void xent::cuda::(anonymous namespace)::ce_rows_kernel<(int)8, __nv_bfloat16>"
            "(xent::cuda::RowParams)"
        )
        == "ce_rows_kernel"
    )
    assert short("void reduce_kernel<float>(const float *, long)") == "reduce_kernel"
    # ncu 2025 prints the anonymous namespace as a bare "unnamed>".
    assert (
        short("void unnamed>::ce_rows_kernel<common::bf16_t>(unnamed>::CeKernelParams)")
        == "ce_rows_kernel"
    )
    assert short("unnamed>::ce_reduce_kernel(CeReduceArgs)") == "ce_reduce_kernel"
    assert (
        short("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_kernel__5x_cublas")
        == "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_kernel__5x_cublas"
    )


def test_every_launch_parsed_in_base_units():
    kernels = ncu_summary.parse_raw_csv(SYNTHETIC.read_text())
    assert [k["id"] for k in kernels] == [0, 1, 2, 3, 4]
    assert [k["name"] for k in kernels] == [
        kernels[0]["full_name"],
        "linear_ce_rows_kernel",
        kernels[0]["full_name"],
        "linear_ce_rows_kernel",
        "linear_block_grad_kernel",
    ]
    gemm, row, grad = kernels[0], kernels[1], kernels[4]
    assert gemm["duration_us"] == pytest.approx(338.8)
    assert grad["duration_us"] == pytest.approx(0.0125)
    assert gemm["dram_read_gb_s"] == pytest.approx(3100.0)  # printed in Tbyte/second
    assert gemm["dram_write_gb_s"] == pytest.approx(180.25)  # printed in Gbyte/second
    assert row["dram_write_gb_s"] == pytest.approx(3672.1)  # "3,672.1"
    assert gemm["dram_read_bytes"] == pytest.approx(1.0505e9)  # "1,050.5" Mbyte
    assert gemm["dram_pct"] == pytest.approx(71.3)
    assert gemm["sm_pct"] == pytest.approx(84.0)
    assert row["issue_per_scheduler"] == pytest.approx(0.59)
    assert row["no_eligible_pct"] == pytest.approx(41.0)
    assert row["occupancy_theoretical_pct"] == pytest.approx(37.5)
    assert row["occupancy_achieved_pct"] == pytest.approx(36.4)
    assert row["registers_per_thread"] == 48
    assert row["smem_per_block_bytes"] == pytest.approx(65616.0)  # 65.6 Kbyte + 16 byte
    assert gemm["smem_per_block_bytes"] == pytest.approx(213500.0)
    assert row["grid_size"] == 8192 and row["block_size"] == 256  # "8,192"
    assert row["grid"] == "(8192, 1, 1)" and row["block"] == "(256, 1, 1)"
    assert row["ctas_per_sm_limit"]["registers"] == 5
    assert row["ctas_per_sm_limit"]["shared_mem"] == 3
    assert gemm["tensor_pct"] == pytest.approx(82.4)
    assert gemm["tensor_metric"].startswith("sm__pipe_tensor_cycles_active")
    assert row["tensor_pct"] is None and kernels[3]["tensor_pct"] is None  # "n/a" and empty
    assert grad["dram_read_gb_s"] is None and grad["dram_read_bytes"] is None  # "n/a"
    assert gemm["device"] == "NVIDIA H200"


def test_row_totals_shares_and_groups():
    kernels = ncu_summary.parse_raw_csv(SYNTHETIC.read_text())
    record = ncu_summary.summarize_row({"row": "linear", "op": "linear_ce"}, kernels)
    total = 338.8 + 144.4 + 344.0 + 145.2 + 0.0125
    assert record["total_kernel_us"] == pytest.approx(total)
    assert record["kernel_launches"] == 5
    assert sum(k["time_share"] for k in record["kernels"]) == pytest.approx(1.0)
    assert record["kernels"][1]["time_share"] == pytest.approx(144.4 / total)
    assert all("metrics" not in k for k in record["kernels"])
    groups = record["by_kernel"]
    assert [g["name"] for g in groups] == [
        kernels[0]["name"],
        "linear_ce_rows_kernel",
        "linear_block_grad_kernel",
    ]
    assert record["dominant_kernel"] == kernels[0]["name"]
    gemm = groups[0]
    assert gemm["launches"] == 2
    assert gemm["duration_us"] == pytest.approx(682.8)
    assert gemm["time_share"] == pytest.approx(682.8 / total)
    # Shares of peak over a group are weighted by each launch's time.
    assert gemm["dram_pct"] == pytest.approx((71.3 * 338.8 + 70.9 * 344.0) / 682.8)
    assert gemm["dram_read_bytes"] == pytest.approx(2 * 1.0505e9)
    assert groups[1]["tensor_pct"] is None
    assert groups[2]["dram_read_gb_s"] is None
    assert record["device"] == "NVIDIA H200"
    assert record["gemm_time_share"] == pytest.approx(682.8 / total)
    json.dumps(record)  # the record serialises as it is


def test_units_row_absent_and_profiler_lines():
    text = (
        "==PROF== Connected to process 1\n"
        '"ID","Kernel Name","gpu__time_duration.sum","dram__throughput.avg.pct_of_peak_sustained_elapsed"\n'
        '"0","void k<int>(int)","1,500","n/a"\n'
        "==WARNING== something\n"
        '"1","void k<int>(int)","2","50"\n'
    )
    kernels = ncu_summary.parse_raw_csv(text)
    assert [k["duration_us"] for k in kernels] == [1500.0, 2.0]  # no units row: taken as is
    assert kernels[0]["dram_pct"] is None and kernels[1]["dram_pct"] == 50.0


def test_not_a_capture():
    with pytest.raises(ncu_summary.NcuCsvError):
        ncu_summary.parse_raw_csv("==ERROR== ERR_NVGPUCTRPERM: no permission\n")


def _write_manifest(directory, rows):
    header = (
        "row\tlabel\top\tmode\toptions\tkind\tn\th\tv\tbudget_mib\tstatus\tseconds\tcsv"
        "\tcommit\tncu_version\n"
    )
    lines = ["\t".join(str(x) for x in row) + "\n" for row in rows]
    (directory / "rows.tsv").write_text(header + "".join(lines))


def test_profile_directory(tmp_path, capsys):
    shutil.copy(SYNTHETIC, tmp_path / "linear-8192x4096x128256.csv")
    _write_manifest(
        tmp_path,
        [
            (
                "linear-8192x4096x128256",
                "perf-linear",
                "linear_ce",
                "fwdbwd",
                "plain",
                "",
                8192,
                4096,
                128256,
                512,
                0,
                41,
                "linear-8192x4096x128256.csv",
                "abc123",
                "2025.3.0",
            ),
            (
                "ce-32k",
                "perf-ce",
                "ce",
                "fwdbwd",
                "plain",
                "",
                16384,
                0,
                32768,
                512,
                1,
                3,
                "ce-32k.csv",
                "abc123",
                "2025.3.0",
            ),
        ],
    )
    status = ncu_summary.main([str(tmp_path), "--markdown"])
    assert status == 1  # the second row has no capture
    records = json.loads((tmp_path / "profile.json").read_text())
    assert [r["row"] for r in records] == ["linear-8192x4096x128256", "ce-32k"]
    linear, ce = records
    assert linear["error"] is None and linear["op"] == "linear_ce"
    assert (linear["n"], linear["h"], linear["v"]) == (8192, 4096, 128256)
    assert linear["budget_bytes"] == 512 << 20
    assert linear["commit"] == "abc123" and linear["ncu_version"] == "2025.3.0"
    assert linear["profile_seconds"] == 41 and linear["kernel_launches"] == 5
    assert ce["error"] and ce["kernels"] == [] and ce["total_kernel_us"] is None
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 4  # header, rule, one line per row
    assert table[2].startswith("| linear_ce 8192×4096×128256 fwdbwd plain | 972.4 (5) |")
    assert "| GEMMs 70 %: sm90_xmma_gemm" in table[2] and "linear_ce_rows_kernel 30 %" in table[2]
    assert "| 71 | 3,075 / 178 | 84 | 0.34 | 12.5 / 12.4 | 1 / 1 | 168 |" in table[2]
    assert "error" in table[3]


def test_ce_row_captured_on_an_h200():
    """A real capture (columns trimmed to what the summary reads, values untouched): ce 16384 x
    32768 bf16 fwd+grad, one op call = batch totals, row kernel, reduce."""
    text = (DATA / "ncu_raw_h200_ce_16384x32768.csv").read_text()
    kernels = ncu_summary.parse_raw_csv(text)
    assert [k["name"] for k in kernels] == [
        "ce_batch_totals_kernel",
        "ce_rows_kernel",
        "ce_reduce_kernel",
    ]
    rows = kernels[1]
    assert rows["duration_us"] == pytest.approx(632.416)  # "632,416" ns
    assert rows["dram_pct"] is not None and 50 < rows["dram_pct"] < 100  # gpu__dram_throughput
    assert rows["dram_read_gb_s"] == pytest.approx(1698.258, rel=1e-5)  # byte/s
    assert rows["dram_read_bytes"] == pytest.approx(1074005760)
    assert rows["grid_size"] == 16384 and rows["block_size"] == 256
    assert rows["ctas_per_sm_limit"]["registers"] == 5
    assert rows["ctas_per_sm_limit"]["shared_mem"] == 3
    assert rows["smem_per_block_bytes"] == 65536 + 896
    assert rows["top_stalls"][0][0] == "barrier"
    assert rows["device"] == "NVIDIA H200"
    record = ncu_summary.summarize_row({"row": "ce-32k"}, kernels)
    assert record["dominant_kernel"] == "ce_rows_kernel"
    assert record["gemm_time_share"] == 0
    assert record["by_kernel"][0]["time_share"] == pytest.approx(632.416 / 647.968, rel=1e-4)


@pytest.mark.parametrize("capture", sorted(DATA.glob("ncu_raw_h*.csv")), ids=lambda p: p.name)
def test_captured_on_a_gpu(capture):
    """Captures taken on the GPU: every launch has a time, figures within their ranges."""
    kernels = ncu_summary.parse_raw_csv(capture.read_text())
    assert kernels
    for k in kernels:
        assert k["duration_us"] is not None and k["duration_us"] > 0
        for key in ("dram_pct", "sm_pct", "occupancy_achieved_pct", "occupancy_theoretical_pct"):
            assert k[key] is not None and 0 <= k[key] <= 100.5, (k["name"], key, k[key])
        assert 0 < k["issue_per_scheduler"] <= 1.0
        assert k["registers_per_thread"] > 0 and k["block_size"] > 0 and k["grid_size"] > 0
        assert not math.isnan(k["dram_read_gb_s"])


def test_instruction_mix_per_element():
    # The dominant kernel's counts over N·V elements; warp instructions of a pipe count 32 lanes.
    kernel = {"thread_instructions": 6.4e9, "xu_instructions": 2.0e7, "fma_instructions": 1.0e8}
    mix = ncu_summary.per_element_mix(kernel, 1000, 200000)
    assert mix["thread_instructions"] == pytest.approx(32.0)
    assert mix["mufu_lanes"] == pytest.approx(3.2)
    assert mix["fma_lanes"] == pytest.approx(16.0)
    missing = ncu_summary.per_element_mix(
        {"thread_instructions": None, "xu_instructions": None, "fma_instructions": 5.0}, 10, 10
    )
    assert missing["thread_instructions"] is None and missing["mufu_lanes"] is None
    assert missing["fma_lanes"] == pytest.approx(1.6)
    assert ncu_summary.per_element_mix(kernel, None, 10) is None
    assert ncu_summary.per_element_mix(None, 10, 10) is None
