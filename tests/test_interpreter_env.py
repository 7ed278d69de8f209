"""TRITON_INTERPRET, read as Triton reads it, and set at any point of a session.

triton.jit decides when it decorates a kernel (at the generated module's import) whether it
is a function for the CPU interpreter, by TRITON_INTERPRET then; fusegen's checks follow
that decision, so setting the variable later (in a notebook, say) gives one clear line, not
a CUDA-only torch function's AttributeError. Each case runs in a fresh Python, the only way
to import triton and the op in a chosen order.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from triton import knobs

from fusegen.backends.triton import interpreter

ROOT = Path(__file__).resolve().parent.parent

TRUE_VALUES = ["1", "true", "True", "on", "yes"]
FALSE_VALUES = ["0", "false", "FALSE", "off", "no", ""]

CPU_MESSAGE = (
    "gelu(): tensors are on cpu, but the Triton kernel needs a CUDA device; set TRITON_INTERPRET=1 before "
    "importing triton to run it on the CPU, or call reference(...)"
)
SET_AFTER_IMPORT_MESSAGE = (
    "gelu(): tensors are on cpu, and TRITON_INTERPRET is set, but it was not when triton was imported (kernels "
    "are built for the interpreter or for CUDA then); set TRITON_INTERPRET=1 before importing triton (restart "
    "Python or the notebook kernel), or call reference(...)"
)

# Sets TRITON_INTERPRET to VALUE at the point ORDER names, then runs gelu forward and
# backward on bf16 CPU tensors (bf16 rounding and gelu's backward, libdevice.exp, need the
# interpreter fixes) and on meta tensors; prints what happened as JSON.
_SCRIPT = """
import json, os, sys
order, value = sys.argv[1], sys.argv[2]
def set_here(point):
    if order == point:
        os.environ["TRITON_INTERPRET"] = value
set_here("before")
import torch
import triton
set_here("after triton")
import fusegen.backends.triton.launch
set_here("after fusegen.backends.triton")
from generated.gelu import gelu, reference
set_here("after the op")
result = {"is_interpreting": fusegen.backends.triton.interpreter.is_interpreting()}
x = torch.randn(3, 8, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
try:
    leaf = x.clone().requires_grad_(True)
    y = gelu(leaf)
    y.sum().backward()
    want = x.clone().requires_grad_(True)
    reference(want).sum().backward()
    result["outcome"] = "ran"
    result["matches_reference"] = torch.equal(y, reference(x)) and torch.allclose(leaf.grad, want.grad, rtol=0.02, atol=1e-3)
except Exception as exc:
    result["outcome"] = f"{type(exc).__name__}: {exc}"
meta = torch.empty(2, 5, 8, device="meta", requires_grad=True)
y = gelu(meta)
y.sum().backward()
result["meta"] = [list(y.shape), str(y.device), list(meta.grad.shape), str(meta.grad.device)]
print(json.dumps(result))
"""


def _run(order: str, value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, order, "" if value is None else value],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # Shape-only tensors need no kernel: the same in every case.
    assert result.pop("meta") == [[2, 5, 8], "meta", [2, 5, 8], "meta"]
    return result


@pytest.mark.parametrize("value", TRUE_VALUES + FALSE_VALUES + ["2", "y", " 1"])
def test_is_interpreting_reads_the_variable_as_triton_does(monkeypatch, value):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreter.is_interpreting() == knobs.runtime.interpret
    if value in TRUE_VALUES or value in FALSE_VALUES:
        assert interpreter.is_interpreting() == (value in TRUE_VALUES)


def test_is_interpreting_follows_the_knob():
    # scope() restores the knob and the variable (setting the knob sets TRITON_INTERPRET too);
    # monkeypatch would leave the knob set, and every later @triton.jit built for CUDA.
    with knobs.runtime.scope():
        os.environ["TRITON_INTERPRET"] = "0"
        knobs.runtime.interpret = True
        assert interpreter.is_interpreting()
        knobs.runtime.interpret = False
        assert not interpreter.is_interpreting()
    assert interpreter.is_interpreting() == knobs.runtime.interpret and "interpret" not in vars(knobs.runtime)


@pytest.mark.parametrize("value", ["1", "true", "on"])
def test_set_before_import_runs_on_the_cpu(value):
    assert _run("before", value) == {"is_interpreting": True, "outcome": "ran", "matches_reference": True}


@pytest.mark.parametrize("value", [None, "0", "false", ""])
def test_unset_or_false_gives_the_cuda_message(value):
    # None: not set at all. "false" once reached Triton's GPU path ("0 active drivers").
    order = "nowhere" if value is None else "before"
    assert _run(order, value) == {"is_interpreting": False, "outcome": f"FusegenArgumentError: {CPU_MESSAGE}"}


@pytest.mark.parametrize(
    "order, value", [("after the op", "1"), ("after the op", "yes"), ("after fusegen.backends.triton", "1"), ("after triton", "1")]
)
def test_set_after_triton_gives_one_line_naming_the_fix(order, value):
    # After the op: its kernels were built for CUDA (this was AttributeError: module
    # 'torch._C' has no attribute '_cuda_getDevice'). After triton but before the op: the
    # op's kernels are the interpreter's, but Triton's own (tl.sigmoid, tl.sum's combine)
    # are not, and gelu's backward failed deep in the interpreter.
    result = _run(order, value)
    assert result == {"is_interpreting": True, "outcome": f"FusegenArgumentError: {SET_AFTER_IMPORT_MESSAGE}"}
