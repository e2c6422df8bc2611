"""The user documentation stands alone: it cites nothing a reader of the repository lacks.

``README.md`` and ``docs/*.md`` may cite vLLM (by function or file name) and files of this
repository, never internal specifications (``C§2.5``, ``DESIGN §4``), issues, branches or
commit ids.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])

FORBIDDEN: dict[str, re.Pattern[str]] = {
    "a section sign (C§, DESIGN §)": re.compile("§"),
    "an internal spec": re.compile(r"\b(DESIGN|CONTRACT|HELPERS)(\.md)?\b"),
    "an issue": re.compile(r"\b[Tt]he issue\b|\b[Ii]ssues? ?#?\d+|(?<![\w:/#])#\d+\b"),
    "a branch": re.compile(r"\bbranch `|\bbranch [\w-]+/"),
    "a commit id": re.compile(r"`(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}`"),
    "a path outside the repository": re.compile(r"/work/|\bshared/"),
}


SOURCES = sorted(
    p for top in ("kvevents", "benchmarks", "examples") for p in (REPO / top).rglob("*.py")
)


@pytest.mark.parametrize("top", ["kvevents", "benchmarks", "examples"])
def test_code_cites_vllm_not_internal_specs(top: str) -> None:
    """Docstrings and comments stand alone too: they name vLLM's functions or say the
    fact, never a section of an internal contract (``C§5.3``) or design document."""
    found = [
        f"{path.relative_to(REPO)}:{lineno}: {line.strip()[:100]}"
        for path in SOURCES
        if path.relative_to(REPO).parts[0] == top
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if "§" in line or re.search(r"\b(DESIGN|CONTRACT)\b", line)
    ]
    assert not found, "\n".join(found)


def test_the_docs_are_found() -> None:
    assert REPO / "README.md" in DOCS and len(DOCS) > 5


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_doc_cites_only_what_a_reader_has(path: Path) -> None:
    found = [
        f"{path.name}:{lineno}: {what}: {line.strip()[:100]}"
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        for what, pattern in FORBIDDEN.items()
        if pattern.search(line)
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "as C§2.5 says",
        "see DESIGN §4",
        "the issue asked for 10%",
        "fixed in issue 12",
        "see #14",
        "after the pass (branch `perf`)",
        "the index at `a5d4e71`",
        "from /work/shared/golden",
    ],
)
def test_the_patterns_catch_citations(line: str) -> None:
    assert any(p.search(line) for p in FORBIDDEN.values())


@pytest.mark.parametrize(
    "line",
    [
        "tcp://127.0.0.1:5557#0        287",
        "vLLM's `ZmqEventPublisher._service_replay` answers",
        "hashes=[1298830101561815286]",
        "a design choice",
    ],
)
def test_the_patterns_spare_ordinary_text(line: str) -> None:
    assert not any(p.search(line) for p in FORBIDDEN.values())


# --- the architecture map names only files that exist -------------------------------------

ARCHITECTURE = REPO / "docs" / "architecture.md"
CITED_PATH = re.compile(r"`((?:kvevents|tests|benchmarks|examples|docs)/[^`\s]*)`")


def cited_paths(text: str) -> list[str]:
    """Every backticked repository path (``kvevents/...``, ``tests/...``) in ``text``."""
    return CITED_PATH.findall(text)


def test_the_path_pattern_finds_paths() -> None:
    text = "see `kvevents/codec/` and `kvevents/events.py`, not `kvevents.codec` nor `BlockIndex`"
    assert cited_paths(text) == ["kvevents/codec/", "kvevents/events.py"]


def test_every_path_the_architecture_map_cites_exists() -> None:
    paths = cited_paths(ARCHITECTURE.read_text(encoding="utf-8"))
    assert len(paths) > 30, "the map cites the code by path"
    missing = [
        p
        for p in dict.fromkeys(paths)
        if not (any(REPO.glob(p)) if "*" in p else (REPO / p).exists())
        or (p.endswith("/") and not (REPO / p).is_dir())
    ]
    assert not missing, f"docs/architecture.md cites paths that do not exist: {missing}"


SHORT_NAME = re.compile(r"`(\w+(?:\.py|/))`")


def test_every_file_a_row_of_the_map_names_exists() -> None:
    """A table row names its files by full path once, then by their short names
    (``stores.py``, ``policies/``): each short name is in a folder the row cites."""
    missing = []
    rows = [ln for ln in ARCHITECTURE.read_text(encoding="utf-8").splitlines() if ln[:1] == "|"]
    for row in rows:
        cited = [REPO / p for p in cited_paths(row) if "*" not in p]
        folders = {p if p.is_dir() or str(p).endswith("/") else p.parent for p in cited}
        for name in SHORT_NAME.findall(row):
            if folders and not any((folder / name).exists() for folder in folders):
                missing.append(f"{name} (row: {row[:60]})")
    assert not missing, f"docs/architecture.md names files no row folder holds: {missing}"
