"""What this build of xent was made with (xent.build_info()), and the check, at import, that every
visible GPU can run its CUDA kernels."""

from __future__ import annotations

import os
import re

import torch

try:
    from xent import _build_info as _info
except ImportError:  # a source tree configured before the file existed: nothing to report
    _info = None


def build_info() -> dict:
    """The versions and GPU architectures this build of xent was compiled with.

    Keys: version; torch and torch_cuda (the torch it was compiled against, and that torch's CUDA
    version); cuda (the toolkit of its CUDA kernels, None when it has CPU ops only); cuda_archs
    (cubins, e.g. ["sm_90"]) and cuda_ptx (PTX the driver compiles for newer GPUs, e.g.
    ["compute_90"]).
    """
    if _info is None:
        return dict(
            version=None, torch=None, torch_cuda=None, cuda=None, cuda_archs=[], cuda_ptx=[]
        )
    return dict(
        version=_info.VERSION,
        torch=_info.TORCH,
        torch_cuda=_info.TORCH_CUDA,
        cuda=_info.CUDA,
        cuda_archs=list(_info.CUDA_SASS),
        cuda_ptx=list(_info.CUDA_PTX),
    )


def source_version() -> str:
    """The version in the repository's VERSION file, for a source tree without build info."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "VERSION")
    try:
        with open(path) as file:
            return file.read().strip()
    except OSError:
        return "unknown"


def check_torch() -> None:
    """Raises ImportError when the running torch is not the release the binding was compiled
    against: its C++ ABI differs between releases, and a mismatch fails later, obscurely."""
    built = _info.TORCH if _info is not None else ""
    if not built:
        return

    def release(version: str) -> tuple:
        return tuple(version.split("+")[0].split(".")[:2])

    if release(built) != release(torch.__version__):
        raise ImportError(
            f"xent was compiled against torch {built} but torch {torch.__version__} is "
            f"installed; install torch {'.'.join(release(built))}.* or rebuild xent against "
            "this torch (pip install --no-build-isolation . from the xent source)"
        )


def _parse(arch: str) -> tuple:
    """'sm_90a' / 'compute_90' -> (90, True when architecture-specific)."""
    match = re.fullmatch(r"(?:sm|compute)_(\d+)([af]?)", arch)
    return (int(match.group(1)), bool(match.group(2))) if match else (None, False)


def runs_on(capability: tuple, cubins: list, ptx: list) -> bool:
    """Whether a GPU of compute capability (major, minor) can run kernels built as `cubins` and
    `ptx`: a cubin sm_XY runs on X.Y and later minors of major X (sm_XYa on X.Y only); PTX
    compute_XY is compiled by the driver for X.Y and every later GPU (compute_XYa for X.Y only)."""
    major, minor = capability
    device = major * 10 + minor
    for arch in cubins:
        number, specific = _parse(arch)
        if number is None:
            continue
        if device == number or (not specific and major == number // 10 and device >= number):
            return True
    for arch in ptx:
        number, specific = _parse(arch)
        if number is not None and (device == number or (not specific and device >= number)):
            return True
    return False


def check_gpus() -> None:
    """Raises ImportError naming the GPU and the build's architectures when a visible GPU cannot
    run this build's kernels. Nothing to check without CUDA kernels or without a GPU."""
    info = build_info()
    if not info["cuda"] or not torch.cuda.is_available():
        return
    for index in range(torch.cuda.device_count()):
        capability = torch.cuda.get_device_capability(index)
        if runs_on(capability, info["cuda_archs"], info["cuda_ptx"]):
            continue
        name: str | None = torch.cuda.get_device_name(index)
        built = ", ".join(info["cuda_archs"] + info["cuda_ptx"])
        arch = f"{capability[0]}{capability[1]}"
        raise ImportError(
            f"xent: GPU {index} ({name}) unsupported: got sm_{arch}; expected a GPU this build "
            f"has kernels for ({built}). Rebuild for it with XENT_CUDA_ARCHS={arch} "
            "(README, 'Building a wheel'); the kernels need sm_80 or later"
        )
