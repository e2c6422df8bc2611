"""The README's main command (the first one a newcomer runs) installs no torch, and the
demo it runs works, silently, in an install without torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def main_command() -> str:
    """The first ``bash`` block of the README."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block is not None
    return block.group(1).strip()


def requirement_names(extras: list[str]) -> set[str]:
    """Every distribution ``pip install -e ".[EXTRAS]"`` asks for by name: the core
    dependencies and those of each extra, the extras it names of itself followed."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    names: set[str] = set()
    todo, seen = list(extras), set()
    reqs = list(project["dependencies"])
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        reqs += optional[extra]
    for req in reqs:
        name = re.match(r"[A-Za-z0-9_.-]+", req)
        assert name is not None, req
        inner = re.match(r"kvevents\[([^\]]+)\]", req)
        if inner:
            names |= requirement_names(inner.group(1).split(","))
        else:
            names.add(name.group(0).lower())
    return names


def test_the_main_command_installs_no_torch() -> None:
    cmd = main_command()
    m = re.fullmatch(
        r'python -m pip install (?:--[a-z-]+ )*-e "\.\[([a-z,]+)\]" && kvevents demo --quick', cmd
    )
    assert m is not None, cmd
    names = requirement_names(m.group(1).split(","))
    assert {"msgspec", "pyzmq", "matplotlib", "uvicorn"} <= names  # what the demo needs
    assert not names & {"torch", "nats-py", "selenium", "pytest", "hypothesis"}, names


def test_the_demo_path_imports_no_torch() -> None:
    """``kvevents demo --quick`` where torch cannot be found (as after the main command):
    it finishes, prints its one ``note:``, warns about nothing and never loads torch."""
    code = (
        "import json, sys\n"
        "from importlib.machinery import PathFinder\n"
        "class NoTorch(PathFinder):  # the path finder, blind to torch as if not installed\n"
        "    @classmethod\n"
        "    def find_spec(cls, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch':\n"
        "            return None\n"
        "        return PathFinder.find_spec(name, path, target)\n"
        "sys.meta_path[:] = [NoTorch if f is PathFinder else f for f in sys.meta_path]\n"
        "from kvevents.cli import main\n"
        "rc = main(sys.argv[1:])\n"
        "print(json.dumps({'rc': rc, 'torch': 'torch' in sys.modules}))\n"
    )
    args = ["demo", "--quick", "--requests", "24", "--policy", "kv-aware", "--plot", "", "-q"]
    res = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    *report, last = res.stdout.strip().splitlines()
    assert json.loads(last) == {"rc": 0, "torch": False}
    assert any(line.startswith("note: CPU tier without byte copies") for line in report)
