"""The simulated engines' tokenizer and chat template: deterministic and prefix-stable.

Text splits into pieces, each a run of non-space characters with the whitespace after
it (``"\\S+\\s*"``; leading whitespace is a piece of its own).  A piece's token id is a
hash of its text, so no vocabulary file is needed and the same text always gives the
same ids.  The split is *prefix-stable*: when text ``A`` ends in whitespace and ``B``
starts with a non-space character, ``encode(A + B) == encode(A) + encode(B)``.

The chat template renders each message as ``<|ROLE|>\\n`` + content + ``\\n`` and, with
``add_generation_prompt``, ends with ``<|assistant|>\\n``.  Every message ends in a newline
and starts with ``<|``, so a conversation's next turn starts with the tokens of the
previous turn's prompt, exactly: that is what makes multi-turn prefix reuse visible.

The file form (:meth:`SimTokenizer.save`, :func:`load_sim_tokenizer`) is a small JSON
object ``{"type": "kvevents-sim-tokenizer", "vocab_size": V}`` that ``kvevents serve
--tokenizer`` accepts.

A core module (it imports only :mod:`kvevents.errors`): the simulator's engines and
``kvevents serve`` both tokenize with it, and the service must not load the simulator to
do so.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from kvevents.errors import ConfigError

__all__ = ["TOKENIZER_TYPE", "SimTokenizer", "load_sim_tokenizer", "message_text"]

TOKENIZER_TYPE = "kvevents-sim-tokenizer"
_PIECE = re.compile(r"\S+\s*|\s+")


class SimTokenizer:
    """Hash tokenizer over whitespace-delimited pieces; ids in ``[1, vocab_size)``."""

    def __init__(self, vocab_size: int = 32_000) -> None:
        if vocab_size < 2:
            raise ConfigError("vocab_size must be >= 2")
        self.vocab_size = vocab_size
        self._cache: dict[str, int] = {}

    def piece_id(self, piece: str) -> int:
        """The token id of one piece."""
        tid = self._cache.get(piece)
        if tid is None:
            digest = hashlib.blake2b(piece.encode(), digest_size=8).digest()
            tid = 1 + int.from_bytes(digest, "big") % (self.vocab_size - 1)
            if len(self._cache) < 1_000_000:
                self._cache[piece] = tid
        return tid

    def pieces(self, text: str) -> list[str]:
        return _PIECE.findall(text)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        return [self.piece_id(p) for p in _PIECE.findall(text)]

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """The chat template.  Raises :class:`ConfigError` for a malformed message."""
        out: list[str] = []
        for i, msg in enumerate(messages):
            if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str):
                raise ConfigError(f"messages[{i}] must be an object with a string 'role'")
            text = message_text(msg.get("content"), f"messages[{i}].content")
            out.append(f"<|{msg['role']}|>\n{text}")
            if not (continue_final_message and i == len(messages) - 1):
                out.append("\n")
        if add_generation_prompt and not continue_final_message:
            out.append("<|assistant|>\n")
        return "".join(out)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Token ids of the rendered chat."""
        return self.encode(
            self.render_chat(
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
            )
        )

    def generate(self, prompt: Sequence[int], n: int, seed: int = 0) -> list[tuple[str, int]]:
        """``n`` output pieces (text, id) chosen deterministically from the prompt: the
        same prompt always gets the same answer."""
        h = hashlib.blake2b(digest_size=8)
        h.update(seed.to_bytes(8, "big", signed=True))
        h.update(len(prompt).to_bytes(8, "big"))
        for t in prompt[-64:]:
            h.update(int(t).to_bytes(8, "big"))
        rng = random.Random(int.from_bytes(h.digest(), "big"))
        out = []
        for _ in range(n):
            piece = f"w{rng.randrange(100_000)} "
            out.append((piece, self.piece_id(piece)))
        return out

    def save(self, path: str) -> None:
        """Write the tokenizer file ``kvevents serve --tokenizer`` reads."""
        with open(path, "w") as f:
            json.dump({"type": TOKENIZER_TYPE, "vocab_size": self.vocab_size}, f)


def message_text(content: Any, where: str = "content") -> str:
    """The text of a message's ``content``: a string, or OpenAI's list of parts (text
    parts joined; each non-text part rendered as ``<|TYPE|>``)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise ConfigError(f"{where}[{j}] must be an object with a string 'type'")
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise ConfigError(f"{where}[{j}].text must be a string")
                parts.append(part["text"])
            else:
                parts.append(f"<|{part['type']}|>")
        return "".join(parts)
    raise ConfigError(f"{where} must be a string or a list of parts")


def load_sim_tokenizer(data: Mapping[str, Any]) -> SimTokenizer:
    """A :class:`SimTokenizer` from its file's JSON object."""
    if data.get("type") != TOKENIZER_TYPE:
        raise ConfigError(f"not a {TOKENIZER_TYPE} file")
    vocab = data.get("vocab_size", 32_000)
    if not isinstance(vocab, int):
        raise ConfigError("vocab_size must be an integer")
    return SimTokenizer(vocab)
