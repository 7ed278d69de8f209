"""Fixes for Triton 3.6's CPU interpreter, applied only when TRITON_INTERPRET=1.

bf16 rounding: the interpreter converts float32 → bfloat16 by truncating the mantissa,
whereas the GPU (and torch) round to nearest even. Left alone, every bf16 result on the
interpreter is up to 1 ulp off what the same kernel gives on a GPU, and tests would have
to allow for an error the product does not have. We route that one conversion through torch.

float8: its float32 → float8 conversions truncate too; routed through torch likewise.

libdevice: the interpreter runs `triton.language.extra.libdevice`'s stubs, which return
None, and has no extern calls at all. We point the stubs the printers use at the CUDA
backend's definitions, so that arguments are converted, broadcast and dispatched on their
types exactly as a GPU compile does them, and compute the extern call itself with numpy.
"""
from __future__ import annotations

import numpy as np
import torch
import triton.language as tl
from triton import knobs

from fusegen.runtime import FusegenArgumentError

_PATCHED = False
_LIBDEVICE_PATCHED = False


def is_interpreting() -> bool:
    """Whether triton.jit would now build kernels for its CPU interpreter: TRITON_INTERPRET
    as Triton itself reads it (1, true, on, yes; 0, false, off, no, unset), or its knob."""
    return bool(knobs.runtime.interpret)


def kernel_is_interpreted(kernel) -> bool:
    """Whether `kernel` (a @triton.jit function, or an autotuner over one) runs on the
    interpreter: triton.jit decided that when it decorated it, by TRITON_INTERPRET then."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction) or isinstance(getattr(kernel, "fn", None), InterpretedFunction)


def check_runs_off_cuda(op: str, device: torch.device, kernel) -> None:
    """Off CUDA only the interpreter runs kernels: kernels triton.jit built for it, calling
    Triton's own jit functions (tl.sigmoid, tl.sum's combine), built at triton's import."""
    if kernel_is_interpreted(kernel) and kernel_is_interpreted(tl.sigmoid):
        return
    if is_interpreting():
        # Set after triton's import (in a notebook, say): too late for the kernels built then.
        raise FusegenArgumentError(
            f"{op}(): tensors are on {device.type}, and TRITON_INTERPRET is set, but it was not when triton was "
            "imported (kernels are built for the interpreter or for CUDA then); set TRITON_INTERPRET=1 before "
            "importing triton (restart Python or the notebook kernel), or call reference(...)"
        )
    raise FusegenArgumentError(
        f"{op}(): tensors are on {device.type}, but the Triton kernel needs a CUDA device; set "
        "TRITON_INTERPRET=1 before importing triton to run it on the CPU, or call reference(...)"
    )


def quiet_numpy():
    """Around an interpreted launch: the interpreter computes padded lanes too (past N, past
    M), with whatever their masked loads gave, and numpy would warn of their 0/0 and
    overflows, which the kernel never stores: a valid call prints nothing."""
    return np.errstate(all="ignore")


def _to_bfloat16_bits(data: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(data)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


# float8: the interpreter truncates float32 → float8 (and errs past the range) where the GPU
# rounds to nearest even; routed through torch's conversion as bf16 is. Past the range the
# kernels set torch's values themselves (kernel_lib.to_float8), on the GPU as here.
_FLOAT8 = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}


def _to_float8_bits(data: np.ndarray, dtype) -> np.ndarray:
    values = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
    return values.to(_FLOAT8[dtype]).view(torch.uint8).numpy()


def patch_bfloat16_rounding() -> None:
    global _PATCHED
    if _PATCHED:
        return
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    cast_impl, fp_to_fp = builder.cast_impl, builder.create_fp_to_fp

    def rounds_to_bf16(src, dst_type) -> bool:
        return dst_type.scalar == tl.bfloat16 and src.dtype.scalar in (tl.float32, tl.float64)

    def rounds_to_float8(src, dst_type) -> bool:
        return dst_type.scalar in _FLOAT8 and src.dtype.scalar == tl.float32

    def patched_cast_impl(self, src, dst_type):
        if rounds_to_bf16(src, dst_type):
            return interpreter.TensorHandle(_to_bfloat16_bits(src.data), dst_type.scalar)
        if rounds_to_float8(src, dst_type):
            return interpreter.TensorHandle(_to_float8_bits(src.data, dst_type.scalar), dst_type.scalar)
        return cast_impl(self, src, dst_type)

    def patched_fp_to_fp(self, src, dst_type, rounding_mode):
        if rounds_to_bf16(src, dst_type):
            return interpreter.TensorHandle(_to_bfloat16_bits(src.data), dst_type.scalar)
        if rounds_to_float8(src, dst_type):
            return interpreter.TensorHandle(_to_float8_bits(src.data, dst_type.scalar), dst_type.scalar)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    builder.cast_impl = patched_cast_impl
    builder.create_fp_trunc = patched_cast_impl
    builder.create_fp_to_fp = patched_fp_to_fp
    _PATCHED = True


