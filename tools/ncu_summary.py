#!/usr/bin/env python3
"""Turns the ncu captures of scripts/gpu-profile.sh into one JSON record per docs/performance.md row and a
markdown table.

Input: a profile directory holding rows.tsv (one line per row, written by gpu-profile.sh: row id,
label, op, mode, options, kind, n, h, v, budget MiB, exit status, seconds, CSV file) and, per row,
the CSV of `ncu --import ROW.ncu-rep --csv --page raw`: a header of column names (launch
attributes, then one column per metric), a units row whose ID cell is empty, then one line per
profiled kernel launch. Each row profiles exactly one op call, so every kernel line belongs to it.

ncu's CSV quirks handled here: lines of the profiler ("==PROF==", "==WARNING==") mixed in, the
units row, values with thousands separators ("1,234.5"), "n/a" and empty cells, scaled units
("usecond", "msecond", "Gbyte/second", "Kbyte/block") that differ between kernels of one report.

Usage:
  tools/ncu_summary.py PROFILE_DIR [--json FILE] [--markdown]
  tools/ncu_summary.py --csv ROW.csv [--label L] [--markdown]     (one capture, no rows.tsv)
JSON goes to FILE (default PROFILE_DIR/profile.json); --markdown prints the table on stdout.
"""

import argparse
import csv
import io
import json
import math
import os
import re
import sys

# The metrics read, by what they mean. Where ncu versions spell one differently, the names are
# tried in order.
DURATION = ("gpu__time_duration.sum",)
DRAM_PCT = (
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
)
DRAM_READ_RATE = ("dram__bytes_read.sum.per_second",)
DRAM_WRITE_RATE = ("dram__bytes_write.sum.per_second",)
DRAM_READ_BYTES = ("dram__bytes_read.sum",)
DRAM_WRITE_BYTES = ("dram__bytes_write.sum",)
SM_PCT = ("sm__throughput.avg.pct_of_peak_sustained_elapsed",)
ISSUE = ("smsp__issue_active.avg.per_cycle_active",)
INSTRUCTIONS = ("smsp__inst_executed.sum", "sm__inst_executed.sum")
# The instruction mix behind the arithmetic budget (docs/archive/perf-notes.md): thread-level instructions
# (inactive lanes not counted), warp instructions issued to the special-function pipe (MUFU: ex2,
# lg2, rcp, tanh; 16 lanes per clock per SM) and to the FMA pipes, and the SM clock of the run.
THREAD_INSTRUCTIONS = ("smsp__thread_inst_executed.sum",)
XU_INSTRUCTIONS = ("sm__inst_executed_pipe_xu.sum", "smsp__inst_executed_pipe_xu.sum")
FMA_INSTRUCTIONS = ("sm__inst_executed_pipe_fma.sum", "smsp__inst_executed_pipe_fma.sum")
SM_CLOCK = ("sm__cycles_elapsed.avg.per_second",)
OCC_THEORETICAL = ("sm__maximum_warps_per_active_cycle_pct",)
OCC_ACHIEVED = ("sm__warps_active.avg.pct_of_peak_sustained_active",)
REGISTERS = ("launch__registers_per_thread",)
SMEM_STATIC = ("launch__shared_mem_per_block_static",)
SMEM_DYNAMIC = ("launch__shared_mem_per_block_dynamic",)
GRID = ("launch__grid_size",)
BLOCK = ("launch__block_size",)
LIMIT_REGISTERS = ("launch__occupancy_limit_registers",)
LIMIT_SMEM = ("launch__occupancy_limit_shared_mem",)
LIMIT_WARPS = ("launch__occupancy_limit_warps",)
LIMIT_BLOCKS = ("launch__occupancy_limit_blocks",)
CLUSTER = ("launch__cluster_size",)
_STALL_PREFIX = "smsp__average_warps_issue_stalled_"
_STALL_SUFFIX = "_per_issue_active.ratio"
# Tensor pipe busy: on Hopper the wgmma work counts in the tensor pipe's active cycles; older
# names and the per-instruction view follow as fall-backs.
TENSOR_PCT = (
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
)

_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_BINARY = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_TIME_US = {
    "nsecond": 1e-3,
    "ns": 1e-3,
    "usecond": 1.0,
    "us": 1.0,
    "msecond": 1e3,
    "ms": 1e3,
    "second": 1e6,
    "s": 1e6,
}


class NcuCsvError(ValueError):
    """The text is not an `ncu --csv --page raw` capture."""


