"""Generated ops inside traced graphs: torch.compile and torch.export record their Triton
kernels (torch.library.triton_op + wrap_triton), which Inductor launches itself, forward and
backward, instead of one opaque op per call.

On the CPU the kernels run on Triton's interpreter, which a graph cannot record (the library
ops stay opaque there, test_compile.py); the first test traces a graph there in a process
without the interpreter, on fake CUDA tensors, where nothing runs. The rest need a GPU."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import as_tuple

ROOT = Path(__file__).resolve().parent.parent

_TRACE = textwrap.dedent("""
    import json, torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._functorch.aot_autograd import aot_function
    from generated.bias_gelu_dropout_add import bias_gelu_dropout_add
    from generated.layernorm import layernorm
    graphs = []

    def keep(gm, inputs):
        graphs.append(str(gm.graph))
        return gm

    with FakeTensorMode():
        x, residual, grad = (torch.empty(64, 128, device="cuda") for _ in range(3))
        weight, bias = torch.empty(128, device="cuda"), torch.empty(128, device="cuda")

        def step(x, bias, residual, weight, grad):
            y = layernorm(bias_gelu_dropout_add(x, bias, residual, 0.1), weight, bias)
            statistics = torch.empty(64, 2, device="cuda")
            grads = torch.ops.fusegen.layernorm_backward([grad], [y, weight, bias], 1e-5, statistics,
                                                         [True, True, True])
            return y, *grads

        try:  # the compiled function's run needs a GPU; its graph is made before
            aot_function(step, fw_compiler=keep)(x, bias, residual, weight, grad)
        except RuntimeError:
            pass
    print(json.dumps(graphs))
""")


def test_traced_graph_records_the_kernels_not_an_opaque_op():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _TRACE], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    graph = json.loads(done.stdout.strip().splitlines()[-1])[0]
    launches = [line for line in graph.splitlines() if "target=torch.ops.higher_order.triton_kernel_wrapper_functional" in line]
    # Each op's kernel, by name in the kernel side table: forward, forward, backward.
    assert len(launches) == 3, graph
    assert "fusegen" not in graph, graph  # no opaque fusegen:: op left
    assert "aten.randint" in graph  # dropout's seed is drawn in the graph, a fresh one per run


_DYNAMIC = textwrap.dedent("""
    import torch
    import torch._higher_order_ops.triton_kernel_wrap as wrap
    from torch._dynamo.backends.common import aot_autograd
    from generated.add_rmsnorm import add_rmsnorm
    from generated.bias_gelu_dropout_add import bias_gelu_dropout_add
    from generated.layernorm import layernorm
    from generated.swiglu import swiglu

    def written(kernel_idx, constant_args_idx, kwargs, tma):
        # What Triton's TTIR analysis finds on a GPU (here it has no target): the outputs
        # and gradient buffers are written, nothing else.
        return [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)
                and (k in ("y_ptr", "h_ptr", "statistics_ptr")
                     or (k.startswith("grad_") and k[5:7] not in ("y_", "h_")))]

    wrap.get_mutated_tensors = written

    def no_run(gm, inputs):  # the graph is what is checked; running it needs a GPU
        def run(*args):
            raise RuntimeError("not run")
        return run

    def block(x, residual, weight, bias, up):
        h = layernorm(x, weight, bias)
        h = swiglu(h @ up)
        h = bias_gelu_dropout_add(h, bias, residual, 0.1)
        return add_rmsnorm(h, x, weight)

    step = torch.compile(block, backend=aot_autograd(fw_compiler=no_run, bw_compiler=no_run), dynamic=True,
                         fullgraph=True)
    weight, bias = torch.ones(64, requires_grad=True), torch.zeros(64, requires_grad=True)
    up = torch.randn(64, 128, requires_grad=True)
    for seq in (16, 24, 40, 64, 100, 128, 250, 512):
        x, residual = torch.randn(2, seq, 64, requires_grad=True), torch.randn(2, seq, 64, requires_grad=True)
        try:
            step(x, residual, weight, bias, up)
        except RuntimeError as error:
            assert "not run" in str(error), error
    print(torch._dynamo.utils.counters["stats"]["unique_graphs"])
