"""The compiled content keys equal the Python chain for any tokens, unit and root, and
refuse what the Python chain refuses with the same error.  Skipped without
``kvevents-native``."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

kn = pytest.importorskip("kvevents_native")

import kvevents.consumers.content as content  # noqa: E402
from kvevents.errors import ConfigError  # noqa: E402

i64 = st.integers(-(2**63), 2**63 - 1)


def both(fn: Any) -> tuple[Any, Any]:
    """``fn()`` with the compiled keys, then with the Python ones (result or error type)."""
    out = []
    saved = content.NATIVE
    for core in (kn, None):
        content.NATIVE = core
        try:
            out.append(fn())
        except Exception as exc:  # compared by type below
            out.append(type(exc))
        finally:
            content.NATIVE = saved
    return out[0], out[1]


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.one_of(i64, st.integers(0, 50_000)), max_size=200),
    st.sampled_from([1, 2, 3, 16, 64]),
    st.one_of(st.none(), st.text(max_size=5)),
    st.one_of(st.none(), st.text(max_size=5)),
)
def test_prompt_keys_equal_the_python_chain(
    tokens: list[int], unit: int, lora: str | None, salt: str | None
) -> None:
    native, python = both(lambda: content.prompt_keys(tokens, unit, lora, salt))
    assert native == python


@pytest.mark.parametrize("tokens", [[1, 2.0], [2**63], [-(2**63) - 1], [1, "2"], [None], [True, 3]])
def test_bad_token_ids_fail_alike(tokens: list[Any]) -> None:
    native, python = both(lambda: content.prompt_keys(tokens, 1))
    assert native == python
    if native is not ConfigError:  # bools are ints to both
        assert tokens == [True, 3]


def test_tuples_and_numpy_ints_are_tokens_too() -> None:
    np = pytest.importorskip("numpy")
    toks = list(range(64))
    want = both(lambda: content.prompt_keys(toks, 16))[1]
    assert both(lambda: content.prompt_keys(tuple(toks), 16)) == (want, want)
    arr = np.arange(64, dtype=np.int64)
    assert both(lambda: content.prompt_keys(arr, 16)) == (want, want)
