"""Name → :class:`CachePolicy` class registry (built in: ``"lru"``, ``"arc"``).

Users plug their own policy in with :func:`register_cache_policy`, or name a class in an
importable module with ``get_cache_policy(name, module_path="pkg.module")``.
"""

from __future__ import annotations

import importlib

from kvevents.errors import OffloadError
from kvevents.publishers.offload.policies.arc import ARCCachePolicy
from kvevents.publishers.offload.policies.base import CachePolicy
from kvevents.publishers.offload.policies.lru import LRUCachePolicy

__all__ = ["get_cache_policy", "known_cache_policies", "register_cache_policy"]

_REGISTRY: dict[str, type[CachePolicy]] = {
    "lru": LRUCachePolicy,
    "arc": ARCCachePolicy,
}


def register_cache_policy(name: str, cls: type[CachePolicy], *, replace: bool = False) -> None:
    """Make ``cls`` available as ``cache_policy=name``.

    Raises :class:`~kvevents.errors.OffloadError` if ``cls`` is not a CachePolicy
    subclass, or if ``name`` is taken and ``replace`` is false.
    """
    if not (isinstance(cls, type) and issubclass(cls, CachePolicy)):
        raise OffloadError(f"{cls!r} is not a CachePolicy subclass")
    if name in _REGISTRY and not replace and _REGISTRY[name] is not cls:
        raise OffloadError(f"cache policy {name!r} is already registered")
    _REGISTRY[name] = cls


def known_cache_policies() -> list[str]:
    """The registered policy names, sorted."""
    return sorted(_REGISTRY)


def get_cache_policy(name: str, module_path: str | None = None) -> type[CachePolicy]:
    """The policy class called ``name``.

    With ``module_path``, ``name`` is a class name inside that importable module (an
    out-of-tree policy).  Unknown names raise :class:`~kvevents.errors.OffloadError`
    listing the known ones.
    """
    if module_path is not None:
        try:
            module = importlib.import_module(module_path)
        except ImportError as exc:
            raise OffloadError(f"cannot import cache policy module {module_path!r}: {exc}") from exc
        cls = getattr(module, name, None)
        if not (isinstance(cls, type) and issubclass(cls, CachePolicy)):
            raise OffloadError(f"{module_path}.{name} is not a CachePolicy subclass")
        return cls
    try:
        return _REGISTRY[name]
    except KeyError:
        raise OffloadError(
            f"unknown cache policy {name!r}; known: {', '.join(known_cache_policies())}"
        ) from None
