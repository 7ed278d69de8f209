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


@pytest.fixture
def use_node(monkeypatch):
    """`use_node("native")`: the rest of the test runs through fusegen's C++ extension (its
    autograd node and eager call; built if need be); `use_node("python")`: without it. The
    ops forget their eager calls then and after the test, so that each call meets the
    extension as the test set it."""
    from fusegen.runtime import native

    def use(node: str):
        module = native.load(build=node == "native")
        assert node == "python" or module is not None, native.status()
        monkeypatch.setattr(native._state, "module", module if node == "native" else None)
        monkeypatch.setattr(native._state, "failed", None if node == "native" else "off in this test")
        native.forget_calls()
        return module

    yield use
    native.forget_calls()