def parse_number(text):
    """A float from an ncu cell, or None for "n/a", "", or a non-numeric cell."""
    if text is None:
        return None
    cleaned = text.strip().replace(",", "")
    if cleaned.endswith("%"):
        cleaned = cleaned[:-1]
    if cleaned == "" or cleaned.lower() in ("n/a", "nan", "-"):
        return None
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _byte_scale(unit):
    """Bytes per unit for "byte", "Kbyte", "MiByte", "Gibyte" ...; None when not a byte unit."""
    match = re.fullmatch(r"([kmgtp]i?)?byte", unit.strip().lower())
    if not match:
        return None
    prefix = match.group(1) or ""
    return _BINARY[prefix] if prefix.endswith("i") else _SI[prefix]


def to_base(value, unit):
    """The value in base units: seconds are microseconds here (the unit of kernel times),
    byte rates are GB/s, byte counts are bytes, "x/block" counts are per block."""
    if value is None:
        return None
    unit = (unit or "").strip()
    low = unit.lower()
    if low in _TIME_US:
        return value * _TIME_US[low]
    if "/" in low:
        numerator, denominator = low.split("/", 1)
        scale = _byte_scale(numerator)
        if scale is not None and denominator in _TIME_US:
            # Byte rates in GB/s: bytes per second / 1e9.
            per_second = value * scale / (_TIME_US[denominator] * 1e-6)
            return per_second / 1e9
        if scale is not None:
            return value * scale  # e.g. Kbyte/block -> bytes per block
        return value
    scale = _byte_scale(low)
    if scale is not None:
        return value * scale
    return value


def _records(text):
    """Header, units and data lines of the CSV, with the profiler's own lines dropped."""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("==")]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    start = next((i for i, row in enumerate(rows) if row and row[0].strip() == "ID"), None)
    if start is None:
        raise NcuCsvError('no header line starting with "ID" (is this `ncu --csv --page raw`?)')
    header = [cell.strip() for cell in rows[start]]
    rest = rows[start + 1 :]
    units = [""] * len(header)
    if rest and rest[0] and rest[0][0].strip() == "":
        units = [cell.strip() for cell in rest[0]] + [""] * (len(header) - len(rest[0]))
        rest = rest[1:]
    return header, units, [row for row in rest if row and row[0].strip() != ""]


def short_kernel_name(name):
    """The kernel's own name without namespace, template arguments or parameters:
    "void xent::cuda::ce_rows_kernel<(int)8, bf16>(Params)" -> "ce_rows_kernel"."""
    # ncu prints an anonymous namespace as "(anonymous namespace)" or, in some versions, as a
    # bare "unnamed>" whose lone '>' would upset the bracket count below.
    text = (
        name.strip().replace("(anonymous namespace)", "anonymous").replace("unnamed>", "anonymous")
    )
    depth, cut = 0, []
    for ch in text:  # drop everything inside <...> and (...)
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth = max(0, depth - 1)
        elif depth == 0:
            cut.append(ch)
    base = "".join(cut).strip()
    base = base.split()[-1] if base.split() else text
    return base.split("::")[-1] or text


