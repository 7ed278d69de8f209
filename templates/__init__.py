"""Lets setuptools ship templates/ as the package fusegen.templates (see pyproject.toml)."""
