"""`fusegen build --backend cuda` (issue 33): every shipped pointwise and row op's module with CUDA
C++ kernels, compiled by NVRTC at run time and launched through cuda-core.

Everywhere: which shipped specs the backend builds and the one line for those it refuses, the
modules' Python face (meta tensors, the error for CPU tensors, the reference), and the CLI. Where
NVRTC is installed (cuda-bindings and nvidia-cuda-nvrtc, `fusegen[cuda]`): each op's forward and
backward compiled for sm_90 in every dtype. On a GPU: values and gradients against the same op
built by the Triton backend, dropout's masks bit for bit, broadcast and strided inputs, CUDA
graphs and torch.compile. Each op is built under its name with `_cuda` added, so that its library
ops (fusegen::<name>) do not replace the Triton op's in the same process."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from fusegen import cli
from fusegen.backends.cuda import launch as cuda_launch
from fusegen.backends.cuda import row_launch
from fusegen.errors import SpecError
from fusegen.runtime import FusegenArgumentError
from tests.helpers import ShapeCase, build_and_import, make_inputs, op_by_name, params_for, shipped_as

ROOT = Path(__file__).resolve().parent.parent
POINTWISE = ("add_mul_activation", "add_relu", "bias_dropout_add", "bias_geglu", "bias_gelu", "bias_gelu_dropout_add",
             "bias_relu", "bias_swiglu", "geglu", "gelu", "gelu_tanh", "leaky_relu", "mish", "quick_gelu", "rope", "scale_add",
             "softcap", "squared_relu", "swiglu")
ROWS = ("add_rmsnorm", "bias_dropout_add_layernorm", "bias_layernorm", "cross_entropy", "layernorm", "layernorm_dropout_add",
        "layernorm_fp8", "log_softmax", "rmsnorm", "rmsnorm_fp8", "scaled_masked_softmax_dropout", "softmax",
        "swiglu_fp8")
OPS = tuple(sorted(POINTWISE + ROWS))
HAS_CUDA = torch.cuda.is_available()
try:
    from fusegen.backends.cuda import compiler

    compiler.nvrtc_version()
    HAS_NVRTC = True
except Exception:  # noqa: BLE001 - cuda-bindings or libnvrtc missing (CudaBackendMissing, or an ImportError)
    HAS_NVRTC = False
# CI installs the test extra, which brings NVRTC: there a missing one fails the tests, never skips them.
needs_nvrtc = pytest.mark.skipif(not HAS_NVRTC and not os.environ.get("CI"),
                                 reason="NVRTC (pip install 'fusegen[cuda]') is not installed")
needs_gpu = pytest.mark.skipif(not (HAS_CUDA and HAS_NVRTC), reason="needs a CUDA GPU and NVRTC")


def _build(folder: Path, name: str):
    """The shipped spec `name`, built by the CUDA backend as `<name>_cuda`, imported."""
    return build_and_import(folder, shipped_as(name, f"{name}_cuda"), "cuda")


class _Modules(dict):
    """The shipped ops' CUDA modules, each built on first use (a test process of many builds
    only the ops its tests take)."""

    def __init__(self, folder: Path):
        super().__init__()
        self.folder = folder

    def __missing__(self, name: str):
        self[name] = _build(self.folder, name)
        return self[name]


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    return _Modules(tmp_path_factory.mktemp("cuda_backend"))


def test_every_shipped_spec_builds_or_is_refused_in_one_line():
    built, refused = [], []
    for path in sorted((ROOT / "specs").glob("*.yaml")):
        try:
            cli.build_op(path, "cuda")
            built.append(path.stem)
        except SpecError as exc:
            message = str(exc)
            assert "\n" not in message and message.startswith(f"{path}: --backend cuda: {path.stem}: "), message
            assert "not supported by the CUDA backend yet" in message, message
            refused.append(path.stem)
    assert tuple(built) == OPS
    assert {"linear_bias_gelu", "dlrm_mlp"} <= set(refused)


def test_the_module_reads_as_written(modules):
    """The source is beside the module (which reads it), under 200 lines for a simple op, the build
    deterministic; the module's face is the Triton one's (the same public names)."""
    gelu = modules["gelu"]
    assert gelu.CUDA_SOURCE == Path(gelu.__file__).with_suffix(".cu").read_text()
    assert len(gelu.CUDA_SOURCE.splitlines()) < 200
    assert "__global__ void gelu_cuda_forward(" in gelu.CUDA_SOURCE and "gelu_cuda_backward(" in gelu.CUDA_SOURCE
    spec = ROOT / "specs" / "gelu.yaml"
    assert cli.build_op(spec, "cuda").files == cli.build_op(spec, "cuda").files
    assert set(gelu.__all__) == {"gelu_cuda", "GeluCuda", "reference", "eager"}


def test_meta_tensors_and_cpu_tensors(modules):
    m = modules["bias_dropout_add"]
    x = torch.randn(4, 8, device="meta")
    assert m.bias_dropout_add_cuda(x, torch.randn(8, device="meta"), x, 0.5).shape == (4, 8)
    with pytest.raises(FusegenArgumentError, match=r"^bias_dropout_add_cuda\(\): tensors are on cpu, but this op's "
                                                   r"kernels are CUDA C\+\+"):
        m.bias_dropout_add_cuda(torch.randn(4, 8), torch.randn(8), torch.randn(4, 8))
    torch.testing.assert_close(m.reference(torch.ones(2, 3), torch.ones(3), torch.ones(2, 3), 0.0), torch.full((2, 3), 3.0))


def test_the_cli_builds_and_checks_with_the_backend(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["build", str(ROOT / "specs" / "gelu.yaml"), "-o", str(out), "--backend", "cuda"]) == 0
    assert "CUDA_SOURCE = cuda_launch.source_beside(__file__)" in (out / "gelu.py").read_text()
    assert (out / "gelu.cu").read_text().startswith("// gelu: generated by fusegen from specs/gelu.yaml; do not edit.\n")
    assert cli.main(["check", str(ROOT / "specs" / "gelu.yaml"), "-o", str(out), "--backend", "cuda"]) == 0
    capsys.readouterr()
    assert cli.main(["check", str(ROOT / "specs" / "gelu.yaml"), "-o", str(out)]) == 1  # the Triton build differs
    err = capsys.readouterr().err
    assert "--backend" not in err and f"stale: {out / 'gelu.cu'}" in err  # the command it names builds with Triton
    # The source beside the module: a build with Triton removes it; without it the module says so.
    (out / "gelu.cu").rename(tmp_path / "gelu.cu")
    with pytest.raises(ImportError, match=r"^gelu.cu is missing beside gelu.py: build the op again"):
        cuda_launch.source_beside(str(out / "gelu.py"))
    (tmp_path / "gelu.cu").rename(out / "gelu.cu")
    assert cli.main(["build", str(ROOT / "specs" / "gelu.yaml"), "-o", str(out)]) == 0
    assert f"removed {out / 'gelu.cu'} (no longer built)" in capsys.readouterr().out and not (out / "gelu.cu").exists()
    # A gelu.cu of the user's is never written over: the build refuses, writing nothing.
    (out / "gelu.cu").write_text("// mine\n")
    before = (out / "gelu.py").read_text()
    assert cli.main(["build", str(ROOT / "specs" / "gelu.yaml"), "-o", str(out), "--backend", "cuda"]) == 2
    assert "gelu.cu: not fusegen's" in capsys.readouterr().err
    assert (out / "gelu.cu").read_text() == "// mine\n" and (out / "gelu.py").read_text() == before
    assert cli.main(["build", str(ROOT / "specs" / "gelu.yaml"), "-o", str(out)]) == 0  # Triton's build leaves it
    assert (out / "gelu.cu").read_text() == "// mine\n"
    assert cli.main(["build", str(ROOT / "specs" / "linear_bias_gelu.yaml"), "-o", str(out), "--backend", "cuda"]) == 2
    assert "linear_bias_gelu.yaml: --backend cuda: linear_bias_gelu: the gemm kind is not supported" in capsys.readouterr().err
    assert not (out / "linear_bias_gelu.py").exists()


def test_a_spec_names_its_backend(tmp_path, capsys):
    """`backend: cuda` in a spec builds its kernels in CUDA C++; --backend wins over it; an unknown
    backend, and a kind the spec's backend cannot build, are one line naming the spec's line."""
    text = (ROOT / "specs" / "gelu.yaml").read_text().rstrip("\n") + "\nbackend: cuda\n"
    (tmp_path / "gelu.yaml").write_text(text)
    assert "CUDA_SOURCE" in cli.build_op(tmp_path / "gelu.yaml").text and "gelu.cu" in cli.build_op(tmp_path / "gelu.yaml").files
    assert "CUDA_SOURCE" not in cli.build_op(tmp_path / "gelu.yaml", "triton").text
    out = tmp_path / "out"
    assert cli.main(["build", str(tmp_path / "gelu.yaml"), "-o", str(out)]) == 0
    assert cli.main(["check", str(tmp_path / "gelu.yaml"), "-o", str(out)]) == 0
    line = len(text.splitlines())
    (tmp_path / "gelu.yaml").write_text(text.replace("backend: cuda", "backend: metal"))
    with pytest.raises(SpecError, match=rf"gelu.yaml:{line}: 'backend' must be one of triton, cuda; got 'metal'"):
        cli.build_op(tmp_path / "gelu.yaml")
    gemm = (ROOT / "specs" / "linear_bias_gelu.yaml").read_text().rstrip("\n") + "\nbackend: cuda\n"
    (tmp_path / "linear_bias_gelu.yaml").write_text(gemm)
    with pytest.raises(SpecError, match=rf"linear_bias_gelu.yaml:{len(gemm.splitlines())}: backend cuda: linear_bias_gelu: "
                                        "the gemm kind"):
        cli.build_op(tmp_path / "linear_bias_gelu.yaml")


def _expressions(module, name: str, t: str, element: str, choice: int = 0, pack: int = 8,
                 index: str = "int32_t") -> tuple[str, ...]:
    """The forward and backward kernels' name expressions, as the launcher writes them."""
    kernels = module._OP.kernels
    chosen = [[str(choice)] * len(c) for c in kernels._choices]
    if kernels.kernels.statistics:  # the row kind: a block's threads, the packs each holds, blocks a row (bf16: a
        # cluster of two) and whether the row is in registers (fp32), after the pack
        chosen = [[*c, "256", "4" if pack > 1 else "0", "2" if pack == 8 else "1", "true" if pack == 4 else "false"]
                  for c in chosen]
    outputs = len(module._OP.outputs)
    rows = chosen[0][len(kernels._choices[0]):]
    chosen = [c[:len(k)] for c, k in zip(chosen, kernels._choices)]
    inputs = module._OP.inputs
    reads = [[element if inputs[i].differentiable else "int64_t" for i in kernels._reads[k]] for k in (0, 1)]
    written = [element if dtype is None else cuda_launch._C_TYPES[dtype] for dtype in module._OP._output_dtypes]
    forward = f"{name}_cuda_forward<{', '.join([t, index, *chosen[0], str(pack), *rows, *reads[0], *written])}>"
    if module._OP._forward_only:
        return (forward,)
    grads = len(kernels._gradients)
    backward = (f"{name}_cuda_backward<{', '.join([t, index, *chosen[1], str(pack), *rows, *reads[1]])}, "
                f"{', '.join([element] * (outputs + grads))}>")
    return forward, backward


