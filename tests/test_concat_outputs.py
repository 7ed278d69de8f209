"""Concatenated outputs (issue 31): `y: [a, b]` is an output of parts side by side along the
last dim, [..., kN] (part k at columns k·N to (k + 1)·N), the mirror of a chunked input
(`x: [..., 2N]`, read as chunk(x, k)). The kernel writes each part into its columns, the
backward reads the incoming gradient part by part; the reference and eager twin concatenate.
And the library's `rope`, against Hugging Face's apply_rotary_pos_emb (rotate_half).
"""
from __future__ import annotations

import pytest
import torch

from fusegen import cli
from fusegen.errors import SpecError
from fusegen.runtime import FusegenArgumentError
from generated.rope import rope
from tests.helpers import build_and_import

TWO = """\
name: cat_two
doc: y = [a * b, sin(a) + b], z = a - b
inputs:
  a: [..., N]
  b: [..., N]
outputs:
  y: [a * b, sin(a) + b]
  z: a - b
"""

# Three parts of a chunked input and an [N] input broadcast over rows; one part a passthrough
# of a chunk (no gradient passes it through whole: a part is not a whole tensor).
THREE = """\
name: cat_three
doc: y = [x0 * w, exp(x1), x0], where x = [x0, x1]
inputs:
  x: [..., 2N]
  w: [N]
outputs:
  y:
    - chunk(x, 0) * w
    - exp(chunk(x, 1))
    - chunk(x, 0)
"""


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    folder = tmp_path_factory.mktemp("concat")
    return {"two": build_and_import(folder, TWO), "three": build_and_import(folder, THREE)}


def _inputs(name, dtype=torch.float64, device="cpu", lead=(3, 2), n=5):
    g = torch.Generator().manual_seed(1)
    if name == "two":
        shapes = {"a": (*lead, n), "b": (*lead, n)}
    else:
        shapes = {"x": (*lead, 2 * n), "w": (n,)}
    return {k: torch.randn(s, generator=g, dtype=torch.float64).to(dtype).to(device) for k, s in shapes.items()}


def _torch64(name, t):
    """The op in float64 torch, written by hand."""
    if name == "two":
        a, b = t["a"], t["b"]
        return torch.cat((a * b, torch.sin(a) + b), dim=-1), a - b
    x0, x1 = t["x"].chunk(2, dim=-1)
    return (torch.cat((x0 * t["w"], torch.exp(x1), x0), dim=-1),)


def _fn(module, name):
    return module.cat_two if name == "two" else module.cat_three


