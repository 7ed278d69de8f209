"""Generated kernels compile for an H100 (sm_90) through Triton's real compiler, without a GPU.

The interpreter never runs the compiler: an argument type no libdevice overload takes, an
fp32-only `tl` function in an fp64 kernel, or a construct the code generator rejects passes
on the CPU and fails on the GPU. tests/sm90_compile.py compiles each kernel for every
choice, dtype and flag combination, in a subprocess without TRITON_INTERPRET.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fusegen import cli

ROOT = Path(__file__).resolve().parent.parent
GENERATED = sorted(p for p in (ROOT / "generated").glob("*.py") if p.name != "__init__.py")

# Specs that reach what the library's own ops do not: libdevice.pow with number, float- and
# int-param operands, rsqrt and sqrt, constants, clamps and chunked and per-row inputs.
UNUSUAL_SPECS = {
    "powers": "inputs:\n  x: [..., N]\nparams:\n  s: {type: float, default: 1.5}\n  n: {type: int, default: 3}\n"
    "outputs:\n  y: x ** 1.5 + 2 ** x + x ** s + x ** n + rsqrt(x) + sqrt(x) + 0.5 ** s\n",
    "clamps": "inputs:\n  x: [..., N]\n  w: [..., 1]\noutputs:\n  y: where(x > 0, max(x, w), min(x, -w)) * 3\n  z: 2\n",
    "halves": "inputs:\n  x: [..., 2N]\n  b: [2N]\noutputs:\n  y: silu(chunk(x, 0)) * chunk(x, 1) + log(abs(chunk(b, 1)) + 1)\n",
    # Wheres decided by params alone: a branch in the kernel, whose sides must have one type
    # (a number side made a tile), nested, and beside a row value; the row kind too.
    "param_branches": "inputs:\n  x: [..., N]\n  s: [..., 1]\nparams:\n  c: {type: float, default: 0.0}\n"
    "outputs:\n  y: where(c > 0, tanh(x / c) * c, where(c < -1, 1.0, x * s))\n"
    "  z: x - max(where(c > 0, exp(x * c), x))\n",
}


def _compile(paths) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, str(ROOT / "tests" / "sm90_compile.py"), *map(str, paths)],
        env=env, capture_output=True, text=True, timeout=600,
    )


def test_generated_kernels_compile_for_h100():
    result = _compile(GENERATED)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert f"{len(GENERATED)} modules compiled" in result.stdout


def test_unusual_specs_compile_for_h100(tmp_path):
    paths = []
    for name, body in UNUSUAL_SPECS.items():
        spec_path = tmp_path / f"sm90_{name}.yaml"
        spec_path.write_text(f"name: sm90_{name}\ndoc: d\n{body}", encoding="utf-8")
        paths.append(tmp_path / f"sm90_{name}.py")
        paths[-1].write_text(cli.build_op(spec_path).text, encoding="utf-8")
    result = _compile(paths)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]


def test_the_check_catches_what_the_interpreter_does_not(tmp_path):
    # The kernels as the printers wrote them before: libdevice.pow with an fp32 number in
    # an fp64 kernel, tl.sqrt_rn (fp32 only) on fp64. The compiler must refuse both.
    spec_path = tmp_path / "sm90_regress.yaml"
    spec_path.write_text("name: sm90_regress\ndoc: d\ninputs:\n  x: [..., N]\noutputs:\n  y: x ** 1.7\n", encoding="utf-8")
    text = cli.build_op(spec_path).text
    old = text.replace("tl.full((), 1.7, compute)", "1.7")
    old = old.replace("libdevice.pow(x, tl.full((), 0.7, compute))", "tl.sqrt_rn(x)")
    assert old.count("libdevice.pow(x, 1.7)") == 1 and "tl.sqrt_rn" in old
    (tmp_path / "sm90_regress.py").write_text(old, encoding="utf-8")
    result = _compile([tmp_path / "sm90_regress.py"])
    assert result.returncode == 1
    assert "sm90_regress_kernel fp64" in result.stdout and "KeyError" in result.stdout
    assert "sm90_regress_backward_kernel fp64" in result.stdout and "Expected dtype ['fp32'] but got fp64" in result.stdout
    assert "sm90_regress_kernel fp32" not in result.stdout  # fp32 had an overload all along
