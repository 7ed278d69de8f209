"""Launching an autotuned kernel without Triton's per-call dispatch.

On an H100 host, Triton's autotuner and JIT dispatch cost about 80 µs a call
(docs/benchmarks.md): more than the kernel itself below a few million elements. Both
recompute, on every call, what only changes with the arguments' specialization: the
tuned config, the compiled binary, the grid.

`CachedLauncher` lets Triton do that work on the first call for a given key, remembers
the binary, its config's constexprs and the grid, and on later calls hands the arguments
straight to the binary's launcher (the C function Triton itself ends with).

The key refines Triton's specialization, so a hit never launches a binary compiled for
other arguments: for each tensor its dtype and 16-byte alignment; each int by value
(Triton specializes on == 1 and % 16, and on the i32/i64 range), except parameters marked
do_not_specialize, which only contribute their integer width; floats by type; None and
bools by value; the constexprs by value; the current device. The grid function must
depend only on those values and the config (the generated launchers' grids do).

`launch` returns the `Binary` it ran: a caller that knows its next calls have the same key
(launch.Launch, prepared once per call key) launches that directly, without the key.
"""
from __future__ import annotations

import functools
import struct
import warnings

import torch
import triton
from triton import knobs

from .interpreter import kernel_is_interpreted, quiet_numpy

_CACHE_SIZE = 1024
# The Triton versions whose launcher this file calls directly (the C function's arguments,
# packed_metadata, launch_cooperative_grid, launch_pdl, the parameter packing) was checked
# on, by the GPU suite. Under another version every launch takes Triton's own path (slower
# on the host, never wrong), with one warning, until it is checked and added here
# (tests/test_launch.py fails loudly meanwhile).
CHECKED_TRITON = ("3.6",)


def triton_checked() -> bool:
    return ".".join(triton.__version__.split(".")[:2]) in CHECKED_TRITON


def _int_width(value: int) -> str:
    """The integer type Triton gives an unspecialized int argument."""
    if -(2**31) <= value < 2**31:
        return "i32"
    return "i64" if -(2**63) <= value < 2**63 else "u64"


class CachedLauncher:
    """`launcher[grid](*args, **constexprs)`: the same call as on the autotuned kernel."""

    def __init__(self, kernel: triton.runtime.Autotuner):
        self.kernel = kernel
        # As triton.jit built it: TRITON_INTERPRET set later changes nothing for this kernel.
        self._interpreting = kernel_is_interpreted(kernel)
        self.tunes = not self._interpreting  # the interpreter's pruners leave one config
        self._entries: dict[tuple, tuple] = {}
        jit = kernel.fn
        self._arg_names = jit.arg_names
        # The interpreter's functions have no binary, hence no specialization to mirror.
        unspecialized = set() if self._interpreting else {
            name if isinstance(name, str) else jit.arg_names[name] for name in jit.do_not_specialize
        }
        self._unspecialized = frozenset(i for i, name in enumerate(jit.arg_names) if name in unspecialized)

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.launch(grid, args, constexprs)

    def key(self, args: tuple, constexprs: dict) -> tuple:
        # What Triton's specialization can see of each argument (inline: this runs every call).
        tokens = [
            (a.dtype, not a.data_ptr() & 15) if isinstance(a, torch.Tensor) else float if type(a) is float else a
            for a in args
        ]
        for i in self._unspecialized:
            if i < len(args) and type(args[i]) is int:
                tokens[i] = _int_width(args[i])
        tokens.append(torch._C._cuda_getDevice())  # what torch.cuda.current_device() returns, minus its Python
        tokens.extend(constexprs.items())
        return tuple(tokens)

    def launch(self, grid, args: tuple, constexprs: dict) -> "Binary | None":
        """Launch; returns the binary it launched when a later call with the same key may
        launch it directly (None under the interpreter, with launch hooks, or before Triton
        could say which binary it ran)."""
        if self._interpreting:  # no binary to call
            with quiet_numpy():
                self.kernel[grid](*args, **constexprs)
            return None
        if hooks_active():  # launch hooks (profilers) want Triton's path
            self.kernel[grid](*args, **constexprs)
            return None
        key = self.key(args, constexprs)
        binary = self._entries.get(key)
        if binary is None:
            # Triton tunes, compiles and launches this call; later ones with the key reuse its work.
            binary = self._remember(key, self.kernel[grid](*args, **constexprs), grid, args, constexprs)
        else:
            binary(args)
        return binary

    def _remember(self, key, compiled, grid, args, constexprs) -> "Binary | None":
        """The binary, grid and trailing constexprs of the call Triton just made."""
        if hasattr(compiled, "result"):  # an asynchronous compile's future
            compiled = compiled.result()
        named = {**dict(zip(self._arg_names, args)), **constexprs, **self.kernel.best_config.kwargs}
        trailing = self._arg_names[len(args):]
        if compiled is None or any(name not in named for name in trailing):
            return None  # e.g. a parameter left to its default: keep Triton's path
        if not triton_checked():
            _warn_unchecked()
            return None
        dims = grid(named) if callable(grid) else grid
        binary = Binary(compiled, (*dims, 1, 1)[:3], tuple(named[n] for n in trailing), key[len(args)])
        if len(self._entries) >= _CACHE_SIZE:
            self._entries.clear()
        self._entries[key] = binary
        return binary


