"""A row forward split across programs (row_kernel_text's split layout, kernel_lib.split_program):
each program holds one part of its rows, and each pass's reductions are combined through the
exchange buffer, the row read once. On the CPU the interpreter runs such a launch's programs
side by side (interpreter.patch_cooperative_grid), so the layout is tested at small widths
by forcing it; the H100 suite reaches it by width (test_rows' widest rows)."""
from __future__ import annotations

import pytest
import torch

from fusegen.backends.triton import row_tuning
from fusegen.backends.triton.row_launch import _BoundRows
from tests.helpers import ShapeCase, _seed_of, all_ops, as_tuple, call_of, make_inputs, params_for

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's inf - inf in masked lanes

ROW_OPS = [op for op in all_ops() if isinstance(op.module._OP.kernels, _BoundRows)]
# (BLOCK_M, BLOCK_N, SPLITS) over 37 columns: four parts, the last partly past N; eight,
# three of them wholly past N (a part with nothing to reduce); one tile, the baseline.
SPLIT_LAYOUTS = [(2, 16, 4), (1, 8, 8)]
ONE_TILE = (4, 64, 1)


def _forward(op, tensors, params, layout, device):
    fused = op.module._OP
    call = call_of(op, tensors, params, training=True, seed=9)
    problem = call.problem
    outputs = [torch.full(fused.output_shape(problem, i), float("nan"), device=device).to(fused.output_dtype(problem, i))
               for i in range(len(fused.outputs))]
    statistics = torch.full(fused.statistics_shape(problem), float("nan"), dtype=problem.compute_dtype, device=device)
    block_m, block_n, splits = layout
    fused.kernels.forward(call, tuple(tensors[n] for n in op.input_names), outputs, _seed_of(call),
                          tile=(block_m, block_n), statistics=statistics, splits=splits)
    return outputs, statistics


# Eight parts (the interpreter's threads wait longest) for one op of each shape of program:
# online sums, two rounds, an integer input with per-row outputs; four parts for every op.
EIGHT_PARTS = {"softmax", "layernorm", "cross_entropy"}
CASES = [(op, layout) for op in ROW_OPS for layout in SPLIT_LAYOUTS if layout[2] == 4 or op.name in EIGHT_PARTS]


@pytest.mark.parametrize("op,layout", CASES, ids=lambda v: f"{v[0]}x{v[1]}x{v[2]}" if isinstance(v, tuple) else str(v))
def test_a_split_row_computes_what_one_tile_does(op, layout, device):
    """fp64 inputs (the split sums in another order: a few ulps), every library row op: the
    outputs, and the statistics the backward reads, against one tile's; float8 outputs alike
    bit for bit (their scale's rounding never meets a float8 step at fp64)."""
    tensors = make_inputs(op, ShapeCase("split", (3,), 37), dtype=torch.float64, device=device, seed=4)
    params = params_for(op, p=0.3)
    outputs, statistics = _forward(op, tensors, params, layout, device)
    want, want_statistics = _forward(op, tensors, params, ONE_TILE, device)
    for name, got, expected in zip(op.output_names, outputs, want):
        if not expected.is_floating_point() or expected.element_size() == 1:
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), name
        else:
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14, msg=name)
    torch.testing.assert_close(statistics, want_statistics, rtol=1e-12, atol=1e-14)


def test_online_sums_combine_where_the_parts_maxima_differ(device):
    """softmax with each part's maximum far from the others' (a row rising by 40 a part): a
    part's sum is rescaled by exp(its max - the row's) when combined; fp32 against torch."""
    from tests.helpers import op_by_name

    op = op_by_name("softmax")
    x = torch.randn(3, 64, device=device) + torch.arange(64, device=device).div(16, rounding_mode="floor") * 40
    x[1, :16] = -float("inf")  # a part with nothing but -inf
    (y,), _ = _forward(op, {"x": x}, {}, (1, 16, 4), device)
    torch.testing.assert_close(y, torch.softmax(x, -1), rtol=1e-6, atol=1e-30)


def test_the_split_layout_is_chosen_by_width_and_the_gpus_size(monkeypatch):
    """Past one tile a float32 row is split into about eight parts of 8192 to 32768 columns,
    narrower where few rows leave the GPU idle or a program loads several tiles, and never into
    more parts than the GPU has multiprocessors (a group's programs wait for each other): then,
    and for 16-bit inputs (measured slower split), the loop along the row."""
    monkeypatch.setattr(row_tuning, "is_interpreting", lambda: False)
    monkeypatch.setattr(row_tuning, "_multiprocessors", lambda device: 132)
    layout = row_tuning.row_forward_layout
    assert layout(8192, 4096, None) == (8192, 1)  # one tile
    assert layout(65536, 1024, None) == (8192, 8)
    assert layout(262144, 256, None) == (32768, 8)
    assert layout(131072, 1024, None) == (16384, 8)
    assert layout(262144, 4, None) == (8192, 32)  # four rows: more, narrower parts
    assert layout(100000, 1024, None) == (16384, 8)  # parts in powers of two, the last partly past N
    assert layout(1 << 20, 4, None) == (8192, 128)
    assert layout(1 << 21, 4, None) == (16384, 128)
    assert layout(1 << 23, 4, None) == (row_tuning.ROW_STEP, 1)  # 256 parts: more than the GPU holds
    assert layout(262144, 256, None, tiles=3) == (16384, 16)  # three tiles a program: narrower parts
    assert layout(65536, 1024, None, narrow=True) == (row_tuning.ROW_STEP, 1)  # a bf16 input: the loop
    monkeypatch.setattr(row_tuning, "_multiprocessors", lambda device: 16)
    assert layout(262144, 4, None) == (row_tuning.ROW_STEP, 1)


