#!/usr/bin/env python3
"""Draws docs/img/*.png from the benchmark records in bench/results/*.json.

Reads every JSON array written by xent-bench --json or tools/compare_torch.py --json, keeps the
successful forward + backward measurements, and draws for each GPU (device name) found:

  ce_<device>.png              time vs vocabulary size, one line per implementation
  distill_<device>.png         the same per distillation kind
  linear_ce_<device>.png       time and peak extra memory vs tokens N (or per docs/performance.md shape when
                               the records have one N per shape)
  linear_ce_curve_<device>.png time / F against peak extra memory: xent at each workspace budget
                               and the anchors (compare_torch.py --suite linear-curve)
  linear_distill_curve_<device>.png  the same for linear_distill (--suite linear-distill-curve)

Implementations: xent, naive (xent-bench's materialised form), eager, compile (torch.compile),
liger, cce, quack — whichever the records hold. With --markdown it also prints the table README.md
shows. Usage: plot_results.py [--results DIR] [--out DIR] [--markdown]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from collections import defaultdict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPL_STYLE = {  # one colour and marker per implementation, the same in every picture
    "xent": ("#d62728", "o"),
    "naive": ("#7f7f7f", "x"),
    "eager": ("#1f77b4", "s"),
    "compile": ("#2ca02c", "^"),
    "liger": ("#9467bd", "D"),
    "cce": ("#ff7f0e", "v"),
    "cce_exact": ("#8c564b", "<"),
    "xent_torch": ("#e377c2", "P"),
    "quack": ("#17becf", "*"),
}
IMPL_LABEL = {
    "xent": "xent",
    "naive": "naive (materialised)",
    "eager": "torch eager",
    "compile": "torch.compile",
    "liger": "Liger-Kernel",
    "cce": "Cut Cross-Entropy",
    "cce_exact": "Cut Cross-Entropy (exact)",
    "xent_torch": "xent (Python)",
    "quack": "QuACK",
}


def load_records(results_dir: str) -> list:
    records = []

    # Oldest first, by the date in the file name (YYYY-MM-DD, a letter after it for a later run
    # of the day), so that latest() keeps the newest measurement of a case.
    def dated(path):
        found = re.search(r"(\d{4}-\d{2}-\d{2}[a-z]?)", os.path.basename(path))
        return (found.group(1) if found else "", os.path.basename(path))

    for path in sorted(glob.glob(os.path.join(results_dir, "*.json")), key=dated):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as error:
            print(f"plot_results: skipping {path}: {error}", file=sys.stderr)
            continue
        if isinstance(data, dict):
            data = [data]
        for record in data:
            # A/B records (ab_experiment, ab_side; scripts/ab-builds.sh and older ab_config ones) time
            # variants of the kernels that are not the library's state; they stay in
            # bench/results for the notes, not the plots.
            if isinstance(record, dict) and any(
                k in record for k in ("ab_experiment", "ab_side", "ab_config")
            ):
                continue
            if isinstance(record, dict) and not record.get("error") and record.get("time_ms"):
                record["_source"] = os.path.basename(path)
                records.append(record)
    return records


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def style(impl: str):
    return IMPL_STYLE.get(impl, ("#17becf", "."))


def latest(records: list) -> list:
    """One record per (device, impl, op, kind, shape, dtype, mode, options, top-k teacher): the
    last one read, the newest (without the device, a record of one GPU replaced the same case
    measured on another)."""
    keyed = {}
    for r in records:
        # h and the budget matter to the linear ops only (older records of the logits ops carry
        # h = null and no budget, and must still be replaced by newer ones of the same case).
        linear = r["op"].startswith("linear")
        key = (
            r.get("device"),
            r["impl"],
            r["op"],
            r.get("kind"),
            r["n"],
            r.get("h") or 0,
            r["v"],
            r["dtype"],
            r["mode"],
            r.get("options", "plain"),
            r.get("reduction", "mean"),
            r.get("budget_bytes") if linear else None,
            r.get("distribution") or "random",
            r.get("weight_dtype"),
            bool(r.get("autocast")),
            r.get("teacher_topk"),
            r.get("topk_mass"),
        )
        keyed[key] = r
    return list(keyed.values())


def plain_fwdbwd(records: list, op: str) -> list:
    """Plain-option forward + backward records of op, in its most measured dtype (one picture
    never mixes dtypes)."""
    rows = [
        r
        for r in records
        if r["op"] == op
        and r["mode"] == "fwdbwd"
        and r.get("options", "plain") == "plain"
        and r.get("reduction", "mean") == "mean"
        and not r.get("teacher_topk")  # a top-k teacher is another problem, not drawn here
    ]
    dtype = most_common(r["dtype"] for r in rows)
    return [r for r in rows if r["dtype"] == dtype]


def most_common(values):
    counts = defaultdict(int)
    for value in values:
        counts[value] += 1
    return max(counts, key=lambda value: (counts[value], value)) if counts else None


def save(plt, fig, path: str, rect=None) -> str:
    """Lays the figure out (within rect when given), writes it to path and closes it."""
    fig.tight_layout(**({"rect": rect} if rect else {}))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_time_vs_v(plt, ax, records: list, title: str) -> bool:
    """Time vs V at the most common N; returns False when there is nothing to draw."""
    n = most_common(r["n"] for r in records)
    rows = [r for r in records if r["n"] == n]
    by_impl = defaultdict(list)
    for r in rows:
        by_impl[r["impl"]].append((r["v"], r["time_ms"]["median"]))
    if not by_impl:
        return False
    for impl, points in sorted(by_impl.items()):
        points.sort()
        colour, marker = style(impl)
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            color=colour,
            marker=marker,
            label=IMPL_LABEL.get(impl, impl),
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("vocabulary size V")
    ax.set_ylabel("time, forward + backward (ms)")
    ax.set_title(f"{title}, N = {n}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return True


def plot_ce(plt, records: list, device: str, out_dir: str) -> list:
    rows = plain_fwdbwd(records, "ce")
    if not rows:
        return []
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    plot_time_vs_v(plt, ax, rows, "cross-entropy")
    fig.suptitle(device, fontsize=9)
    return [save(plt, fig, os.path.join(out_dir, f"ce_{slug(device)}.png"))]


def plot_distill(plt, records: list, device: str, out_dir: str) -> list:
    rows = plain_fwdbwd(records, "distill")
    kinds = sorted({r.get("kind") for r in rows if r.get("kind")})
    if not kinds:
        return []
    columns = min(3, len(kinds))
    lines = (len(kinds) + columns - 1) // columns
    fig, axes = plt.subplots(lines, columns, figsize=(4.6 * columns, 3.8 * lines), squeeze=False)
    for index, kind in enumerate(kinds):
        plot_time_vs_v(
            plt,
            axes[index // columns][index % columns],
            [r for r in rows if r.get("kind") == kind],
            kind,
        )
    for index in range(len(kinds), lines * columns):
        axes[index // columns][index % columns].axis("off")
    fig.suptitle(f"distillation — {device}", fontsize=9)
    return [save(plt, fig, os.path.join(out_dir, f"distill_{slug(device)}.png"))]


def plot_linear(plt, records: list, device: str, out_dir: str) -> list:
    # What users run: each library through its PyTorch API at its default settings (xent at its
    # default budget), on random logits, with a 16-bit weight.
    rows = [
        r
        for r in plain_fwdbwd(records, "linear_ce")
        if r.get("budget_bytes") is None
        and (r.get("distribution") or "random") == "random"
        and not r.get("weight_dtype")
        and r["impl"] in IMPL_LABEL
    ]
    if not rows:
        return []
    # The shapes xent was measured at, every implementation beside it there. A scan over N at one
    # (H, V) draws lines; one N per shape (the docs/performance.md rows) draws bars.
    xent_impl = "xent_torch" if any(r["impl"] == "xent_torch" for r in rows) else "xent"
    measured = {(r["n"], r["h"], r["v"]) for r in rows if r["impl"] == xent_impl}
    if measured:
        rows = [r for r in rows if (r["n"], r["h"], r["v"]) in measured]
    shapes = defaultdict(set)
    for r in rows:
        shapes[(r["h"], r["v"])].add(r["n"])
    scan_shape = max(shapes, key=lambda s: len(shapes[s]))
    fig, (time_ax, memory_ax) = plt.subplots(1, 2, figsize=(11, 4.4))
    impls = sorted({r["impl"] for r in rows})
    if len(shapes[scan_shape]) >= 2:
        h, v = scan_shape
        for impl in impls:
            points = sorted(
                (r["n"], r["time_ms"]["median"], r.get("peak_extra_bytes"))
                for r in rows
                if r["impl"] == impl and (r["h"], r["v"]) == scan_shape
            )
            colour, marker = style(impl)
            label = IMPL_LABEL.get(impl, impl)
            time_ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                color=colour,
                marker=marker,
                label=label,
            )
            memory = [(p[0], p[2] / 2**20) for p in points if p[2] is not None]
            if memory:
                memory_ax.plot(
                    [m[0] for m in memory],
                    [m[1] for m in memory],
                    color=colour,
                    marker=marker,
                    label=label,
                )
        for ax in (time_ax, memory_ax):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens N")
            ax.grid(True, which="both", alpha=0.3)
        time_ax.set_title(f"linear_ce time, H = {h}, V = {v}")
    else:
        labels = sorted({(r["n"], r["h"], r["v"]) for r in rows})
        width = 0.8 / max(len(impls), 1)
        for k, impl in enumerate(impls):
            by_shape = {(r["n"], r["h"], r["v"]): r for r in rows if r["impl"] == impl}
            xs = [i + k * width for i, shape in enumerate(labels) if shape in by_shape]
            found = [by_shape[shape] for shape in labels if shape in by_shape]
            colour, _ = style(impl)
            label = IMPL_LABEL.get(impl, impl)
            time_ax.bar(
                xs, [r["time_ms"]["median"] for r in found], width, color=colour, label=label
            )
            memory = [
                (x, r["peak_extra_bytes"] / 2**20)
                for x, r in zip(xs, found)
                if r.get("peak_extra_bytes") is not None
            ]
            if memory:
                memory_ax.bar(
                    [m[0] for m in memory],
                    [max(m[1], 1e-3) for m in memory],
                    width,
                    color=colour,
                    label=label,
                )
        ticks = [i + 0.4 - width / 2 for i in range(len(labels))]
        for ax in (time_ax, memory_ax):
            ax.set_xticks(ticks)
            ax.set_xticklabels([f"N={n}\nH={h}\nV={v}" for n, h, v in labels], fontsize=8)
            ax.grid(True, axis="y", alpha=0.3)
        memory_ax.set_yscale("log")
        time_ax.set_title("linear_ce time per docs/performance.md shape")
    time_ax.set_ylabel("time, forward + backward (ms)")
    memory_ax.set_ylabel("peak extra memory (MiB)")
    memory_ax.set_title("memory beyond inputs and their gradients")
    # One legend under both panels: inside, it would hide the tallest bars.
    handles, labels = time_ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(device, fontsize=9)
    path = os.path.join(out_dir, f"linear_ce_{slug(device)}.png")
    return [save(plt, fig, path, rect=(0, 0.07, 1, 1))]


def plot_linear_curve(plt, records: list, device: str, out_dir: str) -> list:
    """linear_ce's memory–time plane (compare_torch.py --suite linear-curve): time / F against
    peak extra memory, xent's workspace budgets as one line, its default and each anchor as
    points; one panel per docs/performance.md shape and distribution."""
    return _memory_time_plane(
        plt, records, device, out_dir, "linear_ce", "linear-curve", "three bare products"
    )


def plot_linear_distill_curve(plt, records: list, device: str, out_dir: str) -> list:
    """linear_distill's plane (compare_torch.py --suite linear-distill-curve), as linear_ce's."""
    return _memory_time_plane(
        plt,
        records,
        device,
        out_dir,
        "linear_distill",
        "linear-distill-curve",
        "four bare products",
    )


def _memory_time_plane(
    plt, records: list, device: str, out_dir: str, op: str, label: str, floor: str
) -> list:
    rows = [
        r
        for r in records
        if r["op"] == op
        and str(r.get("label", "")).startswith(label)
        and r.get("ratio")
        and r.get("peak_extra_bytes") is not None
    ]
    if not rows:
        return []
    shapes = sorted({(r["n"], r["h"], r["v"]) for r in rows}, key=lambda s: (s[1], s[2], s[0]))
    shapes.reverse()
    distributions = [d for d in ("random", "peaked") if any(_dist(r) == d for r in rows)]
    fig, axes = plt.subplots(
        len(distributions),
        len(shapes),
        figsize=(4.6 * len(shapes), 3.9 * len(distributions)),
        squeeze=False,
    )
    for i, distribution in enumerate(distributions):
        for j, (n, h, v) in enumerate(shapes):
            ax = axes[i][j]
            here = [
                r
                for r in rows
                if (r["n"], r["h"], r["v"]) == (n, h, v) and _dist(r) == distribution
            ]
            curve = sorted(
                (r for r in here if r["impl"] == "xent_torch" and r.get("budget_bytes")),
                key=lambda r: r["budget_bytes"],
            )
            if curve:
                color, marker = style("xent_torch")
                ax.plot(
                    [max(r["peak_extra_bytes"], 1) / 2**20 for r in curve],
                    [r["ratio"] for r in curve],
                    color=color,
                    marker=marker,
                    label="xent, budget 64 MiB … 4 GiB",
                )
                for r in curve:
                    ax.annotate(
                        _mib(r["budget_bytes"]),
                        (max(r["peak_extra_bytes"], 1) / 2**20, r["ratio"]),
                        textcoords="offset points",
                        xytext=(3, 4),
                        fontsize=6,
                        color=color,
                    )
            for r in here:
                if r["impl"] == "xent_torch" and r.get("budget_bytes"):
                    continue
                color, marker = style(r["impl"])
                name = IMPL_LABEL.get(r["impl"], r["impl"])
                if r["impl"] == "xent_torch":
                    name = "xent, default budget"
                ax.scatter(
                    max(r["peak_extra_bytes"], 1) / 2**20,
                    r["ratio"],
                    color=color,
                    marker=marker if r["impl"] != "xent_torch" else "*",
                    s=60,
                    label=name,
                    zorder=3,
                )
            ax.set_xscale("log")
            ax.set_xlabel("peak extra memory (MiB)")
            ax.set_ylabel(f"time / F ({floor})")
            ax.set_title(f"N={n}, H={h}, V={v}, {distribution}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6)
    fig.suptitle(f"{op} forward + backward, memory against time ({device})", fontsize=10)
    return [save(plt, fig, os.path.join(out_dir, f"{op}_curve_{slug(device)}.png"))]


def _dist(record: dict) -> str:
    return record.get("distribution") or "random"


def _mib(size: int) -> str:
    return f"{size >> 30} GiB" if size >= 1 << 30 else f"{size >> 20} MiB"


def markdown_table(records: list) -> str:
    lines = [
        "| device | op | N × H × V | dtype | impl | median ms | ratio | extra MiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    order = {impl: i for i, impl in enumerate(IMPL_STYLE)}
    for r in sorted(
        records,
        key=lambda r: (
            r["device"],
            r["op"],
            r.get("kind") or "",
            r["n"],
            r.get("h", 0),
            r["v"],
            r["mode"],
            order.get(r["impl"], 99),
        ),
    ):
        op = (
            r["op"]
            + (f" {r['kind']}" if r.get("kind") else "")
            + (" (no grad)" if r["mode"] == "fwd" else "")
        )
        shape = " × ".join(str(x) for x in (r["n"], r.get("h") or None, r["v"]) if x)
        ratio = (
            ""
            if r.get("ratio") is None
            else f"{r['ratio']:.2f} ({'of B' if r.get('ratio_kind') == 'bandwidth' else 'x F'})"
        )
        extra = "" if r.get("peak_extra_bytes") is None else f"{r['peak_extra_bytes'] / 2**20:.0f}"
        lines.append(
            f"| {r['device']} | {op} | {shape} | {r['dtype']} | {r['impl']} | "
            f"{r['time_ms']['median']:.3f} | {ratio} | {extra} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=os.path.join(REPO, "bench", "results"))
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "img"))
    parser.add_argument("--markdown", action="store_true", help="print README's table")
    args = parser.parse_args(argv)
    records = latest(load_records(args.results))
    if not records:
        print(f"plot_results: no successful records in {args.results}/*.json", file=sys.stderr)
        return 1
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_results: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    by_device = defaultdict(list)
    for r in records:
        by_device[r.get("device", "unknown")].append(r)
    written = []
    for device, rows in sorted(by_device.items()):
        for plot in (
            plot_ce,
            plot_distill,
            plot_linear,
            plot_linear_curve,
            plot_linear_distill_curve,
        ):
            written += plot(plt, rows, device, args.out)
    for path in written:
        print(f"plot_results: wrote {os.path.relpath(path, REPO)}", file=sys.stderr)
    if args.markdown:
        print(markdown_table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
