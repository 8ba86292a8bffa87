"""Where linear_distill with a top-k teacher spends a training step, kernel by kernel: the CUDA
time of each kernel per step (torch.profiler, three steps after three warm-ups) at
(8192, 4096, 128256) bf16, k = 64, forward KL, for the tail and renormalize masses, on the inputs
compare_torch.py's top-k suite draws (make_inputs). The steps do not clear .grad, so each profile
also holds autograd's bf16 gradient additions.

    PYTHONPATH=python OUT=DIR python3 tools/profile_linear_topk.py   # writes DIR/prof.json
"""

import json
import os
import pathlib
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import xent.functional as xf

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from compare_torch import git_commit, make_inputs  # noqa: E402

case = dict(op="linear_distill", n=8192, h=4096, v=128256, mode="fwdbwd", teacher_topk=64)
x = make_inputs(case, torch.bfloat16, "cuda", seed=0)
hid, W, ids, lps = x["hidden"], x["weight"], x["topk_ids"], x["topk_logprobs"]
out = {}
for mass in ("tail", "renormalize"):
    f = lambda: xf.linear_distill(hid, W, teacher=xf.TopK(ids, lps, mass), kind="forward_kl")
    for _ in range(3):
        f().backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        for _ in range(3):
            f().backward()
        torch.cuda.synchronize()
    rows = []
    for e in p.key_averages():
        if e.device_time_total > 0 and e.device_type.name == "CUDA":
            rows.append((e.key[:90], e.count, round(e.device_time_total / 3 / 1e3, 3)))
    rows.sort(key=lambda r: -r[2])
    out[mass] = rows[:14]
    print(mass)
    for name, count, ms in rows[:14]:
        print(f"  {ms:8.3f} ms  x{count // 3:<3d} {name}")
record = {
    "device": torch.cuda.get_device_name(),
    "commit": git_commit(),
    "case": "linear_distill forward_kl (8192, 4096, 128256) bf16 fwdbwd, top-64 teacher",
    # per mass: [kernel name (90 characters), launches in the three steps, ms per step]
    "kernels_per_step": out,
}
with open(os.path.join(os.environ.get("OUT", "."), "prof.json"), "w") as f:
    json.dump(record, f, indent=1)
