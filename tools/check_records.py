#!/usr/bin/env python3
"""Checks that a benchmark record file holds what docs/performance.md asks of a record (used by ctest).

Usage: check_records.py FILE [MIN_RECORDS]: exits 1 with a message on the first problem.
"""

import json
import math
import sys

REQUIRED = (
    "op",
    "impl",
    "mode",
    "options",
    "dtype",
    "n",
    "h",
    "v",
    "device",
    "time_ms",
    "copy_bandwidth_bytes_per_s",
    "gemm_floor_ms",
    "ratio",
    "peak_extra_bytes",
    "loss_rel_err",
    "grad_rel_err",
    "error",
    "commit",
)


def main() -> int:
    path = sys.argv[1]
    minimum = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    with open(path) as f:
        records = json.load(f)
    if not isinstance(records, list) or len(records) < minimum:
        print(f"{path}: expected a JSON array of at least {minimum} records", file=sys.stderr)
        return 1
    for index, record in enumerate(records):
        if not isinstance(record, dict):
            print(f"{path}[{index}]: not an object", file=sys.stderr)
            return 1
        missing = [key for key in REQUIRED if key not in record]
        if missing:
            print(f"{path}[{index}]: missing {', '.join(missing)}", file=sys.stderr)
            return 1
        if record["error"] is None:
            times = record["time_ms"]
            if not (0 < times["p20"] <= times["median"] <= times["p80"]):
                print(f"{path}[{index}]: times out of order: {times}", file=sys.stderr)
                return 1
            # null: not measured (the GPU suites skip the float64 check); a number must be finite
            error = record["loss_rel_err"]
            if record["impl"] == "xent" and error is not None and not math.isfinite(error):
                print(f"{path}[{index}]: no agreement figure", file=sys.stderr)
                return 1
        if not record["commit"]:
            print(f"{path}[{index}]: empty commit", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
