"""CUDA C++ source → a loaded module's kernels, at run time: NVRTC through NVIDIA's cuda-bindings,
the binary loaded and launched through cuda-core (the optional dependency `fusegen[cuda]`).

A source is compiled once per machine: the cubin is kept under the cache folder
(`$FUSEGEN_CACHE_DIR/cuda`, else `~/.cache/fusegen/cuda`), named by the sha256 of everything the
binary depends on (the source, fusegen_cuda.cuh, the kernels' template arguments, the GPU's
architecture, NVRTC's version and options), with the kernels' mangled names beside it; a second
process loads it. Nothing compiles on import: the first call with a new dtype combination does.

NVRTC has no system headers (fusegen_cuda.cuh stands in for the few it needs under
`__CUDACC_RTC__`); the fp16 and bf16 headers come from the CUDA toolkit where one is installed,
else from the copy Triton ships for its own use (Triton is a dependency: always there)."""
from __future__ import annotations

import hashlib
import json
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

HEADER = Path(__file__).with_name("csrc") / "fusegen_cuda.cuh"
OPTIONS = ("-std=c++17", "--fmad=true")  # no fast math: rounded as torch rounds


class CudaBackendMissing(RuntimeError):
    """What the CUDA backend needs at run time is not installed: one line naming it."""


@dataclass(frozen=True)
class Binary:
    """A compiled source: the cubin and each kernel's mangled name, by its name expression."""

    cubin: bytes
    lowered: dict[str, str]
    name: str = ""  # the source file's, for cuda-core's messages


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise CudaBackendMissing(
            "fusegen's CUDA backend compiles with NVRTC through cuda-bindings, which is not installed: "
            "pip install 'fusegen[cuda]' (cuda-bindings, cuda-core, nvidia-cuda-nvrtc)") from exc
    try:
        nvrtc.nvrtcVersion()
    except Exception as exc:  # noqa: BLE001 - libnvrtc not found: cuda-bindings' own error type varies
        raise CudaBackendMissing(f"fusegen's CUDA backend needs libnvrtc, which cuda-bindings cannot load "
                                 f"({exc}): pip install nvidia-cuda-nvrtc") from exc
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    _, major, minor = _nvrtc().nvrtcVersion()
    return major, minor


def cuda_include() -> Path:
    """A folder holding cuda_fp16.h and cuda_bf16.h: the toolkit's, else Triton's copy."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "include" / "cuda_bf16.h").is_file():
            return Path(root) / "include"
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "include"
    if (bundled / "cuda_bf16.h").is_file():
        return bundled
    raise CudaBackendMissing("fusegen's CUDA backend needs cuda_bf16.h: install the CUDA toolkit or set CUDA_HOME")


def cache_dir() -> Path:
    root = os.environ.get("FUSEGEN_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "fusegen") / "cuda"


def _check(nvrtc, result, program=None, what: str = "") -> tuple:
    """The values of an NVRTC call's (error, *values) result; its log in the error where it failed."""
    error, *values = result
    if error != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        log = _log(nvrtc, program) if program is not None else ""
        raise RuntimeError(f"NVRTC {what}: {error.name}\n{log}")
    return tuple(values)


def _log(nvrtc, program) -> str:
    (size,) = _check(nvrtc, nvrtc.nvrtcGetProgramLogSize(program))
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(program, log)
    return log.decode(errors="replace").rstrip("\x00 \n")


_LOCK = threading.Lock()


def compile_source(source: str, file_name: str, expressions: tuple[str, ...], arch: str) -> Binary:
    """The cubin of `source` for `arch` ("sm_90") with the kernels `expressions` (name expressions:
    "gelu_forward<float, int64_t, float, float>") instantiated; from the cache where it is there."""
    nvrtc = _nvrtc()
    header = HEADER.read_bytes()
    version = nvrtc_version()
    include = cuda_include()
    options = (f"-arch={arch}", *OPTIONS, f"-I{include}")
    key = hashlib.sha256(json.dumps([source, header.decode(), expressions, arch, version, options]).encode()).hexdigest()
    folder = cache_dir()
    cubin_path, names_path = folder / f"{key}.cubin", folder / f"{key}.json"
    with _LOCK:
        if cubin_path.is_file() and names_path.is_file():
            return Binary(cubin_path.read_bytes(), json.loads(names_path.read_text()), file_name)
        (program,) = _check(nvrtc, nvrtc.nvrtcCreateProgram(source.encode(), file_name.encode(), 1, [header],
                                                              [HEADER.name.encode()]), what="create")
        try:
            for expression in expressions:
                _check(nvrtc, nvrtc.nvrtcAddNameExpression(program, expression.encode()), what="name expression")
            encoded = [o.encode() for o in options]
            _check(nvrtc, nvrtc.nvrtcCompileProgram(program, len(encoded), encoded), program, f"compiling {file_name}")
            (size,) = _check(nvrtc, nvrtc.nvrtcGetCUBINSize(program))
            cubin = b" " * size
            _check(nvrtc, nvrtc.nvrtcGetCUBIN(program, cubin))
            lowered = {e: _check(nvrtc, nvrtc.nvrtcGetLoweredName(program, e.encode()))[0].decode() for e in expressions}
        finally:
            nvrtc.nvrtcDestroyProgram(program)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            # Written whole, then renamed: a process reading the cache never sees half a file; the
            # names first, so that a cubin there always has its names.
            for path, data in ((names_path, json.dumps(lowered).encode()), (cubin_path, cubin)):
                partial = path.with_name(f"{path.name}.{uuid.uuid4().hex}.partial")
                partial.write_bytes(data)
                os.replace(partial, path)
        except OSError:
            pass  # a cache that cannot be written (read-only, full): compiled again next process
        return Binary(cubin, lowered, file_name)
