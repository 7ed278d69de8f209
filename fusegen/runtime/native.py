"""fusegen's C++ extension, built once per machine and torch: the autograd node
(csrc/autograd_node.cpp) and the eager call (csrc/eager_call.cpp: a call whose call key the
Python path has launched once, forward and backward, keyed, allocated and launched in C++;
on the H100 host a forward then costs about what torch.add costs, docs/benchmarks.md).

A generated op called with gradients on puts one autograd node behind its outputs. As a
Python `torch.autograd.Function` that node costs about 20 µs of host time per call
(forward and backward, an identity op on the H100 host); the C++ node costs about 8
(docs/benchmarks.md). Inside a whole training step the saving is below that host's
run-to-run noise, so the node is used where it is already built and never built behind
the user's back: a build takes about 30 s, which a fresh container would pay on every start.

It is compiled with torch's extension machinery (a C++ compiler and ninja; no CUDA
toolkit: it only calls back into Python). Nothing is built at install time, so the README's
set-up needs no compiler. FUSEGEN_NATIVE says when it is used (read at a process's first
call with gradients):

- unset or "auto": when already built (`fusegen native` builds it, e.g. in an image);
- "1" or "on": also built on the first call that needs it, on any device (the tests use this);
- "0" or "off": never; the Python Function throughout.

A failed build warns once and leaves the Python Function in place. The build lives in
FUSEGEN_CACHE_DIR (default ~/.cache/fusegen), keyed by the source, torch and Python, so
upgrading any of them needs a new build (until then: the Python Function).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
import threading
import warnings
import weakref
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

import torch

from .seeds import SEED_BATCH, SEED_LIMIT

_CSRC = Path(__file__).with_name("csrc")
SOURCES = (_CSRC / "autograd_node.cpp", _CSRC / "eager_call.cpp")
HEADERS = (_CSRC / "fusegen_native.h",)
_MODES = {"": "auto", "auto": "auto", "1": "on", "on": "on", "0": "off", "off": "off"}


class _State:
    module = None  # the loaded extension, once loaded
    failed: str | None = None  # why a build failed (then no retry in this process)
    # Why op calls have settled on the Python Function for this process ("off", "not built"),
    # or None: FUSEGEN_NATIVE is read once, at the first call with gradients, so that the
    # check costs nothing per call. load(build=True) still turns the node on.
    settled: str | None = None


_state = _State()
_lock = threading.Lock()
_ops_with_calls: weakref.WeakSet = weakref.WeakSet()  # FusedOps with an eager call in C++


def mode() -> str:
    value = os.environ.get("FUSEGEN_NATIVE", "").strip().lower()
    if value not in _MODES:
        raise ValueError(f"FUSEGEN_NATIVE must be one of auto, on, off (or 1, 0), got {value!r}")
    return _MODES[value]


_CFLAGS = ("-O2",)


@functools.cache
def build_directory() -> Path:
    """Where this build lives: keyed by the source, the build flags, torch (its version and
    commit) and Python."""
    key = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        key.update(path.read_bytes())
    # "flock": builds of this folder take _build_lock (a fusegen from before it, building
    # the same folder at once, would have its live lock file taken for a leftover).
    key.update(repr((_CFLAGS, torch.__version__, torch.version.git_version, sys.version,
                     sysconfig.get_platform(), _cuda_include(), "flock")).encode())
    root = Path(os.environ.get("FUSEGEN_CACHE_DIR") or Path.home() / ".cache" / "fusegen")
    return root / f"native-{key.hexdigest()[:16]}"


def _cuda_include() -> str:
    """Triton's bundled CUDA headers: the eager call needs the driver API's types (cuda.h),
    not a CUDA toolkit."""
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "include")


def _module_name(directory: Path) -> str:
    return "fusegen_native_" + directory.name.removeprefix("native-")


def _library_name(directory: Path) -> str:
    # As torch.utils.cpp_extension.load names what it builds.
    return _module_name(directory) + (".pyd" if sys.platform == "win32" else ".so")


def _built_file(directory: Path) -> Path:
    """The finished build. torch links into directory/build; the library is moved here
    whole once linked, so a file here is never half-written (importing a half-written
    library can kill the process with SIGBUS)."""
    return directory / _library_name(directory)


def _import(path: Path):
    spec = importlib.util.spec_from_file_location(_module_name(path.parent), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return _configured(module)


def _configured(module):
    """The extension, loaded or just built, set to own the eager seed batches from now on."""
    module.configure_seeds(SEED_BATCH, SEED_LIMIT - 1)
    return module


def call_key(calls, args: tuple) -> tuple | None:
    """The key of a call as the extension's eager call `calls` keys it (csrc/eager_call.cpp,
    make_key), or None for a call it does not take: where the extension is in use, the one
    key of the process (FusedOp.prepare keys its prepared calls by it too)."""
    return _state.module.call_key(calls, args)


def seed_owner():
    """The loaded extension, which then owns the eager seed batches (csrc/eager_call.cpp's
    next_seed; runtime.dropout's eager seeds call in), or None."""
    return _state.module


# The torch versions whose private APIs the extension uses were checked on (THPVariable_Unpack
# and _Wrap, generator state, the raw current stream, dispatch key sets): 2.11 by the GPU suite,
# 2.13 by the CPU suite. Another version leaves the extension off, with one warning, until its
# tests pass there and it is added (tests/test_native.py fails loudly meanwhile). Triton's
# launcher, which it shares with Python, has its own list (backends/triton/cached_launcher.py).
CHECKED_TORCH = ("2.11", "2.13")


def unchecked_torch() -> str | None:
    """Why the installed torch is not one the extension was checked against, or None."""
    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if version in CHECKED_TORCH:
        return None
    return f"torch {version} is not among the versions its private APIs were checked on ({', '.join(CHECKED_TORCH)})"


def load(build: bool):
    """The extension: loaded if built, else built when `build` (None when it cannot be)."""
    if _state.module is not None or _state.failed is not None:
        return _state.module
    with _lock:
        if _state.module is not None or _state.failed is not None:
            return _state.module
        try:
            unchecked = unchecked_torch()
            if unchecked is not None:
                raise RuntimeError(unchecked)
            built = _built_file(build_directory())
            if built.exists():
                _state.module = _import(built)
            elif build:
                _state.module = _build(build_directory())
        except Exception as error:  # no compiler, no ninja, a read-only cache: the Python Function
            _fail(error)
        return _state.module


def _fail(error: Exception) -> None:
    text = str(error).strip()
    _state.failed = f"{type(error).__name__}: {text.splitlines()[-1] if text else ''}"
    if len(text.splitlines()) > 1:  # a compiler's output: the cause is above its last line
        print(f"fusegen: building the C++ autograd node failed:\n{text}", file=sys.stderr)
    warnings.warn(f"fusegen: the C++ autograd node is unavailable ({_state.failed}); "
                  "using torch.autograd.Function (set FUSEGEN_NATIVE=off to silence this)", stacklevel=4)


def _compiler_missing() -> str | None:
    """Why torch's build could not start a C++ compiler, or None: without one, ninja says
    only "build stopped"."""
    from torch.utils import cpp_extension

    command = cpp_extension.get_cxx_compiler()  # $CXX, else c++; it may be "ccache g++"
    words = command.split()
    if words and shutil.which(words[0]):
        return None
    looked = f"$CXX is {command!r}" if "CXX" in os.environ else f"looked for {command!r} on PATH, or $CXX"
    return f"no C++ compiler found ({looked}): install one (g++ or clang++), or set CXX"


def _build(directory: Path):
    from torch.utils import cpp_extension

    missing = _compiler_missing()
    if missing:
        raise RuntimeError(missing)
    work = directory / "build"
    work.mkdir(parents=True, exist_ok=True)
    with _build_lock(directory) as locked:
        built = _built_file(directory)
        if built.exists():  # another process built it while this one waited
            return _import(built)
        if locked:
            # torch's own lock file (cpp_extension's FileBaton): a build killed midway leaves
            # it, and every later build would wait on it forever. Builds of this folder take
            # the lock above first, so with it held a file left here is such a leftover.
            (work / "lock").unlink(missing_ok=True)
        print(f"fusegen: building the C++ autograd node once, into {directory} (about 30 s)", file=sys.stderr)
        module = cpp_extension.load(_module_name(directory), sources=[str(path) for path in SOURCES],
                                    build_directory=str(work), extra_cflags=list(_CFLAGS),
                                    extra_include_paths=[_cuda_include()], verbose=False)
        partial = directory / (_library_name(directory) + f".{os.getpid()}.partial")
        shutil.copyfile(work / _library_name(directory), partial)
        os.replace(partial, built)
        return _configured(module)  # as an import's: the process that builds it draws seeds too


@contextlib.contextmanager
def _build_lock(directory: Path):
    """One build of `directory` at a time across processes: an advisory lock on a file,
    which the system lets go when its process ends, however it ends. Gives whether it holds
    the lock: not without flock (Windows, some network file systems), where torch's lock
    file alone serializes builds, as before."""
    if fcntl is None:
        yield False
        return
    with open(directory / "build.flock", "w") as handle:
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"fusegen: waiting for another process's build of {directory}", file=sys.stderr)
                fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:  # a file system without flock
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def attach_for():
    """The extension's `attach`, or None: take the Python Function."""
    module = _state.module if _state.module is not None else _settle()
    return None if module is None else module.attach