""")


def test_one_traced_graph_serves_every_sequence_length():
    """dynamic=True: the ops' bodies keep the row count symbolic (a size made constant would
    recompile the graph for each sequence length), forward and backward (traced together)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _DYNAMIC], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "1"


_SAME_ARGUMENTS = textwrap.dedent("""
    import importlib, inspect, json, torch
    import torch._higher_order_ops.triton_kernel_wrap as wrap
    from torch._dynamo.backends.common import aot_autograd
    from fusegen.backends.triton import graph_launcher, launch

    recorded = {}
    launch_in_graph = graph_launcher.GraphLauncher.launch

    def record(self, grid, args, constexprs):
        recorded[self.kernel.fn.__name__] = list(args)
        return launch_in_graph(self, grid, args, constexprs)

    graph_launcher.GraphLauncher.launch = record
    ops = {}

    def written(kernel_idx, constant_args_idx, kwargs, tma):  # Triton's write analysis, stood in for
        name = wrap.kernel_side_table.get_kernel(kernel_idx).fn.__name__
        op = ops[name]
        if "backward" in name:
            names = {f"grad_{i.name}_ptr" for i in op.inputs}
        else:
            names = {f"{o}_ptr" for o in op.outputs} | {"statistics_ptr"}
        return [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k in names]

    wrap.get_mutated_tensors = written

    def no_run(gm, inputs):
        def run(*args):
            raise RuntimeError("not run")
        return run

    def shown(value):  # a tensor by its dtype; a symbolic size by the size it was traced with
        if isinstance(value, torch.Tensor):
            return str(value.dtype)
        if isinstance(value, (torch.SymInt, torch.SymBool)):
            return value.node.hint
        return value

    def same(eager, traced):
        # None (a pointer the kernel does not read: its flag is off) may be a tensor in a graph.
        return len(eager) == len(traced) and all(
            e == t or (e is None and isinstance(t, str)) for e, t in zip(eager, traced))

    def check(name, tensors, dynamic, **params):
        module = importlib.import_module(f"generated.{name}")
        op, function = module._OP, getattr(module, name)
        ops[op.kernels.forward_kernel.fn.__name__] = ops[op.kernels.backward_kernel.fn.__name__] = op
        recorded.clear()
        torch._dynamo.reset()
        step = torch.compile(lambda *t: function(*t, **params), fullgraph=True, dynamic=dynamic,
                             backend=aot_autograd(fw_compiler=no_run, bw_compiler=no_run))
        try:
            step(*tensors)
        except RuntimeError as error:
            assert "not run" in str(error), error
        # What the eager path passes for the same call (prepared, not launched).
        bound = inspect.signature(function).bind(*tensors, **params)
        bound.apply_defaults()
        args = tuple(v for k, v in bound.arguments.items() if k not in ("out", "inplace_backward"))
        call = op.check(args, needs_kernel=False)
        problem = call.problem
        outputs = [torch.empty(op.output_shape(problem, i), dtype=problem.out_dtype) for i in range(len(op.outputs))]
        statistics = torch.empty(op.statistics_shape(problem), dtype=problem.compute_dtype) if op.statistics else None
        seed = torch.zeros(1, dtype=torch.int64) if call.has_dropout else None
        prepared = op.kernels.prepare_forward(call, tensors)
        values = (*tensors, *outputs, statistics, seed)
        want = {op.kernels.forward_kernel.fn.__name__: [
            shown(values[a.index]) if type(a) is launch.Slot else shown(a) for a in prepared._template]}
        needs = op.gradient_sources([t.requires_grad for t in tensors], tensors)[0]
        backward = op.kernels.prepare_backward(call, tensors, outputs, needs)
        buffers = [None if t is None else t.new_buffer() for t in backward._targets]
        values = (*tensors, *outputs, *buffers, statistics, seed)
        want[op.kernels.backward_kernel.fn.__name__] = [
            shown(values[a.index]) if type(a) is launch.Slot else shown(a) for a in backward._launch._template]
        return [f"{name} dynamic={dynamic} {kernel}: eager {args} traced {[shown(a) for a in recorded.get(kernel, [])]}"
                for kernel, args in want.items()
                if kernel not in recorded or not same(args, [shown(a) for a in recorded[kernel]])]

    def grad(*shape, dtype=torch.float32):
        return torch.randn(*shape, dtype=dtype, requires_grad=True)

    differ = []
    dynamic = True  # symbolic sizes: what a static graph passes too, as plain ints
    differ += check("scale_add", (grad(4, 8, 64), grad(4, 8, 1), grad(4, 8, 64)), dynamic)  # row sums
    differ += check("swiglu", (torch.randn(8, 4, 128).transpose(0, 1).requires_grad_(),), dynamic)
    differ += check("add_relu", (grad(4, 8, 64), grad(4, 1, 64)), dynamic)  # a broadcast copied
    differ += check("layernorm", (grad(4, 8, 64, dtype=torch.float64), grad(64, dtype=torch.float64),
                                  grad(64, dtype=torch.float64)), dynamic)
    differ += check("softmax", (grad(4, 8, 3000),), dynamic)  # a row in several tiles
    differ += check("bias_gelu_dropout_add", (grad(4, 8, 66), grad(66), grad(4, 8, 66)), dynamic, p=0.1, seed=5)
    differ += check("bias_gelu_dropout_add", (grad(4, 8, 64), grad(64), grad(4, 8, 64)), dynamic, p=0.1,
                    training=False)
    differ += check("add_rmsnorm", (grad(4, 8, 64), grad(4, 8, 64), grad(64)), dynamic)  # two outputs
    print(json.dumps(differ))
""")