# The libdevice functions the printers spell (printers.TritonPrinter), by their CUDA symbol.
_LIBDEVICE = {
    "exp": ("__nv_expf", "__nv_exp"),
    "tanh": ("__nv_tanhf", "__nv_tanh"),
    "pow": ("__nv_powf", "__nv_pow", "__nv_powif", "__nv_powi"),
    "rint": ("__nv_rintf", "__nv_rint"),
    "floor": ("__nv_floorf", "__nv_floor"),
    "log1p": ("__nv_log1pf", "__nv_log1p"),
    "expm1": ("__nv_expm1f", "__nv_expm1"),
    "sin": ("__nv_sinf", "__nv_sin"),
    "cos": ("__nv_cosf", "__nv_cos"),
}
_NUMPY = {"exp": np.exp, "tanh": np.tanh, "pow": np.power, "rint": np.rint, "floor": np.floor, "log1p": np.log1p,
          "expm1": np.expm1, "sin": np.sin, "cos": np.cos}


def patch_libdevice() -> None:
    global _LIBDEVICE_PATCHED
    if _LIBDEVICE_PATCHED:
        return
    from triton.language.extra import libdevice
    from triton.language.extra.cuda import libdevice as cuda_libdevice
    from triton.language.semantic import TritonSemantic
    from triton.runtime import interpreter

    numpy_of = {symbol: _NUMPY[name] for name, symbols in _LIBDEVICE.items() for symbol in symbols}

    def extern_elementwise(self, lib_name, lib_path, symbol, args, ret_type, is_pure):
        if symbol not in numpy_of:
            raise NotImplementedError(f"{symbol} is not supported in interpreter mode")
        dtype = ret_type.scalar
        data = numpy_of[symbol](*(a.data for a in args)).astype(interpreter._get_np_dtype(dtype), copy=False)
        return interpreter.TensorHandle(data, dtype)

    def interpreted(function):
        def call(*args):
            return function(*args, _semantic=TritonSemantic(interpreter.interpreter_builder))

        call.__module__ = libdevice.__name__  # a stub to the JIT's dependency tracking, as before
        return call

    interpreter.InterpreterBuilder.create_extern_elementwise = extern_elementwise
    for name in _LIBDEVICE:
        setattr(libdevice, name, interpreted(getattr(cuda_libdevice, name)))
    _LIBDEVICE_PATCHED = True


_INDEX_PATCHED = False


def patch_scalar_index() -> None:
    """A runtime int as a loop bound (`range(0, N, BLOCK_N)`): the interpreter holds scalars
    as one-element arrays, which NumPy 2 no longer converts with int()."""
    global _INDEX_PATCHED
    if _INDEX_PATCHED:
        return
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    _INDEX_PATCHED = True


_SPLAT_PATCHED = False


def patch_splat_dtype() -> None:
    """A 0-d comparison made a block (`(m == x) | (c <= 0)`, c a param): the interpreter keeps
    a comparison's result typed as its operands (float) and splats it as floats, and NumPy's
    `|` of bool and float fails. The block takes the result type's elements (bool)."""
    global _SPLAT_PATCHED
    if _SPLAT_PATCHED:
        return
    import numpy as np
    from triton.runtime import interpreter

    def patched(self, ret_ty, arg):
        value = arg.data.reshape(-1)[0] if arg.data.ndim else arg.data
        return interpreter.TensorHandle(np.full(ret_ty.shape, value, dtype=interpreter._get_np_dtype(ret_ty)),
                                        ret_ty.scalar)

    interpreter.InterpreterBuilder.create_splat = patched
    _SPLAT_PATCHED = True


_DOT_PATCHED = False


