"""``kvevents loadgen``: a seeded multi-turn chat workload against an OpenAI endpoint.

Tenants each have a system prompt that starts every one of their conversations; a
conversation's next turn is its whole history (system prompt, every question and every
answer the server gave) plus a new question, so a server that keeps a conversation's KV
cache reuses nearly all of it.  At most ``sessions`` conversations are open at once; a
turn is sent only after the previous turn's answer arrived, as a chat client would.
The conversations are planned from the seed (tenant, number of turns, questions), and
their turns add up to exactly ``requests``: two runs with one seed send the same
questions, whatever order the answers come back in.

Requests go out at a fixed ``concurrency`` (that many in flight) or at a ``rate``
(Poisson arrivals, requests per second).  Every request streams with
``stream_options.include_usage`` so the report has, per request, the time to first token,
the latency, and ``usage.prompt_tokens_details.cached_tokens``: prefix reuse is
``Σ cached_tokens / Σ prompt_tokens`` as the server reported it.  Behind a service that
disaggregates prefill and decode, each request's path (``x-kvevents-prefill`` present
or not) is recorded, and reuse and time to first token are also given per path; a
disaggregated request's reuse is what its prefill engine reported
(``x-kvevents-prefill-cached-tokens``).

The text (system prompts, questions) is drawn from one :class:`random.Random` seeded with
``seed``, so a run's prompts are reproducible; which request meets which answer depends on
the server.  Needs the ``serve`` extra (httpx).  Bursts of siblings sharing a new long
context (``--burst K``) are :mod:`~kvevents.serve.burstgen`'s.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from kvevents.errors import ConfigError

__all__ = [
    "LoadgenConfig",
    "LoadgenReport",
    "RequestRecord",
    "format_loadgen",
    "request_one",
    "run_loadgen",
]


@dataclass(frozen=True)
class LoadgenConfig:
    """The workload and how it is sent (lengths in words; ranges inclusive)."""

    url: str
    requests: int = 200
    tenants: int = 4
    sessions: int = 16
    turns: tuple[int, int] = (2, 6)
    system_words: tuple[int, int] = (150, 300)
    question_words: tuple[int, int] = (20, 60)
    max_tokens: int = 32
    concurrency: int | None = 8
    rate: float | None = None
    seed: int = 0
    model: str | None = None
    timeout_s: float = 120.0

    def validate(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"loadgen URL {self.url!r} must start with http:// or https://")
        if self.requests < 1 or self.tenants < 1 or self.sessions < 1 or self.max_tokens < 1:
            raise ConfigError("requests, tenants, sessions and max_tokens must be >= 1")
        if (self.concurrency is None) == (self.rate is None):
            raise ConfigError("give exactly one of concurrency and rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ConfigError("concurrency must be >= 1")
        if self.rate is not None and self.rate <= 0:
            raise ConfigError("rate must be > 0")
        for name in ("turns", "system_words", "question_words"):
            lo, hi = getattr(self, name)
            if lo < 0 or hi < lo or (name == "turns" and lo < 1):
                raise ConfigError(f"{name} must be a range lo..hi with 0 <= lo <= hi")


@dataclass
class RequestRecord:
    """One request as the client saw it (seconds; tokens as the server reported)."""

    session: int
    turn: int
    ok: bool
    status: int
    worker: str | None
    ttft_s: float | None
    latency_s: float
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    completion_tokens: int = 0
    error: str = ""
    prefill: str | None = None
    """The prefill rank of a disaggregated request (``x-kvevents-prefill``)."""
    prefill_cached: int | None = None
    """What its prefill engine reported it reused (``x-kvevents-prefill-cached-tokens``)."""

    @property
    def path(self) -> str:
        """``disaggregated`` (a prefill and a decode step) or ``whole``."""
        return "disaggregated" if self.prefill else "whole"

    @property
    def reused(self) -> int | None:
        """Prompt tokens reused where the prompt was computed: on the prefill engine for a
        disaggregated request (the decode engine's ``cached_tokens`` counts the
        transferred prefix), else the engine's ``cached_tokens``."""
        return self.prefill_cached if self.prefill else self.cached_tokens