def _settle():
    """The extension where this process uses it (FUSEGEN_NATIVE, read once), else None."""
    if _state.failed is not None or _state.settled:
        return None
    try:
        current = mode()
    except ValueError as error:  # said once, not on every op call
        _fail(error)
        return None
    module = None if current == "off" else load(build=current == "on")
    if module is None and _state.failed is None:
        _state.settled = current if current == "off" else "not built"
    return module


def settled_off() -> bool:
    """Whether this process has settled on the Python path (cheap: eager calls ask it)."""
    return _state.module is None and (_state.failed is not None or bool(_state.settled))


def eager_calls(*, inputs: int, arguments: int, seed_position: int | None, outputs: int, name: str, op, backward):
    """A new eager call in C++ for `op` (csrc/eager_call.cpp): `calls(args, inplace_backward)`
    gives the outputs of a call with a registered call key (`inputs` tensors first, `arguments` in
    all), with its autograd node `name`, or None. None where the extension is not in use.
    `backward`: the node's Python backward."""
    module = _state.module if _state.module is not None else _settle()
    if module is None:
        return None
    from triton import knobs

    _ops_with_calls.add(op)
    return module.new_calls(inputs, arguments, -1 if seed_position is None else seed_position, outputs,
                            name, op, backward, getattr(torch._C, "_cuda_getDevice", None),
                            getattr(torch._C, "_cuda_getCurrentRawStream", None), knobs.runtime)


