"""Names in generated code: spec names stay the user's, and nothing the generator adds can
collide with them.

A `Namer` starts from the names a backend's generated code uses for itself (its imports,
its kernels' own arguments and locals, Python's builtins) and hands out every other name:
the spec's names first, each as written unless the generated code already uses it, then
the names derived from them. A name already taken gets a trailing underscore (rows →
rows_), as PEP 8 suggests for a name that would shadow another.
"""
from __future__ import annotations

import builtins
import keyword

PYTHON_BUILTINS = frozenset(dir(builtins))


class Namer:
    def __init__(self, reserved=()):
        self._taken = set(reserved)

    def claim(self, preferred: str) -> str:
        """`preferred`, or the first of preferred_, preferred__, ... not yet taken; now taken."""
        name = preferred
        while name in self._taken or keyword.iskeyword(name):
            name += "_"
        self._taken.add(name)
        return name

    def taken(self, name: str) -> bool:
        return name in self._taken

    def all_taken(self) -> frozenset[str]:
        """Every name taken so far (the reserved ones too): what a later scope starts from."""
        return frozenset(self._taken)

    def child(self, reserved=()) -> "Namer":
        """A namer for one scope: everything taken here stays taken there, plus `reserved`."""
        namer = Namer(self._taken)
        namer._taken.update(reserved)
        return namer
