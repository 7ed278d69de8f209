"""Installed, generated/ is the package fusegen.ops: importable from any directory."""
import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMPORT_SWIGLU = "import fusegen.ops; from fusegen.ops.swiglu import swiglu; print(fusegen.ops.__file__)"


def _env(**extra) -> dict:
    # Nothing that points at the checkout: the import must come through the installed package.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INDEX": "1", **extra}


def test_generated_modules_import_nothing_as_generated():
    """Installed as fusegen.ops, a module that imported `generated.x` would fail."""
    for path in sorted((ROOT / "generated").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            assert not [n for n in names if n == "generated" or n.startswith("generated.")], path.name


def test_installed_ops_import_from_another_directory(tmp_path):
    """What `pip install -e .` (CI) gives: fusegen.ops is generated/ of this checkout."""
    result = subprocess.run([sys.executable, "-c", IMPORT_SWIGLU], cwd=tmp_path, env=_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"fusegen.ops not importable (reinstall: pip install -e .):\n{result.stderr}"
    assert Path(result.stdout.strip()) == ROOT / "generated" / "__init__.py"


def test_a_wheel_maps_generated_to_fusegen_ops(tmp_path):
    """A non-editable install: the wheel carries generated/ as fusegen/ops/, templates/ as
    fusegen/templates/ and each backend's templates, and nothing top-level besides fusegen/. Built from a copy of the
    sources, so the checkout gets no build/ folder; no network (no isolation, no deps)."""
    source = tmp_path / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("fusegen", "templates", "generated", "specs"):
        shutil.copytree(ROOT / folder, source / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(source)], check=True, env=_env(), capture_output=True, timeout=120)
    (wheel,) = wheels.glob("fusegen-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.name for p in (ROOT / "generated").glob("*.py")}
    assert {f"fusegen/ops/{m}" for m in modules} <= names
    assert "fusegen/templates/init.py.jinja" in names and "fusegen/cli.py" in names
    assert {f"fusegen/specs/{p.name}" for p in (ROOT / "specs").glob("*.yaml")} <= names
    assert "fusegen/backends/triton/templates/op.py.jinja" in names and "fusegen/bench/running.py" in names
    assert {n.split("/")[0] for n in names if not n.startswith("fusegen-")} == {"fusegen"}

    # Installed from the wheel into a folder of its own, it imports from anywhere.
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, env=_env(), capture_output=True, timeout=120)
    result = subprocess.run([sys.executable, "-c", IMPORT_SWIGLU], cwd=tmp_path, env=_env(PYTHONPATH=str(site)),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == site / "fusegen" / "ops" / "__init__.py"
    # And it builds: the backend finds its templates inside the installed package.
    out = tmp_path / "built"
    result = subprocess.run([sys.executable, "-m", "fusegen", "build", str(ROOT / "specs" / "gelu.yaml"), "-o", str(out)],
                            cwd=tmp_path, env=_env(PYTHONPATH=str(site)), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (out / "gelu.py").read_text(encoding="utf-8") == (ROOT / "generated" / "gelu.py").read_text(encoding="utf-8")
    # Outside a checkout (no ./specs), `show NAME` and `list` read the specs the wheel ships.
    for command in (["show", "swiglu"], ["list"]):
        result = subprocess.run([sys.executable, "-m", "fusegen", *command], cwd=tmp_path,
                                env=_env(PYTHONPATH=str(site)), capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert "swiglu(x, *, out=None)" in result.stdout or result.stdout.startswith("# swiglu: ")
    assert result.stdout.count("\n    ") == len(list((ROOT / "specs").glob("*.yaml")))
