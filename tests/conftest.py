"""Test setup: with no CUDA device, Triton kernels run on Triton's CPU interpreter.

TRITON_INTERPRET must be set before triton is first imported, hence here, at the top.
"""
import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    skip_two = pytest.mark.skip(reason="needs two CUDA devices; this machine has fewer")
    two = HAS_CUDA and torch.cuda.device_count() >= 2
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
        if "gpu2" in item.keywords and not two:
            item.add_marker(skip_two)


@pytest.fixture
def device():
    return DEVICE
