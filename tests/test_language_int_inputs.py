"""Integer and bool inputs (issue 31): `t: {dims: [..., 1], dtype: int64}` (also int32),
`mask: {dims: [..., N], dtype: bool}`. The kernels read them in their own type (compared with
numbers and `col`, conditions of `where`), never differentiate them (no gradient buffer, None
to autograd), and a call checks their dtype as it checks every input's.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fusegen import cli
from fusegen.errors import SpecError
from fusegen.runtime import FusegenArgumentError
from tests.helpers import build_and_import

# Per-row cross-entropy with an ignore index, and the target's logit, from an int64 target.
CROSS_ENTROPY = """\
name: ce_int
doc: per-row cross-entropy of logits x at the int64 class index target, -100 ignored
inputs:
  x: [..., N]
  target: {dims: [..., 1], dtype: int64}
let:
  shifted: x - max(x)
outputs:
  loss: where(target == -100, 0.0, log(sum(exp(shifted))) - sum(where(col == target, shifted, 0.0)))
  logit: sum(where(col == target, x, 0.0))
"""

# Pointwise: a one-hot from an int32 target, scaled by x.
ONE_HOT = """\
name: one_hot_int32
doc: x at the int32 target's column, 0 elsewhere
inputs:
  x: [..., N]
  target: {dims: [..., 1], dtype: int32}
outputs:
  y: where(col == target, x, 0.0) * 3.0
"""

MASKED = """\
name: masked_bool
doc: x where mask, else 0; and x where not mask and x > 0
inputs:
  x: [..., N]
  mask: {dims: [..., N], dtype: bool}
outputs:
  y: where(mask, x, 0.0)
  z: where(~mask & (x > 0.0), x * x, 0.0)