@needs_nvrtc
@pytest.mark.parametrize("name", OPS)
def test_nvrtc_compiles_every_dtype(modules, name, tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEGEN_CACHE_DIR", str(tmp_path))
    module = modules[name]
    for t, element, pack in (("float", "float", 4), ("float", "__nv_bfloat16", 8), ("float", "__half", 1),
                             ("double", "double", 4)):
        expressions = _expressions(module, name, t, element, pack=pack, index="int64_t" if pack == 1 else "int32_t")
        binary = compiler.compile_source(module.CUDA_SOURCE, f"{name}_cuda.cu", expressions, "sm_90")
        assert set(binary.lowered) == set(expressions) and binary.cubin[:4] == b"\x7fELF"
        # The second time from the cache folder, without NVRTC.
        assert compiler.compile_source(module.CUDA_SOURCE, f"{name}_cuda.cu", expressions, "sm_90") == binary
    assert len(list(tmp_path.glob("cuda/*.cubin"))) == 4
    if name == "add_mul_activation":  # every choice of its activation
        for choice in range(6):
            expressions = _expressions(module, name, "float", "__nv_bfloat16", choice)
            assert set(compiler.compile_source(module.CUDA_SOURCE, f"{name}_cuda.cu", expressions, "sm_90").lowered) == set(
                expressions)


# -- on the host: the launcher and the kernels compiled by g++ (tests/cuda_host.py) ----------------

needs_host_build = pytest.mark.skipif(shutil.which("g++") is None or (not HAS_NVRTC and not os.environ.get("CI")),
                                      reason="needs g++ and cuda-core (pip install 'fusegen[cuda]')")
HOST_CASES = (ShapeCase("rows", (37,), 300), ShapeCase("bcast", (2, 3, 5), 130, layout="bcast"),
              ShapeCase("held", (9,), 24),  # a row kernel's row held in shared memory
              ShapeCase("tall", (66000,), 3, layout="bcast"),  # more rows than a grid's 65535
              ShapeCase("wide", (3,), 2100))


def _against_the_reference(module, name: str, op, case, dtype, params: dict) -> None:
    """Values and every gradient of `module`'s op against its reference in fp64."""
    fn = getattr(module, name)
    kwargs = dict(params, **({"training": True, "seed": 1234} if op.has_dropout else {}))
    tensors = make_inputs(op, case, dtype, seed=5)
    ours = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in tensors.items()}
    exact = {k: (v.clone().double() if v.is_floating_point() else v.clone()).requires_grad_(v.is_floating_point())
             for k, v in tensors.items()}
    got, want = fn(*ours.values(), **kwargs), module.reference(*exact.values(), **kwargs)
    got, want = (got,) if torch.is_tensor(got) else got, (want,) if torch.is_tensor(want) else want
    tolerance = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    for g, w in zip(got, want):
        # A float8 output from fp64 is rounded as the reference rounds it; from fp32, within its step.
        close = tolerance if g.dtype.itemsize > 1 or dtype == torch.float64 else dict(rtol=2**-3, atol=2**-9)
        torch.testing.assert_close(g.double(), w.double(), **close)
    if not any(w.requires_grad for w in want):  # an op without gradients (float8 outputs)
        return
    grads = [torch.randn(w.shape, dtype=torch.float64) for w in want]
    torch.autograd.backward(got, [g.to(dtype) for g in grads])
    torch.autograd.backward(want, grads)
    for key in (k for k, v in tensors.items() if v.is_floating_point()):
        torch.testing.assert_close(ours[key].grad.double(), exact[key].grad, **tolerance, msg=f"{name}: {key}'s gradient")


