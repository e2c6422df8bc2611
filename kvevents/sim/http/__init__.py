"""An OpenAI-compatible HTTP front for simulated engines (``kvevents sim serve``).

:class:`SimHTTPEngine` wraps one :class:`~kvevents.sim.engine.SimEngine` and its
``ZmqEventPublisher`` (vLLM's frames, seq and replay) behind the routes a vLLM OpenAI
server answers:

* ``POST /v1/completions`` and ``POST /v1/chat/completions``, streaming (SSE) or not; the
  usage carries ``prompt_tokens_details.cached_tokens`` (what the engine reused, GPU and
  CPU tiers, as vLLM reports with ``--enable-prompt-tokens-details``), also in a last
  streamed chunk when ``stream_options.include_usage`` is set;
* ``POST /tokenize`` (``{"prompt": ...}`` or ``{"messages": ...}`` → ``{"tokens": ...}``);
* ``GET /v1/models``; ``GET /metrics`` with vLLM's gauge names
  (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc``) and counters; ``GET /health``.

Time is simulated: the engine steps while it has work, each step lasting
``step_s + prefill_s_per_token × tokens prefilled in it``; a running request emits
``decode_tokens_per_step`` output tokens per step.  Tokens come from
:class:`~kvevents.tokenizer.SimTokenizer` (deterministic, prefix-stable) and the
answer to a prompt is a deterministic function of it.

Needs the ``serve`` extra (Starlette, uvicorn).

Rooms: :mod:`~kvevents.sim.http.config` (:class:`SimHTTPConfig`),
:mod:`~kvevents.sim.http.openai` (the wire shapes), :mod:`~kvevents.sim.http.routes`
(the HTTP routes), :mod:`~kvevents.sim.http.engine` (:class:`SimHTTPEngine`),
:mod:`~kvevents.sim.http.fleet` (``kvevents sim serve``'s fleet).  This package
re-exports the public names.
"""

from kvevents.sim.http.config import MODEL as MODEL  # re-exported
from kvevents.sim.http.config import SimHTTPConfig, default_http_engine
from kvevents.sim.http.engine import SimHTTPEngine
from kvevents.sim.http.fleet import run_sim_fleet
from kvevents.sim.http.fleet import sim_specs_lines as sim_specs_lines  # re-exported

__all__ = ["SimHTTPConfig", "SimHTTPEngine", "default_http_engine", "run_sim_fleet"]