def forget_calls() -> None:
    """Every op drops its eager call in C++ and the call keys it prepared, so that the next
    calls see the extension as it is now (tests turn it off and on)."""
    for op in list(_ops_with_calls):
        op.forget_native_calls()
    _ops_with_calls.clear()


def register_call(calls, args: tuple, device: int, outputs: list, statistics, launch: tuple, prepared, seed,
                  bare: tuple | None = None):
    """Registers the call key of `args` with `calls` (see csrc/eager_call.cpp); its C++ half (Prepared),
    to register backwards with, or None. `launch`: None where it has not launched yet (then the
    C++ call leaves the calls a gradient may follow to Python until register_pending gives it).
    `bare`: the launch for a call that no gradient follows, which writes no statistics (None:
    `launch` for every call; True: one not launched yet, as `launch` None)."""
    return _state.module.register_call(calls, args, device, outputs, statistics, launch, prepared, seed, bare)


def register_pending(prepared, launch: tuple | None, bare: bool) -> None:
    """A launch of a registered call key registered as pending (see register_call), the bare one or
    the keeping one: None, where it has no form the C++ call takes (its calls then stay in Python)."""
    _state.module.register_pending(prepared, launch, bare)


def register_backward(prepared, needs: tuple, grads: tuple, launch: tuple | None, targets: list, sources: list) -> None:
    """Registers a backward of a registered call key (see csrc/eager_call.cpp)."""
    _state.module.register_backward(prepared, list(needs), grads, launch, targets, sources)


def status() -> str:
    """One line: the node this process uses (or would use, before its first call with
    gradients), and where it is built."""
    if _state.module is not None:
        return f"built: {build_directory()}"
    if _state.failed is not None:
        return f"unavailable: {_state.failed}"
    settled = _state.settled or ("off" if mode() == "off" else None)
    if settled == "off":
        return "off (FUSEGEN_NATIVE=off): torch.autograd.Function"
    if settled == "not built" or not _built_file(build_directory()).exists():
        return f"not built: {build_directory()}"
    return f"built: {build_directory()}"