@needs_host_build
@pytest.mark.parametrize("name", OPS)
def test_the_launcher_and_kernels_on_the_host(modules, name, tmp_path, monkeypatch):
    """Every op through launch.py and its kernels (compiled for the host, run over the grid), in
    fp64 (and fp32 at the first case) against its reference: full, broadcast, past 65535 rows,
    wide rows."""
    from tests.cuda_host import on_the_host

    op = op_by_name(name)
    with on_the_host(tmp_path, monkeypatch) as launches:
        cases = HOST_CASES[:3] if name not in ("gelu", "bias_dropout_add", "swiglu", "rope", "softmax", "rmsnorm") else HOST_CASES
        for k, case in enumerate(cases):
            for dtype in (torch.float64, torch.float32)[:2 if k == 0 else 1]:  # fp32's kernels at the first case
                _against_the_reference(modules[name], f"{name}_cuda", op, case, dtype, params_for(op, p=0.3))
    assert launches, "nothing launched"


@needs_host_build
def test_packs_follow_the_views(modules, tmp_path, monkeypatch):
    """A thread's pack of elements: 4 fp32 values (vector loads) where every row is aligned, 1
    where a view is misaligned or strided, 8 where the launcher would take it; the same values,
    masks and gradients each way."""
    from fusegen.backends.cuda import launch as cuda_launch
    from tests.cuda_host import on_the_host

    module = modules["bias_dropout_add"]
    base = torch.randn(6 * 64 + 1)
    bias, residual = torch.randn(64), torch.randn(6, 64)
    views = {4: base[:384].view(6, 64), 1: base[1:385].view(6, 64)}  # the second 4 bytes off: no vector loads
    views[0] = torch.randn(6, 128)[:, ::2]  # strided columns: pack 1 too
    with on_the_host(tmp_path, monkeypatch) as launches:
        for pack, x in views.items():
            ours = [x.detach().requires_grad_(), bias.clone().requires_grad_()]
            exact = [x.detach().clone().requires_grad_(), bias.clone().requires_grad_()]
            y = module.bias_dropout_add_cuda(*ours, residual, 0.3, seed=99)
            want = module.reference(*exact, residual, 0.3, seed=99)
            torch.testing.assert_close(y, want)
            assert f"int32_t, {max(pack, 1)}, float" in launches[-1][0], launches[-1]  # the forward's pack
            g = torch.randn(6, 64)
            y.backward(g)
            want.backward(g)
            for a, b in zip(ours, exact):  # x's written, bias's summed over blocks of rows
                torch.testing.assert_close(a.grad, b.grad)
        original = cuda_launch._pack
        monkeypatch.setattr(cuda_launch, "_pack", lambda *a: 8 if original(*a) == 4 else original(*a))
        x = torch.randn(6, 64, requires_grad=True)
        y = module.bias_dropout_add_cuda(x, bias, residual, 0.3, seed=99)
        torch.testing.assert_close(y, module.reference(x.detach(), bias, residual, 0.3, seed=99))
        assert "int32_t, 8, float" in launches[-1][0]


def _shard_cases(modules, name: str, device: str, launches: list, tolerance: float) -> None:
    """A DTensor's local part (runtime.sharding's rules call the op so, with the shard's place):
    its masks drawn at the global problem's flat indices, so the local values and x's gradient are
    the global problem's at the shard's elements (the reference's, in fp64). Rows of a sharded
    middle dim; for the pointwise op also columns from an offset of whole groups of four (vector
    packs) and from one that is not (a pack of one)."""
    from fusegen.runtime.sharding import Shard

    op = op_by_name(name)
    fused = modules[name]._OP
    params = params_for(op, p=0.3)
    whole = make_inputs(op, ShapeCase("rows", (3, 5), 24), torch.float64, seed=3)
    exact = {k: v.clone().requires_grad_() for k, v in whole.items()}
    want = modules[name].reference(*exact.values(), **params, training=True, seed=4321)
    grad = torch.randn(want.shape, dtype=torch.float64)
    want.backward(grad)
    places = [((slice(None), slice(3, 5)), Shard(1, 2, 5, 3, 0, 24), 4)]  # rows 3-4 of the middle dim, of 5
    if not fused.statistics:  # the pointwise op: its columns may be sharded too
        places += [((Ellipsis, slice(12, 24)), Shard(1, 15, 15, 0, 12, 24), 4),  # columns 12-23 of 24
                   ((Ellipsis, slice(2, 22)), Shard(1, 15, 15, 0, 2, 24), 1)]  # from 2: groups straddle the edges
    for where, shard, pack in places:
        local = {k: v[where] if v.shape == whole["x"].shape else v[where[-1]] if where[0] is Ellipsis else v
                 for k, v in whole.items()}
        local = {k: v.clone().to(device) for k, v in local.items()}  # a rank's own memory, as a DTensor's local part
        values = [params[q.name] for q in fused.params]
        first = len(launches)
        (y,), seed, statistics = fused.forward((*local.values(), *values, True, 4321), shard=shard)
        torch.testing.assert_close(y.cpu(), want.detach()[where], rtol=tolerance, atol=tolerance, msg=f"{name} at {where}")
        if len(launches) > first:  # on the host, the launches seen: the forward's pack
            assert launches[first][0].split("<")[1].split(", ")[2] == str(pack), launches[first]
        needs = tuple(k == "x" for k in local)
        (grad_x,) = fused.backward_kernels((grad[where].to(device),), (*local.values(), *values, True, None), seed,
                                           needs, statistics, shard=shard)
        torch.testing.assert_close(grad_x.cpu(), exact["x"].grad[where], rtol=tolerance, atol=tolerance,
                                   msg=f"{name}: x's gradient at {where}")