@functools.cache
def _warn_unchecked() -> None:
    warnings.warn(f"fusegen: Triton {triton.__version__}'s launcher was not checked (checked: "
                  f"{', '.join(CHECKED_TRITON)}); kernels launch through Triton's own path", stacklevel=4)


def hooks_active() -> bool:
    """Whether a profiler hooked Triton's launches (then every launch takes Triton's path)."""
    return bool(knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls)


class Binary:
    """One compiled kernel with its grid and trailing constexprs: `binary(args)` launches it
    on the current stream of its device, through the C function Triton's launcher ends with
    (its Python wrapper only allocates scratch memory, which these kernels do not use)."""

    __slots__ = ("device", "_compiled", "_launch", "_grid", "_head", "_tail")

    def __init__(self, compiled, grid: tuple[int, int, int], tail: tuple, device: int):
        self.device = device
        self._compiled = compiled
        self._grid = grid
        self._tail = tail
        run = compiled.run
        meta = (compiled.packed_metadata, None, None, None)  # launch metadata, enter and exit hooks
        if getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0 \
                and hasattr(run, "launch"):
            self._launch = run.launch
            self._head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None, *meta)
        else:
            self._launch = run
            self._head = (compiled.function, *meta)

    def __call__(self, args) -> None:
        x, y, z = self._grid
        self._launch(x, y, z, torch._C._cuda_getCurrentRawStream(self.device), *self._head, *args, *self._tail)

    def native_form(self, args: list, slots: dict[int, int]) -> tuple | None:
        """This launch as a compiled caller makes it (runtime/csrc/eager_call.cpp), with
        `args` (all but the trailing constexprs) and, by position, the per-call value each
        slot in them takes: (function handle, grid, num_warps, num_ctas, shared memory,
        cooperative, pdl, params), each param as Triton's launcher passes it: (slot, 0) for a
        tensor's address, (-1, bits) for a fixed value packed as its type. None where that
        launcher does more (scratch memory) or a param is of a type it does not pack."""
        run = self._compiled.run
        if self._launch is run:  # scratch memory: Triton's Python launcher allocates it
            return None
        signature = list(getattr(self._compiled.src, "signature", {}).values())
        values = [*args, *self._tail]
        if len(signature) != len(values):
            return None
        params = []
        for position, (triton_type, value) in enumerate(zip(signature, values)):
            if triton_type == "constexpr":
                continue
            if not isinstance(triton_type, str):  # a tuple: Triton flattens it; these kernels have none
                return None
            if position in slots:
                if not triton_type.startswith("*"):
                    return None
                params.append((slots[position], 0))
                continue
            bits = _packed(triton_type, value)
            if bits is None:
                return None
            params.append((-1, bits))
        num_warps, num_ctas, shared = self._compiled.packed_metadata
        return (self._compiled.function, self._grid, num_warps, num_ctas, shared,
                bool(run.launch_cooperative_grid), bool(run.launch_pdl), params)


_INT_BITS = {"i1": 8, "i8": 8, "u1": 8, "u8": 8, "i16": 16, "u16": 16, "i32": 32, "u32": 32, "i64": 64, "u64": 64}
_FLOAT_FORMATS = {"fp16": "<e", "fp32": "<f", "f32": "<f", "fp64": "<d"}


def _packed(triton_type: str, value) -> int | None:
    """A fixed param's bits as Triton's launcher packs its type (triton/backends/nvidia/
    driver.py: ty_to_cpp, pack_fp16/bf16/fp32/fp64); None for a type it takes otherwise
    (a pointer, a tensor descriptor) or a value that does not fit."""
    if type(value) not in (int, float, bool):
        return None
    if triton_type in _INT_BITS:
        if type(value) is float:
            return None
        return int(value) & ((1 << _INT_BITS[triton_type]) - 1)
    if triton_type == "bf16":  # Triton truncates the fp32 value
        bits = _packed("fp32", value)
        return None if bits is None else bits >> 16
    layout = _FLOAT_FORMATS.get(triton_type)
    if layout is None:
        return None
    try:
        return int.from_bytes(struct.pack(layout, float(value)), "little")
    except (OverflowError, struct.error):  # out of the type's range: Triton's cast gives inf
        return None