@dataclass
class LoadgenReport:
    config: LoadgenConfig
    records: list[RequestRecord] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]

    @property
    def prefix_reuse(self) -> float:
        """Σ cached_tokens / Σ prompt_tokens over requests that reported both."""
        rs = [r for r in self.ok if r.cached_tokens is not None]
        prompt = sum(r.prompt_tokens for r in rs)
        return sum(r.cached_tokens or 0 for r in rs) / prompt if prompt else 0.0

    def percentile(
        self, what: str, q: float, records: list[RequestRecord] | None = None
    ) -> float | None:
        rs = self.ok if records is None else records
        vals = sorted(v for r in rs if (v := getattr(r, what)) is not None)
        if not vals:
            return None
        return float(vals[min(len(vals) - 1, int(q * len(vals)))])

    def paths(self) -> dict[str, dict[str, Any]]:
        """Per path (``disaggregated``, ``whole``): requests, prefix reuse where the
        prompt was computed (:attr:`RequestRecord.reused` over prompt tokens), and time
        to first token."""
        out: dict[str, dict[str, Any]] = {}
        for path in ("disaggregated", "whole"):
            rs = [r for r in self.ok if r.path == path]
            if not rs:
                continue
            known = [r for r in rs if r.reused is not None]
            prompt = sum(r.prompt_tokens for r in known)
            reused = sum(r.reused or 0 for r in known)
            out[path] = {
                "requests": len(rs),
                "prefix_reuse": round(reused / prompt, 4) if prompt else 0.0,
                "reused_tokens": reused,
                "prompt_tokens": prompt,
                "ttft_p50_s": self.percentile("ttft_s", 0.5, rs),
                "ttft_p90_s": self.percentile("ttft_s", 0.9, rs),
            }
        return out

    def to_json(self) -> dict[str, Any]:
        ok = self.ok
        wall = self.wall_s or 1e-9
        return {
            "url": self.config.url,
            "requests": len(self.records),
            "ok": len(ok),
            "failed": len(self.records) - len(ok),
            "errors": dict(Counter(r.error for r in self.records if not r.ok)),
            "prefix_reuse": round(self.prefix_reuse, 4),
            "prompt_tokens": sum(r.prompt_tokens for r in ok),
            "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
            "ttft_p50_s": self.percentile("ttft_s", 0.5),
            "ttft_p90_s": self.percentile("ttft_s", 0.9),
            "ttft_p99_s": self.percentile("ttft_s", 0.99),
            "latency_p50_s": self.percentile("latency_s", 0.5),
            "latency_p99_s": self.percentile("latency_s", 0.99),
            "requests_per_s": round(len(ok) / wall, 3),
            "output_tokens_per_s": round(sum(r.completion_tokens for r in ok) / wall, 1),
            "wall_s": round(self.wall_s, 3),
            "workers": dict(sorted(Counter(r.worker or "?" for r in ok).items())),
            "prefill_workers": dict(sorted(Counter(r.prefill for r in ok if r.prefill).items())),
            "paths": self.paths(),
        }


class _Session:
    def __init__(self, sid: int, system: str, turns: int, rng: random.Random) -> None:
        self.sid = sid
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        self.turns_left = turns
        self.turn = 0
        self.busy = False
        self.rng = rng