@needs_host_build
@pytest.mark.parametrize("name", ["bias_dropout_add", "layernorm_dropout_add"])
def test_a_dtensor_shard_draws_the_global_masks_on_the_host(modules, name, tmp_path, monkeypatch):
    from tests.cuda_host import on_the_host

    with on_the_host(tmp_path, monkeypatch) as launches:
        _shard_cases(modules, name, "cpu", launches, 1e-12)
    assert launches


@needs_gpu
@pytest.mark.parametrize("name", ["bias_dropout_add", "layernorm_dropout_add"])
def test_a_dtensor_shard_draws_the_global_masks(modules, name):
    """As on the host, on the GPU: the shard's sizes in device memory, read by the kernels."""
    _shard_cases(modules, name, "cuda", [], 1e-10)


@needs_host_build
@pytest.mark.parametrize("name", ["rmsnorm", "layernorm_dropout_add", "softmax", "bias_layernorm"])
def test_row_backward_blocks_of_many_rows_on_the_host(modules, name, tmp_path, monkeypatch):
    """The row backward with fewer blocks than rows (each block a run of adjacent rows, none
    without one: 4 rows on 3 blocks take 2, of 2 rows each, whose rows of the sums buffer
    (torch.empty) each block writes): the statistics read row by row, an [N] input's gradient
    summed over a block's rows in registers (the row held) or in its row of the buffer (read
    again each pass)."""
    from tests.cuda_host import on_the_host

    op = op_by_name(name)
    cases = (ShapeCase("held", (11,), 24), ShapeCase("four", (4,), 24), ShapeCase("rows", (10,), 300),
             ShapeCase("four read", (4,), 300))
    with on_the_host(tmp_path, monkeypatch) as launches:
        monkeypatch.setattr("tests.cuda_host._Properties.multi_processor_count", 3)  # 3 blocks at most
        for k, case in enumerate(cases):
            if k == 2:  # the rest read the row again each pass (no shared memory to hold it)
                monkeypatch.setattr(row_launch, "shared_limit", lambda device: (0, 1))
            for dtype in (torch.float64, torch.float32)[:2 if k == 0 else 1]:
                _against_the_reference(modules[name], f"{name}_cuda", op, case, dtype, params_for(op, p=0.3))
    backward = [(grid[0], e.split("<")[1].split(", ")[4]) for e, grid in launches if "_backward<" in e]
    assert [blocks for blocks, _ in backward] == [3, 3, 2, 3, 2], backward
    assert [items == "0" for _, items in backward] == [False, False, False, True, True], backward


@needs_host_build
def test_torch_func_and_export_as_with_the_triton_backend(modules, tmp_path, monkeypatch):
    """torch.func's transforms run the op's reference (torch's ops, the kernels' masks), so vmap,
    grad and jvp of a CUDA-backend op are those of its reference, with the kernels' masks for a
    seed under vmap; torch.export records the library op, whose exported program runs the kernels
    (here compiled for the host) as a call does."""
    from torch.func import grad, jvp, vmap

    from tests.cuda_host import on_the_host

    norm, dropout = modules["layernorm"], modules["bias_dropout_add"]
    x = torch.randn(3, 4, 8, dtype=torch.float64)
    w, b = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    torch.testing.assert_close(vmap(lambda x: norm.layernorm_cuda(x, w, b))(x), vmap(lambda x: norm.reference(x, w, b))(x))
    torch.testing.assert_close(grad(lambda x: norm.layernorm_cuda(x, w, b).square().sum())(x),
                               grad(lambda x: norm.reference(x, w, b).square().sum())(x))
    tangent = torch.randn_like(x)
    torch.testing.assert_close(jvp(lambda x: norm.layernorm_cuda(x, w, b), (x,), (tangent,)),
                               jvp(lambda x: norm.reference(x, w, b), (x,), (tangent,)))
    residual, bias = torch.zeros(4, 8, dtype=torch.float64), torch.rand(8, dtype=torch.float64) + 1
    ys = vmap(lambda x: dropout.bias_dropout_add_cuda(x, bias, residual, 0.5, seed=77))(x.abs())
    for y, row in zip(ys, x.abs()):  # each element of the batch: the seed's masks at its own indices
        want = dropout.reference(row, bias, residual, 0.5, training=True, seed=77)
        assert 0 < int((want == 0).sum()) < want.numel() and torch.equal(y == 0, want == 0)
        torch.testing.assert_close(y, want)

    class Norm(torch.nn.Module):
        def forward(self, x, w, b):
            return norm.layernorm_cuda(x, w, b)

    program = torch.export.export(Norm(), (x, w, b))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "fusegen.layernorm_cuda.default" in targets, targets
    with on_the_host(tmp_path, monkeypatch) as launches:
        torch.testing.assert_close(program.module()(x, w, b), norm.reference(x, w, b))
    assert launches, "the exported program ran no kernel"


@needs_host_build
@pytest.mark.parametrize("name", ["layernorm_dropout_add", "bias_dropout_add"])
def test_torch_compile_calls_the_library_op_on_the_host(modules, name, tmp_path, monkeypatch):
    """A CUDA-backend op inside torch.compile (aot_eager, fullgraph: the library op's fake
    and autograd registrations traced; Inductor's GPU codegen is the GPU test's): values,
    dropout's masks and every gradient as an eager call's, bit for bit."""
    from tests.cuda_host import on_the_host

    op = op_by_name(name)
    fn = getattr(modules[name], f"{name}_cuda")
    params = params_for(op, p=0.3)
    tensors = make_inputs(op, ShapeCase("rows", (3, 5), 24), torch.float64, seed=11)
    with on_the_host(tmp_path, monkeypatch) as launches:
        results, counts = [], []
        for call in (fn, torch.compile(fn, backend="aot_eager", fullgraph=True)):
            leaves = {k: v.clone().requires_grad_() for k, v in tensors.items()}
            first = len(launches)
            y = call(*leaves.values(), **params, training=True, seed=99)
            y.backward(torch.ones_like(y))
            results.append((y.detach(), *(v.grad for v in leaves.values())))
            counts.append(len(launches) - first)
    eager, compiled = results
    assert counts[1] == counts[0] == 2, counts  # the compiled graph launched the kernels: forward, backward
    assert 0 < int((eager[0] == tensors["residual"]).sum()) < eager[0].numel()  # some elements dropped
    for want, got in zip(eager, compiled):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@needs_host_build
