"""``kvevents loadgen --burst K``: bursts of siblings that share a long new context.

An agent fanning out, a batch job, a chat product's retries: K requests arrive at once,
share a long context nobody has seen before (a new document, a new tool transcript) and
differ only in their last message.  Each burst here is K concurrent chat requests whose
system message is a fresh context of ``context_words`` words (new for every burst) and
whose user message is the sibling's own question.  Bursts go one after the other (a
burst starts when the previous one has answered).  Requests may be spread over several
service URLs: sibling ``i`` of a burst goes to ``urls[i % len(urls)]`` (replicas taking
alternate requests).

The report, per burst: the recomputed prompt tokens (Σ prompt − cached, as the engines
reported them in ``usage``: what the fleet prefilled) and the time to first token of its
requests; overall, their sums and percentiles.  A router that sends the siblings to one
engine recomputes the context once; one that spreads them recomputes it once per engine.

The text is drawn from ``seed``, so two runs send the same prompts.  Needs the ``serve``
extra (httpx).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvevents.errors import ConfigError
from kvevents.serve.loadgen import LoadgenConfig, RequestRecord, request_one

__all__ = ["BurstConfig", "BurstRecord", "BurstReport", "format_bursts", "run_bursts"]


@dataclass(frozen=True)
class BurstConfig:
    """The burst workload (lengths in words; ranges inclusive)."""

    urls: tuple[str, ...]
    burst: int = 8
    bursts: int = 10
    context_words: tuple[int, int] = (1500, 3000)
    question_words: tuple[int, int] = (10, 30)
    max_tokens: int = 16
    seed: int = 0
    model: str | None = None
    timeout_s: float = 120.0

    def validate(self) -> None:
        if not self.urls:
            raise ConfigError("give at least one URL")
        for u in self.urls:
            if not u.startswith(("http://", "https://")):
                raise ConfigError(f"loadgen URL {u!r} must start with http:// or https://")
        if self.burst < 1 or self.bursts < 1 or self.max_tokens < 1:
            raise ConfigError("burst, bursts and max_tokens must be >= 1")
        for name in ("context_words", "question_words"):
            lo, hi = getattr(self, name)
            if lo < 1 or hi < lo:
                raise ConfigError(f"{name} must be a range lo..hi with 1 <= lo <= hi")


@dataclass
class BurstRecord:
    """One burst's requests and what they cost."""

    index: int
    requests: list[RequestRecord] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests if r.ok)

    @property
    def recomputed(self) -> int:
        """Σ prompt − cached over the burst's answered requests."""
        return sum(r.prompt_tokens - (r.cached_tokens or 0) for r in self.requests if r.ok)

    @property
    def ttft_mean_s(self) -> float | None:
        ts = [r.ttft_s for r in self.requests if r.ok and r.ttft_s is not None]
        return sum(ts) / len(ts) if ts else None

    @property
    def ttft_max_s(self) -> float | None:
        ts = [r.ttft_s for r in self.requests if r.ok and r.ttft_s is not None]
        return max(ts) if ts else None

    @property
    def workers(self) -> int:
        """Distinct engine ranks the burst went to."""
        return len({r.worker for r in self.requests if r.ok})


@dataclass
class BurstReport:
    config: BurstConfig
    bursts: list[BurstRecord] = field(default_factory=list)
    wall_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        reqs = [r for b in self.bursts for r in b.requests]
        ok = [r for r in reqs if r.ok]
        n = len(self.bursts) or 1
        ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)

        def pct(q: float) -> float | None:
            return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else None

        means = [m for b in self.bursts if (m := b.ttft_mean_s) is not None]
        return {
            "urls": list(self.config.urls),
            "burst": self.config.burst,
            "bursts": len(self.bursts),
            "requests": len(reqs),
            "ok": len(ok),
            "errors": dict(Counter(r.error for r in reqs if not r.ok)),
            "prompt_tokens": sum(b.prompt_tokens for b in self.bursts),
            "recomputed_tokens": sum(b.recomputed for b in self.bursts),
            "recomputed_per_burst": round(sum(b.recomputed for b in self.bursts) / n, 1),
            "prompt_per_burst": round(sum(b.prompt_tokens for b in self.bursts) / n, 1),
            "engines_per_burst": round(sum(b.workers for b in self.bursts) / n, 2),
            "ttft_burst_mean_s": round(sum(means) / len(means), 4) if means else None,
            "ttft_p50_s": pct(0.5),
            "ttft_p90_s": pct(0.9),
            "wall_s": round(self.wall_s, 3),
            "per_burst": [
                {
                    "recomputed": b.recomputed,
                    "prompt": b.prompt_tokens,
                    "engines": b.workers,
                    "ttft_mean_s": b.ttft_mean_s,
                    "ttft_max_s": b.ttft_max_s,
                }
                for b in self.bursts
            ],
        }


def _words(rng: random.Random, span: tuple[int, int], tag: str) -> str:
    n = rng.randint(*span)
    return " ".join(f"{tag}w{rng.randrange(50_000)}" for _ in range(n))


async def run_bursts(cfg: BurstConfig) -> BurstReport:
    """Send ``cfg.bursts`` bursts of ``cfg.burst`` concurrent siblings, one burst after
    the other."""
    import httpx

    cfg.validate()
    rng = random.Random(cfg.seed)
    report = BurstReport(cfg)
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    clients = [
        httpx.AsyncClient(base_url=u.rstrip("/"), timeout=cfg.timeout_s, limits=limits)
        for u in cfg.urls
    ]
    one = LoadgenConfig(
        url=cfg.urls[0], max_tokens=cfg.max_tokens, model=cfg.model, timeout_s=cfg.timeout_s
    )
    try:
        t0 = time.perf_counter()
        for b in range(cfg.bursts):
            context = _words(rng, cfg.context_words, f"b{b}c")
            sibs = [
                [
                    {"role": "system", "content": context},
                    {"role": "user", "content": _words(rng, cfg.question_words, f"b{b}q{i}")},
                ]
                for i in range(cfg.burst)
            ]
            answers = await asyncio.gather(
                *(
                    request_one(clients[i % len(clients)], one, b, i, msgs)
                    for i, msgs in enumerate(sibs)
                )
            )
            report.bursts.append(BurstRecord(b, [r for r, _ in answers]))
        report.wall_s = time.perf_counter() - t0
    finally:
        for c in clients:
            await c.aclose()
    return report


def format_bursts(report: BurstReport) -> str:
    """A short human-readable summary."""
    j = report.to_json()

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f} ms"

    lines = [
        f"bursts       {j['bursts']} of {j['burst']} ({j['ok']}/{j['requests']} ok)"
        + (f" ({', '.join(f'{k}: {v}' for k, v in j['errors'].items())})" if j["errors"] else ""),
        f"recomputed   {j['recomputed_per_burst']:.0f} prompt tokens per burst "
        f"(of {j['prompt_per_burst']:.0f}); {j['recomputed_tokens']} in all",
        f"engines      {j['engines_per_burst']:.2f} per burst",
        f"TTFT         burst mean {ms(j['ttft_burst_mean_s'])}  p50 {ms(j['ttft_p50_s'])}  "
        f"p90 {ms(j['ttft_p90_s'])}",
    ]
    return "\n".join(lines)