def parse_raw_csv(text):
    """One dict per kernel launch, in launch order, with the figures of the summary in base
    units (µs, %, GB/s, bytes) and every raw metric under "metrics" (value in base units)."""
    header, units, rows = _records(text)
    column = {name: i for i, name in enumerate(header)}

    kernels = []
    for row in rows:
        row = row + [""] * (len(header) - len(row))
        metrics = {}
        for name, i in column.items():
            if "__" not in name:
                continue
            value = to_base(parse_number(row[i]), units[i])
            if value is not None:
                metrics[name] = value

        def pick(names):
            for metric in names:
                if metric in metrics:
                    return metrics[metric]
            return None

        def cell(name):
            return row[column[name]].strip() if name in column else None

        # Stall reasons (WarpStateStats): cycles a warp spent stalled per issued instruction.
        stalls = sorted(
            (
                (m[len(_STALL_PREFIX) : -len(_STALL_SUFFIX)], v)
                for m, v in metrics.items()
                if m.startswith(_STALL_PREFIX) and m.endswith(_STALL_SUFFIX)
            ),
            key=lambda item: -item[1],
        )
        issue = pick(ISSUE)
        smem = [pick(SMEM_STATIC), pick(SMEM_DYNAMIC)]
        tensor_metric = next((m for m in TENSOR_PCT if m in metrics), None)
        full_name = cell("Kernel Name") or cell("Function Name") or "?"
        kernels.append(
            {
                "id": int(parse_number(cell("ID")) or 0),
                "name": short_kernel_name(full_name),
                "full_name": full_name,
                "duration_us": pick(DURATION),
                "dram_pct": pick(DRAM_PCT),
                "dram_read_gb_s": pick(DRAM_READ_RATE),
                "dram_write_gb_s": pick(DRAM_WRITE_RATE),
                "dram_read_bytes": pick(DRAM_READ_BYTES),
                "dram_write_bytes": pick(DRAM_WRITE_BYTES),
                "sm_pct": pick(SM_PCT),
                "issue_per_scheduler": issue,
                # ncu's "no eligible": the share of cycles in which a scheduler issued nothing.
                "no_eligible_pct": None if issue is None else max(0.0, 100.0 * (1.0 - issue)),
                "instructions": pick(INSTRUCTIONS),
                "thread_instructions": pick(THREAD_INSTRUCTIONS),
                "xu_instructions": pick(XU_INSTRUCTIONS),
                "fma_instructions": pick(FMA_INSTRUCTIONS),
                "sm_clock_hz": pick(SM_CLOCK),
                "occupancy_theoretical_pct": pick(OCC_THEORETICAL),
                "occupancy_achieved_pct": pick(OCC_ACHIEVED),
                "registers_per_thread": pick(REGISTERS),
                "smem_per_block_bytes": None
                if all(s is None for s in smem)
                else sum(s for s in smem if s is not None),
                "grid_size": pick(GRID),
                "block_size": pick(BLOCK),
                "grid": cell("Grid Size"),
                "block": cell("Block Size"),
                "ctas_per_sm_limit": {
                    "registers": pick(LIMIT_REGISTERS),
                    "shared_mem": pick(LIMIT_SMEM),
                    "warps": pick(LIMIT_WARPS),
                    "blocks": pick(LIMIT_BLOCKS),
                },
                "tensor_pct": metrics.get(tensor_metric) if tensor_metric else None,
                "tensor_metric": tensor_metric,
                "cluster_size": pick(CLUSTER),
                "top_stalls": [[reason, value] for reason, value in stalls if reason != "selected"][
                    :4
                ],
                "device": cell("device__attribute_display_name") or None,
                "metrics": metrics,
            }
        )
    return kernels


# Figures of a kernel group weighted by each launch's time (a share-of-peak over the group's span).
_WEIGHTED = (
    "dram_pct",
    "dram_read_gb_s",
    "dram_write_gb_s",
    "sm_pct",
    "issue_per_scheduler",
    "no_eligible_pct",
    "occupancy_theoretical_pct",
    "occupancy_achieved_pct",
    "tensor_pct",
    "sm_clock_hz",
)
_SUMMED = (
    "duration_us",
    "dram_read_bytes",
    "dram_write_bytes",
    "instructions",
    "thread_instructions",
    "xu_instructions",
    "fma_instructions",
)
_FIRST = (
    "registers_per_thread",
    "smem_per_block_bytes",
    "grid_size",
    "block_size",
    "grid",
    "block",
    "cluster_size",
    "ctas_per_sm_limit",
)


_GEMM_NAME = re.compile(r"nvjet|gemm|xmma|cutlass|cublas", re.IGNORECASE)


def is_gemm(name):
    """cuBLAS/cuBLASLt kernels (nvjet_*, *gemm*, sm90_xmma_*, cutlass_*): the matrix products of
    the fused linear ops, as opposed to xent's own kernels."""
    return bool(_GEMM_NAME.search(name or ""))


def group_by_kernel(kernels):
    """Launches of the same kernel merged: count, summed time and bytes, time-weighted figures;
    launch shape of the first launch. Sorted by time, largest first."""
    groups = {}
    for k in kernels:
        groups.setdefault(k["name"], []).append(k)
    total = sum(k["duration_us"] or 0.0 for k in kernels)
    merged = []
    for name, launches in groups.items():
        entry = {"name": name, "launches": len(launches)}
        for key in _SUMMED:
            values = [k[key] for k in launches if k[key] is not None]
            entry[key] = sum(values) if values else None
        weight = [k["duration_us"] or 0.0 for k in launches]
        for key in _WEIGHTED:
            pairs = [(w, k[key]) for w, k in zip(weight, launches) if k[key] is not None]
            span = sum(w for w, _ in pairs)
            if not pairs:
                entry[key] = None
            elif span > 0:
                entry[key] = sum(w * v for w, v in pairs) / span
            else:
                entry[key] = sum(v for _, v in pairs) / len(pairs)
        for key in _FIRST:
            entry[key] = launches[0][key]
        entry["top_stalls"] = max(launches, key=lambda k: k["duration_us"] or 0.0)["top_stalls"]
        entry["time_share"] = (entry["duration_us"] or 0.0) / total if total > 0 else None
        merged.append(entry)
    merged.sort(key=lambda e: -(e["duration_us"] or 0.0))
    return merged


