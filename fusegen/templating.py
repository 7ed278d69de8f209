"""The Jinja environment every template of fusegen renders in: templates hold layout only,
so a variable not given is an error (StrictUndefined), and blocks leave no stray lines."""
from __future__ import annotations

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
