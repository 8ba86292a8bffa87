"""Where linear_distill with a top-k teacher spends a training step, kernel by kernel: the CUDA
time of each kernel per step (torch.profiler, three steps after three warm-ups) at
(8192, 4096, 128256) bf16, k = 64, forward KL, for the tail and renormalize masses. The inputs are
drawn as compare_torch.py draws them (hidden uniform in [-1, 1], the head scaled so that the logits
have a standard deviation of about 4.6; the teacher the student's logits plus noise of scale 0.5).
The steps do not clear .grad, so each profile also holds autograd's bf16 gradient additions.
The record names the commit from XENT_COMMIT.

    PYTHONPATH=python OUT=DIR XENT_COMMIT=$(git rev-parse HEAD) python3 tools/profile_linear_topk.py
"""

import json
import os

import torch
from torch.profiler import ProfilerActivity, profile

import xent.functional as xf

n, h, v, k = 8192, 4096, 128256, 64
g = torch.Generator(device="cuda").manual_seed(0)
hid = (torch.rand(n, h, device="cuda", generator=g) * 2 - 1).bfloat16().requires_grad_()
W = (
    ((torch.rand(v, h, device="cuda", generator=g) * 2 - 1) * 8 * (3 / h) ** 0.5)
    .bfloat16()
    .requires_grad_()
)
with torch.no_grad():
    ids, lps = [], []
    for s in range(0, n, 1024):
        st = (hid[s : s + 1024] @ W.t()).float()
        val, ch = (
            (st + 0.5 * torch.randn(st.shape, device="cuda", generator=g))
            .log_softmax(-1)
            .topk(k, -1)
        )
        ids.append(ch)
        lps.append(val)
    ids, lps = torch.cat(ids), torch.cat(lps)
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
    "commit": os.environ.get("XENT_COMMIT", ""),
    "case": "linear_distill forward_kl (8192, 4096, 128256) bf16 fwdbwd, top-64 teacher",
    # per mass: [kernel name (90 characters), launches in the three steps, ms per step]
    "kernels_per_step": out,
}
with open(os.path.join(os.environ.get("OUT", "."), "prof.json"), "w") as f:
    json.dump(record, f, indent=1)
