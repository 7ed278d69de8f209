"""The ranks of test_distributed's CPU runs (gloo, a 1-D CPU device mesh, kernels on Triton's
interpreter), forked from one process: generated ops on DTensors against the same ops on
whole tensors in one process.

Every rank builds the same whole tensors (fixed generators); rank 0 runs the op on them and
sends the results to the others; every rank runs it on DTensors made from them with a
placement, and compares its shard of the outputs and the gathered gradients with the
whole-tensor results: dropout masks bit for bit."""
from __future__ import annotations

import os
import signal
import sys
import traceback

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported: the ranks have no GPU

import importlib  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402
from fusegen.runtime import FusegenArgumentError  # noqa: E402


def _randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()


def _check(name, fn, whole: dict, placements: dict, mesh, exact: bool, grad_seed: int):
    """fn on whole tensors and on DTensors; outputs and input gradients must agree. The whole
    tensors' run is rank 0's, its results sent to the other ranks: each would compute the same
    (and compile it, where fn is compiled), on the two cores that CI's ranks share."""
    shared = [None, None]
    if dist.get_rank() == 0:
        leaves = {k: v.clone().requires_grad_(True) for k, v in whole.items()}
        expected = fn(**leaves)
        grad = _randn(expected.shape, grad_seed)
        shared = [expected.detach(), torch.autograd.grad(expected, list(leaves.values()), grad)]
    dist.broadcast_object_list(shared, src=0)
    expected, expected_grads = shared
    grad = _randn(expected.shape, grad_seed)
    def placed(k):  # one placement per mesh dim
        placement = placements.get(k, (Replicate(),) * mesh.ndim)
        return list(placement) if isinstance(placement, tuple) else [placement]

    shards = {k: distribute_tensor(v, mesh, placed(k)).requires_grad_(True) for k, v in whole.items()}
    got = fn(**shards)
    assert isinstance(got, DTensor), f"{name}: the result is not a DTensor"
    full = got.full_tensor()
    if exact:
        assert torch.equal(full, expected.detach()), f"{name} {placements}: outputs differ"
    else:
        torch.testing.assert_close(full, expected.detach(), rtol=1e-5, atol=1e-5, msg=f"{name} {placements}")
    grads = torch.autograd.grad(got, list(shards.values()), distribute_tensor(grad, mesh, got.placements))
    for k, g, e in zip(whole, grads, expected_grads):
        g = g.full_tensor() if isinstance(g, DTensor) else g
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=f"{name} {placements}: grad {k}")
    return got