def test_traced_launches_take_the_eager_arguments():
    """Each kernel a traced graph records gets the arguments the eager path gives the same call
    (strides, M, N, the bucket, tiles, flags, gradient targets): broadcast, chunked,
    non-contiguous, fp64, [..., 1] and dropout inputs, with dynamic shapes."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _SAME_ARGUMENTS], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


# -- on a GPU ------------------------------------------------------------------------------


class _Block(torch.nn.Module):
    """A pre-norm block's elementwise parts: every kind of kernel, with and without dropout."""

    def __init__(self, n: int):
        super().__init__()
        from generated.add_rmsnorm import AddRmsnorm
        from generated.layernorm import Layernorm
        from generated.swiglu import Swiglu

        self.up = torch.nn.Linear(n, 4 * n)
        self.down = torch.nn.Linear(2 * n, n, bias=False)
        self.norm = Layernorm()
        self.norm_weight = torch.nn.Parameter(torch.rand(n) + 0.5)
        self.norm_bias = torch.nn.Parameter(torch.randn(n) * 0.1)
        self.glu = Swiglu()
        self.add_norm = AddRmsnorm()
        self.p = 0.0

    def forward(self, x, residual):
        from generated.bias_gelu_dropout_add import bias_gelu_dropout_add

        h = self.norm(x, self.norm_weight, self.norm_bias)
        h = self.down(self.glu(self.up(h)))
        h = bias_gelu_dropout_add(h, self.norm_bias, residual, self.p)
        s, y = self.add_norm(h, x, self.norm_weight)
        return s, y


def _step(fn, model, x, residual):
    for t in (*model.parameters(), x, residual):
        t.grad = None
    outputs = as_tuple(fn(x, residual))
    sum((o.float() ** 2).sum() for o in outputs).backward()
    return [o.detach() for o in outputs] + [t.grad.clone() for t in (*model.parameters(), x, residual)]


