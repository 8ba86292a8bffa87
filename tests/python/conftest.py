"""Shared fixtures: the devices to run on, per-test random generators, tolerances."""

import os
import zlib

import pytest
import torch

import xent  # noqa: F401  (fails loudly here when the package is not built)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def _devices():
    params = [pytest.param("cpu", id="cpu")]
    params.append(pytest.param("cuda", id="cuda", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    ]))
    return params


DEVICES = _devices()


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture
def gen(request):
    """A CPU generator seeded from the test id (and XENT_TEST_SEED), so every test draws fresh
    inputs of its own and a failure replays exactly."""
    base = int(os.environ.get("XENT_TEST_SEED", "0"))
    seed = (zlib.crc32(request.node.nodeid.encode()) + base) % (2**31)
    generator = torch.Generator().manual_seed(seed)
    return generator


def pytest_runtest_makereport(item, call):
    if call.when == "call" and call.excinfo is not None and "gen" in item.fixturenames:
        base = int(os.environ.get("XENT_TEST_SEED", "0"))
        seed = (zlib.crc32(item.nodeid.encode()) + base) % (2**31)
        item.add_report_section("call", "seed", f"generator seed {seed} (XENT_TEST_SEED={base})")
