"""Shared fixtures: the devices to run on, per-test random generators, tolerances."""

import os
import random
import zlib

import pytest
import torch

import xent  # noqa: F401  (fails loudly here when the package is not built)


def pytest_addoption(parser):
    parser.addoption(
        "--seed",
        type=int,
        default=None,
        help="the run's seed (default: XENT_TEST_SEED, else a random one); every "
        "test derives its generator from it and its id",
    )
    parser.addoption(
        "--portable-paths",
        action="store_true",
        default=False,
        help="run the CUDA ops on their portable paths (as a non-Hopper GPU does) on every "
        "device; also XENT_TEST_PORTABLE_PATHS=1",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    # One seed per run, chosen here and printed in the header, so a failure replays with
    # `--seed N` (or XENT_TEST_SEED=N) whatever the order or the selection of tests.
    seed = config.getoption("--seed")
    if seed is None and os.environ.get("XENT_TEST_SEED"):
        seed = int(os.environ["XENT_TEST_SEED"])
    if seed is None:
        seed = random.SystemRandom().randrange(10**9)
    config.xent_seed = seed
    portable = config.getoption("--portable-paths")
    portable = portable or os.environ.get("XENT_TEST_PORTABLE_PATHS") == "1"
    config.xent_portable = portable
    if portable:
        if not hasattr(torch.ops.xent, "_force_portable_paths"):
            raise pytest.UsageError("--portable-paths: this build of xent has no CUDA ops")
        torch.ops.xent._force_portable_paths(True)


def _seed_line(config):
    seed = config.xent_seed
    line = f"xent: XENT_TEST_SEED={seed} (replay with --seed {seed} or XENT_TEST_SEED={seed})"
    if config.xent_portable:
        line += "; the portable paths forced on every device"
    return line


def pytest_report_header(config):
    return _seed_line(config)


def pytest_sessionstart(session):
    # -q hides the report header; the seed must show in every log all the same.
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and reporter.verbosity < 0:
        reporter.write_line(_seed_line(session.config))


def _test_seed(config, nodeid):
    return (zlib.crc32(nodeid.encode()) + config.xent_seed) % (2**31)


def _devices():
    params = [pytest.param("cpu", id="cpu")]
    params.append(
        pytest.param(
            "cuda",
            id="cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
            ],
        )
    )
    return params


DEVICES = _devices()


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture
def gen(request):
    """A CPU generator seeded from the run's seed and the test id, so every test draws fresh
    inputs of its own and a failure replays exactly."""
    return torch.Generator().manual_seed(_test_seed(request.config, request.node.nodeid))


def pytest_runtest_makereport(item, call):
    if call.when == "call" and call.excinfo is not None and "gen" in item.fixturenames:
        base = item.config.xent_seed
        seed = _test_seed(item.config, item.nodeid)
        item.add_report_section("call", "seed", f"generator seed {seed} (XENT_TEST_SEED={base})")
