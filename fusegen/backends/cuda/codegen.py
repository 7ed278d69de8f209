"""Plan → the text of a generated module whose kernels are CUDA C++ (`fusegen build --backend cuda`):
the source (pointwise_source.py) held as the module's CUDA_SOURCE, and the same Python face as a
Triton module's (fusegen.face) around it, its kernels declared as launch.CudaKernels.

The pointwise kind only, for now; other kinds, and what the pointwise source does not render
yet, are one-line errors naming the op and what is missing (pointwise_source.CudaUnsupported)."""
from __future__ import annotations

from fusegen import face, outdir
from fusegen.names import PYTHON_BUILTINS
from fusegen.plan import OpPlan
from fusegen.pyformat import format_module

from .pointwise_source import CPP_KEYWORDS, OWN_NAMES, CudaUnsupported, source

__all__ = ["MODULE_IMPORTS", "RESERVED_NAMES", "render"]

MODULE_IMPORTS = frozenset({"torch", "F", "runtime", "cuda_launch", "CUDA_SOURCE"})
# The module's own names, and the C++ source's: planning gives no local one of them.
RESERVED_NAMES = (MODULE_IMPORTS | {"reference", "eager", "_OP", "_reference", "problem", "masks", "self", "training"}
                  | PYTHON_BUILTINS | OWN_NAMES | CPP_KEYWORDS)

DOC = ("The forward kernel computes every output element by element, four elements a CUDA thread; the backward "
       "kernel one thread a column over a chunk of rows, summing the gradients of inputs broadcast along rows. "
       "CUDA C++ (CUDA_SOURCE), compiled by NVRTC on first use per dtype combination and cached on disk.")


def render(plan: OpPlan) -> str:
    """The text of generated/<op>.py with the CUDA backend's kernels."""
    if plan.kind != "pointwise":
        raise CudaUnsupported(f"{plan.op}: the {plan.kind} kind is not supported by the CUDA backend yet; "
                              "build it with --backend triton")
    if plan.forward_only:
        raise CudaUnsupported(f"{plan.op}: an op without a backward is not supported by the CUDA backend yet")
    cuda = source(plan)
    forward, backward = plan.forward, plan.backward
    keywords = [f"forward_reads={_names(i.name for i in forward.inputs)}"]
    if backward.scalars:
        keywords.append(f"backward_scalars={_names(p.name for p in backward.scalars)}")
    for which, kernel in (("forward", forward), ("backward", backward)):
        if kernel.masks:
            keywords.append(f"{which}_dropout={_names(dict.fromkeys(m.p.name for m in kernel.masks))}")
        if kernel.choices:
            keywords.append(f"{which}_choices={_names(p.name for p in kernel.choices)}")
    the_face = face.face(plan, backend="CUDA", class_name=face.module_class_name(plan.op, MODULE_IMPORTS),
                         binding="cuda_launch.CudaKernels",
                         kernel_names=("CUDA_SOURCE", f'"{plan.op}"'), kernels_doc=DOC, kernel_keywords=tuple(keywords))
    lines = [
        *outdir.header_lines(plan.op, plan.spec_path),
        f"# spec sha256: {plan.spec_sha256}",
        '"""' + "\n".join(the_face.docstring),
        '"""',
        "import torch",
        *(["import torch.nn.functional as F"] if the_face.uses_functional else []),
        "",
        "from fusegen import runtime",
        "from fusegen.backends.cuda import launch as cuda_launch",
        "",
        f"__all__ = [{the_face.exports}]",
        "",
        "# The kernels, CUDA C++ for NVRTC (fusegen/backends/cuda/csrc/fusegen_cuda.cuh has the functions they call).",
        'CUDA_SOURCE = r"""',
        cuda.rstrip("\n"),
        '"""',
        the_face.text,
    ]
    return format_module("\n".join(lines) + "\n")


def _names(names) -> str:
    names = [f'"{n}"' for n in names]
    return "(" + ", ".join(names) + ("," if len(names) == 1 else "") + ")"