class _Workload:
    """The planned conversations: session ``s`` (its tenant, its number of turns, its
    questions) depends only on the seed and ``s``, and the sessions' turns add up to
    exactly ``requests``, so every run sends the same questions whatever the order the
    answers come back in."""

    def __init__(self, cfg: LoadgenConfig) -> None:
        self.cfg = cfg
        rng = random.Random(cfg.seed)
        self.systems = [_words(rng, cfg.system_words, f"t{t}") for t in range(cfg.tenants)]
        self.plan: list[tuple[int, int]] = []  # (tenant, turns) per session
        total = 0
        while total < cfg.requests:
            turns = min(rng.randint(*cfg.turns), cfg.requests - total)
            self.plan.append((rng.randrange(cfg.tenants), turns))
            total += turns
        self.open: list[_Session] = []
        self.next_sid = 0
        self.issued = 0
        self.pick = random.Random(cfg.seed + 2)

    def next_turn(self) -> tuple[_Session, list[dict[str, str]]] | None:
        """A free session's next request (opening planned sessions as room allows), or
        None when every open session waits for an answer and none may open."""
        if self.issued >= self.cfg.requests:
            return None
        while len(self.open) < self.cfg.sessions and self.next_sid < len(self.plan):
            sid = self.next_sid
            tenant, turns = self.plan[sid]
            srng = random.Random(f"{self.cfg.seed}/{sid}")
            self.open.append(_Session(sid, self.systems[tenant], turns, srng))
            self.next_sid += 1
        free = [s for s in self.open if not s.busy]
        if not free:
            return None
        s = free[self.pick.randrange(len(free))]
        s.busy = True
        s.messages.append({"role": "user", "content": _words(s.rng, self.cfg.question_words)})
        self.issued += 1
        return s, list(s.messages)

    def answered(self, s: _Session, text: str | None) -> None:
        s.busy = False
        # a failed turn still counts: the conversation goes on with an empty answer
        s.messages.append({"role": "assistant", "content": text or ""})
        s.turn += 1
        s.turns_left -= 1
        if s.turns_left <= 0:
            self.open.remove(s)


def _words(rng: random.Random, span: tuple[int, int], tag: str = "") -> str:
    n = rng.randint(*span)
    return " ".join(f"{tag}w{rng.randrange(50_000)}" for _ in range(n))


async def request_one(
    client: Any, cfg: LoadgenConfig, session: int, turn: int, msgs: list[dict[str, str]]
) -> tuple[RequestRecord, str | None]:
    """Send one streamed chat request ``msgs`` (``cfg``'s ``max_tokens`` and ``model``)
    with ``client`` (an ``httpx.AsyncClient`` on the server's base URL); its record and
    the answer's text (None when it failed)."""
    import httpx

    body: dict[str, Any] = {
        "messages": msgs,
        "max_tokens": cfg.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.model:
        body["model"] = cfg.model
    t0 = time.perf_counter()
    rec = RequestRecord(session, turn, False, 0, None, None, 0.0)
    text: list[str] = []
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            rec.status = r.status_code
            rec.worker = r.headers.get("x-kvevents-worker")
            rec.prefill = r.headers.get("x-kvevents-prefill")
            pc = r.headers.get("x-kvevents-prefill-cached-tokens")
            rec.prefill_cached = int(pc) if pc and pc.isdigit() else None
            if r.status_code != 200:
                await r.aread()
                rec.error = f"HTTP {r.status_code}"
                rec.latency_s = time.perf_counter() - t0
                return rec, None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                try:
                    chunk = json.loads(line[6:])
                except ValueError:
                    continue
                if "error" in chunk:
                    rec.error = "stream error"
                    break
                for ch in chunk.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content")
                    if piece:
                        if rec.ttft_s is None:
                            rec.ttft_s = time.perf_counter() - t0
                        text.append(piece)
                usage = chunk.get("usage")
                if usage:
                    rec.prompt_tokens = int(usage.get("prompt_tokens", 0))
                    rec.completion_tokens = int(usage.get("completion_tokens", 0))
                    details = usage.get("prompt_tokens_details") or {}
                    if isinstance(details.get("cached_tokens"), int):
                        rec.cached_tokens = details["cached_tokens"]
    except httpx.HTTPError as exc:
        rec.error = type(exc).__name__
    rec.latency_s = time.perf_counter() - t0
    rec.ok = not rec.error
    return rec, ("".join(text) if rec.ok else None)


async def run_loadgen(
    cfg: LoadgenConfig, progress: Callable[[int, int], None] | None = None
) -> LoadgenReport:
    """Send the workload; ``progress(done, total)`` after each answer."""
    import httpx

    cfg.validate()
    work = _Workload(cfg)
    report = LoadgenReport(cfg)
    changed = asyncio.Condition()
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=cfg.url, timeout=cfg.timeout_s, limits=limits) as client:

        async def send(s: _Session, msgs: list[dict[str, str]]) -> None:
            rec, text = await request_one(client, cfg, s.sid, s.turn, msgs)
            report.records.append(rec)
            async with changed:
                work.answered(s, text)
                changed.notify_all()
            if progress is not None:
                progress(len(report.records), cfg.requests)

        async def take() -> tuple[_Session, list[dict[str, str]]] | None:
            async with changed:
                while True:
                    if work.issued >= cfg.requests:
                        return None
                    nxt = work.next_turn()
                    if nxt is not None:
                        return nxt
                    await changed.wait()

        t0 = time.perf_counter()
        if cfg.concurrency is not None:

            async def worker() -> None:
                while (nxt := await take()) is not None:
                    await send(*nxt)

            await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
        else:
            assert cfg.rate is not None
            arrivals = random.Random(cfg.seed + 1)
            tasks = []
            next_at = time.perf_counter()
            while (nxt := await take()) is not None:
                next_at += arrivals.expovariate(cfg.rate)
                delay = next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(send(*nxt)))
            await asyncio.gather(*tasks)
        report.wall_s = time.perf_counter() - t0
    return report