@pytest.mark.parametrize(("name", "held"), [("softmax", "shared"), ("rmsnorm", "shared"), ("bias_layernorm", "shared"),
                                            ("layernorm_dropout_add", "shared"), ("softmax", "registers"),
                                            ("layernorm_dropout_add", "registers")])  # in registers: an op with masks, one without
def test_row_kernels_with_blocks_of_threads_on_the_host(modules, name, held, tmp_path, monkeypatch):
    """Row kernels whose blocks run 32-64 threads at once (host threads): the threads' columns,
    held rows across threads (in registers or in shared memory), the block's reductions; fewer
    blocks than rows in the backward."""
    from tests.cuda_host import on_the_host

    op = op_by_name(name)
    in_registers = held == "registers"
    monkeypatch.setattr(row_launch, "LAYOUTS", {size: (((32,), in_registers), ((16,), in_registers)) for size in (2, 4)})
    monkeypatch.setattr(row_launch, "REGISTER_BYTES", 1 << 20)
    monkeypatch.setattr(row_launch, "SM_REGISTERS", 1 << 30)
    monkeypatch.setattr(modules[name]._OP, "_prepared", {})  # layouts are kept by call key: none from another test
    with on_the_host(tmp_path, monkeypatch, row_threads=64) as launches:
        monkeypatch.setattr("tests.cuda_host._Properties.multi_processor_count", 2)  # 2 blocks a backward
        for k, case in enumerate((ShapeCase("held", (5,), 256), ShapeCase("odd", (7,), 1001),
                                  ShapeCase("read", (3,), 16000))):  # 64 threads hold 250 values each, or (fp64 backwards) read again
            for dtype in (torch.float64, torch.float32)[:2 if k == 0 else 1]:
                _against_the_reference(modules[name], f"{name}_cuda", op, case, dtype, params_for(op, p=0.3))
    layouts = {tuple(e.split("<")[1].split(", ")[2:7]) for e, _ in launches}
    assert any(items != "0" for _, _, items, _, _ in layouts) and any(items == "0" for _, _, items, _, _ in layouts), layouts
    assert all(int(threads) > 1 for _, threads, _, _, _ in layouts), layouts
    assert all((registers == "true") == (held == "registers" and items != "0") for _, _, items, _, registers in layouts), \
        layouts


@needs_host_build
@pytest.mark.parametrize(("resident", "threads"), [({32: 1, 64: 1}, 64), ({32: 2, 64: 1}, 32), ({32: 3, 64: 1}, 32)])
def test_backward_values_a_thread_by_the_threads_resident_on_the_host(modules, resident, threads, tmp_path,
                                                                      monkeypatch):
    """Of the backward's values a thread (LAYOUTS: 16 and 8; fp64 rows of 512 in 16-byte packs:
    32 or 64 threads), the one whose kernel the GPU runs more threads of at once (the driver's
    blocks an SM, here given), the first on a tie; values and gradients as the reference's."""
    from tests.cuda_host import on_the_host

    op = op_by_name("rmsnorm")
    monkeypatch.setattr(modules["rmsnorm"]._OP, "_prepared", {})  # layouts are kept by call key: none from another test
    with on_the_host(tmp_path, monkeypatch, row_threads=64) as launches:
        monkeypatch.setattr(cuda_launch, "_resident", lambda kernel, device, threads, shared, cluster=1: resident[threads])
        _against_the_reference(modules["rmsnorm"], "rmsnorm_cuda", op, ShapeCase("held", (3,), 512), torch.float64,
                               params_for(op))
    backward = [e.split("<")[1].split(", ")[3] for e, _ in launches if "_backward<" in e]
    assert backward == [str(threads)], (backward, launches)


@needs_host_build
@pytest.mark.parametrize("text", [
    "params: {k: {type: float, default: 2.5}}\noutputs: {y: x * k}",  # a param named as the kernel's loop counter
    "outputs: {y: x * exp(-col) + col / (col + 1)}",  # col as a number of the compute type
    "inputs: {x: [..., N], r: [..., N]}\noutputs: {y: x + r}",  # every gradient an output's own: no backward kernel
])
def test_names_col_and_ops_without_a_backward_kernel(tmp_path, monkeypatch, text):
    from tests.cuda_host import on_the_host

    inputs = "" if text.startswith("inputs") else "inputs: {x: [..., N]}\n"
    module = build_and_import(tmp_path, f"name: odd_cuda\ndoc: a spec\n{inputs}{text}\n", "cuda")
    if HAS_NVRTC:  # the whole source compiles for the device
        op = module._OP
        compiler.compile_source(module.CUDA_SOURCE, "odd_cuda.cu", _expressions(module, "odd", "float", "float")[
            :1 if not op.kernels._gradients else 2], "sm_90")
    with on_the_host(tmp_path, monkeypatch):
        x = torch.randn(3, 600, dtype=torch.float64, requires_grad=True)
        args = (x, torch.randn(3, 600, dtype=torch.float64)) if "r:" in text else (x,)
        params = (2.5,) if "k:" in text else ()
        y = module.odd_cuda(*args, *params)
        torch.testing.assert_close(y, module.reference(*args, *params))
        y.sum().backward()
        exact = x.detach().clone().requires_grad_()
        module.reference(exact, *args[1:], *params).sum().backward()
        torch.testing.assert_close(x.grad, exact.grad)


GLU_NORM = """name: glu_norm_cuda
doc: a row op of an input in chunks and a [2N] bias
inputs:
  x: [..., 2N]
  bias: [2N]
let:
  h: (chunk(x, 0) + chunk(bias, 0)) * sigmoid(chunk(x, 1) + chunk(bias, 1))
outputs:
  y: h * rsqrt(mean(h * h) + 1.0e-5)
"""


