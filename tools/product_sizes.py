"""How fast the fused linear losses' chunk and block products run at the sizes the CUDA planner
chooses between, against the whole product: the data to price short row chunks and schedule
(d)'s tiles (docs/archive/perf-notes.md, decision 143's "next"). torch.matmul in bf16 (cuBLAS,
as a proxy for xent's own cuBLASLt calls, which time their candidates and may pick others).

For one shape (N, H, V) it times, per row-chunk size c, the three products of a chunk: logits
(c × H)·(H × V), ∂W = Gᵀ·h (V × c)·(c × H), ∂h = G·W (c × V)·(V × H);
and per (d) tile (r rows × b columns): logits (r × H)·(H × b), ∂W of the block (b × r)·(r × H),
∂h of the tile (r × b)·(b × H). Outputs are bf16: the fp32 sums the schedules add into are priced
apart by the model (a read and a write of the accumulator). Each figure is the time of one product
times the number of such products that cover N × V, over the whole product's time: 1.00 is as
fast as the whole product, which is what the planner's model assumes.

    PYTHONPATH=python python3 tools/product_sizes.py --n 32768 --h 768 --v 128256 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from compare_torch import Timer, summarize  # noqa: E402


def timed(fn, repeat: int, device: str) -> float:
    """Median milliseconds of fn (compare_torch.py's timer: two warm-ups, then `repeat` calls)."""
    return summarize(Timer(device, 2, repeat).run(lambda _: fn()))["median"]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--h", type=int, default=768)
    parser.add_argument("--v", type=int, default=128256)
    parser.add_argument("--chunks", default="512,1024,2432,4096,6656,8192,16384,32768")
    parser.add_argument("--tile-rows", default="4096,8192,16384,32768")
    parser.add_argument("--block-columns", default="1024,1792,3072,4096,8192")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    n, h, v = args.n, args.h, args.v
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    bf16 = torch.bfloat16
    hidden = torch.randn(n, h, device=dev, dtype=bf16)
    weight = torch.randn(v, h, device=dev, dtype=bf16) / h**0.5
    grad = torch.randn(n, v, device=dev, dtype=bf16)
    whole = timed(lambda: hidden @ weight.T, args.repeat, dev)
    record = {
        "n": n,
        "h": h,
        "v": v,
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
    }
    record["whole_ms"] = whole
    print(f"({n}, {h}, {v}) bf16 on {record['device']}: one whole product {whole:.3f} ms")

    chunks = []
    for c in (int(x) for x in args.chunks.split(",")):
        if c > n:
            continue
        count = n / c
        h_c, g_c = hidden[:c], grad[:c]
        logits = timed(lambda: h_c @ weight.T, args.repeat, dev) * count
        dweight = timed(lambda: g_c.T @ h_c, args.repeat, dev) * count
        dhidden = timed(lambda: g_c @ weight, args.repeat, dev) * count
        row = {"chunk_rows": c, "logits": logits / whole, "dW": dweight / whole}
        row["dh"] = dhidden / whole
        chunks.append(row)
        print(
            f"  row chunk {c:6d}: logits {row['logits']:.2f}  dW {row['dW']:.2f}"
            f"  dh {row['dh']:.2f}  (x the whole product's time, per N x V)"
        )
    record["row_chunks"] = chunks

    tiles = []
    for r in (int(x) for x in args.tile_rows.split(",")):
        for b in (int(x) for x in args.block_columns.split(",")):
            if r > n or b > v:
                continue
            count = (n / r) * math.ceil(v / b)
            h_r, g_rb, w_b = hidden[:r], grad[:r, :b], weight[:b]
            logits = timed(lambda: h_r @ w_b.T, args.repeat, dev) * count
            dweight = timed(lambda: g_rb.T @ h_r, args.repeat, dev) * count
            dhidden = timed(lambda: g_rb @ w_b, args.repeat, dev) * count
            row = {"tile_rows": r, "block_columns": b, "logits": logits / whole}
            row.update({"dW": dweight / whole, "dh": dhidden / whole})
            tiles.append(row)
            print(
                f"  (d) tile {r:6d} x {b:5d}: logits {row['logits']:.2f}  dW {row['dW']:.2f}"
                f"  dh {row['dh']:.2f}"
            )
    record["d_tiles"] = tiles
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
