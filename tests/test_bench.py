"""`fusegen bench` / `fusegen profile` on CPU: shape mapping, bytes model, rows, arguments, no-GPU exit.

Nothing here launches a kernel or times anything: the GPU parts are exercised on a GPU.
"""
import argparse
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fusegen import bench, profile
from fusegen.bench import arguments, cases, reporting, running, timing
from fusegen.errors import SpecError
from fusegen.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
SEED_SPEC = ROOT / "specs" / "bias_gelu_dropout_add.yaml"
BSH = (8, 2048, 4096)
ROWS = 8 * 2048
H = 4096


@pytest.fixture(scope="module")
def seed_spec():
    return load_spec(SEED_SPEC)


def bench_parser():
    parser = argparse.ArgumentParser(prog="fusegen bench")
    arguments.add_bench_arguments(parser)
    return parser


def profile_parser():
    parser = argparse.ArgumentParser(prog="fusegen profile")
    profile.add_profile_arguments(parser)
    return parser


# ---------------------------------------------------------------------------
# Shapes


def test_seed_spec_shapes(seed_spec):
    assert cases.input_shapes(seed_spec, BSH) == {"x": (8, 2048, H), "bias": (H,), "residual": (8, 2048, H)}
    assert cases.output_shape(seed_spec, BSH) == (8, 2048, H)


@pytest.mark.parametrize(
    "dims, expected",
    [
        (("...", "N"), (8, 2048, H)),
        (("N",), (H,)),
        (("M", "N"), (ROWS, H)),
        (("M", "1"), (ROWS, 1)),
        (("...", "1"), (8, 2048, 1)),
    ],
)
def test_shape_for_dims(dims, expected):
    assert cases.shape_for_dims(dims, BSH, "N") == expected


def test_ops_without_a_named_dim_get_the_whole_shape():
    """gelu's x: [...] is (B, S, H), as large as the other ops' inputs, not (B, S)."""
    spec = load_spec(ROOT / "specs" / "gelu.yaml")
    assert cases.input_shapes(spec, BSH) == {"x": (8, 2048, H)}
    assert cases.output_shape(spec, BSH) == (8, 2048, H)


def test_chunked_inputs_hold_their_chunks():
    """An input written [..., 2N] holds two N-wide halves (InputSpec.chunks); the output has N."""
    spec = load_spec(ROOT / "specs" / "bias_swiglu.yaml")
    assert cases.input_shapes(spec, BSH) == {"x": (8, 2048, 2 * H), "bias": (2 * H,)}
    assert cases.output_shape(spec, BSH) == (8, 2048, H)


def test_an_op_with_a_matmul_takes_k_from_a_four_part_shape(tmp_path):
    """BxSxKxH: x [..., K], nn.Linear's weight [N, K] (linear_swiglu's [2N, K]: two projections);
    without K, K is H. An op without a matmul refuses four parts."""
    spec = load_spec(ROOT / "specs" / "linear_bias_gelu.yaml")
    assert cases.input_shapes(spec, (1, 16384, 4096, 11008)) == {
        "x": (1, 16384, 4096), "weight": (11008, 4096), "bias": (11008,)}
    assert cases.input_shapes(spec, (1, 64, 32)) == {"x": (1, 64, 32), "weight": (32, 32), "bias": (32,)}
    assert cases.output_shape(spec, (1, 16384, 4096, 11008)) == (1, 16384, 11008)
    swiglu = load_spec(ROOT / "specs" / "linear_swiglu.yaml")
    assert cases.input_shapes(swiglu, (2, 8, 16, 4)) == {"x": (2, 8, 16), "weight": (8, 16)}
    with pytest.raises(ValueError, match="is BxSxKxH, for ops with a matmul; gelu has none"):
        cases.input_shapes(load_spec(ROOT / "specs" / "gelu.yaml"), (1, 2, 3, 4))
    (tmp_path / "square.yaml").write_text("name: square\ndoc: d\ninputs: {x: [..., N], weight: [N, N]}\n"
                                          "outputs:\n  y: x @ T(weight)\n")
    square = load_spec(tmp_path / "square.yaml")  # K is N: a four-part shape's K must be H
    assert cases.shape_problem(square, (1, 2, 8, 8)) is None
    assert "so K must be H" in cases.shape_problem(square, (1, 2, 4, 8))


