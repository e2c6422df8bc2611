"""A seeded synthetic workload: tenants with shared system prompts and multi-turn chats.

Each tenant has one system prompt that starts every one of its requests.  A chat session
belongs to a tenant; its turn *k+1* prompt is its turn *k* prompt, plus the turn *k*
answer, plus a new user message, so later turns extend earlier ones token for token.
Sessions are interleaved at random, the way a real front end sees them.  Everything is
drawn from one :class:`random.Random` seeded with :attr:`WorkloadConfig.seed`, so the same
config always yields the same requests.

A session can also carry what vLLM keys blocks by besides tokens, each drawn once per
session: a LoRA adapter (``lora_names``), a cache salt (``cache_salts``) and images
(``images``): an image is a run of identical placeholder tokens right after the system
prompt, told apart only by its identifier, as vLLM's multimodal placeholders are.  With
the defaults none is drawn and the workload is the plain one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvevents.errors import ConfigError
from kvevents.request import MMFeature, RequestKey
from kvevents.sim.keys import SimKey

__all__ = ["SimRequest", "WorkloadConfig", "generate_workload"]


@dataclass(frozen=True)
class WorkloadConfig:
    """Shape of a synthetic chat workload.  Lengths are in tokens, ranges inclusive.

    ``concurrent_sessions`` is how many chats are open at once; when one ends a new one
    starts, until ``num_requests`` requests have been produced.
    """

    num_requests: int = 200
    num_tenants: int = 4
    concurrent_sessions: int = 12
    system_prompt_tokens: tuple[int, int] = (192, 320)
    first_message_tokens: tuple[int, int] = (32, 96)
    followup_message_tokens: tuple[int, int] = (16, 48)
    output_tokens: tuple[int, int] = (16, 48)
    turns_per_session: tuple[int, int] = (2, 6)
    vocab_size: int = 32_000
    seed: int = 0
    lora_names: tuple[str | None, ...] = (None,)
    cache_salts: tuple[str | None, ...] = (None,)
    images: int = 0
    image_tokens: tuple[int, int] = (24, 40)
    image_placeholder: int = 1

    def validate(self) -> None:
        """Raise :class:`ConfigError` when a field is out of range."""
        if self.num_requests < 0:
            raise ConfigError("num_requests must be >= 0")
        if self.num_tenants < 1 or self.concurrent_sessions < 1:
            raise ConfigError("num_tenants and concurrent_sessions must be >= 1")
        for name in (
            "system_prompt_tokens",
            "first_message_tokens",
            "followup_message_tokens",
            "output_tokens",
            "turns_per_session",
        ):
            lo, hi = getattr(self, name)
            if lo < 0 or hi < lo:
                raise ConfigError(f"{name} must be a range (lo, hi) with 0 <= lo <= hi")
        if self.turns_per_session[0] < 1:
            raise ConfigError("turns_per_session must start at >= 1")
        if self.vocab_size < 2:
            raise ConfigError("vocab_size must be >= 2")
        if not self.lora_names or not self.cache_salts:
            raise ConfigError("lora_names and cache_salts need at least one entry")
        if (
            self.images < 0
            or self.image_tokens[0] < 1
            or self.image_tokens[1] < self.image_tokens[0]
        ):
            raise ConfigError("images must be >= 0 and image_tokens a range starting at >= 1")


@dataclass(frozen=True)
class SimRequest:
    """One request of the workload.

    ``prompt`` is the full prompt (system prompt, history, new message); ``output`` the
    tokens the engine will generate for it.  ``turn`` counts from 0 within ``session``.
    ``lora_name``, ``cache_salt``, ``mm_features`` (offset-sorted placeholder ranges in
    the prompt) and ``prompt_embeds`` (one ``bytes`` row per prompt token) are what vLLM
    keys blocks by besides tokens.  ``remote_tokens`` is how many prompt tokens' KV a
    remote prefill engine computed for it (a disaggregated decode: the engine receives
    those instead of computing them, as vLLM's KV connector fills them).
    """

    request_id: str
    tenant: int
    session: int
    turn: int
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    lora_name: str | None = None
    cache_salt: str | None = None
    mm_features: tuple[MMFeature, ...] = ()
    prompt_embeds: tuple[bytes, ...] | None = None
    remote_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """Prompt plus output length."""
        return len(self.prompt) + len(self.output)

    @property
    def key(self) -> RequestKey:
        """The prompt as a router is asked about it."""
        return RequestKey(
            self.prompt,
            lora_name=self.lora_name,
            cache_salt=self.cache_salt,
            mm_features=self.mm_features,
            prompt_embeds=self.prompt_embeds,
        )

    @property
    def sim_key(self) -> SimKey:
        """The extras the engine's hasher reads (an empty salt is no salt, as in vLLM)."""
        return SimKey(
            self.lora_name,
            self.cache_salt or None,
            tuple(sorted((MMFeature(*f) for f in self.mm_features), key=lambda f: f.offset)),
            self.prompt_embeds,
        )


@dataclass
class _Session:
    sid: int
    tenant: int
    turns_left: int
    history: list[int] = field(default_factory=list)
    turn: int = 0
    lora_name: str | None = None
    cache_salt: str | None = None
    mm: tuple[MMFeature, ...] = ()


def generate_workload(config: WorkloadConfig) -> list[SimRequest]:
    """The requests of ``config``, in arrival order (deterministic for a given config)."""
    config.validate()
    rng = random.Random(config.seed)

    def tokens(span: tuple[int, int]) -> list[int]:
        return [rng.randrange(1, config.vocab_size) for _ in range(rng.randint(*span))]

    system_prompts = [tokens(config.system_prompt_tokens) for _ in range(config.num_tenants)]
    image_lengths = [rng.randint(*config.image_tokens) for _ in range(config.images)]
    sessions: list[_Session] = []
    next_sid = 0

    def open_session() -> _Session:
        nonlocal next_sid
        tenant = rng.randrange(config.num_tenants)
        s = _Session(next_sid, tenant, rng.randint(*config.turns_per_session))
        s.history = list(system_prompts[tenant])
        # extras are drawn only when configured, so a plain workload stays the same
        if len(config.lora_names) > 1:
            s.lora_name = rng.choice(config.lora_names)
        else:
            s.lora_name = config.lora_names[0]
        if len(config.cache_salts) > 1:
            s.cache_salt = rng.choice(config.cache_salts)
        else:
            s.cache_salt = config.cache_salts[0]
        if config.images:
            # an image right after the system prompt, from a small shared pool: the
            # same placeholder tokens under different identifiers
            image = rng.randrange(config.images + 1)
            if image < config.images:
                length = image_lengths[image]
                s.mm = (MMFeature(f"image-{image}", len(s.history), length),)
                s.history += [config.image_placeholder] * length
        next_sid += 1
        return s

    out: list[SimRequest] = []
    while len(out) < config.num_requests:
        while len(sessions) < config.concurrent_sessions:
            sessions.append(open_session())
        s = sessions[rng.randrange(len(sessions))]
        span = config.first_message_tokens if s.turn == 0 else config.followup_message_tokens
        prompt = s.history + tokens(span)
        answer = tokens(config.output_tokens)
        out.append(
            SimRequest(
                request_id=f"s{s.sid}-t{s.turn}",
                tenant=s.tenant,
                session=s.sid,
                turn=s.turn,
                prompt=tuple(prompt),
                output=tuple(answer),
                lora_name=s.lora_name,
                cache_salt=s.cache_salt,
                mm_features=s.mm,
            )
        )
        s.history = prompt + answer
        s.turn += 1
        s.turns_left -= 1
        if s.turns_left == 0:
            sessions.remove(s)
    return out