@pytest.mark.parametrize("name", ["two", "three"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_values_and_gradients_match_float64_torch_and_the_reference(ops, name, dtype, device):
    module = ops[name]
    tensors = _inputs(name, dtype, device)
    leaves = {k: t.clone().requires_grad_(True) for k, t in tensors.items()}
    outs = _fn(module, name)(**leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    truth_leaves = {k: t.double().cpu().requires_grad_(True) for k, t in tensors.items()}
    truths = _torch64(name, truth_leaves)
    refs = module.reference(**leaves)
    refs = refs if isinstance(refs, tuple) else (refs,)
    eagers = module.eager(**leaves)
    eagers = eagers if isinstance(eagers, tuple) else (eagers,)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    assert outs[0].shape == (3, 2, 10 if name == "two" else 15) and outs[0].is_contiguous()
    for out, truth, ref, eager in zip(outs, truths, refs, eagers):
        assert out.dtype == dtype and out.shape == truth.shape == ref.shape == eager.shape
        torch.testing.assert_close(out.double().cpu(), truth.detach(), **tol)
        torch.testing.assert_close(out, ref, **tol)
        torch.testing.assert_close(out, eager, **tol)
    g = torch.Generator().manual_seed(2)
    grads_out = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in truths]
    got = torch.autograd.grad(outs, list(leaves.values()), [o.to(dtype).to(device) for o in grads_out])
    want = torch.autograd.grad(truths, list(truth_leaves.values()), grads_out)
    via_ref = torch.autograd.grad(refs, list(leaves.values()), [o.to(dtype).to(device) for o in grads_out])
    for k, gw, gr, name_ in zip(got, want, via_ref, leaves):
        torch.testing.assert_close(k.double().cpu(), gw, **tol, msg=f"gradient of {name_}")
        torch.testing.assert_close(k, gr, **tol, msg=f"gradient of {name_} (reference)")


def test_an_unused_part_of_the_gradient_reads_as_zero(ops, device):
    """Only z's gradient given: y's parts read none (not even a zeros kernel per part)."""
    t = {k: v.requires_grad_(True) for k, v in _inputs("two", device=device).items()}
    _, z = ops["two"].cat_two(**t)
    grad_a, grad_b = torch.autograd.grad(z.sum(), [t["a"], t["b"]])
    torch.testing.assert_close(grad_a, torch.ones_like(grad_a))
    torch.testing.assert_close(grad_b, -torch.ones_like(grad_b))


@pytest.mark.parametrize("name", ["two", "three"])
def test_gradcheck_fp64(ops, name, device):
    tensors = {k: v.requires_grad_(True) for k, v in _inputs(name, device=device, lead=(2,), n=3).items()}
    # fast_mode: a few backward probes, not one per output element (the interpreter is slow).
    assert torch.autograd.gradcheck(lambda *ts: _fn(ops[name], name)(*ts), tuple(tensors.values()), fast_mode=True)


def test_non_contiguous_inputs_and_incoming_gradient(ops, device):
    module = ops["three"]
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(4, 3, 21, generator=g, dtype=torch.float64).to(device)
    x = wide[..., 1:11].transpose(0, 1)  # [3, 4, 10], strided both ways
    w = torch.randn(10, generator=g, dtype=torch.float64).to(device)[::2]
    assert not x.is_contiguous() and not w.is_contiguous()
    xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = module.cat_three(xl, wl)
    truth = _torch64("three", {"x": x, "w": w})[0]
    torch.testing.assert_close(y, truth, rtol=1e-12, atol=1e-12)
    grad_y = torch.randn(15, 4, 3, generator=g, dtype=torch.float64).to(device).permute(2, 1, 0)  # strided too
    got = torch.autograd.grad(y, [xl, wl], grad_y)
    x64, w64 = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    want = torch.autograd.grad(_torch64("three", {"x": x64, "w": w64})[0], [x64, w64], grad_y)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_meta_tensors_and_out(ops, device):
    module = ops["two"]
    y, z = module.cat_two(torch.empty(2, 7, 4, device="meta"), torch.empty(7, 4, device="meta"))
    assert y.shape == (2, 7, 8) and z.shape == (2, 7, 4) and y.device.type == "meta"
    t = _inputs("two", device=device)
    out = (torch.empty(3, 2, 10, dtype=torch.float64, device=device), torch.empty(3, 2, 5, dtype=torch.float64, device=device))
    got = module.cat_two(**t, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    torch.testing.assert_close(out[0], _torch64("two", t)[0], rtol=1e-12, atol=1e-12)
    wrong = (torch.empty(3, 2, 5, dtype=torch.float64, device=device), out[1])  # y is [..., 2N], not [..., N]
    with pytest.raises(FusegenArgumentError, match=r"out\[0\]") as info:
        module.cat_two(**t, out=wrong)
    assert "\n" not in str(info.value)


def test_compile_fullgraph_forward_and_backward(device):
    """The library op's fake function gives the [..., 2N] output; its autograd the gradients."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 3, 4, 8, generator=g).to(device).requires_grad_(True)
    cos, sin = _cos_sin(2, 4, 8, torch.float32, device)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, c, s: rope(q, c[:, None], s[:, None]) * 2.0, fullgraph=True)
    y = compiled(q, cos, sin)
    want = rope(q, cos[:, None], sin[:, None]) * 2.0
    torch.testing.assert_close(y, want)
    grad = torch.randn(y.shape, generator=g).to(device)
    torch.testing.assert_close(torch.autograd.grad(y, q, grad)[0], torch.autograd.grad(want, q, grad)[0])


def test_the_module_declares_its_parts_and_docstring_shows_the_output(ops):
    module = ops["three"]
    assert module._OP.output_parts == (3,)
    assert "Outputs: y [..., 3N]" in module.__doc__


BAD = [
    ("  y: [a]\n", "output 'y': a concatenated output has 2 to 99 parts, got 1"),
    ("  y: []\n", "output 'y': a concatenated output has 2 to 99 parts, got 0"),
    ("  y: [a, [b]]\n", "output 'y': each part must be an expression (a string), got a list"),
    ("  y: [a, b +]\n", "cannot parse 'b +'"),
    ("  y: [a, sum(b)]\n", "output 'y': a concatenated output is not supported yet in an op with row reductions"),
]


@pytest.mark.parametrize("outputs,message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_concatenated_outputs_are_one_line_errors(tmp_path, outputs, message):
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\ndoc: d\ninputs:\n  a: [..., N]\n  b: [..., N]\noutputs:\n" + outputs)
    with pytest.raises(SpecError) as info:
        cli.build_op(path)
    text = str(info.value)
    assert text.startswith("tmp") is False and "bad.yaml:7:" in text and message in text and "\n" not in text


def test_a_let_cannot_be_a_list(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\ndoc: d\ninputs:\n  a: [..., N]\nlet:\n  t: [a, a]\noutputs:\n  y: t\n")
    with pytest.raises(SpecError, match=r"bad.yaml:6: intermediate 't' must be an expression \(a string\)"):
        cli.build_op(path)


# -- rope, against Hugging Face's formula (transformers' modeling_llama, copied) --------------


def _rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (_rotate_half(q) * sin)
    k_embed = (k * cos) + (_rotate_half(k) * sin)
    return q_embed, k_embed


def _cos_sin(batch, seq, head_dim, dtype, device):
    """As LlamaRotaryEmbedding makes them: [batch, seq, head_dim], the halves duplicated."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    positions = torch.arange(seq, dtype=torch.float64)[None].expand(batch, seq) + torch.arange(batch)[:, None] * 3
    freqs = positions[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_rope_is_hugging_faces_apply_rotary_pos_emb(dtype, device):
    batch, heads, kv_heads, seq, head_dim = 2, 3, 1, 5, 8
    g = torch.Generator().manual_seed(5)
    q = torch.randn(batch, heads, seq, head_dim, generator=g, dtype=torch.float64).to(dtype).to(device)
    k = torch.randn(batch, kv_heads, seq, head_dim, generator=g, dtype=torch.float64).to(dtype).to(device)
    cos, sin = _cos_sin(batch, seq, head_dim, dtype, device)
    ql, kl = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    # cos/sin broadcast over heads as HF unsqueezes them: [batch, 1, seq, head_dim].
    q_got, k_got = rope(ql, cos[:, None], sin[:, None]), rope(kl, cos[:, None], sin[:, None])
    q64, k64 = q.double().cpu().requires_grad_(True), k.double().cpu().requires_grad_(True)
    q_want, k_want = _apply_rotary_pos_emb(q64, k64, cos.double().cpu(), sin.double().cpu())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    assert q_got.shape == q.shape and k_got.shape == k.shape and q_got.dtype == dtype
    torch.testing.assert_close(q_got.double().cpu(), q_want.detach(), **tol)
    torch.testing.assert_close(k_got.double().cpu(), k_want.detach(), **tol)
    gq, gk = torch.randn(q.shape, generator=g, dtype=torch.float64), torch.randn(k.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((q_got, k_got), (ql, kl), (gq.to(dtype).to(device), gk.to(dtype).to(device)))
    want = torch.autograd.grad((q_want, k_want), (q64, k64), (gq, gk))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double().cpu(), b, **tol)


def test_rope_gradients_of_cos_and_sin_are_summed_over_heads(device):
    """cos and sin are float inputs: differentiated too, their broadcast over heads summed."""
    q = torch.randn(2, 3, 2, 4, dtype=torch.float64, device=device, requires_grad=True)
    cos, sin = (t[:, None].clone().requires_grad_(True) for t in _cos_sin(2, 2, 4, torch.float64, device))
    assert torch.autograd.gradcheck(rope, (q, cos, sin), fast_mode=True)
