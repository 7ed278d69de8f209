"""Generated ops on DTensors (runtime.sharding): 2 CPU processes with gloo, kernels on
Triton's interpreter (tests/distributed_worker.py says what each rank checks)."""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo backend")


def _run_forked(args: list, env: dict, capture: bool = False) -> subprocess.CompletedProcess:
    """`args`, a process that forks the ranks, in a session of its own: past 600 s, or on an
    interrupt, its ranks end with it (a rank left behind would wait in a collective)."""
    pipe = subprocess.PIPE if capture else None
    process = subprocess.Popen(args, cwd=ROOT, env=env, start_new_session=True, stdout=pipe, stderr=pipe, text=True)
    try:
        stdout, stderr = process.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        raise AssertionError("the ranks ran past 600 s") from None
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


def _run_ranks(tmp_path, world: int, *extra: str) -> None:
    """tests/distributed_worker.py, which forks `world` processes, one per rank; every one must
    succeed (one failing ends the others). The worker is never imported here: it turns on
    Triton's interpreter for itself, which in this process would reach every kernel built
    after it (on a GPU too)."""
    worker = Path(__file__).with_name("distributed_worker.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = _run_forked([sys.executable, str(worker), str(tmp_path / "init"), str(world), *extra], env)
    assert done.returncode == 0, f"a rank failed (exit code {done.returncode}; its traceback above)"


def test_placements_values_gradients_and_dropout_masks_match_one_process(tmp_path):
    _run_ranks(tmp_path, 2)


def test_a_two_by_two_mesh_matches_one_process(tmp_path):
    """Four processes on a 2 × 2 mesh (data parallel × tensor parallel): placements on both
    mesh dims, eager and compiled, dropout masks bit for bit (tests/distributed_worker.py run_2d)."""
    _run_ranks(tmp_path, 4, "2d")


@pytest.mark.skipif(shutil.which("g++") is None, reason="the CUDA backend's kernels run on the host through g++")
def test_the_cuda_backend_on_dtensors_matches_one_process(tmp_path):
    """The CUDA backend's ops on 2 ranks (kernels compiled for the host, tests/cuda_host.py):
    placements of rows and columns, even and uneven, eager and compiled, dropout masks bit for bit
    with one process (tests/distributed_worker.py run_cuda)."""
    pytest.importorskip("cuda.core", reason="the host launches pack arguments with cuda-core (fusegen[cuda])")
    _run_ranks(tmp_path, 2, "cuda")


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


# python -c _FORKED_RANKS WORLD SCRIPT ARGS...: SCRIPT's main() on WORLD ranks (env://, as
# torch.distributed.run starts them), forks of this process after it imported SCRIPT (torch,
# the model benchmark, the ops: seconds of CPU a process, on CI's two cores).
_FORKED_RANKS = """
import importlib.util, os, socket, sys
world, script = int(sys.argv[1]), sys.argv[2]
sys.argv = sys.argv[2:]  # as the script sees them, importing it too
spec = importlib.util.spec_from_file_location("distributed_check", script)
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)
sys.path.insert(0, "tests")
from distributed_worker import fork_ranks
with socket.socket() as free:
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]

def rank(rank, world, _):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    check.main()

sys.exit(fork_ranks(world, rank, None))
"""


def test_fsdp2_trains_the_model_benchmark_stack_as_one_process_does(tmp_path):
    """docs/scripts/distributed_check.py on 2 CPU processes (gloo, the interpreter): FSDP2
    training of the model benchmark's GPT-2 stack, whose blocks hand a pending residual add to
    the next one, and FSDP2 × tensor parallel with dropout, eager and compiled, against the
    same model in one process."""
    report_path = tmp_path / "report.json"
    # One thread a rank, as torch.distributed.run sets; the ranks are forks of one process
    # (_FORKED_RANKS), not torch.distributed.run's launcher and two processes of their own.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = _run_forked([sys.executable, "-c", _FORKED_RANKS, "2",
                       str(ROOT / "docs" / "scripts" / "distributed_check.py"), "--cpu", "--json", str(report_path),
                       # The shards eager and compiled are distributed_worker's (above); tensor
                       # parallel without dropout is a subset of the run with it.
                       "--parts", "fsdp,tp", "--tp-runs", "p=0.1,p=0.1 compiled"], env, capture=True)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(report_path.read_text())
    one, fsdp = report["fsdp"]["losses"]["one device"], report["fsdp"]["losses"]["fsdp2"]
    assert len(fsdp) == 3 and all(math.isfinite(v) for v in one + fsdp), (one, fsdp)
    assert max(abs(a - b) for a, b in zip(one, fsdp)) < 1e-5  # fp32, 3 steps
    # FSDP2 × tensor parallel (sequence parallel) on a 1 × 2 mesh, dropout on, eager and
    # compiled block by block: the losses of one process (fp32; a TP matmul sums in halves).
    assert set(report["tensor_parallel"]) == {"p=0.1", "p=0.1, compiled"}
    for label, run in report["tensor_parallel"].items():
        assert len(run["losses"]["fsdp2 x tp"]) == 3 and run["max_difference"] < 1e-4, (label, run)


@pytest.mark.gpu2
def test_two_gpus_match_one_device(tmp_path):
    """docs/scripts/distributed_check.py on 2 GPUs (NCCL, NVLink multicast off): shards of the
    seed op, swiglu, layer norm and a sequence-parallel layernorm_dropout_add against one
    device, eager and compiled by Inductor; FSDP2 training, and FSDP2 × tensor parallel on a
    1 × 2 mesh with dropout on, against one device."""
    report_path = tmp_path / "report.json"
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                    str(ROOT / "docs" / "scripts" / "distributed_check.py"), "--json", str(report_path)],
                   check=True, cwd=ROOT, env=env, timeout=600)
    report = json.loads(report_path.read_text())
    assert len(report["shards"]) >= 10
    for row in report["shards"]:
        where = (row["op"], row["placements"])
        if "dropout" in row["op"]:
            assert row["dropped_elements_identical"], where
        # Elementwise ops: bit for bit. A row reduction's sum order follows the kernel tuned
        # for the local row count, so its values may round apart (bf16).
        if not row["op"].startswith("layernorm"):
            assert row["output_bit_identical"], where
        assert row["output_relative_error"] < 1e-5, where
        assert max(row["gradient_relative_errors"]) < 1e-2, where  # bf16; row-summed ones rounded per rank
    assert report["fsdp"]["max_difference"] < 1e-4  # fp32 over 10 steps
    assert any(row["op"].endswith(", compiled") for row in report["shards"])
    for label, run in report["tensor_parallel"].items():
        assert run["max_difference"] < 1e-3, (label, run)  # fp32, 10 steps, TF32 off
