"""Generated ops across 2 processes: DTensor shards against one device (outputs bit for bit,
gradients), FSDP2 training against one device (losses), and a timing of a sharded forward +
backward against the replicated op. On 2 GPUs (NCCL; NVLink multicast stays off):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=. \\
        torchrun --nproc_per_node 2 docs/scripts/distributed_check.py [--json out.json]

`--cpu` runs the same on the CPU (gloo, Triton's interpreter, small shapes).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

CPU = "--cpu" in sys.argv
if CPU:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402

from fusegen.bench import model as model_bench  # noqa: E402
from generated.bias_gelu_dropout_add import bias_gelu_dropout_add  # noqa: E402
from generated.layernorm import layernorm  # noqa: E402
from generated.layernorm_dropout_add import layernorm_dropout_add  # noqa: E402
from generated.swiglu import swiglu  # noqa: E402


def reseeded(op):
    """The op with seed=None, after torch.manual_seed(7): each call draws the same seed."""
    def call(*tensors):
        torch.manual_seed(7)
        return op(*tensors, p=0.1)
    return call


def tensor_parallel(net, mesh) -> None:
    """Megatron-style tensor parallelism with sequence parallelism for fusegen.bench.model's
    GPT-2 stack: the residual stream sharded over tokens (Shard(1)); attention on the gathered
    tokens, whole on every rank (its heads are not split here); the MLP column then row
    parallel; the embedding by vocabulary rows, the head by columns. The other parameters
    (norms, the fused biases) are replicated DTensors, so the generated ops see DTensors only."""
    from torch import nn
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInputOutput, RowwiseParallel,
                                                   parallelize_module)

    parallelize_module(net, mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in net.blocks:
        parallelize_module(block, mesh, {
            "attention": PrepareModuleInputOutput(
                input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_input=True,
                output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False),
            "fc": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
            "out": RowwiseParallel(input_layouts=Shard(2), output_layouts=Shard(1), use_local_output=False),
        })
        block.fc_bias = nn.Parameter(distribute_tensor(block.fc_bias.data, mesh, [Shard(0)]))
    whole = {m for block in net.blocks for m in block.attention.modules()}  # plain: attention's own
    for module in net.modules():
        if module is net or module in whole:
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                setattr(module, name, nn.Parameter(distribute_tensor(param.data, mesh, [Replicate()])))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--parts", default="shards,fsdp,tp,timing", help="comma-separated: what to run")
    parser.add_argument("--tp-runs", default="p=0.0,p=0.1,p=0.1 compiled",
                        help="comma-separated: the tensor-parallel runs (of the default's)")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if os.environ.get("FUSEGEN_HANG_DUMP"):  # a stuck rank prints every thread's stack
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["FUSEGEN_HANG_DUMP"]), exit=True)
    dist.init_process_group("gloo" if CPU else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cpu" if CPU else f"cuda:{rank}"
    if not CPU:
        torch.cuda.set_device(rank)
    mesh = init_device_mesh("cpu" if CPU else "cuda", (world,))
    dtype = torch.float32 if CPU else torch.bfloat16
    generator = torch.Generator(device=device).manual_seed(0)  # the same tensors on every rank

    def randn(*shape):
        return torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(dtype)

    report = {"world": world, "device": "cpu" if CPU else torch.cuda.get_device_name(), "torch": torch.__version__,
              "shards": [], "fsdp": {}, "timing": {}}
    b, s, h = (2, 6, 16) if CPU else (4, 1024, 4096)
    x, bias, residual, grad = randn(b, s, h), randn(h), randn(b, s, h), randn(b, s, h)
    cases = [
        ("bias_gelu_dropout_add p=0.1", lambda x, bias, r: bias_gelu_dropout_add(x, bias, r, p=0.1, seed=1234),
         (x, bias, residual), [(Shard(0), Replicate(), Shard(0)), (Shard(1), Replicate(), Shard(1)),
                               (Shard(2), Replicate(), Shard(2))]),
        ("swiglu", lambda a: swiglu(a), (randn(b, s, 2 * h),), [(Shard(0),), (Shard(1),), (Shard(2),)]),
        ("layernorm", lambda x, w, c: layernorm(x, w, c), (x, randn(h), randn(h)),
         [(Shard(0), Replicate(), Replicate()), (Shard(1), Replicate(), Replicate())]),
        # Sequence parallel: a post-LN block's tail with the activations sharded over tokens.
        ("layernorm_dropout_add p=0.1",
         lambda x, bias, g, c, r: layernorm_dropout_add(x, bias, g, c, r, p=0.1, seed=99),
         (x, randn(h), randn(h), randn(h), residual),
         [(Shard(1), Replicate(), Replicate(), Replicate(), Shard(1)),
          (Shard(0), Replicate(), Replicate(), Replicate(), Shard(0))]),
        # seed=None: every rank and the one-device call draw from the same generator state.
        ("bias_gelu_dropout_add p=0.1 seed=None", reseeded(bias_gelu_dropout_add),
         (x, bias, residual), [(Shard(1), Replicate(), Shard(1))]),
    ]
    if "shards" in parts:
        # Each case eager, then compiled (Inductor on GPUs, aot_eager on the CPU's interpreter;
        # fullgraph, dynamic sizes): the graph carries each shard's place in the global mask.
        backend = "aot_eager" if CPU else "inductor"
        cases += [(name + ", compiled", torch.compile(fn, backend=backend, fullgraph=True, dynamic=True), tensors, sets)
                  for name, fn, tensors, sets in cases if "seed=None" not in name]
        for name, fn, tensors, placement_sets in cases:
            leaves = [t.clone().requires_grad_(True) for t in tensors]
            whole = fn(*leaves)
            whole_grads = torch.autograd.grad(whole, leaves, grad)
            for placements in placement_sets:
                shards = [distribute_tensor(t, mesh, [p]).requires_grad_(True) for t, p in zip(tensors, placements)]
                out = fn(*shards)
                grads = torch.autograd.grad(out, shards, distribute_tensor(grad, mesh, out.placements))
                errors = [((g.full_tensor().double() - w.double()).norm() / w.double().norm()).item()
                          for g, w in zip(grads, whole_grads)]
                full = out.full_tensor()
                row = {"op": name, "placements": [str(p) for p in placements], "output": str(out.placements[0]),
                       "output_bit_identical": bool(torch.equal(full, whole.detach())),
                       "output_relative_error": ((full.double() - whole.double()).norm() / whole.double().norm()).item(),
                       "gradient_relative_errors": errors}
                if "dropout" in name:  # y = dropout(...) + residual: y == residual exactly where dropped
                    residual_in = tensors[-1]
                    row["dropped_elements_identical"] = bool(torch.equal(full == residual_in, whole == residual_in))
                report["shards"].append(row)
                if rank == 0:
                    print(row, flush=True)

    # FSDP2: a small GPT-2 stack with generated ops, trained on 2 ranks (half the batch each)
    # against the same model on one device (the whole batch); dropout off, so the two see
    # the same computation.
    # On the CPU as small as the checks allow (the interpreter's time grows with the rows): two
    # blocks (one hands its pending residual add to the next), a sequence per rank, 4 tokens a
    # rank under sequence parallelism.
    size = dict(hidden=32, mlp=64, heads=2, layers=2, batch=2, seq=8, vocab=64) if CPU else \
        dict(hidden=512, mlp=2048, heads=8, layers=2, batch=8, seq=256, vocab=1024)
    ops = model_bench.fusegen_ops(model_bench.Path("generated"))
    steps = 3 if CPU else 10
    tokens = torch.randint(0, size["vocab"], (steps, 2, size["batch"], size["seq"]),
                           generator=torch.Generator().manual_seed(1)).to(device)
    # The one-device runs are rank 0's alone, whose report this is: build_model seeds each
    # model, and the runs with dropout seed their draws, so skipping them changes nothing else.
    references = ("one device",) if rank == 0 else ()
    if "fsdp" in parts:
        losses = {}
        for variant in (*references, "fsdp2"):
            net = model_bench.build_model("gpt2", size, 0.0, ops, torch.float32, device)
            if variant == "fsdp2":
                for block in net.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(net, mesh=mesh)
            optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
            losses[variant] = []
            for step in range(steps):
                inputs, targets = tokens[step]
                if variant == "fsdp2":
                    half = size["batch"] // world
                    inputs, targets = inputs[rank * half:(rank + 1) * half], targets[rank * half:(rank + 1) * half]
                loss = net(inputs, targets)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                value = loss.detach().clone()
                if variant == "fsdp2":
                    dist.all_reduce(value, op=dist.ReduceOp.AVG if not CPU else dist.ReduceOp.SUM)
                    value = value / world if CPU else value
                losses[variant].append(float(value))
        if rank == 0:
            report["fsdp"] = {"losses": losses, "max_difference": max(abs(a - b) for a, b in zip(*losses.values()))}
            print(report["fsdp"], flush=True)

    if "tp" in parts:
        # FSDP2 × tensor parallel on a 2-D mesh (1 × world: data parallel of one, tensor parallel
        # over every rank), sequence parallel: the generated ops see DTensors sharded over tokens
        # (norms, the fused residual adds) and over the MLP's columns (bias + GELU). Dropout on:
        # every rank and the one device draw the same seeds, and the masks are the global ones.
        mesh_2d = init_device_mesh("cpu" if CPU else "cuda", (1, world), mesh_dim_names=("dp", "tp"))
        report["tensor_parallel"] = {}
        runs = args.tp_runs.split(",")
        for p, compiled in ((0.0, False), (0.1, False), (0.1, True)):
            if f"p={p}" + (" compiled" if compiled else "") not in runs:
                continue
            label = f"p={p}" + (", compiled" if compiled else "")
            tp_losses = {}
            for variant in (*references, "fsdp2 x tp"):
                if rank == 0:
                    print(time.strftime("%X"), "tensor parallel:", label, variant, flush=True)
                net = model_bench.build_model("gpt2", size, p, ops, torch.float32, device)
                if variant != "one device":
                    tensor_parallel(net, mesh_2d["tp"])
                    for block in net.blocks:
                        fully_shard(block, mesh=mesh_2d["dp"])
                    fully_shard(net, mesh=mesh_2d["dp"])
                optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
                if compiled:  # block by block, as FSDP2 advises (its hooks stay outside the graphs)
                    for block in net.blocks:
                        block.compile(backend="aot_eager" if CPU else "inductor")
                torch.manual_seed(5)  # the dropout seeds: one sequence for every rank and the one device
                tp_losses[variant] = []
                for step in range(steps):
                    loss = net(*tokens[step])
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    tp_losses[variant].append(float(loss.detach()))
            if rank == 0:
                report["tensor_parallel"][label] = {
                    "losses": tp_losses, "max_difference": max(abs(a - b) for a, b in zip(*tp_losses.values()))}
                print(label, report["tensor_parallel"][label], flush=True)

    if "timing" in parts and not CPU:  # a sharded forward + backward against the replicated op, on (8, 2048, 4096) bf16
        import triton

        xs, bs, rs, gs = randn(8, 2048, 4096), randn(4096), randn(8, 2048, 4096), randn(8, 2048, 4096)
        for label, placement in (("replicated", Replicate()), ("Shard(0)", Shard(0)), ("Shard(1)", Shard(1))):
            leaves = [distribute_tensor(t, mesh, [p]).requires_grad_(True)
                      for t, p in zip((xs, bs, rs), (placement, Replicate(), placement))]
            grad_d = distribute_tensor(gs, mesh, [placement])

            def step():
                out = bias_gelu_dropout_add(*leaves, p=0.1)
                torch.autograd.grad(out, leaves[:2], grad_d)

            report["timing"][label] = triton.testing.do_bench(step, warmup=10, rep=100)
        # Host time of a compiled step (forward + backward issued, the GPU idle first), sharded
        # against replicated: what the shard's place adds to a graph.
        compiled_op = torch.compile(lambda x, b, r: bias_gelu_dropout_add(x, b, r, p=0.1), fullgraph=True)
        report["host_ms"] = {}
        for label, placement in (("replicated", Replicate()), ("Shard(0)", Shard(0)), ("Shard(1)", Shard(1))):
            leaves = [distribute_tensor(t, mesh, [p]).requires_grad_(True)
                      for t, p in zip((xs, bs, rs), (placement, Replicate(), placement))]
            grad_d = distribute_tensor(gs, mesh, [placement])
            times = []
            for i in range(30):
                torch.cuda.synchronize()
                start = time.perf_counter()
                torch.autograd.grad(compiled_op(*leaves), leaves[:2], grad_d)
                times.append(time.perf_counter() - start)
            torch.cuda.synchronize()
            report["host_ms"][label] = 1e3 * statistics.median(times[10:])
        if rank == 0:
            print("compiled step, host ms:", report["host_ms"], flush=True)
        plain = [t.clone().requires_grad_(True) for t in (xs, bs, rs)]
        report["timing"]["plain tensors, one GPU"] = triton.testing.do_bench(
            lambda: torch.autograd.grad(bias_gelu_dropout_add(*plain, p=0.1), plain[:2], gs), warmup=10, rep=100)
        if rank == 0:
            print(report["timing"], flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