@needs_host_build
def test_row_inputs_in_chunks_on_the_host(tmp_path, monkeypatch):
    """A row op of an input in chunks ([..., 2N], a [2N] bias): each chunk's columns, its
    gradient at its columns, the bias's chunks' sums over rows; the row held and read again."""
    from tests.cuda_host import on_the_host

    module = build_and_import(tmp_path, GLU_NORM, "cuda")
    if HAS_NVRTC:
        compiler.compile_source(module.CUDA_SOURCE, "glu_norm_cuda.cu", _expressions(module, "glu_norm", "float", "float"),
                                "sm_90")
    with on_the_host(tmp_path, monkeypatch, row_threads=32) as launches:
        monkeypatch.setattr("tests.cuda_host._Properties.multi_processor_count", 2)  # 2 blocks a backward
        for shared in (None, 0):  # the row held; read again
            if shared == 0:
                monkeypatch.setattr(row_launch, "shared_limit", lambda device: (0, 1))
            for m, n in ((5, 64 + 8 * (shared == 0)), (4, 301 + 2 * (shared == 0))):  # new call keys: new layouts
                x = torch.randn(m, 2 * n, dtype=torch.float64, requires_grad=True)
                bias = torch.randn(2 * n, dtype=torch.float64, requires_grad=True)
                y = module.glu_norm_cuda(x, bias)
                exact = [x.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()]
                want = module.reference(*exact)
                torch.testing.assert_close(y, want)
                g = torch.randn_like(want)
                y.backward(g)
                want.backward(g)
                torch.testing.assert_close(x.grad, exact[0].grad)
                torch.testing.assert_close(bias.grad, exact[1].grad)
    items = {e.split("<")[1].split(", ")[4] for e, _ in launches}
    assert "0" in items and items - {"0"}, items


# -- on the GPU: against the Triton backend's op ------------------------------------------------

CASES = (ShapeCase("rows", (37,), 300), ShapeCase("bcast", (2, 3, 5), 130, layout="bcast"))
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
             torch.float64: dict(rtol=1e-12, atol=1e-12)}


def _call(fn, op, tensors, params, seed):
    kwargs = dict(params)
    if op.has_dropout:
        kwargs.update(training=True, seed=seed)
    return fn(*tensors.values(), **kwargs)


@needs_gpu
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_values_gradients_and_masks_as_the_triton_backend(modules, name, dtype, case):
    op = op_by_name(name)
    fn = getattr(modules[name], f"{name}_cuda")
    params = params_for(op, p=0.3)
    tensors = make_inputs(op, case, dtype, device="cuda", seed=5)
    ours = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in tensors.items()}
    theirs = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in tensors.items()}
    got, want = _call(fn, op, ours, params, 1234), _call(op.fn, op, theirs, params, 1234)
    got, want = (got,) if torch.is_tensor(got) else got, (want,) if torch.is_tensor(want) else want
    for g, w in zip(got, want):  # a float8 output within its step (the two backends round the scale alike)
        torch.testing.assert_close(g.float(), w.float(), **(TOLERANCE[dtype] if g.dtype.itemsize > 1 else
                                                             dict(rtol=2**-3, atol=2**-9)))
    if not any(w.requires_grad for w in want):  # an op without gradients (float8 outputs)
        return
    grads = [torch.randn_like(w) for w in want]
    torch.autograd.backward(got, grads)
    torch.autograd.backward(want, grads)
    for key in (k for k, v in tensors.items() if v.is_floating_point()):
        torch.testing.assert_close(ours[key].grad, theirs[key].grad, **TOLERANCE[dtype])
    if op.has_dropout:  # the same elements dropped: x's gradient is its mask times the scale
        assert torch.equal(ours["x"].grad == 0, theirs["x"].grad == 0)


@needs_gpu
@pytest.mark.parametrize("activation", ["relu", "sigmoid", "silu", "gelu", "gelu_tanh", "identity"])
def test_every_choice_as_the_triton_backend(modules, activation):
    """The seed's add_mul_activation with each activation (a template argument of the kernels)."""
    op = op_by_name("add_mul_activation")
    fn = modules["add_mul_activation"].add_mul_activation_cuda
    tensors = make_inputs(op, CASES[1], torch.float32, device="cuda", seed=3)
    ours = {k: v.clone().requires_grad_() for k, v in tensors.items()}
    theirs = {k: v.clone().requires_grad_() for k, v in tensors.items()}
    got = fn(*ours.values(), 0.7, activation)
    want = op.fn(*theirs.values(), 0.7, activation)
    g = torch.randn_like(want)
    got.backward(g)
    want.backward(g)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])
    for key in (k for k, v in tensors.items() if v.is_floating_point()):
        torch.testing.assert_close(ours[key].grad, theirs[key].grad, **TOLERANCE[torch.float32])


@needs_gpu
def test_masks_bit_for_bit_and_strided_inputs(modules):
    op = op_by_name("bias_dropout_add")
    fn = modules["bias_dropout_add"].bias_dropout_add_cuda
    x = torch.randn(64, 2048, device="cuda")[:, ::2]  # strided columns
    bias, residual = torch.randn(1024, device="cuda"), torch.randn(1024, 64, device="cuda").t()
    for seed in (0, 7, 2**62 + 3):
        assert torch.equal(fn(x, bias, residual, 0.5, seed=seed), op.fn(x, bias, residual, 0.5, seed=seed))
    assert torch.equal(fn(x, bias, residual, 0.5, training=False), op.fn(x, bias, residual, 0.5, training=False))


