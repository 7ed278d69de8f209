"""Plan → a generated module whose kernels are CUDA C++ (`fusegen build --backend cuda`): the source
as <op>.cu beside the module (which reads it as CUDA_SOURCE on import), and the same Python face as
a Triton module's (fusegen.face), its kernels declared as its kind's run-time class.

Each kind the backend renders is one entry of KINDS: its source (pointwise_source.py,
row_source.py) and its launcher. Other kinds (the gemm kind stays Triton's), and what a kind's
source does not render yet, are one-line errors naming the op and what is missing
(pointwise_source.CudaUnsupported)."""
from __future__ import annotations

from dataclasses import dataclass

from fusegen import face, outdir
from fusegen.names import PYTHON_BUILTINS
from fusegen.plan import OpPlan
from fusegen.pyformat import format_module

from . import pointwise_source, row_source
from .pointwise_source import CPP_KEYWORDS, OWN_NAMES, CudaUnsupported

__all__ = ["MODULE_IMPORTS", "RESERVED_NAMES", "beside", "render"]


@dataclass(frozen=True)
class CudaKind:
    source: object  # OpPlan → the C++ text
    binding: str  # the module's run-time class for its kernels
    imports: tuple[str, ...]  # what the module imports for it
    doc: str  # what the kernels do, for the module's docstring


KINDS = {
    "pointwise": CudaKind(
        pointwise_source.source, "cuda_launch.CudaKernels", ("from fusegen.backends.cuda import launch as cuda_launch",),
        "The forward kernel computes every output element by element, a pack of adjacent elements a CUDA thread "
        "(16 bytes of vector loads where the views allow); the backward kernel a pack of columns a thread over a "
        "block of rows, summing the gradients of inputs broadcast along rows."),
    "row": CudaKind(
        row_source.source, "cuda_rows.CudaRowKernels", ("from fusegen.backends.cuda import launch as cuda_launch",
                                                         "from fusegen.backends.cuda import row_launch as cuda_rows"),
        "The kernels take a row a CUDA block: each pass along the row a loop of packs of adjacent columns, its "
        "reductions across the block by warp shuffles; the forward keeps each row's reductions for the backward."),
}
MODULE_IMPORTS = frozenset({"torch", "F", "runtime", "cuda_launch", "cuda_rows", "CUDA_SOURCE"})
# The module's own names, and the C++ source's: planning gives no local one of them.
RESERVED_NAMES = (MODULE_IMPORTS | {"reference", "eager", "_OP", "_reference", "problem", "masks", "self", "training"}
                  | PYTHON_BUILTINS | OWN_NAMES | CPP_KEYWORDS)

COMPILED = " CUDA C++ (CUDA_SOURCE), compiled by NVRTC on first use per dtype combination and cached on disk."


def _kind(plan: OpPlan) -> CudaKind:
    kind = KINDS.get(plan.kind)
    if kind is None:
        raise CudaUnsupported(f"{plan.op}: the {plan.kind} kind is not supported by the CUDA backend yet; "
                              "build it with --backend triton")
    if plan.forward_only and plan.kind != "row":
        raise CudaUnsupported(f"{plan.op}: an op without a backward is not supported by the CUDA backend yet")
    return kind


def beside(plan: OpPlan) -> dict[str, str]:
    """<op>.cu: the kernels' source, headed as the module is."""
    return {f"{plan.op}.cu": _kind(plan).source(plan)}


def render(plan: OpPlan) -> str:
    """The text of generated/<op>.py with the CUDA backend's kernels (<op>.cu: beside)."""
    kind = _kind(plan)
    forward, backward = plan.forward, plan.backward
    keywords = [f"forward_reads={_names(i.name for i in forward.inputs)}"]
    if backward.scalars:
        keywords.append(f"backward_scalars={_names(p.name for p in backward.scalars)}")
    if plan.kind == "row":  # what each kernel holds where the row is held: the launcher's shared memory
        keywords.append(f"held={row_source.held_arrays(plan)}")
    for which, kernel in (("forward", forward), ("backward", backward)):
        if kernel.masks:
            keywords.append(f"{which}_dropout={_names(dict.fromkeys(m.p.name for m in kernel.masks))}")
        if kernel.choices:
            keywords.append(f"{which}_choices={_names(p.name for p in kernel.choices)}")
    the_face = face.face(plan, backend="CUDA", class_name=face.module_class_name(plan.op, MODULE_IMPORTS),
                         binding=kind.binding, kernel_names=("CUDA_SOURCE", f'"{plan.op}"'),
                         kernels_doc=kind.doc + COMPILED, kernel_keywords=tuple(keywords))
    lines = [
        *outdir.header_lines(plan.op, plan.spec_path),
        f"# spec sha256: {plan.spec_sha256}",
        '"""' + "\n".join(the_face.docstring),
        '"""',
        "import torch",
        *(["import torch.nn.functional as F"] if the_face.uses_functional else []),
        "",
        "from fusegen import runtime",
        *kind.imports,
        "",
        f"__all__ = [{the_face.exports}]",
        "",
        f"# The kernels, CUDA C++ for NVRTC: {plan.op}.cu beside this module (fusegen/backends/cuda/csrc/fusegen_cuda.cuh",
        "# has the functions they call).",
        "CUDA_SOURCE = cuda_launch.source_beside(__file__)",
        the_face.text,
    ]
    return format_module("\n".join(lines) + "\n")


def _names(names) -> str:
    names = [f'"{n}"' for n in names]
    return "(" + ", ".join(names) + ("," if len(names) == 1 else "") + ")"

