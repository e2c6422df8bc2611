"""``kvevents serve``: an OpenAI-compatible, KV-aware routing service.

The configuration (:class:`ServeConfig`, :class:`EngineSpec`, :func:`load_config`,
:func:`parse_engine_spec`) imports nothing beyond the core.  The service itself
(:class:`~kvevents.serve.app.ServeApp`) needs the ``serve`` extra (Starlette, uvicorn,
httpx, prometheus-client): ``pip install 'kvevents[serve]'``.
"""

import importlib.util

from kvevents import errors
from kvevents.serve.config import (
    POLICIES,
    EngineSpec,
    ServeConfig,
    load_config,
    parse_engine_spec,
)

__all__ = [
    "POLICIES",
    "EngineSpec",
    "ServeConfig",
    "load_config",
    "parse_engine_spec",
    "require_serve_extra",
]

_SERVE_EXTRA_HINT = "pip install 'kvevents[serve]'"


def require_serve_extra(what: str = "kvevents serve") -> None:
    """Raise :class:`~kvevents.errors.ConfigError` (one line naming the extra) when a
    package of the ``serve`` extra is missing."""
    missing = [
        m
        for m in ("starlette", "uvicorn", "httpx", "prometheus_client")
        if importlib.util.find_spec(m) is None
    ]
    if missing:
        raise errors.ConfigError(f"{what} needs {', '.join(missing)}: {_SERVE_EXTRA_HINT}")
