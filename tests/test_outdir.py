"""The output folder of `fusegen build`: a user's files are never replaced, a build is all or
nothing (a failed write, a kill, a build at the same time), and a bad -o is one line."""
import ast
import errno
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from fusegen import cli

ROOT = Path(__file__).resolve().parent.parent
SMALL = ("gelu", "add_relu", "swiglu")  # quick to build


@pytest.fixture
def project(tmp_path, monkeypatch):
    """specs/ with three small specs built into gen/, and extra/my_op.yaml (not built)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "specs").mkdir()
    for name in SMALL:
        shutil.copy(ROOT / "specs" / f"{name}.yaml", tmp_path / "specs")
    (tmp_path / "extra").mkdir()
    text = (ROOT / "specs" / "gelu.yaml").read_text()
    (tmp_path / "extra" / "my_op.yaml").write_text(text.replace("name: gelu", "name: my_op"))
    assert cli.main(["build", "specs", "-o", "gen"]) == 0
    return tmp_path


def _change_every_spec(project: Path, new_op: str | None = None) -> None:
    """Every module of specs/ differs from gen/'s (their docs change); `new_op` adds a spec."""
    for path in (project / "specs").iterdir():
        text = path.read_text()
        path.write_text(text.replace("\ndoc: ", "\ndoc: changed, ", 1))
    if new_op:
        text = (project / "specs" / "gelu.yaml").read_text()
        (project / "specs" / f"{new_op}.yaml").write_text(text.replace("name: gelu", f"name: {new_op}"))


def _snapshot(folder: Path) -> dict[str, bytes]:
    """Every entry, hidden ones included, with its bytes."""
    return {p.name: p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(folder.iterdir())}


def _listed(init: Path) -> tuple[str, ...]:
    tree = ast.parse(init.read_text())
    return next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign))


def _one_line(err: str) -> bool:
    return err.endswith("\n") and "\n" not in err[:-1]