@needs_gpu
@pytest.mark.parametrize("name", ["bias_dropout_add", "layernorm_dropout_add"])
def test_more_than_2_31_elements_as_the_triton_backend(modules, name):
    """Past 2**31 elements the launchers switch to 64-bit offsets and dropout's flat index keeps
    its high bits: the rows on both sides of 2**31, the same elements dropped as the Triton op,
    values and x's gradient within rounding there, and the [N] inputs' gradients summed over every
    row (half precision: 4 GiB an array)."""
    if torch.cuda.get_device_properties(0).total_memory < 60 * 2**30:
        pytest.skip("needs 60 GiB of GPU memory (about 50 in use)")
    op = op_by_name(name)
    fn = getattr(modules[name], f"{name}_cuda")
    n = 4096
    m = 2**31 // n + 3
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = {i.name: torch.randn((m, n) if i.dims[0] == "..." else (n,), device="cuda", dtype=torch.float16,
                                   generator=g) for i in op.spec.inputs}
    kwargs = dict(params_for(op, p=0.1), training=True, seed=2**33 + 7)
    rows = [0, 1, m // 2, m - 3, m - 2, m - 1]  # the last rows start past element 2**31
    summed = [k for k, v in tensors.items() if v.dim() == 1]
    leaves = {k: v.requires_grad_(k == "x" or k in summed) for k, v in tensors.items()}
    grad_y = torch.randn(m, n, device="cuda", dtype=torch.float16, generator=g)
    results = []
    for f in (fn, op.fn):
        y = f(*leaves.values(), **kwargs)
        grads = torch.autograd.grad(y, [leaves["x"], *(leaves[k] for k in summed)], grad_y)
        results.append((y[rows].float(), grads[0][rows].float(), [s.float() for s in grads[1:]]))
        del y, grads
    (y, gx, sums), (y_want, gx_want, sums_want) = results
    torch.testing.assert_close(y, y_want, rtol=2e-3, atol=2e-3)
    assert torch.equal(gx == 0, gx_want == 0), f"{name}: other elements dropped past 2**31"
    torch.testing.assert_close(gx, gx_want, rtol=2e-3, atol=2e-3)
    for key, got, want in zip(summed, sums, sums_want):  # ~ sqrt(m) ≈ 724: half precision's step there, 0.5
        torch.testing.assert_close(got, want, rtol=2e-3, atol=1.0, msg=f"{name}: {key}'s gradient")


@needs_gpu
@pytest.mark.parametrize("name", ["softmax", "log_softmax", "rmsnorm", "layernorm", "layernorm_dropout_add"])
@pytest.mark.parametrize("dtype, n", [(torch.float32, 40000), (torch.bfloat16, 131072), (torch.float32, 1001)], ids=str)
def test_rows_wide_and_odd_as_the_triton_backend(modules, name, dtype, n):
    """Rows of a thousand blocks' packs, and of an odd width (a pack of one), against the Triton op."""
    op = op_by_name(name)
    fn = getattr(modules[name], f"{name}_cuda")
    params = params_for(op, p=0.3)
    tensors = make_inputs(op, ShapeCase("wide", (5,), n), dtype, device="cuda", seed=7)
    ours = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in tensors.items()}
    theirs = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in tensors.items()}
    got, want = _call(fn, op, ours, params, 77), _call(op.fn, op, theirs, params, 77)
    g = torch.randn_like(want)
    got.backward(g)
    want.backward(g)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    for key in (k for k, v in tensors.items() if v.is_floating_point()):
        torch.testing.assert_close(ours[key].grad, theirs[key].grad, **TOLERANCE[dtype], msg=f"{name}: {key}")


@pytest.mark.parametrize(("n", "resident", "want"), [
    (8192, {512: 1, 1024: 1}, (1024, 1, 1)),  # 8 values a thread: 1024 threads resident, against 512
    (8192, {512: 2, 1024: 1}, (512, 2, 1)),  # a tie: the first of LAYOUTS' (16 values a thread)
    (131072, {512: 1}, (512, 4, 8)),  # a cluster's blocks capped at 512 threads: one layout, none weighed
])
def test_backward_layouts_weighed_by_the_threads_resident(n, resident, want, monkeypatch):
    """Of the backward's layouts at 16 and 8 values a thread (bf16, x and grad_y held), the one
    whose kernel the driver says the GPU runs the most threads of at once: the candidates compiled
    in one program, an identical one once; a cluster's count is its blocks' threads."""
    from types import SimpleNamespace

    import numpy as np

    compiled = []
    bound = SimpleNamespace(kernels=SimpleNamespace(op="op"), kernel=lambda device, expression: expression,
                            compile_together=lambda device, expressions: compiled.append(list(expressions)))
    launch = object.__new__(row_launch._RowLaunch)
    launch._bound, launch._name, launch._layouts = bound, "backward", {}
    launch._types, launch._sizes = ["float", "__nv_bfloat16", "__nv_bfloat16"], (2, 2)
    launch._call = SimpleNamespace(problem=SimpleNamespace(n=n, device=torch.device("cuda", 0)))
    monkeypatch.setattr(row_launch, "shared_limit", lambda device: (233472 - row_launch.RESERVED, 16))
    monkeypatch.setattr(cuda_launch, "_allow", lambda kernel, device, shared, cluster=1: None)
    monkeypatch.setattr(cuda_launch, "_resident",
                        lambda kernel, device, threads, shared, cluster=1: resident[threads] if cluster == 1 else 7)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(multi_processor_count=132))
    assert launch.layout(8, np.int32)[:3] == want
    assert len(compiled) == (n == 8192) and all(len(e) == 2 for e in compiled), compiled
    if n != 8192:  # a cluster: 7 resident (the driver's count of clusters), each of 8 blocks of 512 threads
        assert launch.threads_resident(8, np.int32, launch.layout(8, np.int32)) == 7 * 8 * 512


def test_what_a_row_forward_holds():
    """The forward holds what its passes read, the [N] inputs too, and the rows only its results
    read; the backward what its passes read with rows (its [N] inputs from memory, cached)."""
    from fusegen.backends.cuda import row_source

    def held(name):  # each kernel's held arrays, by input name (or the element type's name)
        plan = cli.build_op(ROOT / "specs" / f"{name}.yaml", "cuda").plan
        found = row_source.held_arrays(plan)
        return tuple(tuple([*(i.name for i in kernel.inputs), *kernel.incoming][p] if isinstance(p, int) else p
                           for p in places) for kernel, places in zip((plan.forward, plan.backward), found))

    assert held("bias_layernorm") == (("x", "bias"), ("x", "grad_y"))
    assert held("layernorm_dropout_add") == (("x", "bias", "residual"), ("x", "grad_y", "unsigned char"))
    assert held("softmax") == (("x",), ("x", "grad_y"))


def test_cluster_layouts():
    """A row too wide for a block goes to the smallest cluster whose parts fit PART; its blocks
    take at most CLUSTER_THREADS threads where two fit an SM's shared memory, else up to
    MAX_THREADS (a block alone on its SM); rows a block holds keep their threads."""
    from types import SimpleNamespace

    h100 = 233472 - row_launch.RESERVED  # an H100's shared memory a block

    def layout(n, pack, sizes, share):
        return row_launch.layout(SimpleNamespace(n=n), pack, sizes, h100, 16, share)

    assert layout(131072, 8, (2,), 32) == (512, 8, 4)  # bf16 forward: 64 KB parts, 64 values a thread
    assert layout(131072, 8, (2, 2), 16) == (512, 4, 8)  # bf16 backward, two held arrays
    assert layout(262144, 4, (4,), 32) == (512, 8, 16)
    assert layout(262144, 4, (4, 4), 16) == (1024, 4, 16)  # 128 KB a block: alone on its SM
    assert layout(32000, 8, (2,), 32) == (1024, 4, 1)  # one block holds it
    assert layout(8192, 8, (2, 2), 16) == (512, 2, 1)
    # fp32 forwards in registers (16 values a thread), but not where 1024 threads would hold 32
    # each (ptxas: spilled at __launch_bounds__(1024)'s 64 registers a thread), nor in a cluster.
    assert layout(4096, 4, (4,), 16) == (256, 4, 1) and row_launch.in_registers(256, 4, 1, 4, (4,))
    assert layout(32768, 4, (4,), 16) == (1024, 8, 1) and not row_launch.in_registers(1024, 8, 1, 4, (4,))
    assert not row_launch.in_registers(512, 8, 16, 4, (4,)) and not row_launch.in_registers(256, 0, 1, 4, (4,))