def test_the_backward_and_16_bit_rows_take_their_layouts_by_the_values_a_program_holds(monkeypatch):
    """A 16-bit row up to 32768 wide is one tile where a program's tiles hold at most 32768
    values forward, 65536 backward; wider, or with more tiles, the loop. The backward splits as
    the forward with at most 49152 values a program, and never where a gradient is one value a
    row (not `splittable`)."""
    monkeypatch.setattr(row_tuning, "is_interpreting", lambda: False)
    monkeypatch.setattr(row_tuning, "_multiprocessors", lambda device: 132)
    forward, backward = row_tuning.row_forward_layout, row_tuning.row_backward_layout
    assert forward(32000, 16384, None, tiles=1, narrow=True) == (32768, 1)  # softmax, cross-entropy
    assert forward(32768, 4096, None, tiles=2, narrow=True) == (row_tuning.ROW_STEP, 1)  # rmsnorm's weight too
    assert forward(65536, 4096, None, tiles=1, narrow=True) == (row_tuning.ROW_STEP, 1)
    assert backward(32768, 4096, None, tiles=2, narrow=True) == (32768, 1)
    assert backward(32768, 4096, None, tiles=3, narrow=True) == (row_tuning.ROW_STEP_BACKWARD, 1)
    assert backward(65536, 1024, None, tiles=3) == (8192, 8)
    assert backward(262144, 256, None, tiles=3) == (16384, 16)
    assert backward(262144, 256, None, tiles=4) == (8192, 32)  # four tiles: narrower parts
    assert backward(65536, 1024, None, tiles=3, splittable=False) == (row_tuning.ROW_STEP_BACKWARD, 1)
    monkeypatch.setattr(row_tuning, "SPLIT_BACKWARD", False)
    assert backward(65536, 1024, None, tiles=3) == (row_tuning.ROW_STEP_BACKWARD, 1)


def _backward(op, tensors, params, grads, layout, device):
    fused = op.module._OP
    call = call_of(op, tensors, params, training=True, seed=9)
    needs = [through is None and t.is_floating_point() for through, t in zip(fused._passthrough, tensors.values())]
    block_m, block_n, splits = layout
    return fused.kernels.backward(call, tuple(tensors[n] for n in op.input_names), grads, needs, _seed_of(call),
                                  tile=(block_m, block_n), rows_per_program=4, splits=splits)


# One op of each shape of backward (the interpreter's waiting threads are slow): one round a
# row block; two, with [N] gradients summed over rows; an integer input; dropout's masks by part.
BACKWARD_OPS = ["softmax", "layernorm", "cross_entropy", "layernorm_dropout_add"]