def test_an_op_with_a_low_rank_product_takes_r_from_a_five_part_shape():
    """BxSxKxHxR: lora_a [R, K], lora_b [N, R]; its flops count both products; an op with a
    low-rank product refuses fewer parts, and one without refuses five."""
    spec = load_spec(ROOT / "specs" / "lora_linear.yaml")
    bsh = (1, 16384, 4096, 11008, 16)
    assert cases.input_shapes(spec, bsh) == {"x": (1, 16384, 4096), "weight": (11008, 4096), "bias": (11008,),
                                            "lora_a": (16, 4096), "lora_b": (11008, 16)}
    assert cases.output_shape(spec, bsh) == (1, 16384, 11008)
    m, k, n, r = 16384, 4096, 11008, 16
    assert cases.bytes_model(spec, bsh, torch.bfloat16).matmul_flops == 2 * m * k * n + 2 * m * r * (k + n)
    assert cases.shape_problem(spec, (1, 2, 8, 8)) == ("shape 1x2x8x8: lora_linear has a chain of two matmuls; give "
                                                       "its inner dim too (a low-rank product's rank, a hidden layer's "
                                                       "width), as BxSxKxHxR")
    linear = load_spec(ROOT / "specs" / "linear_bias_gelu.yaml")
    assert cases.shape_problem(linear, (1, 2, 8, 8, 4)) == ("shape 1x2x8x8x4 is BxSxKxHxR, for ops with a low-rank "
                                                            "product or a hidden layer; linear_bias_gelu has neither")


def test_an_op_with_a_hidden_layer_takes_its_width_from_a_five_part_shape():
    """BxSxKxHxR for the DLRM MLP: w1 [R, K], w2 [H, R]; its flops count both layers."""
    spec = load_spec(ROOT / "specs" / "dlrm_mlp.yaml")
    bsh = (1, 4096, 512, 64, 256)
    assert cases.input_shapes(spec, bsh) == {"x": (1, 4096, 512), "w1": (256, 512), "b1": (256,), "w2": (64, 256),
                                            "b2": (64,)}
    assert cases.output_shape(spec, bsh) == (1, 4096, 64)
    m, k, n, h = 4096, 512, 64, 256
    assert cases.bytes_model(spec, bsh, torch.bfloat16).matmul_flops == 2 * m * k * h + 2 * m * h * n


def test_an_op_with_a_matmul_has_the_matmul_providers():
    """compile-max-autotune and the matmul alone beside the three; the matmul alone computes the
    product (forward only), whatever the op's epilogue."""
    from fusegen.bench import running

    op = cases.load_bench_op("linear_swiglu", ROOT / "specs", ROOT / "generated")
    assert running.provider_names(op) == ("fusegen", "eager", "compile", "compile-max-autotune", "matmul")
    assert running.provider_names(cases.load_bench_op("gelu", ROOT / "specs", ROOT / "generated")) == running.PROVIDERS
    x, w = torch.randn(2, 3, 5, dtype=torch.float64), torch.randn(8, 5, dtype=torch.float64)
    torch.testing.assert_close(running._bare_matmul(op, op.module._OP.matmul)(x, w), x @ w.mT)
    assert "matmul" in running.FORWARD_ONLY


def test_bench_backend_times_the_op_built_by_another_backend_beside_it(tmp_path):
    """`fusegen bench --backend cuda`: the op built by the CUDA backend as gelu_cuda (its library
    ops beside the generated module's), a provider after fusegen's own."""
    op = cases.load_bench_op("gelu", ROOT / "specs", ROOT / "generated", backends=("cuda",), twins_dir=tmp_path)
    assert running.provider_names(op) == ("fusegen", "fusegen-cuda", "eager", "compile")
    assert (tmp_path / "gelu_cuda.cu").is_file()
    twin = dict(op.twins)["fusegen-cuda"]
    assert twin.__name__ == "gelu_cuda" and twin(torch.randn(4, 8, device="meta")).shape == (4, 8)
    assert list(running.make_providers(op))[:2] == ["fusegen", "fusegen-cuda"]
    mean = cases.load_bench_op("cross_entropy_mean", ROOT / "specs", ROOT / "generated")
    assert mean.twins == ()


