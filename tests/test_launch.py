"""The Triton backend's launch decisions: which tiles the autotuner may try, and when a
cached binary may be launched without Triton's dispatch (cached_launcher.CachedLauncher)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import triton

from fusegen import runtime
from fusegen.backends.triton import cached_launcher, launch, tuning
from helpers import op_by_name


def _tiles(configs):
    return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in configs]


@pytest.fixture
def on_gpu_pruning(monkeypatch):
    """The pruners as they run on a GPU (under the interpreter they keep one config)."""
    monkeypatch.setattr(tuning, "is_interpreting", lambda: False)


@pytest.mark.parametrize("m,n", [(128, 1024), (256, 4096), (1000, 1000), (1, 8), (4096, 4)])
def test_small_problems_get_tiles_that_fill_the_gpu(on_gpu_pruning, m, n):
    tiles = _tiles(tuning.prune_forward_configs(tuning.FORWARD_CONFIGS, {"M_BUCKET": tuning.m_bucket(m), "N": n}))
    assert tiles
    for block_m, block_n in tiles:
        assert block_m * block_n <= max(tuning.SMALL_TILE_ELEMENTS, m * n // 256)
        assert block_m <= triton.next_power_of_2(m) or len(tiles) == 1
    if m * n >= 256 * tuning.SMALL_TILE_ELEMENTS:
        # At least 256 programs: about two per SM on an H100.
        assert all(triton.cdiv(m, bm) * triton.cdiv(n, bn) >= 256 for bm, bn in tiles)


@pytest.mark.parametrize("m,n", [(8 * 1024, 4096), (16 * 2048, 8192), (2**20, 8), (4096, 1024)])
def test_large_problems_get_large_tiles(on_gpu_pruning, m, n):
    tiles = _tiles(tuning.prune_forward_configs(tuning.FORWARD_CONFIGS, {"M_BUCKET": tuning.m_bucket(m), "N": n}))
    assert tiles
    for block_m, block_n in tiles:
        assert block_m * block_n >= tuning.LARGE_TILE_ELEMENTS
        assert block_n >= min(triton.next_power_of_2(n), tuning.WIDE_BLOCK_N)
        assert block_n <= max(triton.next_power_of_2(n), tuning.MIN_BLOCK_N)


def test_interpreter_prunes_to_one_config(monkeypatch):
    monkeypatch.setattr(tuning, "is_interpreting", lambda: True)
    tiles = _tiles(tuning.prune_forward_configs(tuning.FORWARD_CONFIGS, {"M_BUCKET": 128, "N": 1024}))
    assert len(tiles) == 1


def test_an_interpreted_launch_patches_the_language_once_not_per_helper_call(device, monkeypatch):
    """The interpreter patches triton.language for a launch; the kernels' helper calls
    (kernel_lib's, dozens a program) take those patches (interpreter.patch_device_calls)
    instead of scanning the modules again, about 1 ms each. Same values as before."""
    if device != "cpu":
        pytest.skip("the CPU interpreter's")
    from triton.runtime import interpreter

    op = op_by_name("layernorm")
    scans, launches = [], []
    scan, grid = interpreter._patch_builtin, interpreter.GridExecutor.__call__
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda pkg, *args: scans.append(pkg) or scan(pkg, *args))
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", lambda self, *a, **k: launches.append(1) or grid(self, *a, **k))
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    w, b = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    y = op.fn(x, w, b)
    y.backward(torch.ones_like(y))
    assert len(launches) >= 2 and len(scans) <= 12 * len(launches)  # 387 for these two before
    expected = x.detach().clone().requires_grad_(True)
    torch.testing.assert_close(y, op.reference(expected, w, b))
    op.reference(expected, w, b).backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, expected.grad)
    # Outside a launch the language is as it was: the launch undid its patches.
    assert triton.language.tensor.__add__.__name__ == "__add__"


# ---------------------------------------------------------------------------
# CachedLauncher's key: it must tell apart every call Triton would compile differently


@pytest.fixture
def gpu_launcher(monkeypatch):
    """A CachedLauncher over a stand-in kernel (not the interpreter's), keyed as on a GPU."""
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    names = ["x_ptr", "x_stride", "n", "scale", "seed", "FLAG"]
    kernel = SimpleNamespace(fn=SimpleNamespace(arg_names=names, do_not_specialize=["seed"]))
    return cached_launcher.CachedLauncher(kernel)


def test_key_ignores_the_unspecialized_seed_but_not_its_width(gpu_launcher):
    x = torch.empty(64)
    key = lambda seed: gpu_launcher.key((x, 1, 64, 0.5, seed), {"FLAG": True})  # noqa: E731
    assert key(1) == key(2**31 - 1)
    assert key(1) != key(2**31)  # i32 vs i64
    assert key(2**31) != key(2**63)  # i64 vs u64


def test_key_tells_apart_what_triton_specializes_on(gpu_launcher):
    storage = torch.empty(128)
    base = ((storage[:64], 1, 64, 0.5, 7), {"FLAG": True})
    variants = [
        ((storage[1:65], 1, 64, 0.5, 7), {"FLAG": True}),  # 4-byte, not 16-byte, aligned
        ((storage[:64].double(), 1, 64, 0.5, 7), {"FLAG": True}),  # dtype
        ((storage[:64], 2, 64, 0.5, 7), {"FLAG": True}),  # an int == 1 or not
        ((storage[:64], 1, 48, 0.5, 7), {"FLAG": True}),  # divisibility by 16
        ((storage[:64], 1, 64, None, 7), {"FLAG": True}),  # None
        ((storage[:64], 1, 64, 0.5, 7), {"FLAG": False}),  # a constexpr
    ]
    base_key = gpu_launcher.key(*base)
    for args, constexprs in variants:
        assert gpu_launcher.key(args, constexprs) != base_key, (args, constexprs)
    # What Triton does not see: another float value, another tensor of the same kind.
    assert gpu_launcher.key((storage[4:68], 1, 64, 0.25, 9), {"FLAG": True}) == base_key


@pytest.mark.gpu
def test_cached_launches_match_reference_across_alignments_and_shapes():
    op = op_by_name("bias_gelu_dropout_add")
    module = op.module
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((3, 5), (2, 7, 33), (1, 128, 1024), (2, 64, 4099)):
            n = shape[-1]
            storage = torch.randn(2 * torch.Size(shape).numel() + 8, device="cuda", dtype=dtype)
            for offset in (0, 1, 0):  # aligned, misaligned, aligned again: each a cached key
                x = storage[offset:offset + torch.Size(shape).numel()].view(shape)
                bias = torch.randn(n, device="cuda", dtype=dtype)
                residual = torch.randn(shape, device="cuda", dtype=dtype)
                for seed in (1, 2**31 + 5):
                    y = torch.full(shape, float("nan"), device="cuda", dtype=dtype)
                    module.bias_gelu_dropout_add(x, bias, residual, p=0.3, seed=seed, out=y)
                    expected = module.reference(x.double(), bias.double(), residual.double(), p=0.3, seed=seed)
                    error = ((y.double() - expected).norm() / expected.norm()).item()
                    assert error < (1e-6 if dtype == torch.float32 else 1e-2), (dtype, shape, offset, seed, error)
    assert module._OP.kernels._forward._entries, "the cached launch path was never taken"


def test_the_installed_triton_is_one_whose_launcher_was_checked():
    """Fails loudly on a new Triton: run the GPU suite with it, then add it to
    cached_launcher.CHECKED_TRITON."""
    assert cached_launcher.triton_checked(), (triton.__version__, cached_launcher.CHECKED_TRITON)


@pytest.mark.gpu
def test_an_unchecked_triton_launches_through_tritons_own_path(monkeypatch):
    monkeypatch.setattr(cached_launcher, "CHECKED_TRITON", ("0.0",))
    cached_launcher._warn_unchecked.cache_clear()
    op = op_by_name("bias_gelu")
    launcher = op.module._OP.kernels._forward
    before = dict(launcher._entries)
    x, bias = torch.randn(3, 4111, device="cuda"), torch.randn(4111, device="cuda")  # a call key new here
    with pytest.warns(UserWarning, match="launcher was not checked"):
        y = op.fn(x, bias)
    torch.testing.assert_close(y, op.module.reference(x, bias))
    assert launcher._entries == before  # nothing cached: every launch is Triton's


# ---------------------------------------------------------------------------
# Gradients of inputs broadcast along columns ([..., 1]): row sums in the kernel


@pytest.mark.parametrize("n", [1, 7, 1000])
def test_one_value_per_row_gradient_is_summed_in_the_kernel(monkeypatch, device, n):
    module = op_by_name("scale_add").module
    broadcasts = []
    of = runtime.GradTarget.of

    def spy(*args, **kwargs):
        target = of(*args, **kwargs)
        broadcasts.append(target.broadcast)
        return target

    monkeypatch.setattr(runtime.GradTarget, "of", spy)
    # Tune on this call (on the GPU): trial configs of other tile widths write other rows of
    # the row-sum buffer, which must not reach the result.
    module.scale_add_backward_kernel.cache.clear()
    module._OP.kernels._backward._entries.clear()
    module._OP._prepared.clear()
    x = torch.randn(3, 5, n, dtype=torch.float64, device=device, requires_grad=True)
    scale = torch.randn(3, 5, 1, dtype=torch.float64, device=device, requires_grad=True)
    residual = torch.randn(3, 5, n, dtype=torch.float64, device=device)
    grad_y = torch.randn(3, 5, n, dtype=torch.float64, device=device)
    module.scale_add(x, scale, residual).backward(grad_y)
    expected = (grad_y * x.detach()).sum(dim=-1, keepdim=True)
    torch.testing.assert_close(scale.grad, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, grad_y * scale.detach(), rtol=1e-12, atol=1e-12)
    # n == 1: scale is as big as the output, so its gradient is written in full.
    assert broadcasts[-1] == ("full" if n == 1 else "columns")


def test_zero_before_trials_zeros_buffers_and_skips_gradients_not_asked_for():
    hook = tuning.zero_before_trials("grad_a_ptr", "grad_b_ptr")
    buffer = torch.ones(3, 4)
    hook({"grad_a_ptr": buffer, "grad_b_ptr": None, "x_ptr": torch.ones(2)})
    assert torch.equal(buffer, torch.zeros(3, 4))
    buffer.fill_(2.0)
    hook({"grad_a_ptr": None, "grad_b_ptr": buffer}, reset_only=True)  # the call after tuning
    assert torch.equal(buffer, torch.zeros(3, 4))


@pytest.mark.parametrize("m,n", [(16384, 4096), (15, 1000), (3, 7), (100000, 1), (64, 65536 * 20)])
def test_row_sum_buffer_has_one_slot_per_tile_of_the_narrowest_pruned_config(on_gpu_pruning, m, n):
    bucket = tuning.m_bucket(m)
    rows = tuning.backward_rows_per_program(bucket, n)
    pruned = tuning.prune_backward_configs(tuning.BACKWARD_CONFIGS, {"M_BUCKET": bucket, "N": n, "ROWS_PER_PROGRAM": rows})
    assert tuning.narrowest_backward_block_n(bucket, n, rows) == min(bn for _, bn in _tiles(pruned))


@pytest.mark.parametrize("summed", [True, False])
@pytest.mark.parametrize("m,n", [(16384, 8192), (8192, 11008), (16384, 4096), (15, 1000), (3, 7), (100000, 1),
                                 (64, 65536 * 20), (4096, 16)])
def test_backward_rows_per_program_are_whole_tiles(on_gpu_pruning, m, n, summed):
    """A program walks its rows BLOCK_M at a time: every tile the pruner keeps must divide
    them, with or without row sums; without, programs are as short as the tiles allow, and
    a row ONE_ROW_WIDTH wide or wider is one program's alone."""
    bucket = tuning.m_bucket(m)
    rows = tuning.backward_rows_per_program(bucket, n, summed)
    pruned = tuning.prune_backward_configs(tuning.BACKWARD_CONFIGS, {"M_BUCKET": bucket, "N": n, "ROWS_PER_PROGRAM": rows})
    assert pruned and all(rows % bm == 0 for bm, _ in _tiles(pruned)), (rows, _tiles(pruned))
    if not summed:
        assert rows == max(bm for bm, _ in _tiles(pruned))
        assert rows == 1 or n < tuning.ONE_ROW_WIDTH


# ---------------------------------------------------------------------------
# Tuning by M's bucket: every M of a bucket makes the same choices


@pytest.mark.parametrize("m, bucket", [(0, 1), (1, 1), (2, 2), (3, 4), (1000, 1024), (1024, 1024), (1025, 2048)])
def test_m_bucket_is_the_next_power_of_two(m, bucket):
    assert tuning.m_bucket(m) == bucket


def test_row_counts_of_one_bucket_share_one_tuning(device):
    """Three sequence lengths in (1024, 2048] tune once; 2049 rows start a second bucket."""
    module = op_by_name("swiglu").module
    kernel = module.swiglu_kernel
    kernel.cache.clear()
    for m in (1025, 1500, 2048, 2049):
        x = torch.randn(m, 2 * 8, device=device)
        torch.testing.assert_close(module.swiglu(x), module.reference(x))
    buckets = sorted(key[0] for key in kernel.cache)  # the key: (M_BUCKET, N, dtypes...)
    assert buckets == [2048, 4096], list(kernel.cache)


def test_kernels_key_their_tuning_on_the_bucket():
    module = op_by_name("swiglu").module
    for kernel in (module.swiglu_kernel, module.swiglu_backward_kernel):
        assert "M_BUCKET" in kernel.keys and "M" not in kernel.keys


# ---------------------------------------------------------------------------
# Argument lists by name, from the kernel's own signature (launch._Signature)


def _with_signature_edited(tmp_path, edit):
    """generated/scale_add.py with its kernels' signatures edited (as its own op, named
    scale_add_edited), imported."""
    import importlib.util

    text = (Path(__file__).resolve().parents[1] / "generated" / "scale_add.py").read_text(encoding="utf-8")
    text = edit(text).replace("scale_add", "scale_add_edited")
    path = tmp_path / "scale_add_edited.py"
    path.write_text(text, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("scale_add_edited", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _swapped(text: str, a: str, b: str) -> str:
    """The first line starting `a` and the first after it starting `b`, swapped."""
    lines = text.split("\n")
    i = next(k for k, line in enumerate(lines) if line.startswith(a))
    j = next(k for k in range(i, len(lines)) if lines[k].startswith(b))
    lines[i], lines[j] = lines[j], lines[i]
    return "\n".join(lines)


def test_a_kernel_with_its_parameters_reordered_gets_each_value_by_name(tmp_path, device):
    """The kernels' inputs, and M, N moved ahead of them: each value still goes to the
    parameter of its name (a positional list would hand x's pointer to M)."""
    def edit(text):
        forward, backward = text.split("def scale_add_backward_kernel(")
        forward = _swapped(_swapped(forward, "    x_ptr,", "    residual_ptr,"), "    residual_ptr,", "    M, N,")
        return forward + "def scale_add_backward_kernel(" + _swapped(backward, "    x_ptr,", "    grad_y_ptr,")

    module = _with_signature_edited(tmp_path, edit)
    original = op_by_name("scale_add").module
    for edited, kernel in ((module.scale_add_edited_kernel, original.scale_add_kernel),
                           (module.scale_add_edited_backward_kernel, original.scale_add_backward_kernel)):
        assert sorted(edited.arg_names) == sorted(kernel.arg_names) and edited.arg_names != kernel.arg_names
    assert module.scale_add_edited_kernel.arg_names[:2] == ["M", "N"]
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(shape, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
               for shape in ((4, 8), (4, 1), (4, 8))]
    got = module.scale_add_edited(*tensors)
    got_grads = torch.autograd.grad((got * got).sum(), tensors)
    want = module.reference(*tensors)
    want_grads = torch.autograd.grad((want * want).sum(), tensors)
    for g, w in zip((got, *got_grads), (want, *want_grads)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_a_parameter_with_no_value_is_a_one_line_error_naming_both(tmp_path, device):
    module = _with_signature_edited(tmp_path, lambda text: text.replace("    M_BUCKET,", "    M_ROWS,", 1))
    tensors = [torch.randn(shape, dtype=torch.float64, device=device) for shape in ((4, 8), (4, 1), (4, 8))]
    with pytest.raises(launch.KernelSignatureError) as error:
        module.scale_add_edited(*tensors)
    assert str(error.value) == (
        "scale_add_edited_kernel: parameter 'M_ROWS' has no value; value 'M_BUCKET' is for no parameter"
    )


def test_signature_orders_values_by_name_and_leaves_the_tile_to_the_autotuner():
    def k(b, a, FLAG, BLOCK_M, BLOCK_N, ONLINE=True):  # ONLINE: set by a pruner, else its default
        pass

    kernel = SimpleNamespace(fn=k, arg_names=["b", "a", "FLAG", "BLOCK_M", "BLOCK_N", "ONLINE"],
                             configs=[triton.Config({"BLOCK_M": 1, "BLOCK_N": 8})])
    signature = launch._Signature(kernel)
    assert signature.ordered({"a": 1, "FLAG": True, "b": 2}) == [2, 1, True]
    # A tile parameter is the autotuner's only where the ones after it are too.
    with pytest.raises(launch.KernelSignatureError, match=r"^k: parameter 'BLOCK_M' has no value$"):
        signature.ordered({"a": 1, "FLAG": True, "b": 2, "BLOCK_N": 8})
    with pytest.raises(launch.KernelSignatureError, match=r"^k: value 'c' is for no parameter$"):
        signature.ordered({"a": 1, "FLAG": True, "b": 2, "c": 3})


def test_running_a_generated_op_imports_no_code_generator():
    """A process that imports and runs a generated op (forward and backward) loads torch, triton
    and fusegen's runtime, not the code generator's sympy, YAML or Jinja, nor torch's symbolic
    shapes (0.5-0.6 s of CPU a process)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    code = ("import sys, torch\nfrom generated.layernorm import layernorm\n"
            "x = torch.ones(2, 4, requires_grad=True)\n"
            "layernorm(x, torch.ones(4), torch.zeros(4)).sum().backward()\n"
            "print(sorted(m for m in ('sympy', 'yaml', 'jinja2', 'fusegen.plan', 'fusegen.spec',\n"
            "                         'torch.fx.experimental.symbolic_shapes') if m in sys.modules))\n")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