"""


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    folder = tmp_path_factory.mktemp("int_inputs")
    return {name: build_and_import(folder, text)
            for name, text in (("ce", CROSS_ENTROPY), ("one_hot", ONE_HOT), ("masked", MASKED))}


def _targets(device):
    return torch.tensor([0, 5, -100, 23, 11], device=device)[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_cross_entropy_from_an_int64_target_is_torchs(ops, dtype, device):
    module = ops["ce"]
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 24, generator=g, dtype=torch.float64) * 3).to(dtype)
    target = _targets(device)
    xs = x.to(device).requires_grad_(True)
    loss, logit = module.ce_int(xs, target)
    assert loss.shape == logit.shape == (5, 1) and loss.dtype == dtype
    x64 = x.double().requires_grad_(True)
    t = target[:, 0].cpu()
    want = F.cross_entropy(x64, t, reduction="none", ignore_index=-100)
    want_logit = torch.where(t == -100, 0.0, x64.gather(1, t.clamp(min=0)[:, None])[:, 0])
    grad_out = torch.randn(5, generator=g, dtype=torch.float64)
    (got_grad,) = torch.autograd.grad(loss[:, 0], xs, grad_out.to(dtype).to(device), retain_graph=True)
    (want_grad,) = torch.autograd.grad(want, x64, grad_out)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(loss[:, 0].detach().cpu().double(), want.detach(), **tol)
    torch.testing.assert_close(logit[:, 0].detach().cpu().double(), want_logit.detach(), **tol)
    torch.testing.assert_close(got_grad.cpu().double(), want_grad, **tol)  # softmax - one_hot; row 2: 0
    # The logit's gradient: the scatter back to the target's column.
    (logit_grad,) = torch.autograd.grad(logit.sum(), xs)
    torch.testing.assert_close(logit_grad.cpu().double(), torch.autograd.grad(want_logit.sum(), x64)[0], **tol)
    for fn in (module.reference, module.eager):
        got_loss, got_logit = fn(x64.to(device), target)
        torch.testing.assert_close(got_loss[:, 0].cpu(), want, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(got_logit[:, 0].cpu(), want_logit, rtol=1e-12, atol=1e-14)


def test_int_inputs_get_no_gradient(ops, device):
    module = ops["ce"]
    target = _targets(device)
    with pytest.raises(RuntimeError, match="floating point"):
        target.clone().requires_grad_(True)  # torch's own rule: nothing to differentiate
    # The backward kernel has no gradient buffer for it; the graph has no edge to it.
    assert 'gradients=("x",)' in Path(module.__file__).read_text()
    xs = torch.randn(5, 24, dtype=torch.float64, device=device, requires_grad=True)
    loss, _ = module.ce_int(xs, target)
    with pytest.raises(RuntimeError, match="does not require grad"):
        torch.autograd.grad(loss.sum(), [xs, target], allow_unused=True, retain_graph=True)
    (grad,) = torch.autograd.grad(loss.sum(), [xs], allow_unused=True)
    assert grad is not None
    assert [edge for edge, _ in loss.grad_fn.next_functions][1] is None  # target: no edge


def test_one_hot_from_an_int32_target_pointwise(ops, device):
    module = ops["one_hot"]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 9, generator=g, dtype=torch.float64)
    target = torch.tensor([[0], [8], [3], [-1]], dtype=torch.int32)
    xs = x.to(device).requires_grad_(True)
    y = module.one_hot_int32(xs, target.to(device))
    one_hot = (torch.arange(9) == target).double()
    torch.testing.assert_close(y.detach().cpu(), x * one_hot * 3.0, rtol=0, atol=0)
    (grad,) = torch.autograd.grad(y.sum(), xs)
    torch.testing.assert_close(grad.cpu(), one_hot * 3.0, rtol=0, atol=0)
    for fn in (module.reference, module.eager):
        torch.testing.assert_close(fn(x, target), x * one_hot * 3.0, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_bool_mask_is_where_condition(ops, dtype, device):
    module = ops["masked"]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2, 16, generator=g, dtype=dtype)
    mask = torch.rand(3, 2, 16, generator=g) > 0.5
    xs = x.to(device).requires_grad_(True)
    y, z = module.masked_bool(xs, mask.to(device))
    want_y = torch.where(mask, x, 0.0)
    want_z = torch.where(~mask & (x > 0), x * x, 0.0)
    torch.testing.assert_close(y.detach().cpu(), want_y, rtol=0, atol=0)
    torch.testing.assert_close(z.detach().cpu(), want_z)
    gy, gz = torch.randn(3, 2, 16, generator=g, dtype=dtype), torch.randn(3, 2, 16, generator=g, dtype=dtype)
    (grad,) = torch.autograd.grad((y, z), xs, (gy.to(device), gz.to(device)))
    torch.testing.assert_close(grad.cpu(), torch.where(mask, gy, 0.0) + torch.where(~mask & (x > 0), 2 * x * gz, 0.0))
    # A mask broadcast along the rows ([N] given for [..., N]) too.
    y, _ = module.masked_bool(xs, mask[0, 0].to(device))
    torch.testing.assert_close(y.detach().cpu(), torch.where(mask[0, 0], x, 0.0), rtol=0, atol=0)
    for fn in (module.reference, module.eager):
        got_y, got_z = fn(x, mask)
        torch.testing.assert_close(got_y, want_y, rtol=0, atol=0)
        torch.testing.assert_close(got_z, want_z)


@pytest.mark.parametrize("case", ["float_for_int", "int_for_float", "int32_for_int64", "uint8_for_bool"])
def test_wrong_dtype_is_one_line_naming_the_input(ops, case, device):
    x = torch.randn(5, 24, device=device)
    target = _targets(device)
    call, message = {
        "float_for_int": (lambda: ops["ce"].ce_int(x, target.float()),
                          "ce_int(): target has dtype torch.float32; it must be torch.int64"),
        "int_for_float": (lambda: ops["ce"].ce_int(x.long(), target),
                          "ce_int(): x has dtype torch.int64; supported: float16, bfloat16, float32, float64"),
        "int32_for_int64": (lambda: ops["ce"].ce_int(x, target.int()),
                            "ce_int(): target has dtype torch.int32; it must be torch.int64"),
        "uint8_for_bool": (lambda: ops["masked"].masked_bool(x, (x > 0).to(torch.uint8)),
                           "masked_bool(): mask has dtype torch.uint8; it must be torch.bool"),
    }[case]
    with pytest.raises(FusegenArgumentError) as info:
        call()
    assert str(info.value) == message
    with pytest.raises(FusegenArgumentError, match="dtype"):  # the reference checks as the op does
        ops["ce"].reference(x, target.float())


def test_output_dtype_is_the_float_inputs(ops, device):
    x = torch.randn(5, 24, device=device, dtype=torch.float16)
    loss, logit = ops["ce"].ce_int(x, _targets(device))
    assert loss.dtype == logit.dtype == torch.float16


def test_meta_tensors(ops):
    x = torch.empty(2, 5, 24, device="meta", requires_grad=True)
    loss, logit = ops["ce"].ce_int(x, torch.empty(2, 5, 1, dtype=torch.int64, device="meta"))
    assert loss.shape == logit.shape == (2, 5, 1) and loss.device.type == "meta" and loss.dtype == torch.float32
    (grad,) = torch.autograd.grad(loss.sum(), x)
    assert grad.shape == x.shape and grad.device.type == "meta"
    with pytest.raises(FusegenArgumentError, match="target has dtype torch.float32"):
        ops["ce"].ce_int(x, torch.empty(2, 5, 1, device="meta"))


def test_compile_fullgraph(ops, device):
    module = ops["ce"]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 24, generator=g, dtype=torch.float64)
    target = _targets(device)

    def step(fn):
        xs = x.to(device).requires_grad_(True)
        loss, logit = fn(xs, target)
        (grad,) = torch.autograd.grad(loss.sum() + 0.5 * logit.sum(), xs)
        return loss.detach(), logit.detach(), grad

    for got, want in zip(step(torch.compile(module.ce_int, fullgraph=True)), step(module.ce_int)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


BAD = [
    ("unknown_dtype", "inputs:\n  x: [..., N]\n  t: {dims: [..., 1], dtype: int16}\noutputs:\n  y: x\n",
     "x.yaml:5: input 't': unknown dtype 'int16' (known: float, int64, int32, bool)"),
    ("unknown_key", "inputs:\n  x: [..., N]\n  t:\n    dims: [..., 1]\n    type: int64\noutputs:\n  y: x\n",
     "x.yaml:7: unknown key 'type' in input 't' (known: dims, dtype)"),
    ("missing_dims", "inputs:\n  x: [..., N]\n  t: {dtype: int64}\noutputs:\n  y: x\n",
     "x.yaml:5: missing required key 'dims' in input 't'"),
    ("int_chunks", "inputs:\n  x: [..., N]\n  t: {dims: [..., 2N], dtype: int64}\noutputs:\n  y: x\n",
     "x.yaml:5: input 't': a int64 input cannot hold chunks (2N); declare one input per chunk"),
    ("no_float_input", "inputs:\n  t: {dims: [..., N], dtype: int64}\noutputs:\n  y: t * 1.0\n",
     "x.yaml:4: 'inputs' must have at least one float input: the outputs take its dtype"),
    ("bool_as_value", "inputs:\n  x: [..., N]\n  m: {dims: [..., N], dtype: bool}\noutputs:\n  y: x * m\n",
     "x.yaml:7: 'm' is a bool input, a condition: use it in where(...), as in where(m, x, 0.0)"),
]


@pytest.mark.parametrize("text, message", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_specs_are_one_line_file_line_errors(tmp_path, text, message):
    path = tmp_path / "x.yaml"
    path.write_text("name: op\ndoc: d\n" + text, encoding="utf-8")
    with pytest.raises(SpecError) as info:
        cli.build_op(path)
    assert str(info.value).endswith(message) and "\n" not in str(info.value)


def test_int_input_in_arithmetic_needs_no_derivative(tmp_path, device):
    """An int input used where a float input would need a derivative (a factor, an exponent)
    builds: none is taken with respect to it."""
    module = build_and_import(tmp_path, """\