def _inputs(n=256, lead=(4, 64), dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(*lead, n, device="cuda", dtype=dtype, requires_grad=True)
    residual = torch.randn(*lead, n, device="cuda", dtype=dtype, requires_grad=True)
    return x, residual


@pytest.mark.gpu
def test_inductor_launches_the_kernels_forward_and_backward():
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = _Block(256).cuda()
    x, residual = _inputs()
    want = _step(model, model, x, residual)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    got, codes = run_and_get_code(lambda: _step(compiled, model, x, residual))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    code = "\n".join(codes)
    assert "torch.ops.fusegen" not in code  # no opaque op: Inductor launches the kernels
    for kernel in ("layernorm_kernel", "layernorm_backward_kernel", "swiglu_kernel", "swiglu_backward_kernel",
                   "bias_gelu_dropout_add_kernel", "add_rmsnorm_kernel", "add_rmsnorm_backward_kernel"):
        assert kernel in code, kernel


@pytest.mark.gpu
def test_dynamic_shapes_do_not_recompile_per_sequence_length():
    torch.manual_seed(0)
    model = _Block(256).cuda()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    frames = []
    for seq in (64, 80, 100, 128, 200, 256, 384, 500):
        x, residual = _inputs(lead=(2, seq))
        with torch._dynamo.config.patch(error_on_recompile=len(frames) > 0):
            got = _step(compiled, model, x, residual)
        frames.append(seq)
        want = _step(model, model, x, residual)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_dropout_in_compiled_graphs_draws_fresh_masks_and_follows_manual_seed():
    from generated.bias_gelu_dropout_add import bias_gelu_dropout_add

    x = torch.randn(64, 512, device="cuda")
    bias = torch.randn(512, device="cuda")
    residual = torch.randn(64, 512, device="cuda")
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        fn = torch.compile(lambda a, b, c: bias_gelu_dropout_add(a, b, c, 0.5), fullgraph=True, mode=mode)
        torch.manual_seed(7)
        first = [fn(x, bias, residual).clone() for _ in range(3)]
        torch.manual_seed(7)
        again = [fn(x, bias, residual).clone() for _ in range(3)]
        dropped = [(y == residual) for y in first]
        assert all(0.4 < d.float().mean() < 0.6 for d in dropped), mode  # p = 0.5 of the elements
        assert not torch.equal(dropped[0], dropped[1]) and not torch.equal(dropped[1], dropped[2]), mode
        for a, b in zip(first, again):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


_LOAD = textwrap.dedent("""
    import sys, torch
    package, inputs, expected = sys.argv[1:]
    loaded = torch._inductor.aoti_load_package(package)
    got = loaded(*[t.cuda() for t in torch.load(inputs)])
    want = torch.load(expected)
    for g, w in zip([g.cpu() for g in got], want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    assert not any(name.startswith(("fusegen", "generated")) for name in sys.modules), "imported fusegen"
    print("ok")
""")


@pytest.mark.gpu
def test_export_and_aot_inductor_package_runs_in_a_fresh_process(tmp_path):
    """(Needs a `CXX` whose libstdc++ is the process's: README, AOTInductor.)"""
    torch.manual_seed(0)
    model = _Block(256).cuda().eval()
    x, residual = (t.detach() for t in _inputs())
    with torch.no_grad():
        want = model(x, residual)
    exported = torch.export.export(model, (x, residual))
    assert "fusegen" in str(exported.graph)  # exported as the ops themselves (serializable)
    package = torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp_path / "block.pt2"))
    in_process = torch._inductor.aoti_load_package(package)(x, residual)
    for g, w in zip(in_process, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    torch.save((x.cpu(), residual.cpu()), tmp_path / "inputs.pt")
    torch.save([w.cpu() for w in want], tmp_path / "expected.pt")
    done = subprocess.run([sys.executable, "-c", _LOAD, package, str(tmp_path / "inputs.pt"), str(tmp_path / "expected.pt")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
