"""The one-command demo: simulated engines behind ``kvevents serve``, driven over HTTP.

For each policy (KV-aware, KV-aware on the GPU tier only, round-robin, random)
:func:`run_demo` starts fresh simulated engines, each with an OpenAI-compatible HTTP
front and a KV-event publisher, puts ``kvevents serve`` with that policy in front of
them (its subscriber, block index and router, all on real ZMQ and HTTP on loopback), and
sends the same seeded multi-turn chat workload through the service with the load
generator (``kvevents loadgen``), so what it reports is what a user's clients would see:
requests arrive while earlier answers are still streaming, and the index routes on the
events it has received by then.

The GPU-only KV-aware router is fed only the GPU events (as routers that drop events
without tokens are: CPU offload placeholders carry none), so it cannot see what the CPU
tier holds; the difference between the two KV-aware rows is what the join is worth.

Hit rates are what the engines actually reused (ground truth, from the engines' own
counters), per tier: ``gpu_hit_tokens / prompt_tokens`` and ``cpu_hit_tokens /
prompt_tokens``.  The service checks every prediction against the ``cached_tokens`` the
engine reported (its online truth check); time to first token and throughput are the
load generator's.

Rooms: :mod:`~kvevents.demo.config` (what runs), :mod:`~kvevents.demo.run`
(running it), :mod:`~kvevents.demo.results` (what it measured),
:mod:`~kvevents.demo.report` (text, JSON, plot).  This package re-exports the
public names.
"""

from kvevents.demo.config import POLICIES, POLICY_LABELS, DemoConfig, waves
from kvevents.demo.report import format_report, report_to_json, write_plot
from kvevents.demo.results import DemoReport, PolicyResult
from kvevents.demo.run import run_demo, run_policy

__all__ = [
    "POLICIES",
    "POLICY_LABELS",
    "DemoConfig",
    "DemoReport",
    "PolicyResult",
    "format_report",
    "report_to_json",
    "run_demo",
    "run_policy",
    "waves",
    "write_plot",
]