def run(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        seed_op = importlib.import_module("generated.bias_gelu_dropout_add").bias_gelu_dropout_add
        swiglu = importlib.import_module("generated.swiglu").swiglu
        layernorm = importlib.import_module("generated.layernorm").layernorm
        ln_dropout = importlib.import_module("generated.layernorm_dropout_add").layernorm_dropout_add

        # Dropout: masks keyed by the global index, so every placement drops what one device does.
        x, bias, residual = _randn((3, 5, 24), 1), _randn((24,), 2), _randn((3, 5, 24), 3)
        for placement in (Shard(0), Shard(1), Shard(2), Replicate()):
            got = _check(
                "bias_gelu_dropout_add", lambda x, bias, residual: seed_op(x, bias, residual, p=0.3, seed=11),
                {"x": x, "bias": bias, "residual": residual}, {"x": placement, "residual": placement}, mesh,
                exact=True, grad_seed=4,
            )
            assert got.placements[0] == placement, (placement, got.placements)
        # seed=None: every rank draws the seed from its own generator, seeded alike, so the
        # shards of one call share one mask (a mix of two would match neither rank's whole run).
        fulls = []
        for placement in (Shard(0), Replicate()):
            torch.manual_seed(21)
            shards = [distribute_tensor(t, mesh, [p]) for t, p in ((x, placement), (bias, Replicate()), (residual, placement))]
            fulls.append(seed_op(*shards, p=0.5).full_tensor())
        assert torch.equal(fulls[0], fulls[1]), "ranks drew different seeds"
        # N % 4 != 0 and an uneven split (7 rows of 10 on 2 ranks): each element's own Philox call.
        x, bias, residual = _randn((7, 10), 5), _randn((10,), 6), _randn((7, 10), 7)
        for placement in (Shard(0), Shard(1)):
            _check("bias_gelu_dropout_add uneven", lambda x, bias, residual: seed_op(x, bias, residual, p=0.5, seed=3),
                   {"x": x, "bias": bias, "residual": residual}, {"x": placement, "residual": placement}, mesh,
                   exact=True, grad_seed=8)

        # Chunked input: a shard of the last dim would split the chunks; it is gathered first.
        a = _randn((4, 3, 2 * 8), 9)
        for placement in (Shard(0), Shard(2)):
            got = _check("swiglu", lambda a: swiglu(a), {"a": a}, {"a": placement}, mesh, exact=True, grad_seed=10)
            assert got.placements[0] == (placement if placement.dim == 0 else Replicate())

        # Row reductions: rows stay whole (a shard of the last dim is gathered).
        x, weight, b = _randn((2, 6, 12), 12), _randn((12,), 13), _randn((12,), 14)
        for placement in (Shard(0), Shard(1), Shard(2)):
            got = _check("layernorm", lambda x, weight, bias: layernorm(x, weight, bias),
                         {"x": x, "weight": weight, "bias": b}, {"x": placement}, mesh, exact=False, grad_seed=15)
            assert got.placements[0] == (placement if placement.dim < 2 else Replicate())
        gamma, beta, residual = _randn((12,), 16), _randn((12,), 17), _randn((2, 6, 12), 18)
        _check("layernorm_dropout_add",
               lambda x, bias, gamma, beta, residual: ln_dropout(x, bias, gamma, beta, residual, p=0.25, seed=19),
               {"x": x, "bias": weight, "gamma": gamma, "beta": beta, "residual": residual},
               {"x": Shard(1), "residual": Shard(1)}, mesh, exact=False, grad_seed=20)

        # Inside torch.compile: the graph records the library op on the local tensors.
        compiled_layernorm = torch.compile(layernorm, backend="aot_eager", fullgraph=True)
        _check("compiled layernorm", lambda x, weight, bias: compiled_layernorm(x, weight, bias),
               {"x": x, "weight": weight, "bias": b}, {"x": Shard(0)}, mesh, exact=False, grad_seed=21)
        dynamic_layernorm = torch.compile(layernorm, backend="aot_eager", dynamic=True)  # symbolic sizes
        for rows in (4, 6):
            _check("compiled layernorm, dynamic", lambda x, weight, bias: dynamic_layernorm(x, weight, bias),
                   {"x": _randn((rows, 3, 12), 24), "weight": weight, "bias": b}, {"x": Shard(0)}, mesh,
                   exact=False, grad_seed=25)
        x, bias, residual = _randn((3, 5, 24), 1), _randn((24,), 2), _randn((3, 5, 24), 3)
        compiled_seed_op = torch.compile(lambda x, bias, residual, p: seed_op(x, bias, residual, p=p, seed=11),
                                         backend="aot_eager", fullgraph=True)
        _check("compiled bias_gelu_dropout_add, replicated", lambda **t: compiled_seed_op(**t, p=0.3),
               {"x": x, "bias": bias, "residual": residual}, {}, mesh, exact=True, grad_seed=22)
        _check("compiled bias_gelu_dropout_add, p=0", lambda **t: compiled_seed_op(**t, p=0.0),
               {"x": x, "bias": bias, "residual": residual}, {"x": Shard(1), "residual": Shard(1)}, mesh,
               exact=True, grad_seed=23)
        # out= with DTensors: refused plainly (the kernels would see no data).
        try:
            swiglu(distribute_tensor(a, mesh, [Shard(0)]), out=distribute_tensor(torch.empty(4, 3, 8), mesh, [Shard(0)]))
        except FusegenArgumentError as error:
            assert str(error) == "swiglu(): out= does not take DTensor inputs; drop out=", error
        else:
            raise AssertionError("out= with DTensors was not refused")
        # Dropout on shards inside torch.compile: the graph carries each shard's place, so
        # shards drop what one device does, forward and backward, even and uneven, and with
        # dynamic sizes (one graph).
        for placement in (Shard(0), Shard(1), Shard(2)):
            _check("compiled bias_gelu_dropout_add, sharded", lambda **t: compiled_seed_op(**t, p=0.3),
                   {"x": x, "bias": bias, "residual": residual}, {"x": placement, "residual": placement}, mesh,
                   exact=True, grad_seed=26)
        dynamic_seed_op = torch.compile(lambda x, bias, residual: seed_op(x, bias, residual, p=0.5, seed=5),
                                        backend="aot_eager", dynamic=True, fullgraph=True)
        for rows in (3, 5, 7):  # uneven on 2 ranks
            _check("compiled bias_gelu_dropout_add, dynamic", dynamic_seed_op,
                   {"x": _randn((rows, 4, 10), 27), "bias": _randn((10,), 28), "residual": _randn((rows, 4, 10), 29)},
                   {"x": Shard(0), "residual": Shard(0)}, mesh, exact=True, grad_seed=30)
    finally:
        dist.destroy_process_group()


def run_2d(rank: int, world: int, init_file: str) -> None:
    """A 2 × 2 mesh (data parallel × tensor parallel): placements on both mesh dims."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        seed_op = importlib.import_module("generated.bias_gelu_dropout_add").bias_gelu_dropout_add
        layernorm = importlib.import_module("generated.layernorm").layernorm
        x, bias, residual = _randn((6, 5, 24), 31), _randn((24,), 32), _randn((6, 5, 24), 33)
        tensors = {"x": x, "bias": bias, "residual": residual}
        compiled_seed_op = torch.compile(lambda x, bias, residual: seed_op(x, bias, residual, p=0.3, seed=13),
                                         backend="aot_eager", fullgraph=True)
        # Rows × columns, a dim split twice (uneven: 5 rows in 4 parts), and two leading dims
        # (the kernels place a shard by one: the second is gathered first).
        cases = (((Shard(0), Shard(2)), (Shard(0), Shard(2))), ((Shard(1), Shard(1)), (Shard(1), Shard(1))),
                 ((Shard(0), Shard(1)), (Shard(0), Replicate())), ((Replicate(), Shard(2)), (Replicate(), Shard(2))))
        for i, (placements, expected) in enumerate(cases):
            # Compiled for the first and third (each is a compilation; CI has two cores).
            for name, fn in (("bias_gelu_dropout_add 2-D", lambda **t: seed_op(**t, p=0.3, seed=13)),
                             ("compiled bias_gelu_dropout_add 2-D", compiled_seed_op))[:1 if i % 2 else 2]:
                got = _check(name, fn, tensors, {"x": placements, "residual": placements}, mesh, exact=True,
                             grad_seed=34)
                assert got.placements == expected, (name, placements, got.placements)
        # Without dropout, any leading dims stay sharded; a row's last dim is gathered.
        weight, b = _randn((24,), 35), _randn((24,), 36)
        for placements, expected in (((Shard(0), Shard(1)), (Shard(0), Shard(1))),
                                     ((Shard(0), Shard(2)), (Shard(0), Replicate()))):
            got = _check("layernorm 2-D", lambda x, weight, bias: layernorm(x, weight, bias),
                         {"x": x, "weight": weight, "bias": b}, {"x": placements}, mesh, exact=False, grad_seed=37)
            assert got.placements == expected, (placements, got.placements)
    finally:
        dist.destroy_process_group()


def run_cuda(rank: int, world: int, init_file: str) -> None:
    """The CUDA backend's ops on DTensors, their kernels compiled for the host (tests/cuda_host.py):
    masks at the global problem's flat indices, so every placement drops what one process does."""
    from pathlib import Path

    from _pytest.monkeypatch import MonkeyPatch
    from tests.cuda_host import on_the_host

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    patch = MonkeyPatch()
    try:
        mesh = init_device_mesh("cpu", (world,))
        folder = Path(init_file).parent / f"host_kernels_{rank}"
        folder.mkdir(exist_ok=True)
        with on_the_host(folder, patch):
            seed_op = CUDA_OPS["bias_dropout_add"].bias_dropout_add_cuda
            ln_dropout = CUDA_OPS["layernorm_dropout_add"].layernorm_dropout_add_cuda
            x, bias, residual = _randn((3, 5, 24), 1), _randn((24,), 2), _randn((3, 5, 24), 3)
            for placement in (Shard(0), Shard(1), Shard(2), Replicate()):
                _check("bias_dropout_add (CUDA)", lambda x, bias, residual: seed_op(x, bias, residual, 0.3, seed=11),
                       {"x": x, "bias": bias, "residual": residual}, {"x": placement, "residual": placement}, mesh,
                       exact=True, grad_seed=4)
            # N % 4 != 0 and an uneven split: a pack of one, each element's own Philox call.
            x, bias, residual = _randn((7, 10), 5), _randn((10,), 6), _randn((7, 10), 7)
            for placement in (Shard(0), Shard(1)):
                _check("bias_dropout_add (CUDA) uneven", lambda x, bias, residual: seed_op(x, bias, residual, 0.5, seed=3),
                       {"x": x, "bias": bias, "residual": residual}, {"x": placement, "residual": placement}, mesh,
                       exact=True, grad_seed=8)
            # Inside torch.compile: the graph calls the library op on the local tensors with the shard's place.
            compiled = torch.compile(lambda x, bias, residual: seed_op(x, bias, residual, 0.3, seed=11),
                                     backend="aot_eager", fullgraph=True)
            x, bias, residual = _randn((3, 5, 24), 1), _randn((24,), 2), _randn((3, 5, 24), 3)
            for placement in (Shard(0), Shard(2)):
                _check("compiled bias_dropout_add (CUDA)", compiled, {"x": x, "bias": bias, "residual": residual},
                       {"x": placement, "residual": placement}, mesh, exact=True, grad_seed=4)
            x, weight, gamma, beta = _randn((2, 6, 12), 12), _randn((12,), 13), _randn((12,), 16), _randn((12,), 17)
            _check("layernorm_dropout_add (CUDA)",
                   lambda x, bias, gamma, beta, residual: ln_dropout(x, bias, gamma, beta, residual, p=0.25, seed=19),
                   {"x": x, "bias": weight, "gamma": gamma, "beta": beta, "residual": _randn((2, 6, 12), 18)},
                   {"x": Shard(1), "residual": Shard(1)}, mesh, exact=False, grad_seed=20)
    finally:
        patch.undo()
        dist.destroy_process_group()


CUDA_OPS: dict = {}  # the CUDA backend's modules, built before the forks (`cuda` mode)


def fork_ranks(world: int, target, init_file: str) -> int:
    """target(rank, world, init_file) in `world` forks of this process, one per rank; 0 when
    every rank succeeds. A fork starts with torch, the ops and Dynamo imported (seconds of CPU
    each, on CI's two cores, for a process that imports them itself); nothing has run here
    yet, so the forks share no state that running leaves (OpenMP's threads among it). One
    rank failing ends the others, which would wait for it in a collective."""
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:  # the rank
            code = 1
            try:
                target(rank, world, init_file)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    failed = []
    while pids:
        pid, status = os.wait()
        pids.remove(pid)
        if os.waitstatus_to_exitcode(status) != 0:
            failed.append(pid)
            for other in pids:
                os.kill(other, signal.SIGKILL)
    return 1 if failed else 0


if __name__ == "__main__":  # tests/test_distributed.py: python distributed_worker.py INIT_FILE WORLD [2d|cuda]
    import torch._dynamo  # noqa: F401  (torch.compile's: once, before the forks)

    mode = sys.argv[3] if sys.argv[3:] else ""
    if mode == "cuda":
        from pathlib import Path

        from tests.helpers import build_and_import, shipped_as

        built = Path(sys.argv[1]).parent / "cuda_ops"
        built.mkdir()
        for _name in ("bias_dropout_add", "layernorm_dropout_add"):
            CUDA_OPS[_name] = sys.modules[f"{_name}_cuda"] = build_and_import(built, shipped_as(_name, f"{_name}_cuda"),
                                                                             "cuda")  # by name: torch.compile's
    else:
        for _name in ("bias_gelu_dropout_add", "swiglu", "layernorm", "layernorm_dropout_add"):
            importlib.import_module(f"generated.{_name}")
    sys.exit(fork_ranks(int(sys.argv[2]), {"2d": run_2d, "cuda": run_cuda}.get(mode, run), sys.argv[1]))
