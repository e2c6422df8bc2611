"""Event-side extra keys of a request's blocks, as vLLM's ``to_event_extra_keys`` gives them."""

from __future__ import annotations

import hashlib

import pytest

from kvevents import MMFeature, RequestKey
from kvevents.errors import ConfigError
from kvevents.request import block_extra_keys, embeds_digest


def test_plain_tokens_have_no_extra_keys() -> None:
    key = RequestKey(list(range(64)))
    assert not key.has_extras
    assert block_extra_keys(key, 0, 16) is None


def test_lora_on_every_block() -> None:
    # vLLM's _gen_lora_extra_hash_keys: the adapter name goes on every block
    key = RequestKey(list(range(64)), lora_name="my-lora")
    assert [block_extra_keys(key, s, s + 16) for s in (0, 16, 32)] == [("my-lora",)] * 3


def test_salt_only_on_the_block_at_token_0() -> None:
    key = RequestKey(list(range(64)), cache_salt="s")
    assert block_extra_keys(key, 0, 16) == ("s",)
    assert block_extra_keys(key, 16, 32) is None
    # an empty salt is no salt (vLLM tests the salt's truth)
    assert not RequestKey([1], cache_salt="").has_extras


def test_multimodal_offsets_are_relative_to_the_block() -> None:
    # an image at tokens [20, 40): blocks [16,32) (offset 4) and [32,48) (offset -12)
    key = RequestKey(list(range(64)), mm_features=[MMFeature("img", 20, 20)])
    assert block_extra_keys(key, 0, 16) is None
    assert block_extra_keys(key, 16, 32) == (("img", 4),)
    assert block_extra_keys(key, 32, 48) == (("img", -12),)
    assert block_extra_keys(key, 48, 64) is None
    # at 32-token blocks the same image is at offset 20 of block [0, 32)
    assert block_extra_keys(key, 0, 32) == (("img", 20),)


def test_two_images_in_one_block_and_order_of_all_kinds() -> None:
    rows = [bytes([i]) * 8 for i in range(32)]
    key = RequestKey(
        list(range(32)),
        lora_name="a",
        cache_salt="salt",
        mm_features=[("b", 10, 2), ("a", 2, 4)],  # unsorted on purpose
        prompt_embeds=rows,
    )
    digest = hashlib.sha256(b"".join(rows[0:16])).digest()
    # the order of vLLM's to_event_extra_keys: lora, mm..., salt, prompt embeds
    assert block_extra_keys(key, 0, 16) == ("a", ("a", 2), ("b", 10), "salt", digest)
    assert embeds_digest(lambda s, e: b"%d-%d" % (s, e), 16, 32) == b"16-32"


def test_bad_placeholder_range() -> None:
    with pytest.raises(ConfigError):
        RequestKey([1, 2], mm_features=[MMFeature("x", 0, 0)])