def test_hidden_dim_is_last_named_output_dim():
    assert cases.hidden_dim_name(("...", "N")) == "N"
    assert cases.hidden_dim_name(("M", "N", "1")) == "N"
    assert cases.hidden_dim_name(("...", "1")) is None


# ---------------------------------------------------------------------------
# Bytes model


def test_bytes_model_fp32(seed_spec):
    model = cases.bytes_model(seed_spec, BSH, torch.float32)
    big = 8 * 2048 * 4096 * 4
    assert model.read == big + 4096 * 4 + big  # x, bias (read once at its own size), residual
    assert model.written == big  # y
    assert model.total == 3 * big + 4096 * 4
    assert model.output_elements == 8 * 2048 * 4096


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bytes_model_half_precision(seed_spec, dtype):
    fp32 = cases.bytes_model(seed_spec, BSH, torch.float32)
    half = cases.bytes_model(seed_spec, BSH, dtype)
    assert half.read * 2 == fp32.read and half.written * 2 == fp32.written
    assert half.output_elements == fp32.output_elements


def test_bytes_model_counts_each_outputs_own_dtype():
    """rmsnorm_fp8 writes q in e4m3 (1 byte) and one fp32 scale a row, whatever x's dtype."""
    spec = load_spec(Path(__file__).parents[1] / "specs" / "rmsnorm_fp8.yaml")
    model = cases.bytes_model(spec, (2, 3, 64), torch.bfloat16)
    assert model.read == 2 * 3 * 64 * 2 + 64 * 2  # x and weight in bf16
    assert model.written == 2 * 3 * 64 * 1 + 2 * 3 * 4  # q in float8, scale in float32
    assert model.output_elements == 2 * 3 * 64 + 2 * 3


# ---------------------------------------------------------------------------
# Cases, kwargs and rows


def fake_op(has_dropout=True):
    return SimpleNamespace(name="bias_gelu_dropout_add", has_dropout=has_dropout, dropout_params=("p",))


def test_plan_cases_covers_every_combination():
    planned = cases.plan_cases([fake_op()], [torch.float32, torch.bfloat16], arguments.SWEEP_SHAPES, [0.0, 0.1])
    assert len(planned) == 2 * len(arguments.SWEEP_SHAPES) * 2
    assert len(set(planned)) == len(planned)


def test_plan_cases_without_dropout_ignores_p():
    planned = cases.plan_cases([fake_op(has_dropout=False)], [torch.float32], [BSH], [0.0, 0.1])
    assert [c.p for c in planned] == [None]


def test_op_kwargs_fix_the_seed_and_train():
    assert cases.op_kwargs(fake_op(), 0.1) == {"p": 0.1, "training": True, "seed": cases.DROPOUT_SEED}
    assert cases.op_kwargs(fake_op(has_dropout=False), None) == {}


def test_dropout_param_names(seed_spec):
    assert cases.dropout_param_names(seed_spec) == ("p",)


def test_load_bench_op_by_name_and_path():
    by_name = cases.load_bench_op("bias_gelu_dropout_add", ROOT / "specs", ROOT / "generated")
    by_path = cases.load_bench_op(str(SEED_SPEC), ROOT / "specs", ROOT / "generated")
    assert by_name.name == by_path.name == "bias_gelu_dropout_add"
    assert by_name.has_dropout and by_name.dropout_params == ("p",)
    assert callable(by_name.op) and callable(by_name.reference)


def test_load_bench_op_unknown_name():
    with pytest.raises(SpecError):
        cases.load_bench_op("no_such_op", ROOT / "specs", ROOT / "generated")