name: int_scale
doc: x times an int64 count, to the power of the count
inputs:
  x: [..., N]
  k: {dims: [..., 1], dtype: int64}
outputs:
  y: x * k + x ** k
""")
    x = torch.rand(3, 8, dtype=torch.float64) + 0.5
    k = torch.tensor([[0], [1], [3]])
    xs = x.to(device).requires_grad_(True)
    y = module.int_scale(xs, k.to(device))
    torch.testing.assert_close(y.detach().cpu(), x * k + x ** k)
    (grad,) = torch.autograd.grad(y.sum(), xs)
    torch.testing.assert_close(grad.cpu(), k + k * x ** (k - 1))


@pytest.mark.gpu
def test_native_eager_call_takes_int_inputs(ops, use_node):
    """The C++ eager call and autograd node take integer inputs as any other tensor (keyed by
    dtype, so a wrong one still reaches the Python checks), and give them no gradient."""
    module = ops["ce"]
    x = torch.randn(64, 300, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, 300, (64, 1), device="cuda")  # a class each (torch.cross_entropy asserts on the device otherwise)
    target[::7] = -100
    results = {}
    for node in ("python", "native"):
        use_node(node)
        for _ in range(3):  # the first with a call key in Python, the later ones in C++
            xs = x.clone().requires_grad_(True)
            loss, logit = module.ce_int(xs, target)
            (grad,) = torch.autograd.grad((loss, logit), xs, (torch.ones_like(loss), torch.ones_like(logit)))
        results[node] = (loss, logit, grad)
        with pytest.raises(FusegenArgumentError, match="target has dtype torch.int32"):
            module.ce_int(x, target.int())
    for got, want in zip(results["native"], results["python"]):
        assert torch.equal(got, want)
    want = F.cross_entropy(x.float(), target[:, 0], reduction="none", ignore_index=-100)
    torch.testing.assert_close(results["native"][0][:, 0].float(), want, rtol=1e-2, atol=1e-2)
