"""The last stage: generated text checked (it parses, compiles and reads only names it
defines) and written atomically, only where its bytes changed; plus the backend-neutral
templates (the generated package's __init__.py, `fusegen new`'s starter spec)."""
from __future__ import annotations

import ast
import textwrap
import builtins
import functools
import os
import symtable
import tempfile
from pathlib import Path

import jinja2

from . import templating
from .spec import OpSpec

_TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "templates"


@functools.cache
def _template_environment() -> jinja2.Environment:
    # A checkout has templates/ beside the package; an installed package carries them as
    # fusegen.templates (see pyproject.toml).
    if (_TEMPLATE_DIR / "init.py.jinja").is_file():
        return templating.environment(jinja2.FileSystemLoader(str(_TEMPLATE_DIR)))
    return templating.package_environment("fusegen.templates")


def render_starter_spec(name: str) -> str:
    """A commented spec for `fusegen new NAME` that builds as it is."""
    return _template_environment().get_template("new_spec.yaml.jinja").render(name=name)


def render_package_init(specs: list[OpSpec]) -> str:
    return _template_environment().get_template("init.py.jinja").render(
        ops=[
            dict(name=s.name, doc="\n  ".join(textwrap.wrap(f"{s.name}: {s.doc}", width=96))[len(s.name) + 2:])
            for s in sorted(specs, key=lambda s: s.name)
        ]
    )


class GeneratedCodeError(Exception):
    """The generator produced a module that does not parse or compile: a fusegen bug."""


def check_module(text: str, filename: str) -> None:
    """The generated module parses, compiles, and every name it reads is defined: by the
    module, its imports, the enclosing function, Python's builtins, or Python for every module
    (__file__)."""
    try:
        tree = ast.parse(text, filename=filename)
        compile(tree, filename, "exec")
        table = symtable.symtable(text, filename, "exec")
    except SyntaxError as exc:
        raise GeneratedCodeError(f"{filename}:{exc.lineno}: generated code does not parse: {exc.msg}") from None
    defined = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}
    # A function that reads a name `super` (a spec's input may be named so) gets an
    # implicit __class__ reference from Python's symbol table.
    defined |= set(dir(builtins)) | {"__class__", "__file__"}  # and a module's own path
    for scope in _scopes(table):
        for symbol in scope.get_symbols():
            if symbol.is_referenced() and (symbol.is_global() or scope is table) and symbol.get_name() not in defined:
                raise GeneratedCodeError(
                    f"{filename}: generated code reads '{symbol.get_name()}', which nothing defines (in {scope.get_name()})"
                )


def _scopes(table: symtable.SymbolTable):
    yield table
    for child in table.get_children():
        yield from _scopes(child)


def write_if_changed(path: Path, text: str) -> bool:
    """Write atomically (temp file + rename) and only when the bytes differ; True if written."""
    data = text.encode("utf-8")
    if path.is_file() and path.read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return True
