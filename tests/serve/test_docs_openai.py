"""docs/serve.md's `openai` client example, run as written against simulated engines
behind `kvevents serve` (only the service's address is changed to the test's port)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from ._procs import serve, sim_engines, wait_until

DOC = Path(__file__).resolve().parents[2] / "docs" / "serve.md"


def openai_example() -> str:
    """The first Python block of docs/serve.md that imports the `openai` client."""
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S):
        if "from openai import OpenAI" in block:
            return str(block)
    raise AssertionError("docs/serve.md has no openai example")


def test_the_openai_example_of_the_serve_guide_runs() -> None:
    pytest.importorskip("openai")
    import httpx

    code = openai_example()
    assert "http://127.0.0.1:8031/v1" in code
    engines, specs = sim_engines(2)
    service, url = serve(specs)
    try:
        wait_until(lambda: httpx.get(url + "/readyz").status_code == 200, what="readyz")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code.replace("http://127.0.0.1:8031", url), str(DOC), "exec"), {})
        content, cached = out.getvalue().rsplit(" ", 1)
        assert content.strip()  # the engine's answer
        assert int(cached) >= 0  # usage.prompt_tokens_details.cached_tokens came through
    finally:
        service.stop()
        engines.stop()