def per_element_mix(kernel, n, v):
    """The dominant kernel's instructions per logit (N·V elements): all thread instructions, and
    the lanes issued to the MUFU (XU) and FMA pipes (warp instructions × 32). None where the
    capture lacks the metric or the row has no N × V shape."""
    if kernel is None or not n or not v:
        return None
    elements = float(n) * float(v)

    def per(value, lanes=1.0):
        return None if value is None else value * lanes / elements

    return {
        "thread_instructions": per(kernel.get("thread_instructions")),
        "mufu_lanes": per(kernel.get("xu_instructions"), 32.0),
        "fma_lanes": per(kernel.get("fma_instructions"), 32.0),
    }


def summarize_row(meta, kernels):
    """One JSON record for a docs/performance.md row: what was run, every kernel launch of the one op call,
    the launches grouped by kernel, and the summed kernel time with each kernel's share."""
    total = sum(k["duration_us"] or 0.0 for k in kernels)
    record = {"record": "ncu-profile"}
    record.update(meta)
    record["kernels"] = [
        {key: value for key, value in k.items() if key != "metrics"} for k in kernels
    ]
    for k in record["kernels"]:
        k["time_share"] = (k["duration_us"] or 0.0) / total if total > 0 else None
    record["by_kernel"] = group_by_kernel(kernels)
    record["kernel_launches"] = len(kernels)
    record["total_kernel_us"] = total if kernels else None
    record["dominant_kernel"] = record["by_kernel"][0]["name"] if kernels else None
    gemm_us = sum(k["duration_us"] or 0.0 for k in kernels if is_gemm(k["full_name"]))
    record["gemm_time_share"] = gemm_us / total if total > 0 else None
    record["per_element"] = per_element_mix(
        record["by_kernel"][0] if kernels else None, meta.get("n"), meta.get("v")
    )
    devices = {k["device"] for k in kernels if k["device"]}
    if devices and "device" not in record:
        record["device"] = sorted(devices)[0]
    return record


def _read_manifest(directory):
    path = os.path.join(directory, "rows.tsv")
    if not os.path.exists(path):
        raise SystemExit(f"ncu_summary: {path} not found (written by scripts/gpu-profile.sh)")
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle, delimiter="\t")
        return list(reader)


def _int_or_none(text):
    value = parse_number(text)
    return None if value is None else int(value)


def summarize_directory(directory):
    records = []
    for entry in _read_manifest(directory):
        meta = {
            "row": entry["row"],
            "label": entry["label"],
            "op": entry["op"],
            "mode": entry["mode"],
            "options": entry["options"],
            "kind": entry["kind"] or None,
            "dtype": "bfloat16",
            "n": _int_or_none(entry["n"]),
            "h": _int_or_none(entry["h"]),
            "v": _int_or_none(entry["v"]),
            "budget_bytes": (_int_or_none(entry["budget_mib"]) or 0) << 20 or None,
            "profile_status": _int_or_none(entry["status"]),
            "profile_seconds": _int_or_none(entry["seconds"]),
            "csv": entry["csv"],
        }
        for key in ("commit", "ncu_version"):
            if entry.get(key):
                meta[key] = entry[key]
        kernels, error = [], None
        csv_path = os.path.join(directory, entry["csv"])
        try:
            with open(csv_path, encoding="utf-8", errors="replace") as handle:
                kernels = parse_raw_csv(handle.read())
            if not kernels:
                error = "no kernel was profiled"
        except (OSError, NcuCsvError) as problem:
            error = str(problem)
        if meta["profile_status"] not in (0, None) and error is None:
            error = f"profiling exited with status {meta['profile_status']}"
        record = summarize_row(meta, kernels)
        record["error"] = error
        records.append(record)
    return records


def _fmt(value, digits=0, scale=1.0):
    if value is None:
        return "–"
    return f"{value * scale:,.{digits}f}"


