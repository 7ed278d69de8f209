"""The generated ops an integration calls, loaded so that a process holds one module per op.

A checkout's generated/ is imported as `generated.<op>` (as the tests and fusegen.bench import
it), an installed package's as `fusegen.ops.<op>`. A module imported under two names would
declare its op twice; the runtime then shares the first one's torch.library ops
(fusegen.runtime.op), but each module keeps its own compiled kernels and prepared calls.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Callable


def load_ops(names: set[str], generated: str | Path | None = None, caller: str = "patch()") -> dict[str, Callable]:
    """Each named op function, from a folder of generated modules: `generated`, else the
    checkout's generated/ beside the fusegen package in use, else the installed `fusegen.ops`.
    `caller` names the call in the error for a missing module."""
    if generated is None:
        beside = Path(__file__).resolve().parent.parent.parent / "generated"
        if not all((beside / f"{name}.py").is_file() for name in names):
            # Installed from a wheel: generated/ is fusegen.ops. (A checkout takes its own
            # generated/ first, so that its ops always match the fusegen/runtime it imported.)
            return {name: getattr(importlib.import_module(f"fusegen.ops.{name}"), name) for name in sorted(names)}
        generated = beside
    folder = Path(generated).resolve()
    missing = [name for name in sorted(names) if not (folder / f"{name}.py").is_file()]
    if missing:
        raise FileNotFoundError(f"{caller}: no generated module {', '.join(missing)} in {folder}; run `fusegen build`")
    # Imported as `<folder name>.<op>` with its parent on sys.path, as fusegen.bench does, so
    # that a process importing `generated.<op>` elsewhere (the tests) shares the module.
    if str(folder.parent) not in sys.path:
        sys.path.insert(0, str(folder.parent))
    return {name: getattr(importlib.import_module(f"{folder.name}.{name}"), name) for name in sorted(names)}
