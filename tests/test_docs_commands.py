"""Every shell command of README.md and docs/*.md is run or checked, so the docs cannot
drift from the command line.

A shell block (```` ```console ````, ```` ```bash ````, or a plain fence holding
``kvevents ...`` or ``python examples/...`` lines) carries a marker on the line just above
its opening fence:

* ``<!-- check -->``: a ```` ```console ```` block that is run.  Each ``$ COMMAND`` line
  (a trailing ``\\`` continues it) runs with bash, in order, in a scratch directory that
  links ``examples/`` (``kvevents`` is this tree's command line, ``nats-server`` the one
  beside the test's Python).  The lines after a command are its output, stdout and
  stderr together, compared line by line: ``…`` inside a line matches any text, a line
  holding only ``…`` any number of lines.  Under ``<!-- check: numbers vary -->`` every
  number matches any number too (timings, rates, hit rates of a racing workload).  ``  # exit N`` after a command is its exit
  status (default 0).  A command ending in ``&`` runs in the background (waited for until
  it prints a line or writes the file its ``>`` names) and is stopped when the block ends.
* ``<!-- recipe -->``: a block that needs what a test machine lacks (real engines, fixed
  hosts, minutes).  It is not run, but each ``kvevents`` command in it is parsed by the
  real parser and each ``--option`` of an ``examples/`` script must be in its ``--help``.

docs/benchmarks.md is left out: its commands are the benchmarks, which CI runs itself.
"""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvevents.cli.parser import build_parser

REPO = Path(__file__).resolve().parents[1]
DOCS = [
    REPO / "README.md",
    *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "benchmarks.md"),
]
FENCE = re.compile(r"^```([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
SHELL = {"console", "bash", "sh", "shell"}
CHECK, RECIPE = "<!-- check -->", "<!-- recipe -->"
CHECK_NUMBERS = "<!-- check: numbers vary -->"
ELLIPSIS = "…"


@dataclass
class Block:
    where: str
    lang: str
    body: str
    marker: str | None


def blocks() -> list[Block]:
    out = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            lang, body = m.group(1), m.group(2)
            commands = any(
                ln.removeprefix("$ ").startswith(("kvevents ", "python examples/"))
                for ln in body.splitlines()
            )
            if lang not in SHELL and not (lang == "" and commands):
                continue
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
            marker = before if before in (CHECK, CHECK_NUMBERS, RECIPE) else None
            where = f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}"
            out.append(Block(where, lang, body, marker))
    return out


BLOCKS = blocks()


def test_every_shell_block_is_run_or_checked() -> None:
    unmarked = [b.where for b in BLOCKS if b.marker is None]
    assert not unmarked, f"mark these with {CHECK} or {RECIPE} on the line above: {unmarked}"
    assert sum(b.marker in (CHECK, CHECK_NUMBERS) for b in BLOCKS) >= 10


# --- parsing a console block ------------------------------------------------------------


@dataclass
class Step:
    command: str
    expected: list[str]
    status: int
    background: bool


_EXIT = re.compile(r"\s+#\s*exit (\d+)\s*$")


def steps(body: str) -> list[Step]:
    out: list[Step] = []
    lines = body.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith("$ "):
            assert out, f"output before the first command: {line!r}"
            out[-1].expected.append(line)
            i += 1
            continue
        cmd = line[2:]
        while cmd.endswith("\\") and i + 1 < len(lines):
            i += 1
            cmd = cmd[:-1] + " " + lines[i].strip()
        status = 0
        m = _EXIT.search(cmd)
        if m:
            status, cmd = int(m.group(1)), cmd[: m.start()]
        cmd = re.sub(r"\s+#[^'\"]*$", "", cmd).rstrip()  # a trailing comment for the reader
        background = cmd.endswith("&")
        out.append(Step(cmd.rstrip("&").rstrip(), [], status, background))
        i += 1
    return out


_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def _line_pattern(line: str, numbers_vary: bool) -> str:
    parts = []
    for part in line.rstrip().split(ELLIPSIS):
        if numbers_vary:
            pieces = _NUMBER.split(part)
            parts.append(
                r"\s*\d[\d,]*(?:\.\d+)?".join(
                    re.escape(p.rstrip()) + r"\s*" if p.endswith(" ") else re.escape(p)
                    for p in pieces
                )
            )
        else:
            parts.append(re.escape(part))
    return ".*?".join(parts)


def matches(expected: list[str], got: list[str], numbers_vary: bool = False) -> bool:
    """Line-by-line match with ``…`` wildcards (see the module docstring); with
    ``numbers_vary`` every number matches any number (and the spaces that align it)."""
    if not expected:
        return not got
    head, rest = expected[0], expected[1:]
    if head.strip() == ELLIPSIS:
        return any(matches(rest, got[k:], numbers_vary) for k in range(len(got) + 1))
    if not got:
        return False
    pattern = _line_pattern(head, numbers_vary)
    return re.fullmatch(pattern, got[0].rstrip()) is not None and matches(
        rest, got[1:], numbers_vary
    )


