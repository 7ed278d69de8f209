"""A row launch's layout (one tile, looped along the row, split across programs) measured, not
ruled. Where a row is wider than one program's tile, row_tuning lists the layouts worth
timing; the first launch of a shape bucket times each and keeps the fastest, in this process
and in Triton's cache (the autotuner's own cache keeps each layout's tile beside it), so a
shape runs the same layout, and gives the same bits, in every later process on that GPU.

Where nothing can be timed (a graph being traced or captured, the CPU interpreter), a launch
takes the layout kept for its key, else row_tuning's rule: the first in its list."""
from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import dataclass
from typing import Callable

import torch
import triton
from triton.compiler.errors import CompilationError
from triton.runtime.cache import get_cache_manager
from triton.runtime.errors import OutOfResources

from .tuning import m_bucket, size_hint

Layout = tuple[int, int]  # (BLOCK_N, SPLITS)

_kept: dict[str, Layout] = {}
_FILE = "layout.json"
measured: list[dict] = []  # this process's timings, as kept (docs/scripts/wide_rows.py prints them)


@dataclass(frozen=True)
class Key:
    digest: str  # what the choice is kept under
    label: str  # the kernel, N and M's bucket, for people


def key_of(kernel, problem, tensors, layouts: list[Layout], *facts) -> Key:
    """What a choice holds for: the kernel's source, the row's width, M's bucket, the tensors'
    dtypes and strides' order, the GPU, Triton's version, the candidates and a kind's facts."""
    device = problem.device
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    layouts_ = [tuple(layout) for layout in layouts]
    tensors_ = [(str(t.dtype), t.stride(-1) == 1 if t.dim() else True) for t in tensors if t is not None]
    source = getattr(kernel.fn, "cache_key", None) or _source_hash(kernel.fn)  # the interpreter's have none
    text = repr((source, size_hint(problem.n), m_bucket(problem.m), tensors_, gpu,
                 triton.__version__, layouts_, facts))
    label = f"{kernel.fn.__name__} N={size_hint(problem.n)} M_BUCKET={m_bucket(problem.m)} {tensors_[0][0]}"
    return Key(hashlib.sha256(text.encode()).hexdigest(), label)


def _source_hash(fn) -> str:
    return hashlib.sha256(inspect.getsource(fn.fn).encode()).hexdigest()


def kept(key: Key) -> Layout | None:
    """The layout chosen for `key` in this process or an earlier one (Triton's cache), if any."""
    layout = _kept.get(key.digest)
    if layout is None:
        path = get_cache_manager(key.digest).get_file(_FILE)
        if path is not None:
            try:
                with open(path) as f:
                    layout = _kept[key.digest] = tuple(json.load(f)["layout"])
            except (OSError, ValueError, KeyError, TypeError):
                return None  # a damaged record: measured again
    return layout


def _keep(key: Key, layout: Layout, times: dict[Layout, float]) -> None:
    _kept[key.digest] = layout
    record = {"label": key.label, "layout": list(layout), "ms": [[list(k), v] for k, v in times.items()]}
    measured.append(record)
    get_cache_manager(key.digest).put(json.dumps(record), _FILE, binary=False)


def time_launch(launch, values: tuple) -> float:
    """ms a launch takes on these values: once to tune and compile, then Triton's timer."""
    launch(values)
    return triton.testing.do_bench(lambda: launch(values), warmup=10, rep=50)


TIMER: Callable = time_launch  # tests without a GPU put a stand-in here
MEASURE = True  # False: the rule's layout everywhere (docs/scripts/wide_rows.py's A/B)


def choose(layouts: list[Layout], build: Callable[[Layout], object], key: Callable[[], Key], traced: bool):
    """The launch of the layout to run: `build(layout)` makes a candidate's, `key()` says what
    the choice holds for (key_of). One candidate: its launch. Traced: the kept layout, else the first (nothing to
    time on fake tensors). Otherwise a launch that chooses on its first call."""
    if len(layouts) == 1 or not MEASURE:
        return build(layouts[0])
    key_ = key()
    if traced:
        layout = kept(key_)
        return build(layout if layout in layouts else layouts[0])
    return ChosenLayout({layout: build(layout) for layout in layouts}, key_)


class ChosenLayout:
    """A launch that is one of several candidates' (`{layout: Launch}`, the rule's first),
    settled on its first call: the kept layout where there is one, else each timed on that
    call's own values and the fastest kept (one the GPU cannot run, out of shared memory, is
    passed over); the chosen one then runs last, writing every value the call returns (each
    layout writes the whole result). Inside a CUDA graph's capture nothing is timed: the
    rule's layout, not kept."""

    __slots__ = ("_candidates", "_key", "_chosen")

    def __init__(self, candidates: dict, key: Key):
        self._candidates, self._key, self._chosen = candidates, key, None

    @property
    def settled(self) -> bool:
        """As Launch.settled: before the choice the candidates run several times."""
        return self._chosen is not None and self._chosen.settled

    def native_form(self) -> tuple | None:
        return None if self._chosen is None else self._chosen.native_form()

    @property
    def layout(self) -> Layout | None:
        """The layout chosen (None before the first call)."""
        return next((k for k, v in self._candidates.items() if v is self._chosen), None)

    def __call__(self, values: tuple) -> None:
        if self._chosen is None:
            self._chosen = self._choose(values)
        self._chosen(values)

    def _choose(self, values: tuple):
        layout = kept(self._key)
        if layout in self._candidates:
            return self._candidates[layout]
        first = next(iter(self._candidates))
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return self._candidates[first]
        times = {}
        for layout, launch in self._candidates.items():
            try:
                times[layout] = TIMER(launch, values)
            except (OutOfResources, CompilationError):
                if layout == first:
                    raise  # the rule's layout: its error is the call's
                times[layout] = float("inf")  # a candidate the GPU cannot run
        best = min(times, key=times.get)
        _keep(self._key, best, times)
        return self._candidates[best]