@pytest.mark.parametrize("op", [op for op in ROW_OPS if op.name in BACKWARD_OPS], ids=str)
def test_a_split_row_backward_computes_what_one_tile_does(op, device):
    """The backward split across four programs a row (the last part partly past N), over two
    row blocks a program (rounds go on counting): every gradient, [N] weights' sums included,
    against one tile's, fp64."""
    tensors = make_inputs(op, ShapeCase("split", (7,), 37), dtype=torch.float64, device=device, seed=5)
    params = params_for(op, p=0.3)
    g = torch.Generator().manual_seed(6)
    fused = op.module._OP
    problem = call_of(op, tensors, params, training=True, seed=9).problem
    grads = tuple(torch.randn(fused.output_shape(problem, i), generator=g, dtype=torch.float64).to(device)
                  for i in range(len(fused.outputs)))
    got = _backward(op, tensors, params, grads, (2, 16, 4), device)
    want = _backward(op, tensors, params, grads, ONE_TILE, device)
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_the_layout_is_measured_on_the_first_launch_and_kept(monkeypatch, tmp_path, device):
    """Where several layouts fit a row (row_tuning.forward_layouts, backward_layouts), the first
    launch times each on the call's own values and keeps the fastest, also in Triton's cache: a
    launch prepared later with nothing in memory (another process) runs it untimed. The call
    returns the chosen layout's results, whichever ran before it (fp64 layernorm, forward and
    backward, against one tile's and bit for bit across the two preparations)."""
    from fusegen.backends.triton import layout_choice

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(layout_choice, "_kept", {})
    layouts = [(16, 1), (16, 4), (64, 1)]  # looped (the rule's: first), split in four, one tile
    monkeypatch.setattr(row_tuning, "forward_layouts", lambda *args: layouts)
    monkeypatch.setattr(row_tuning, "backward_layouts", lambda *args: layouts)
    ms = iter([3.0, 1.0, 2.0, 2.0, 3.0, 1.0])  # forward: the split fastest; backward: one tile

    def timer(launch, values):
        launch(values)
        return next(ms)

    op = next(op for op in ROW_OPS if op.name == "layernorm")
    fused = op.module._OP
    tensors = make_inputs(op, ShapeCase("split", (7,), 37), dtype=torch.float64, device=device, seed=5)
    params = params_for(op)
    call = call_of(op, tensors, params, training=True, seed=9)
    problem = call.problem
    inputs = tuple(tensors[n] for n in op.input_names)
    g = torch.Generator().manual_seed(6)
    grads = tuple(torch.randn(fused.output_shape(problem, i), generator=g, dtype=torch.float64).to(device)
                  for i in range(len(fused.outputs)))
    needs = [t.is_floating_point() for t in inputs]

    def run():
        outputs = [torch.full(fused.output_shape(problem, i), float("nan"), dtype=torch.float64, device=device)
                   for i in range(len(fused.outputs))]
        statistics = torch.full(fused.statistics_shape(problem), float("nan"), dtype=torch.float64, device=device)
        forward = fused.kernels.prepare_forward(call, inputs)
        forward((*inputs, *outputs, statistics, _seed_of(call)))
        backward = fused.kernels.prepare_backward(call, inputs, grads, needs)
        gradients = backward(inputs, grads, _seed_of(call), statistics)
        return (forward.layout, backward._launch.layout), outputs, gradients

    monkeypatch.setattr(layout_choice, "TIMER", timer)
    chosen, outputs, gradients = run()
    assert chosen == ((16, 4), (64, 1))
    want, _ = _forward(op, tensors, params, ONE_TILE, device)
    for got, expected in zip(outputs, want):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    for got, expected in zip(gradients, _backward(op, tensors, params, grads, ONE_TILE, device)):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)

    monkeypatch.setattr(layout_choice, "_kept", {})  # a new process: only Triton's cache holds the choice

    def no_timer(launch, values):
        raise AssertionError("a kept layout timed again")

    monkeypatch.setattr(layout_choice, "TIMER", no_timer)
    again, outputs_again, gradients_again = run()
    assert again == chosen
    for a, b in zip((*outputs, *gradients), (*outputs_again, *gradients_again)):
        assert torch.equal(a, b)


def test_a_traced_launch_takes_the_kept_layout_else_the_rules(monkeypatch):
    """Nothing can be timed on a traced graph's fake tensors: its launch takes the layout kept
    for its key, else the first of the list (the rule's), and never one outside the list."""
    from fusegen.backends.triton import layout_choice

    monkeypatch.setattr(layout_choice, "_kept", {"k": (16, 4)})
    built = []
    build = lambda layout: built.append(layout) or layout  # noqa: E731
    key = lambda digest: lambda: layout_choice.Key(digest, "a kernel")  # noqa: E731
    assert layout_choice.choose([(16, 1), (16, 4)], build, key("k"), traced=True) == (16, 4)
    assert layout_choice.choose([(16, 1), (32, 2)], build, key("k"), traced=True) == (16, 1)
    monkeypatch.setattr(layout_choice, "kept", lambda key: None)
    assert layout_choice.choose([(8, 1), (16, 4)], build, key("other"), traced=True) == (8, 1)
    assert built == [(16, 4), (16, 1), (8, 1)]  # only the launch that runs is built (a symbolic N's guard)


def test_a_layout_the_gpu_cannot_run_is_passed_over(monkeypatch, tmp_path):
    """A candidate whose kernel does not fit the GPU (Triton's OutOfResources) is timed as
    never finishing, and another kept; the rule's own layout failing is the call's error."""
    from triton.runtime.errors import OutOfResources

    from fusegen.backends.triton import layout_choice

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(layout_choice, "_kept", {})
    ran = []

    class Launch:
        settled = True

        def __init__(self, layout):
            self.layout = layout

        def __call__(self, values):
            ran.append(self.layout)

    def timer(launch, values):
        if launch.layout == (8, 4):
            raise OutOfResources(300000, 232448, "shared memory")
        return {(16, 1): 2.0, (32, 2): 1.0}[launch.layout]

    monkeypatch.setattr(layout_choice, "TIMER", timer)
    key = lambda digest: lambda: layout_choice.Key(digest, "a kernel")  # noqa: E731
    chosen = layout_choice.choose([(16, 1), (8, 4), (32, 2)], Launch, key("0a" * 32), traced=False)
    chosen(())
    assert chosen.layout == (32, 2) and ran == [(32, 2)]
    failing = layout_choice.choose([(8, 4), (16, 1)], Launch, key("0b" * 32), traced=False)
    with pytest.raises(OutOfResources):
        failing(())