def test_case_rows_rates_and_speedups(seed_spec):
    case = cases.Case("bias_gelu_dropout_add", torch.float32, BSH, 0.1)
    model = cases.bytes_model(seed_spec, BSH, torch.float32)

    def result(name, ms, fb_ms=None, fb_error=None):
        fb = None if fb_ms is None and fb_error is None else timing.Measurement(
            timing=None if fb_ms is None else timing.Timing(fb_ms, fb_ms, fb_ms), error=fb_error)
        return running.ProviderResult(name, timing.Measurement(timing.Timing(ms, ms * 0.9, ms * 1.1), 2**20), fb)

    results = [result("fusegen", 0.5, fb_error="RuntimeError: no grad_fn"), result("eager", 2.0, 6.0),
               result("compile", 1.0, 3.0)]
    rows = reporting.case_rows(case, model, results, copy_gbs=3000.0)
    ours = rows[0]
    assert ours["provider"] == "fusegen"
    assert ours["gb_per_s"] == pytest.approx(model.total / 0.5e-3 / 1e9)
    assert ours["gelem_per_s"] == pytest.approx(model.output_elements / 0.5e-3 / 1e9)
    assert ours["copy_fraction"] == pytest.approx(ours["gb_per_s"] / 3000.0)
    assert ours["speedup_vs_eager"] == pytest.approx(4.0)
    assert ours["speedup_vs_compile"] == pytest.approx(2.0)
    assert ours["peak_fwd_mib"] == 1.0
    assert ours["fwd_bwd_ms"] is None and ours["fwd_bwd_error"] == "RuntimeError: no grad_fn"
    assert rows[2]["fwd_bwd_speedup_vs_eager"] == pytest.approx(2.0)
    assert set(ours) == set(reporting.ROW_FIELDS)


def test_an_op_with_a_matmul_reports_its_flops():
    """2·M·K·(the product's width, all chunks) at the forward's time, in rows and as a column of
    the table; an op without a matmul has none."""
    spec = load_spec(ROOT / "specs" / "linear_swiglu.yaml")
    bsh = (1, 16384, 4096, 11008)
    model = cases.bytes_model(spec, bsh, torch.bfloat16)
    assert model.matmul_flops == 2 * 16384 * 4096 * (2 * 11008)
    case = cases.Case("linear_swiglu", torch.bfloat16, bsh, None)
    measured = running.ProviderResult("fusegen", timing.Measurement(timing.Timing(2.0, 1.9, 2.1)))
    row = reporting.case_rows(case, model, [measured], copy_gbs=3000.0)[0]
    assert row["tflop_per_s"] == pytest.approx(model.matmul_flops / 2e-3 / 1e12)
    assert (row["K"], row["H"]) == (4096, 11008)
    table, _ = reporting.results_table([row], backward=False, copy_gbs=3000.0)
    assert "TFLOP/s" in [column.header for column in table.columns]
    assert cases.bytes_model(load_spec(ROOT / "specs" / "gelu.yaml"), BSH, torch.float32).matmul_flops == 0


def test_case_rows_keep_errors(seed_spec):
    case = cases.Case("bias_gelu_dropout_add", torch.float32, BSH, 0.0)
    model = cases.bytes_model(seed_spec, BSH, torch.float32)
    results = [running.ProviderResult("fusegen", timing.Measurement(error="OutOfMemoryError: CUDA out of memory")),
               running.ProviderResult("eager", timing.Measurement(timing.Timing(1.0, 1.0, 1.0)))]
    rows = reporting.case_rows(case, model, results, copy_gbs=None)
    assert rows[0]["ms"] is None and rows[0]["error"].startswith("OutOfMemoryError")
    assert rows[1]["speedup_vs_eager"] == pytest.approx(1.0) and rows[1]["copy_fraction"] is None
    table, notes = reporting.results_table(rows, backward=False, copy_gbs=None)
    assert len(notes) == 1 and "OutOfMemoryError" in notes[0]


