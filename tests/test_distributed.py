"""Generated ops on DTensors (runtime.sharding): 2 CPU processes with gloo, kernels on
Triton's interpreter (tests/distributed_worker.py says what each rank checks)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import distributed_worker

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo backend")


def _rank(rank: int, world: int, init_file: str) -> None:
    distributed_worker.run(rank, world, init_file)


def test_placements_values_gradients_and_dropout_masks_match_one_process(tmp_path):
    mp.spawn(_rank, args=(2, str(tmp_path / "init")), nprocs=2, join=True)


def test_is_distributed_sees_dtensors_only():
    from fusegen.runtime import sharding

    assert not sharding.is_distributed((torch.ones(2), torch.nn.Parameter(torch.ones(2))))
