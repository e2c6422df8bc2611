"""vLLM-compatible hashing (C§4.1, C§8.3, C§9.9) and the router's content keys."""

from __future__ import annotations

import pytest

from kvevents.errors import ConfigError
from kvevents.hashing import (
    hash_block_tokens,
    hash_request_blocks,
    none_hash,
    to_wire_hash,
)


@pytest.fixture(autouse=True)
def _no_pythonhashseed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


@pytest.mark.parametrize(
    ("algo", "none_hex", "wires", "with_extra"),
    [
        (
            "sha256",
            "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
            [1882140585328457242, 15284023028817948126],
            15151224189724617921,
        ),
        (
            "sha256_cbor",
            "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
            [9561501211280363793, 15292913576410714033],
            9577358887296308044,
        ),
    ],
)
def test_contract_hash_vectors(algo: str, none_hex: str, wires: list[int], with_extra: int) -> None:
    assert none_hash(algo).hex() == none_hex
    assert [to_wire_hash(d) for d in hash_request_blocks(list(range(1, 9)), 4, algo=algo)] == wires
    extra = (("lora", "my-lora", "/p"), ("cache_salt", "s"))
    assert to_wire_hash(hash_block_tokens(None, [1, 2, 3, 4], extra, algo=algo)) == with_extra


def test_sha256_cbor_64_tokens_block_16() -> None:
    assert [to_wire_hash(d) for d in hash_request_blocks(list(range(100, 164)), 16)] == [
        10428775992902877628,
        8101442038445348984,
        9222808348315984622,
        10472129487708613277,
    ]


def test_pythonhashseed_changes_the_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert none_hash("sha256_cbor").hex().startswith("4e1195df")


def test_empty_pythonhashseed_is_a_set_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM tests ``os.getenv("PYTHONHASHSEED") is None``: a variable set to "" (e.g. a
    # container's ``ENV PYTHONHASHSEED=``) seeds NONE_HASH with "", not the default.
    import hashlib

    import cbor2

    monkeypatch.setenv("PYTHONHASHSEED", "")
    expected = hashlib.sha256(cbor2.dumps("", canonical=True)).digest()
    assert none_hash("sha256_cbor") == expected
    first = hash_request_blocks([1, 2, 3, 4], 4)[0]
    assert first == hash_block_tokens(None, [1, 2, 3, 4], none=expected)


def test_wire_hash_is_last_8_bytes() -> None:
    digest = bytes.fromhex("52a7f141" + "00" * 20 + "1a1eb4e3edd9361a")
    assert to_wire_hash(digest) == 1882140585328457242


def test_unknown_algorithm() -> None:
    with pytest.raises(ConfigError, match="sha256_cbor"):
        none_hash("md5")