def test_measure_turns_exceptions_into_errors():
    def boom():
        raise RuntimeError("element 0 of tensors does not require grad\nmore detail")

    def timer(fn, grad_to_none):
        fn()

    measurement = timing.measure(boom, timer=timer, peak=lambda fn: 0)
    assert measurement.timing is None
    assert measurement.error == "RuntimeError: element 0 of tensors does not require grad"


def test_quantiles_match_triton():
    from triton.testing import _quantile

    times = [0.9, 0.1, 0.5, 0.3, 0.7, 0.2]
    assert timing.quantiles(times, timing.QUANTILES) == pytest.approx(_quantile(times, list(timing.QUANTILES)))
    assert timing.quantiles([2.0], timing.QUANTILES) == [2.0, 2.0, 2.0]


def test_host_cover_outlasts_the_host():
    cycles_per_second = 1.8e9
    cover = timing.host_cover_cycles(100e-6, cycles_per_second)
    assert cover / cycles_per_second > 100e-6 * 1.5


def busy(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_time_limit_interrupts_a_long_first_call():
    with pytest.raises(timing.FirstCallTimeout):
        with timing.time_limit(0.05, "the first call"):
            busy(2.0)
    with timing.time_limit(1.0, "the first call"):  # a quick block passes, and the alarm is off afterwards
        busy(0.01)
    busy(0.05)


def test_time_limit_fires_even_when_the_timeout_is_swallowed():
    # torch.compile may catch the exception and fall back to eager; the run must still see a timeout.
    with pytest.raises(timing.FirstCallTimeout):
        with timing.time_limit(0.05, "the first call"):
            try:
                busy(2.0)
            except timing.FirstCallTimeout:
                pass


def test_is_timeout_looks_through_wrapping():
    try:
        try:
            raise timing.FirstCallTimeout("x")
        except timing.FirstCallTimeout as inner:
            raise RuntimeError("BackendCompilerFailed") from inner
    except RuntimeError as outer:
        assert timing.is_timeout(outer)
    assert not timing.is_timeout(RuntimeError("other"))


def test_measure_records_a_timeout_and_memo_skips_later_cases():
    measurement = timing.measure(lambda: busy(2.0), timer=None, peak=None, first_call_timeout_s=0.05)
    assert measurement.timed_out and measurement.error.startswith("timed out")
    memo = running.TimeoutMemo()
    memo.record("op", 0.1, "compile", "forward", measurement)
    assert memo.skip_reason("op", 0.2, "compile", "forward")  # any p > 0: the same dropout graph
    assert memo.skip_reason("op", 0.1, "compile", "forward_backward")
    assert memo.skip_reason("op", 0.0, "compile", "forward") is None  # p == 0 compiles a different graph
    assert memo.skip_reason("op", 0.1, "eager", "forward") is None


def test_host_overhead_is_a_median_of_calls():
    calls = []
    us = timing.host_overhead_us(lambda: calls.append(1), calls=20, warmup=5, synchronize=lambda: None)
    assert len(calls) == 25 and us >= 0


def test_plot_series_groups_by_dtype_and_p():
    rows = [
        {"op": "a", "dtype": "fp32", "p": 0.1, "provider": "fusegen", "output_elements": 100, "gb_per_s": 2.0},
        {"op": "a", "dtype": "fp32", "p": 0.1, "provider": "fusegen", "output_elements": 10, "gb_per_s": 1.0},
        {"op": "a", "dtype": "bf16", "p": 0.0, "provider": "eager", "output_elements": 10, "gb_per_s": None},
    ]
    assert reporting.plot_series(rows) == {("fp32", 0.1): {"fusegen": [(10, 1.0), (100, 2.0)]}}


def test_cuda_kernel_names_skip_copies_and_cpu_events():
    from torch.autograd import DeviceType

    events = [
        SimpleNamespace(name="bias_gelu_dropout_add_kernel", device_type=DeviceType.CUDA),
        SimpleNamespace(name="bias_gelu_dropout_add_kernel", device_type=DeviceType.CUDA),
        SimpleNamespace(name="Memcpy HtoD (Pageable -> Device)", device_type=DeviceType.CUDA),
        SimpleNamespace(name="aten::empty", device_type=DeviceType.CPU),
    ]
    counts = profile.cuda_kernel_names(events)
    assert counts == {"bias_gelu_dropout_add_kernel": 2}
    line = profile.kernel_summary({"fusegen": counts, "compile": "BackendCompilerFailed: x"}, calls=2)
    assert line == "distinct CUDA kernels: fusegen 1 (1 launches per call), compile failed"


# ---------------------------------------------------------------------------
# Arguments


def test_bench_defaults_are_the_sweep():
    args = bench_parser().parse_args(["bias_gelu_dropout_add"])
    assert args.ops == ["bias_gelu_dropout_add"]
    assert arguments.selected_shapes(args) == list(arguments.SWEEP_SHAPES)
    assert args.ps == [0.0, 0.1]
    assert args.dtypes == [torch.float32, torch.bfloat16, torch.float16]
    assert not args.backward and args.json is None and args.csv is None and args.plot is None
    assert args.timer == "do_bench" and args.first_call_timeout == arguments.DEFAULT_FIRST_CALL_TIMEOUT_S
    assert args.specs == Path("specs") and args.generated == Path("generated")


def test_bench_explicit_arguments():
    args = bench_parser().parse_args([
        "bias_gelu_dropout_add", "specs/other.yaml", "--dtype", "bf16,fp16", "--shapes", "8x2048x4096,1x128x1024",
        "--p", "0.1", "--backward", "--json", "out.json", "--csv", "out.csv", "--plot", "out.png",
        "--specs", "s", "--generated", "g", "--timer", "device", "--first-call-timeout", "0",
    ])
    assert args.ops == ["bias_gelu_dropout_add", "specs/other.yaml"]
    assert args.dtypes == [torch.bfloat16, torch.float16]
    assert arguments.selected_shapes(args) == [(8, 2048, 4096), (1, 128, 1024)]
    assert args.ps == [0.1] and args.backward
    assert (args.json, args.csv, args.plot) == (Path("out.json"), Path("out.csv"), Path("out.png"))
    assert (args.specs, args.generated) == (Path("s"), Path("g"))
    assert args.timer == "device" and args.first_call_timeout == 0
    assert args.backends == [] and bench_parser().parse_args(["gelu", "--backend", "cuda"]).backends == ["cuda"]


def test_bench_sweep_flag():
    assert arguments.selected_shapes(bench_parser().parse_args(["op", "--sweep"])) == list(arguments.SWEEP_SHAPES)


@pytest.mark.parametrize(
    "argv",
    [
        [],  # no op
        ["op", "--shapes", "8x2048"],
        ["op", "--shapes", "1x2x3x4x5x6"],
        ["op", "--shapes", "8x0x4096"],
        ["op", "--shapes", "1x2x3", "--sweep"],
        ["op", "--dtype", "int8"],
        ["op", "--p", "1.0"],
        ["op", "--p", "half"],
        ["op", "--timer", "wallclock"],
    ],
)
def test_bench_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_parser().parse_args(argv)
    assert exit_info.value.code == 2


def test_profile_arguments():
    args = profile_parser().parse_args(["bias_gelu_dropout_add"])
    assert args.shape == (8, 2048, 4096) and args.dtype == torch.bfloat16 and args.p == 0.1
    args = profile_parser().parse_args(["x.yaml", "--shape", "1x128x1024", "--dtype", "fp32", "--p", "0"])
    assert (args.op, args.shape, args.dtype, args.p) == ("x.yaml", (1, 128, 1024), torch.float32, 0.0)


# ---------------------------------------------------------------------------
# No GPU: exit 1 with one line on stderr


@pytest.mark.parametrize(
    "parser, run, command",
    [(bench_parser, bench.run_bench, "bench"), (profile_parser, profile.run_profile, "profile")],
)
def test_no_gpu_exit(parser, run, command, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = parser().parse_args(["bias_gelu_dropout_add"])
    assert run(args) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fusegen {command}: no CUDA GPU here")