@pytest.fixture
def scratch(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shim = bindir / "kvevents"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m kvevents "$@"\n')
    shim.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    (work / "examples").symlink_to(REPO / "examples")
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PATH": f"{bindir}:{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        "COLUMNS": "100",
        "NO_COLOR": "1",
    }
    return work, env


def _wait_started(proc: subprocess.Popen[bytes], out: Path, target: Path | None) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"background command exited {proc.returncode}: {out.read_text()}")
        if out.stat().st_size > 0 or (
            target is not None and target.exists() and target.stat().st_size
        ):
            return
        time.sleep(0.05)  # polling a file another process writes
    raise AssertionError("background command printed nothing in 60 s")


CHECKED = [b for b in BLOCKS if b.marker in (CHECK, CHECK_NUMBERS)]


@pytest.mark.parametrize("block", CHECKED, ids=[b.where for b in CHECKED])
def test_checked_block_runs_as_shown(block: Block, scratch: tuple[Path, dict[str, str]]) -> None:
    work, env = scratch
    background: list[subprocess.Popen[bytes]] = []
    # The blocks use the fixed ports a reader would type: two runs of this test on one
    # machine (worktrees side by side) take turns instead of colliding.
    lock = open(Path(tempfile.gettempdir()) / "kvevents-docs-commands.lock", "w")  # noqa: SIM115
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        for n, step in enumerate(steps(block.body)):
            if step.background:
                log = work / f".bg{n}.log"
                redirect = re.search(r">\s*(\S+)\s*$", step.command)
                target = work / redirect.group(1) if redirect else None
                with open(log, "wb") as fh:
                    proc = subprocess.Popen(
                        ["bash", "-c", step.command],
                        cwd=work,
                        env=env,
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                background.append(proc)
                _wait_started(proc, log, target)
                continue
            got = subprocess.run(
                ["bash", "-c", step.command],
                cwd=work,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=180,
            )
            lines = got.stdout.splitlines()
            assert got.returncode == step.status, (
                f"{block.where}: `{step.command}` exited {got.returncode}:\n{got.stdout}"
            )
            assert matches(step.expected, lines, block.marker == CHECK_NUMBERS), (
                f"{block.where}: `{step.command}` printed:\n{got.stdout}\n"
                "expected:\n" + "\n".join(step.expected)
            )
    finally:
        for proc in reversed(background):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        lock.close()  # releases the lock


# --- recipes ----------------------------------------------------------------------------


def recipe_commands(body: str) -> list[list[str]]:
    out = []
    joined = re.sub(r"\\\n\s*", " ", body)
    for line in joined.splitlines():
        line = line.strip().removeprefix("$ ")
        if not line.startswith(("kvevents ", "python examples/")):
            continue
        line = re.sub(r"\s+#.*$", "", line).rstrip("&").strip()
        line = re.sub(r"\$\(cat [^)]*\)", "--engine a=http://h:1,tcp://h:5557", line)
        out.append(shlex.split(line.split(" | ")[0].split(" > ")[0]))
    return out


RECIPES = [b for b in BLOCKS if b.marker == RECIPE]


@pytest.mark.parametrize("block", RECIPES, ids=[b.where for b in RECIPES])
def test_recipe_commands_use_real_options(block: Block) -> None:
    for argv in recipe_commands(block.body):
        if argv[0] == "kvevents":
            try:
                build_parser().parse_args(argv[1:])
            except SystemExit as exc:
                raise AssertionError(f"{block.where}: {' '.join(argv)} does not parse") from exc
        else:
            script = REPO / argv[1]
            assert script.exists(), f"{block.where}: no {argv[1]}"
            help_text = subprocess.run(
                [sys.executable, str(script), "--help"],
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONPATH": str(REPO)},
                cwd=REPO,
                timeout=60,
            ).stdout
            for opt in (a.split("=")[0] for a in argv[2:] if a.startswith("--")):
                assert opt in help_text, f"{block.where}: {argv[1]} has no {opt}"


def test_the_matcher() -> None:
    assert matches(["a …", "…", "z"], ["a b", "x", "y", "z"])
    assert matches(["…"], [])
    assert matches(["kv  79.4%  25,424 x"], ["kv   8.1%     424 x"], numbers_vary=True)
    assert not matches(["kv 79.4% x"], ["kv 79.4% y"], numbers_vary=True)
    assert not matches(["a"], ["a", "b"])
    assert steps("$ kvevents x --y \\\n    --z  # exit 2\nboom\n$ b &")[0].status == 2
