#!/usr/bin/env bash
# Installs the newest wheel of dist/ into a fresh virtual environment and checks it there: the
# package comes from the wheel (not this source tree), its binding finds OpenBLAS, libgfortran
# and libgomp inside the wheel (not on this system), and cross_entropy and linear_cross_entropy
# match PyTorch, forward and backward. torch comes from the system's site-packages (the venv is
# created with --system-site-packages, so no torch download). Ends with "wheel-smoke: N passed,
# M failed"; exits 1 on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
wheel="$(ls -t dist/xent-*manylinux*.whl | head -n 1)"
venv="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$venv")"' EXIT
"$PYTHON" -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "$wheel"
cd "$(dirname "$venv")"  # away from the source tree, so `import xent` can only find the wheel
"$venv/bin/python" - "$wheel" <<'PY'
import os, subprocess, sys
import torch
import xent
passed = failed = 0
def check(name, ok, detail=""):
    global passed, failed
    passed, failed = passed + bool(ok), failed + (not ok)
    print(f"wheel smoke: {name}: {'ok' if ok else 'FAILED'} {detail}")
package = os.path.dirname(xent.__file__)
check("installed from the wheel", "site-packages" in package, package)
binding = [f for f in os.listdir(package) if f.startswith("_C") and f.endswith(".so")][0]
ldd = subprocess.run(["ldd", os.path.join(package, binding)], capture_output=True, text=True).stdout
for lib in ("libopenblas", "libgfortran", "libgomp"):
    lines = [l for l in ldd.splitlines() if lib in l]
    check(f"{lib} vendored", bool(lines) and all("xent.libs" in l for l in lines),
          lines[0].strip() if lines else "(not linked)")
torch.manual_seed(0)
x = torch.randn(37, 1031, dtype=torch.float64, requires_grad=True)
t = torch.randint(0, 1031, (37,))
loss = xent.cross_entropy(x, t, label_smoothing=0.1)
ref = torch.nn.functional.cross_entropy(x, t, label_smoothing=0.1)
(g,) = torch.autograd.grad(loss, x)
(r,) = torch.autograd.grad(ref, x)
check("cross_entropy", torch.allclose(loss, ref) and torch.allclose(g, r), f"{loss.item():.6f}")
h = torch.randn(37, 67, dtype=torch.float64, requires_grad=True)
w = torch.randn(1031, 67, dtype=torch.float64, requires_grad=True)
loss = xent.linear_cross_entropy(h, w, t)
ref = torch.nn.functional.cross_entropy(h @ w.t(), t)
grads = torch.autograd.grad(loss, (h, w))
refs = torch.autograd.grad(ref, (h, w))
check("linear_cross_entropy", torch.allclose(loss, ref) and
      all(torch.allclose(a, b) for a, b in zip(grads, refs)), f"{loss.item():.6f}")
print(f"wheel-smoke: {passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
PY
