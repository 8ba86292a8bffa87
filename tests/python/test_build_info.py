"""xent.__version__ and xent.build_info() report how the package was built; at import, a GPU the
build has no kernels for is refused by name (checked here with a pretend GPU)."""

import pytest
import torch

import xent
from xent import _build


def test_build_info_reports_versions_and_architectures():
    info = xent.build_info()
    assert set(info) == {"version", "torch", "torch_cuda", "cuda", "cuda_archs", "cuda_ptx"}
    assert info["version"] == xent.__version__
    # The torch it was compiled against is the one imported here (same major.minor).
    assert info["torch"].split(".")[:2] == torch.__version__.split(".")[:2]
    if info["cuda"]:
        assert info["cuda_archs"] and all(a.startswith("sm_") for a in info["cuda_archs"])
        assert all(a.startswith("compute_") for a in info["cuda_ptx"])
    else:
        assert info["cuda_archs"] == [] and info["cuda_ptx"] == []


@pytest.mark.parametrize(
    "capability,cubins,ptx,expected",
    [
        ((9, 0), ["sm_90"], ["compute_90"], True),
        ((9, 0), ["sm_90a"], [], True),
        ((8, 0), ["sm_90"], ["compute_90"], False),
        ((10, 0), ["sm_90"], ["compute_90"], True),  # PTX, compiled by the driver
        ((10, 0), ["sm_90a"], [], False),  # 90a cubins run on 9.0 only
        ((10, 0), ["sm_90a"], ["compute_90a"], False),
        ((9, 1), ["sm_90"], [], True),  # same major, later minor
        ((12, 0), ["sm_90a", "sm_100"], ["compute_100"], True),
        ((8, 9), ["sm_90", "sm_100"], ["compute_100"], False),
    ],
)
def test_runs_on(capability, cubins, ptx, expected):
    assert _build.runs_on(capability, cubins, ptx) is expected


def _pretend(monkeypatch, capability, cubins, ptx):
    info = dict(
        version="0",
        torch=torch.__version__,
        torch_cuda="13.0",
        cuda="13.0",
        cuda_archs=cubins,
        cuda_ptx=ptx,
    )
    monkeypatch.setattr(_build, "build_info", lambda: info)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "Pretend GPU")


def test_gpu_without_kernels_is_refused_by_name(monkeypatch):
    _pretend(monkeypatch, (8, 0), ["sm_90"], ["compute_90"])
    with pytest.raises(ImportError) as info:
        _build.check_gpus()
    message = str(info.value)
    for part in ("Pretend GPU", "sm_80", "sm_90, compute_90", "XENT_CUDA_ARCHS=80"):
        assert part in message, message


def test_gpu_with_kernels_or_ptx_passes(monkeypatch):
    _pretend(monkeypatch, (9, 0), ["sm_90"], ["compute_90"])
    _build.check_gpus()
    _pretend(monkeypatch, (10, 0), ["sm_90"], ["compute_90"])
    _build.check_gpus()


def test_no_check_without_cuda_kernels(monkeypatch):
    _pretend(monkeypatch, (8, 0), [], [])
    monkeypatch.setattr(_build, "build_info", lambda: dict(cuda=None, cuda_archs=[], cuda_ptx=[]))
    _build.check_gpus()


def test_import_refuses_another_torch_release(monkeypatch: pytest.MonkeyPatch) -> None:
    """The binding's C++ ABI is its torch release's: import names both when they differ."""
    from xent import _build

    class Built:
        TORCH = "1.13.1"

    monkeypatch.setattr(_build, "_info", Built)
    with pytest.raises(ImportError, match=r"compiled against torch 1\.13\.1 but torch 2\."):
        _build.check_torch()
    Built.TORCH = torch.__version__
    _build.check_torch()  # the same release: nothing raised
