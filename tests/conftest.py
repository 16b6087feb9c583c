"""Shared test setup: the gpu and sm90_compile markers, hypothesis profiles, Triton's CPU
interpreter."""
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

HAS_CUDA = torch.cuda.is_available()

# Without a GPU, Triton kernels run under Triton's interpreter. The flag is read when a
# kernel is decorated, so it must be set before vitattn_bwd.kernels is imported.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Each new shape is a new Inductor compile (seconds on the CPU): keep examples few in CI.
settings.register_profile("ci", max_examples=6, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
# On the H200 (tests/test_gpu_properties.py): fresh random draws each run, failures printed
# with a reproduce blob; each property there sets its own example count and time budget,
# and the whole file stays around 4.5 minutes.
settings.register_profile("gpu", max_examples=20, deadline=None, print_blob=True,
                          suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def triton_interpreter():
    """Triton kernels run under the CPU interpreter, with its bf16 dot patched
    (tests/triton_interpreter.py); skipped where a GPU runs them for real (the gpu-marked
    tests)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a GPU is present: the gpu-marked tests run the kernels for real")
    from .triton_interpreter import patch_bf16_dot
    patch_bf16_dot()


@pytest.fixture
def no_tf32(monkeypatch):
    """float32 matmuls and convolutions in full float32 (TF32 off) for this test only: for
    the GPU tests that compare torch's own float32 math with float64."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


@pytest.fixture
def deterministic():
    """torch.use_deterministic_algorithms(True) for this test, then as it was."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def pytest_addoption(parser):
    parser.addoption("--sm90-compiles", action="store_true",
                     help="run the sm90_compile-marked tests (.ci/run's second step)")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


# Under pytest-xdist each worker is a process of its own: a worker hands its property
# runs' stats to the controller (workeroutput), which prints them with its own.
def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        from .strategies import RUN_STATS
        workeroutput["vitattn_run_stats"] = RUN_STATS


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):            # the controller, as each worker ends
    from .strategies import RUN_STATS
    RUN_STATS.update(getattr(node, "workeroutput", {}).get("vitattn_run_stats", {}))


def pytest_terminal_summary(terminalreporter):
    """What each property run of tests/strategies.run_property did: examples, time, and
    the largest relative error per output (for the notes on the GPU profile's runs)."""
    from .strategies import RUN_STATS
    if not RUN_STATS:
        return
    terminalreporter.section(f"property runs (profile {settings.get_current_profile_name()})")
    terminalreporter.write_line(
        "Runs with a planted error (tests/plants.py) check that the property catches it: "
        "\"caught\" where it did; one it missed fails its test (\"NOT CAUGHT\").")
    for name, stats in RUN_STATS.items():
        errors = ", ".join(f"{k} {v:.2e}" for k, v in stats["max_errors"].items())
        over = stats["rejected_over_budget"]
        failed = stats.get("failed", False)
        if stats["plant"] is None:
            verdict = " -- FAILED" if failed else ""
        elif failed:
            verdict = f" -- caught planted error {stats['plant']}"
        else:                       # its test failed too (pytest.raises: DID NOT RAISE)
            verdict = f" -- NOT CAUGHT: planted error {stats['plant']} passed the property"
        terminalreporter.write_line(
            f"{name}: {stats['examples']} examples in {stats['seconds']:.1f} s"
            + (f" (time budget reached, {over} draws rejected)" if over else "")
            + verdict + (f"; max errors of the passing ones: {errors}" if errors else ""))


def pytest_collection_modifyitems(config, items):
    skips = {}                                  # marker -> why its tests skip here
    if not HAS_CUDA:
        skips["gpu"] = "needs a CUDA GPU"
    # The sm_90 compiles (minutes of ptxas on 2 cores) are CI's second step, with the
    # installed triton and the newest one, not part of the README's test command.
    if not config.getoption("--sm90-compiles"):
        skips["sm90_compile"] = "compiles for sm_90: run with --sm90-compiles"
    for item in items:
        for marker, reason in skips.items():
            if marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))