def _brief(name, limit=40):
    """cuBLAS kernel names run past 100 characters; the table keeps their head (JSON has all)."""
    return name if len(name) <= limit else name[: limit - 1] + "…"


def markdown_table(records):
    """One line per row: the dominant kernel's figures and the time shares of the kernels."""
    lines = [
        "| row | kernel µs (launches) | dominant kernel | DRAM % | read / write GB/s | SM % "
        "| issue / scheduler | occupancy theor. / achieved % | CTA limit regs / smem "
        "| regs | smem KiB | grid × block | tensor % | instr / MUFU / FMA per element "
        "| top stalls (cycles / issue) | time shares |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
        "| --- |",
    ]
    for r in records:
        shape = "×".join(str(x) for x in (r.get("n"), r.get("h"), r.get("v")) if x)
        title = (
            " ".join(
                x for x in (r.get("op"), r.get("kind"), shape, r.get("mode"), r.get("options")) if x
            )
            or r.get("row")
            or "?"
        )
        if r.get("error") or not r["by_kernel"]:
            lines.append(f"| {title} | – | error: {r.get('error')} |" + " |" * 13)
            continue
        d = r["by_kernel"][0]
        limits = d["ctas_per_sm_limit"] or {}
        shares = ", ".join(
            f"{_brief(g['name'])} {_fmt(g['time_share'], 0, 100)} %" for g in r["by_kernel"][:4]
        )
        if r.get("gemm_time_share"):
            shares = f"GEMMs {_fmt(r['gemm_time_share'], 0, 100)} %: " + shares
        stalls = ", ".join(f"{reason} {value:.2f}" for reason, value in d["top_stalls"][:3])
        mix = r.get("per_element") or {}
        mix_text = " / ".join(
            _fmt(mix.get(key), 1) for key in ("thread_instructions", "mufu_lanes", "fma_lanes")
        )
        if len(r["by_kernel"]) > 4:
            shares += f", {len(r['by_kernel']) - 4} more"
        lines.append(
            f"| {title} | {_fmt(r['total_kernel_us'], 1)} ({r['kernel_launches']}) "
            f"| {_brief(d['name'])} ×{d['launches']} ({_fmt(d['time_share'], 0, 100)} %) "
            f"| {_fmt(d['dram_pct'])} | {_fmt(d['dram_read_gb_s'])} / {_fmt(d['dram_write_gb_s'])} "
            f"| {_fmt(d['sm_pct'])} | {_fmt(d['issue_per_scheduler'], 2)} "
            f"| {_fmt(d['occupancy_theoretical_pct'], 1)} / {_fmt(d['occupancy_achieved_pct'], 1)} "
            f"| {_fmt(limits.get('registers'))} / {_fmt(limits.get('shared_mem'))} "
            f"| {_fmt(d['registers_per_thread'])} | {_fmt(d['smem_per_block_bytes'], 1, 1 / 1024)} "
            f"| {_fmt(d['grid_size'])} × {_fmt(d['block_size'])} | {_fmt(d['tensor_pct'])} "
            f"| {mix_text} | {stalls or '–'} | {shares} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", nargs="?", help="profile directory with rows.tsv")
    parser.add_argument("--csv", help="summarize one capture instead of a profile directory")
    parser.add_argument("--label", default="", help="label of the row of --csv")
    parser.add_argument(
        "--json", help="JSON output (default DIRECTORY/profile.json; none with --csv unless given)"
    )
    parser.add_argument("--markdown", action="store_true", help="print the markdown table")
    args = parser.parse_args(argv)
    if bool(args.directory) == bool(args.csv):
        parser.error("give a profile directory or --csv FILE (one of them)")

    if args.csv:
        with open(args.csv, encoding="utf-8", errors="replace") as handle:
            kernels = parse_raw_csv(handle.read())
        records = [
            summarize_row(
                {"row": args.label or os.path.basename(args.csv), "label": args.label}, kernels
            )
        ]
        json_path = args.json
    else:
        records = summarize_directory(args.directory)
        json_path = args.json or os.path.join(args.directory, "profile.json")
    if json_path:
        with open(json_path, "w") as handle:
            json.dump(records, handle, indent=1)
            handle.write("\n")
        print(f"ncu_summary: wrote {len(records)} records to {json_path}", file=sys.stderr)
    if args.markdown:
        print(markdown_table(records))
    return 1 if any(r.get("error") for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
