"""The Jinja environment every template of fusegen renders in: templates hold layout only,
so a variable not given is an error (StrictUndefined), and blocks leave no stray lines.

One environment per template folder for the process (`package_environment`): Jinja keeps
each template compiled in its environment (about 70 ms a build to compile them again), and
reloads one whose file has changed since."""
from __future__ import annotations

import functools
import os
from importlib import resources

import jinja2


def environment(loader: jinja2.BaseLoader) -> jinja2.Environment:
    return jinja2.Environment(
        loader=loader,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


@functools.cache
def package_environment(package: str, folder: str = "") -> jinja2.Environment:
    """The environment of the templates in `package`'s `folder` (package data: files in a
    checkout or an installed package, or inside a zip)."""
    root = resources.files(package)
    if folder:
        root = root.joinpath(folder)

    def load(name: str):
        resource = root.joinpath(name)
        text = resource.read_text(encoding="utf-8")
        path = os.fspath(resource) if isinstance(resource, os.PathLike) else None
        if path is None:  # not a file (a zip): as it is for the process
            return text, None, lambda: True
        mtime = os.path.getmtime(path)
        return text, path, lambda: _mtime(path) == mtime

    return environment(jinja2.FunctionLoader(load))


def _mtime(path: str) -> float | None:
    try:
        return os.path.getmtime(path)
    except OSError:
        return None
