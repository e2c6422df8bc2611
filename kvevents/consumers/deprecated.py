"""Old names kept for one release: keyword arguments renamed to carry their unit.

One job: turn a renamed keyword into its new name with a :class:`DeprecationWarning`.
Imports nothing of kvevents.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

__all__ = ["renamed_kwargs", "warn_renamed"]


def warn_renamed(old: str, new: str, where: str, *, stacklevel: int = 3) -> None:
    """Emit the :class:`DeprecationWarning` for ``where``'s ``old`` name, now ``new``;
    ``stacklevel`` as :func:`warnings.warn` (3: the caller of the function that warns)."""
    warnings.warn(
        f"{where}: {old!r} is deprecated, use {new!r} (the old name goes in the next release)",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def renamed_kwargs(
    given: Mapping[str, Any],
    renames: Mapping[str, str],
    where: str,
    *,
    stacklevel: int = 4,
) -> dict[str, Any]:
    """Map the old keyword names in ``given`` to their new names (``renames``: old ->
    new), warning once for each old name used.

    Raises :class:`TypeError` for a name that is neither (as Python does for an unknown
    keyword argument).  ``stacklevel`` points the warning at the user's call: 4 is the
    caller of the ``__init__`` that calls this."""
    out: dict[str, Any] = {}
    for old, value in given.items():
        new = renames.get(old)
        if new is None:
            raise TypeError(f"{where}() got an unexpected keyword argument {old!r}")
        warn_renamed(old, new, where, stacklevel=stacklevel)
        out[new] = value
    return out
