"""Tokenising a request exactly as its engine will, and building its request key.

By default the service asks an engine's own ``POST /tokenize`` (vLLM serves it for a
``prompt`` and, with the model's chat template, for ``messages``), passing on the fields
that change the tokens (``add_special_tokens``, ``add_generation_prompt``,
``continue_final_message``, ``chat_template``, ``chat_template_kwargs``, ``tools``).
With ``--tokenizer FILE`` a local tokenizer is used instead: a kvevents simulator
tokenizer file (prompts and chats), or a Hugging Face ``tokenizer.json`` through the
``tokenizers`` package (prompts only; chats still go to the engine, since the chat
template lives in the engine).

A prompt given as token ids is used as is.  For a batch of prompts the first one routes.

The request key: the tokens; the LoRA adapter when ``model`` names one of the engines'
adapters (a ``/v1/models`` card with a ``parent``); the ``cache_salt``.  Multimodal
inputs are not keyed: their identifiers are content hashes that only the engine's
processor computes, so a request with images is routed on its text tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec

from kvevents.errors import ConfigError, KVEventsError
from kvevents.request import RequestKey
from kvevents.tokenizer import TOKENIZER_TYPE, load_sim_tokenizer

__all__ = ["BadRequest", "LocalTokenizer", "build_key", "tokenize_body"]

_CHAT_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "mm_processor_kwargs",
)


class BadRequest(KVEventsError, ValueError):
    """A request the service cannot route: answered with HTTP ``status`` and OpenAI's
    error body, whose ``param`` names the offending field (None: the body as a whole)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


class LocalTokenizer:
    """A tokenizer loaded from a file (``--tokenizer``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sim: Any = None
        self.hf: Any = None
        try:
            with open(path, "rb") as f:
                data = json.loads(f.read())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read tokenizer {path!r}: {exc}") from exc
        if isinstance(data, Mapping) and data.get("type") == TOKENIZER_TYPE:
            self.sim = load_sim_tokenizer(data)
            return
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ConfigError(
                f"{path!r} is not a kvevents simulator tokenizer; reading a Hugging Face "
                "tokenizer.json needs the 'tokenizers' package"
            ) from exc
        try:
            self.hf = Tokenizer.from_file(path)
        except Exception as exc:
            raise ConfigError(f"cannot load tokenizer {path!r}: {exc}") from exc

    @property
    def handles_chat(self) -> bool:
        return self.sim is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.sim is not None:
            return list(self.sim.encode(text))
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_chat(self, body: Mapping[str, Any]) -> list[int]:
        return list(
            self.sim.encode_chat(
                body["messages"],
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message", False)),
            )
        )


_TYPED_FIELDS: tuple[tuple[str, type, str], ...] = (
    ("model", str, "a string"),
    ("cache_salt", str, "a string"),
    ("stream", bool, "a boolean"),
    ("add_special_tokens", bool, "a boolean"),
    ("add_generation_prompt", bool, "a boolean"),
    ("continue_final_message", bool, "a boolean"),
    ("chat_template", str, "a string"),
    ("chat_template_kwargs", dict, "an object"),
    ("tools", list, "a list"),
)
"""Optional fields that change the key or the tokens, with the JSON type each must have
(``null`` is accepted for each, as vLLM accepts it)."""


def check_body(body: Any, chat: bool) -> dict[str, Any]:
    """The request body as a dict, or :class:`BadRequest` naming the field that is wrong.

    A chat needs ``messages``: a non-empty list of objects with a string ``role`` and a
    ``content`` that is a string, a list of parts or null.  A completion needs ``prompt``
    (a string, a non-empty list of token ids, or a batch of either), or
    ``prompt_token_ids`` (a non-empty list of token ids).  The fields of
    :data:`_TYPED_FIELDS` must have their type; a boolean is not a number, a number not a
    boolean.
    """
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("'messages' must be a non-empty list of messages", param="messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(
                    f"messages[{i}] must be an object with a string 'role'", param="messages"
                )
            content = m.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise BadRequest(
                    f"messages[{i}].content must be a string or a list of parts",
                    param="messages",
                )
    elif body.get("prompt") is not None:
        first_prompt(body["prompt"])
    elif body.get("prompt_token_ids") is not None:
        if _token_ids(body["prompt_token_ids"]) is None:
            raise BadRequest(
                "'prompt_token_ids' must be a non-empty list of token ids",
                param="prompt_token_ids",
            )
    else:
        raise BadRequest("'prompt' is required", param="prompt")
    for name, kind, what in _TYPED_FIELDS:
        value = body.get(name)
        if value is not None and (
            not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))
        ):
            raise BadRequest(f"'{name}' must be {what}", param=name)
    return body


def _token_ids(value: Any) -> list[int] | None:
    """``value`` as a non-empty list of token ids, or None (validated in C by msgspec)."""
    if not isinstance(value, list) or not value:
        return None
    try:
        return msgspec.convert(value, list[int], strict=True)
    except msgspec.ValidationError:
        return None


def first_prompt(prompt: Any) -> str | list[int]:
    """The prompt that routes: a string, a token list, or the first of a batch."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        ids = _token_ids(prompt)
        if ids is not None:
            return ids
        head = prompt[0]
        if isinstance(head, str):
            return head
        ids = _token_ids(head)
        if ids is not None:
            return ids
    raise BadRequest(
        "'prompt' must be a string, a list of token ids, or a batch of them", param="prompt"
    )


def _prompt(body: Mapping[str, Any]) -> Any:
    """A checked completion body's prompt: ``prompt``, else ``prompt_token_ids``."""
    prompt = body.get("prompt")
    return prompt if prompt is not None else body.get("prompt_token_ids")


def tokenize_request_body(body: Mapping[str, Any], chat: bool) -> dict[str, Any] | None:
    """The body to send to an engine's ``/tokenize``; None when no call is needed (the
    prompt is already token ids)."""
    if chat:
        out: dict[str, Any] = {"messages": body["messages"]}
        for k in _CHAT_FIELDS:
            if k in body:
                out[k] = body[k]
    else:
        prompt = first_prompt(_prompt(body))
        if isinstance(prompt, list):
            return None
        out = {"prompt": prompt}
        if "add_special_tokens" in body:
            out["add_special_tokens"] = body["add_special_tokens"]
    if body.get("model") is not None:
        out["model"] = body["model"]
    return out


def tokenize_body(
    body: Mapping[str, Any], chat: bool, local: LocalTokenizer | None
) -> list[int] | None:
    """Tokens computed without an engine (token-id prompts, a local tokenizer), or None
    when the engine must be asked."""
    if not chat:
        prompt = first_prompt(_prompt(body))
        if isinstance(prompt, list):
            return prompt
        if local is not None:
            return local.encode(prompt, bool(body.get("add_special_tokens", True)))
        return None
    if local is not None and local.handles_chat:
        try:
            return local.encode_chat(body)
        except ConfigError as exc:
            raise BadRequest(str(exc)) from None
    return None


def build_key(tokens: list[int], body: Mapping[str, Any], loras: set[str]) -> RequestKey:
    """The request key of a request with ``tokens``."""
    model = body.get("model")
    lora = model if isinstance(model, str) and model in loras else None
    salt = body.get("cache_salt") or None
    return RequestKey(tokens, lora_name=lora, cache_salt=salt)