@needs_gpu
@pytest.mark.parametrize("name", ["softmax", "log_softmax", "rmsnorm", "layernorm_dropout_add"])
@pytest.mark.parametrize("dtype, n", [(torch.float32, 262144), (torch.bfloat16, 131072)], ids=str)
def test_rows_held_across_a_cluster(modules, name, dtype, n, monkeypatch):
    """Rows wider than an SM holds, held across a cluster of blocks (sm_90): values and every
    gradient against the reference in float64, and the launches' clusters."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("clusters need sm_90")
    from tests.helpers import check_against_truth

    clusters, config = set(), cuda_launch._config

    def recording(grid, block=cuda_launch.BLOCK, shared=0, cluster=1):
        clusters.add(cluster)
        return config(grid, block, shared, cluster)

    monkeypatch.setattr(cuda_launch, "_config", recording)

    op = op_by_name(name)
    module = modules[name]
    fn = getattr(module, f"{name}_cuda")
    kwargs = dict(params_for(op, p=0.3), **({"training": True, "seed": 99} if op.has_dropout else {}))
    tensors = make_inputs(op, ShapeCase("wide", (3,), n), dtype, device="cuda", seed=11)
    ours = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in tensors.items()}
    exact = {k: (v.clone().double() if v.is_floating_point() else v.clone()).requires_grad_(v.is_floating_point())
             for k, v in tensors.items()}
    low = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in tensors.items()}
    got, want, rough = fn(*ours.values(), **kwargs), module.reference(*exact.values(), **kwargs), module.reference(
        *low.values(), **kwargs)
    grad = torch.randn_like(want)
    for y in (got, want, rough):
        y.backward(grad.to(y.dtype))
    check_against_truth(got, want.detach(), rough.detach(), what=name)
    for key in (k for k, v in tensors.items() if v.is_floating_point()):
        check_against_truth(ours[key].grad, exact[key].grad, low[key].grad, what=f"{name}: {key}'s gradient")
    assert max(clusters) > 1, f"{name}: no cluster chosen ({clusters})"


@needs_gpu
def test_cuda_graphs_and_torch_compile(modules):
    fn = modules["gelu_tanh"].gelu_tanh_cuda
    x = torch.randn(512, 1000, device="cuda", requires_grad=True)
    expected = fn(x)
    expected.sum().backward()  # compiled once, before capture
    static = torch.randn(512, 1000, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fn(static)
    static.copy_(x.detach())
    graph.replay()
    torch.testing.assert_close(y, expected.detach(), rtol=0, atol=0)
    compiled = torch.compile(fn, fullgraph=True)
    torch.testing.assert_close(compiled(x), expected, rtol=0, atol=0)


@needs_gpu
@pytest.mark.parametrize("name", ["bias_dropout_add", "layernorm_dropout_add"])
def test_dropout_under_cuda_graphs(modules, name):
    """A captured forward + backward with dropout: each replay draws a new mask, torch.manual_seed
    repeats the replays, and each replay's kernels give the Triton op's values and gradients at
    the seed that replay drew (read back from the captured seed tensor)."""
    op = op_by_name(name)
    module = modules[name]
    public, fused = getattr(module, f"{name}_cuda"), module._OP
    params = params_for(op, p=0.3)
    tensors = list(make_inputs(op, ShapeCase("rows", (48,), 1000), torch.float32, device="cuda", seed=9).values())
    leaves = [t.clone().requires_grad_() for t in tensors]
    args = (*tensors, *params.values(), True, None)
    needs = fused.gradient_sources((True,) * len(tensors), tensors)[0]  # those the kernel computes
    grad_y = torch.randn(48, 1000, device="cuda")

    def step():
        y = public(*leaves, **params, training=True)
        (y_kernel,), seed, statistics = fused.forward(args, eager=False)
        return y, torch.autograd.grad(y, leaves, grad_y), y_kernel, seed, fused.backward_kernels(
            (grad_y,), args, seed, needs, statistics)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and allocate outside the capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, grads, y_kernel, seed, kernel_grads = step()
    torch.cuda.synchronize()

    def replays(count):
        out = []
        for _ in range(count):
            graph.replay()
            out.append((y.detach().clone(), [g.clone() for g in grads], y_kernel.clone(), int(seed.item()),
                        [g.clone() for g in kernel_grads]))
        return out

    torch.manual_seed(11)
    first = replays(3)
    torch.manual_seed(11)
    again = replays(3)
    for i, (a, b) in enumerate(zip(first, again)):
        assert torch.equal(a[0], b[0]) and a[3] == b[3], f"replay {i} did not repeat after manual_seed"
        for j in range(i):
            assert not torch.equal(a[0], first[j][0]) and a[3] != first[j][3], f"replays {j} and {i} drew one mask"
        theirs = [t.clone().requires_grad_() for t in tensors]
        want = op.fn(*theirs, **params, training=True, seed=a[3])
        want_grads = torch.autograd.grad(want, theirs, grad_y)
        # Within rounding (a row op's sums run in another order), so the same elements dropped.
        torch.testing.assert_close(a[2], want.detach(), **TOLERANCE[torch.float32], msg=f"{name} replay {i}")
        for g, w in zip(a[4], [w for w, need in zip(want_grads, needs) if need]):
            torch.testing.assert_close(g, w, **TOLERANCE[torch.float32], msg=f"{name} replay {i}")


def test_the_cuda_backend_satisfies_the_protocols(modules):
    """CudaKernels and what it prepares against runtime.backend's Protocols, as the Triton
    backend's (tests/test_backend_contract.py), on meta tensors (nothing launches)."""
    from fusegen.runtime import backend
    from tests.test_backend_contract import _check_signature

    op = modules["bias_dropout_add"]._OP
    args = (torch.randn(4, 8, device="meta"), torch.randn(8, device="meta"), torch.randn(4, 8, device="meta"), 0.3,
            True, 5)
    call = op.check(args, needs_kernel=False)
    tensors, grads = args[:3], [torch.randn(4, 8, device="meta")]
    bound = op.kernels
    forms = [(backend.BoundKernels, bound), (backend.PreparedForward, bound.prepare_forward(call, tensors)),
             (backend.PreparedBackward, bound.prepare_backward(call, tensors, grads, [True, True, False]))]
    for protocol, obj in forms:
        assert isinstance(obj, protocol), f"{type(obj).__name__} is no {protocol.__name__}"
        _check_signature(protocol, obj)
