"""Every ```python block of README.md and docs/*.md runs as written.

Each block is run on its own (no state from the blocks above it) in a fresh Python
process from the repository root, so it can read ``examples/sample.kvcap``; blocks that
publish or subscribe use real sockets on loopback and must end by themselves.

A block that needs what a test machine does not have (real vLLM engines, a NATS cluster,
fixed hosts) is a *deployment recipe*: put the line ``<!-- recipe -->`` directly above
its opening fence and it is only compiled, not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPE = "<!-- recipe -->"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def snippets() -> list[tuple[str, str, bool]]:
    """(where, code, is a recipe) for every python block of the user docs."""
    out = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
            out.append((f"{path.relative_to(REPO)}:{line}", m.group(1), before == RECIPE))
    return out


SNIPPETS = snippets()


def test_the_docs_have_snippets_to_check() -> None:
    where = {w.split(":")[0] for w, _, _ in SNIPPETS}
    assert "README.md" in where and "docs/publisher.md" in where
    assert sum(not recipe for _, _, recipe in SNIPPETS) >= 6


@pytest.mark.parametrize(
    ("code", "recipe"), [(c, r) for _, c, r in SNIPPETS], ids=[w for w, _, _ in SNIPPETS]
)
def test_snippet_runs_as_written(code: str, recipe: bool, tmp_path: Path) -> None:
    compile(code, "<snippet>", "exec")  # a recipe must at least be valid Python
    if recipe:
        return
    script = tmp_path / "snippet.py"
    script.write_text(code, encoding="utf-8")
    got = subprocess.run(
        [sys.executable, str(script)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert got.returncode == 0, f"stdout:\n{got.stdout}\nstderr:\n{got.stderr}"