def _fusegen(*args: str, cwd: Path, **kwargs) -> subprocess.Popen:
    """`python -m fusegen ARGS` from this checkout, in another process."""
    return subprocess.Popen([sys.executable, *args], cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


# -- item 7: a user's file is never replaced


@pytest.mark.parametrize("name", ["__init__.py", "gelu.py"])
def test_a_build_refuses_to_replace_a_file_fusegen_did_not_write(tmp_path, monkeypatch, capsys, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / name).write_text("# my own, written by hand\nVALUE = 1\n")
    before = _snapshot(tmp_path / "mine")
    assert cli.main(["build", str(ROOT / "specs" / "gelu.yaml"), "-o", "mine"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert _one_line(captured.err) and captured.err.startswith(f"{Path('mine') / name}: not fusegen's")
    assert _snapshot(tmp_path / "mine") == before  # nothing written, not even the other file


def test_fusegen_files_are_replaced_as_before(project):
    gelu = project / "gen" / "gelu.py"
    gelu.write_text(gelu.read_text().replace("import torch\n", "import torch  # edited\n"))  # its header stays
    assert cli.main(["build", "specs", "-o", "gen"]) == 0
    assert cli.main(["check", "specs", "-o", "gen"]) == 0


# -- item 8: all or nothing


def test_a_write_failing_midway_leaves_the_folder_as_it_was(project, monkeypatch, capsys):
    _change_every_spec(project, new_op="new_op")
    before = _snapshot(project / "gen")
    mkstemp, calls = tempfile.mkstemp, []

    def failing_third(*args, **kwargs):  # the disk fills up at the third file
        calls.append(args)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return mkstemp(*args, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", failing_third)
    capsys.readouterr()
    assert cli.main(["build", "specs", "-o", "gen"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert _one_line(captured.err) and "No space left on device" in captured.err
    assert "the folder is as it was" in captured.err
    assert _snapshot(project / "gen") == before  # no temporary files left either
    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    assert cli.main(["build", "specs", "-o", "gen"]) == 0
    assert cli.main(["check", "specs", "-o", "gen"]) == 0


def test_a_build_killed_while_swapping_is_finished_by_the_next(project):
    """A kill between the renames: each file is whole, __init__.py lists only modules that are
    there, and the next build (of anything) into the folder completes the killed one's set."""
    _change_every_spec(project, new_op="new_op")
    gen = project / "gen"
    code = (
        "import os, signal, sys\n"
        "from fusegen import cli\n"
        "replace, renamed = os.replace, []\n"
        "def killing(src, dst):\n"
        "    if str(dst).endswith('.py'):\n"
        "        renamed.append(dst)\n"
        "        if len(renamed) == 2:\n"
        "            os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return replace(src, dst)\n"
        "os.replace = killing\n"
        "sys.exit(cli.main(['build', 'specs', '-o', 'gen']))\n"
    )
    process = _fusegen("-c", code, cwd=project)
    process.communicate(timeout=120)
    assert process.returncode == -9
    listed = _listed(gen / "__init__.py")
    assert "new_op" not in listed  # the old __init__.py, whose modules are all there
    for name in listed:
        ast.parse((gen / f"{name}.py").read_text())  # whole
    changed = [name for name in listed if "changed, " in (gen / f"{name}.py").read_text()]
    assert changed == ["add_relu"]  # the killed build's first rename only: mixed, for now
    assert cli.main(["build", "extra/my_op.yaml", "-o", "gen"]) == 0
    assert cli.main(["check", "specs", "extra/my_op.yaml", "-o", "gen"]) == 0
    assert sorted(p.name for p in gen.iterdir()) == [
        "__init__.py", "add_relu.py", "gelu.py", "my_op.py", "new_op.py", "swiglu.py"
    ]  # nothing staged is left behind


def test_a_build_waits_for_another_and_plans_after_it(project):
    """While the folder is held (as by another build), a build waits; it then reads the folder
    as the other left it: add_relu.py, removed meanwhile, is not listed."""
    gen = project / "gen"
    fd = os.open(gen, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        process = _fusegen("-m", "fusegen", "build", "extra/my_op.yaml", "-o", "gen", cwd=project)
        err: list[str] = []
        reader = threading.Thread(target=lambda: err.extend(process.stderr), daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        while not err and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert err == ["fusegen: waiting for another build into gen\n"]
        assert process.poll() is None and not (gen / "my_op.py").exists()
        (gen / "add_relu.py").unlink()  # the other build's doing
    finally:
        os.close(fd)
    assert process.wait(timeout=120) == 0
    assert _listed(gen / "__init__.py") == ("gelu", "my_op", "swiglu")


def test_two_builds_at_once_end_consistent(project):
    _change_every_spec(project)
    builds = [
        _fusegen("-m", "fusegen", "build", "specs", "-o", "gen", cwd=project),
        _fusegen("-m", "fusegen", "build", "extra/my_op.yaml", "-o", "gen", cwd=project),
    ]
    assert [b.wait(timeout=120) for b in builds] == [0, 0]
    gen = project / "gen"
    modules = sorted(p.stem for p in gen.glob("*.py") if p.name != "__init__.py")
    assert list(_listed(gen / "__init__.py")) == modules == ["add_relu", "gelu", "my_op", "swiglu"]
    assert cli.main(["check", "specs", "extra/my_op.yaml", "-o", "gen"]) == 0


# -- item 11: -o that cannot be an output folder


@pytest.mark.parametrize("command", ["build", "check"])
@pytest.mark.parametrize("out", ["afile", "afile/sub", "/dev/null", ""])
def test_an_out_that_is_no_folder_is_one_line(tmp_path, monkeypatch, capsys, command, out):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("mine\n")
    before = _snapshot(tmp_path)
    assert cli.main([command, str(ROOT / "specs" / "gelu.yaml"), "-o", out]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and _one_line(captured.err)
    assert captured.err.startswith(f"{out}: " if out else "-o '': an empty path")
    assert _snapshot(tmp_path) == before  # "" did not write into the current folder


def test_an_unwritable_folder_is_one_line(tmp_path, monkeypatch, capsys):
    """A read-only folder (root writes into one anyway, so the refusal is simulated)."""
    def refused(*args, dir=None, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), dir)

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ro").mkdir()
    monkeypatch.setattr(tempfile, "mkstemp", refused)
    assert cli.main(["build", str(ROOT / "specs" / "gelu.yaml"), "-o", "ro/new"]) == 2
    err = capsys.readouterr().err
    assert _one_line(err) and "Permission denied" in err
    assert not (tmp_path / "ro" / "new").exists()  # the folder it made is gone again
