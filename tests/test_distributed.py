"""Generated ops on DTensors (runtime.sharding): 2 CPU processes with gloo, kernels on
Triton's interpreter (tests/distributed_worker.py says what each rank checks)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo backend")


def test_placements_values_gradients_and_dropout_masks_match_one_process(tmp_path):
    # A process of its own, never imported here: the worker turns on Triton's interpreter
    # for itself, which in this process would reach every kernel built after it (on a GPU too).
    worker = Path(__file__).with_name("distributed_worker.py")
    subprocess.run([sys.executable, str(worker), str(tmp_path / "init")], check=True, cwd=ROOT,
                   env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}, timeout=600)


def test_plain_tensors_do_not_import_dtensor():
    """Importing DTensor costs most of a second: an op imports it only once a call meets one."""
    code = (
        "import sys, torch\n"
        "from generated import swiglu\n"
        "from fusegen.runtime import sharding\n"
        "x = torch.nn.Parameter(torch.ones(2, 4))\n"
        "swiglu.swiglu(x)\n"
        "assert not sharding.takes_dtensors(swiglu._OP, (torch.ones(2), x))\n"
        "assert 'torch.distributed.tensor' not in sys.modules, 'DTensor was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"})