def patch_bfloat16_dot() -> None:
    """tl.dot of bf16 tiles: the interpreter holds bf16 as its bits (uint16) and multiplies
    the bits (triton-lang/triton#11584). The tiles are widened to fp32 first, exactly, and
    the product accumulates in the accumulator's type, as on the GPU."""
    global _DOT_PATCHED
    if _DOT_PATCHED:
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        return interpreter.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def patched(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = patched
    _DOT_PATCHED = True


_COOPERATIVE_PATCHED = False


def patch_cooperative_grid() -> None:
    """A row split across programs (kernel_lib.split_program: SPLITS > 1) has its programs
    wait for each other, which the interpreter's one-after-another grid would never let
    finish: such a launch runs each program in its own thread (program_id per thread), as a
    GPU runs them side by side. Other launches are left as they were."""
    global _COOPERATIVE_PATCHED
    if _COOPERATIVE_PATCHED:
        return
    import inspect
    import threading

    from triton.runtime import interpreter

    local = threading.local()
    builder = interpreter.InterpreterBuilder
    builder.grid_idx = property(lambda self: getattr(local, "grid_idx", None),
                                lambda self, value: setattr(local, "grid_idx", value))
    call = interpreter.GridExecutor.__call__

    def patched(self, *args, **kwargs):
        named = dict(zip(inspect.getfullargspec(self.fn).args, args), **kwargs)
        splits = named.get("SPLITS")
        if not isinstance(splits, int) or splits <= 1:
            return call(self, *args, **kwargs)
        fn, threads, errors = self.fn, [], []

        def program(grid_idx, program_args):
            local.grid_idx = grid_idx
            try:
                fn(**program_args)
            except BaseException as error:  # re-raised by the launch, as the one-thread grid would
                errors.append(error)

        def start(**program_args):
            thread = threading.Thread(target=program, args=(local.grid_idx, program_args), daemon=True)
            thread.start()
            threads.append(thread)
            x, y, z = interpreter.interpreter_builder.grid_dim
            if len(threads) == x * y * z:  # the grid's last program
                for t in threads:
                    t.join()
                if errors:
                    raise errors[0]

        start.__signature__ = inspect.signature(fn)  # what the executor binds the arguments by
        self.fn = start
        try:
            return call(self, *args, **kwargs)
        finally:
            self.fn = fn

    interpreter.GridExecutor.__call__ = patched
    _COOPERATIVE_PATCHED = True


_DEVICE_CALLS_PATCHED = False


class _NoPatches:
    """The patches a device function's call would have made, when the launch made them already."""

    def restore(self) -> None:
        pass


def patch_device_calls() -> None:
    """A @triton.jit function called from a kernel (kernel_lib's helpers, tl.sigmoid): the
    interpreter patches triton.language's builtins again on every such call, though the
    launch around it patched them already, and never undoes it (the launch's own patches are
    undone when it ends): a patched module has no builtin left to patch, and the call only
    pays for looking (about 1 ms, a quarter of a launch's time for the library's kernels,
    which call dozens of helpers). Inside a launch, once the modules a function sees
    (triton.language, triton.language.core) are patched, by the launch or an earlier call,
    its calls take those patches; a call outside a launch patches as before."""
    global _DEVICE_CALLS_PATCHED
    if _DEVICE_CALLS_PATCHED:
        return
    import inspect
    import threading

    from triton.runtime import interpreter

    patch_lang, grid_call = interpreter._patch_lang, interpreter.GridExecutor.__call__
    lock = threading.Lock()
    # How many launches run, and the language modules patched since the first began (None:
    # none yet). Launches run one at a time; the count keeps the state to the outermost.
    state = {"launches": 0, "patched": None}
    none = _NoPatches()

    def languages(fn) -> frozenset:
        return frozenset(id(value) for value in fn.__globals__.values()
                         if inspect.ismodule(value) and (value is tl or value is tl.core))

    def patched_lang(fn):
        patched = state["patched"]
        if patched is not None:
            seen = languages(fn)
            if seen and seen <= patched:  # (none: the interpreter's own error)
                return none
        scope = patch_lang(fn)
        with lock:
            if state["launches"]:  # the launch's own patches, or a call's, which stay to its end
                state["patched"] = (state["patched"] or frozenset()) | languages(fn)
        return scope

    def launch(self, *args, **kwargs):
        with lock:
            state["launches"] += 1
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            with lock:
                state["launches"] -= 1
                state["patched"] = None

    interpreter._patch_lang = patched_lang
    interpreter.GridExecutor.__call__ = launch
    _DEVICE_CALLS_PATCHED = True