def format_loadgen(report: LoadgenReport) -> str:
    """A short human-readable summary."""
    j = report.to_json()

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f} ms"

    lines = [
        f"requests     {j['ok']} ok, {j['failed']} failed"
        + (f" ({', '.join(f'{k}: {v}' for k, v in j['errors'].items())})" if j["errors"] else ""),
        f"prefix reuse {j['prefix_reuse']:.1%} of prompt tokens cached "
        f"({j['cached_tokens']}/{j['prompt_tokens']})",
        f"TTFT         p50 {ms(j['ttft_p50_s'])}  p90 {ms(j['ttft_p90_s'])}  p99 {ms(j['ttft_p99_s'])}",
        f"latency      p50 {ms(j['latency_p50_s'])}  p99 {ms(j['latency_p99_s'])}",
        f"throughput   {j['requests_per_s']:.1f} req/s, {j['output_tokens_per_s']:.0f} output tokens/s "
        f"over {j['wall_s']:.1f} s",
        "workers      " + ", ".join(f"{k}: {v}" for k, v in j["workers"].items()),
    ]
    if j["prefill_workers"]:
        lines.append(
            "prefill      " + ", ".join(f"{k}: {v}" for k, v in j["prefill_workers"].items())
        )
        for path, d in j["paths"].items():
            lines.append(
                f"{path:<13} {d['requests']} requests, reuse {d['prefix_reuse']:.1%} "
                f"({d['reused_tokens']}/{d['prompt_tokens']}), TTFT p50 {ms(d['ttft_p50_s'])} "
                f"p90 {ms(d['ttft_p90_s'])}"
            )
    return "\n".join(lines)


class ProgressBar:
    """A one-line progress bar on a terminal; silent otherwise, or when ``quiet``."""

    def __init__(self, stream: IO[str] = sys.stderr, width: int = 30, quiet: bool = False) -> None:
        self.stream = stream
        self.enabled = not quiet and stream.isatty()
        self.width = width
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        filled = int(self.width * done / max(1, total))
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\rloadgen [{bar}] {done}/{total}")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()
