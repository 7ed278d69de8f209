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

if os.environ.get("FUSEGEN_TEST_STACKS"):  # SIGUSR1 writes every thread's stack there (a hang)
    import faulthandler
    import signal

    _STACKS = open(os.path.join(os.environ["FUSEGEN_TEST_STACKS"], f"stacks-{os.getpid()}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=_STACKS, all_threads=True)


# The fast GPU lane (`pytest --lane fast`, README): every kernel kind, dtype and path at
# least once, in a few minutes on an H100. Ops stand for their kinds: pointwise with
# dropout, a GLU (chunked input), row reductions with two outputs and a shared gradient, a
# row op with dropout and a mask input, and a plain activation.
LANE_OPS = frozenset({"bias_gelu_dropout_add", "swiglu", "layernorm", "add_rmsnorm",
                      "scaled_masked_softmax_dropout", "gelu"})
# float16 runs once per kernel kind (layernorm's for the rows): these ops' cases are left out.
LANE_NO_HALF = frozenset({"add_rmsnorm", "scaled_masked_softmax_dropout"})
# Files about the spec language, names, code text and the CLI: CPU CI runs them, the lane
# leaves them out. Their few kernel runs (fuzzed constants, hostile names in
# test_injection) are left to the full suite.
LANE_WITHOUT = frozenset({"test_injection.py", "test_bad_specs.py", "test_ir.py", "test_spec.py",
                          "test_printers.py", "test_simplify.py", "test_codegen.py",
                          "test_cli.py", "test_partial_build.py", "test_install.py", "test_fuzz.py",
                          "test_interpreter_env.py", "test_philox.py", "test_outdir.py"})


def pytest_addoption(parser):
    parser.addoption("--lane", choices=("full", "fast", "rest"), default="full",
                     help="fast: the GPU lane (representative ops, files that launch kernels); "
                          "rest: every test the fast lane leaves out (fast + rest = full)")
    parser.addoption("--part", default="1/1", metavar="K/N",
                     help="run the K-th of N interleaved parts of the selected tests, so that a "
                          "suite longer than one device call splits over N calls")


def pytest_ignore_collect(collection_path, config):
    if config.getoption("--lane") == "fast" and collection_path.name in LANE_WITHOUT:
        return True  # not even imported: some build specs as they are collected
    return None


def _ops_named(item, names) -> set:
    """The ops a parametrized test item runs: its params that are ops or op names."""
    found = set()
    for value in getattr(getattr(item, "callspec", None), "params", {}).values():
        name = value if isinstance(value, str) else getattr(value, "name", None)
        if isinstance(name, str) and name in names:
            found.add(name)
    return found


def _lane(config, items, lane: str) -> None:
    from pathlib import Path
    names = {p.stem for p in (Path(__file__).parent.parent / "specs").glob("*.yaml")}
    kept, dropped = [], []
    for item in items:
        ops = _ops_named(item, names)
        params = getattr(getattr(item, "callspec", None), "params", {}).values()
        half = ops & LANE_NO_HALF and any(value is torch.float16 for value in params)
        in_fast = not ((ops and not ops & LANE_OPS) or half or "full_lane" in item.keywords
                       or item.path.name in LANE_WITHOUT)
        (kept if in_fast == (lane == "fast") else dropped).append(item)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept


# The test that spends minutes of CPU in processes of its own (Triton's real compiler for the
# H100, every generated kernel, in a pool): first, so that it overlaps the rest of the suite.
# pytest-xdist hands the collection out in order, and at the end of it it ran alone, the other
# worker idle. (Only it: whatever comes first lands in one worker's first share of the suite.)
FIRST = ("tests/test_sm90.py::test_generated_kernels_compile_for_h100",)  # the rest keep their order


def pytest_collection_modifyitems(config, items):
    if config.getoption("--lane") != "full":
        _lane(config, items, config.getoption("--lane"))
    items.sort(key=lambda item: next((i for i, f in enumerate(FIRST) if item.nodeid.startswith(f)), len(FIRST)))
    part, parts = (int(n) for n in config.getoption("--part").split("/"))
    if parts > 1:
        config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % parts != part - 1])
        items[:] = items[part - 1::parts]
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

    original = (native._state.module, native._state.failed)

    def use(node: str):
        # Back to the state before the test, so a test may switch from python to native.
        monkeypatch.setattr(native._state, "module", original[0])
        monkeypatch.setattr(native._state, "failed", original[1])
        module = native.load(build=node == "native")
        assert node == "python" or module is not None, native.status()
        monkeypatch.setattr(native._state, "module", module if node == "native" else None)
        monkeypatch.setattr(native._state, "failed", None if node == "native" else "off in this test")
        native.forget_calls()
        return module

    yield use
    native.forget_calls()
