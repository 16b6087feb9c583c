"""Shared test setup: the gpu marker, hypothesis profiles, Triton's CPU interpreter."""
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
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
