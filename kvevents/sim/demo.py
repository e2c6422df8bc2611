"""Deprecated location of the demo: it moved to :mod:`kvevents.demo`.

The demo drives ``kvevents serve``, which runs the simulator, so it sits above both
and is no longer part of :mod:`kvevents.sim`.  This module only re-exports the public
names of :mod:`kvevents.demo` for code that imports them from here, and warns once with a
:class:`DeprecationWarning`.  It imports :mod:`kvevents.demo` and nothing else of
kvevents; :mod:`kvevents.sim` itself never imports it, so ``import kvevents.sim`` does not
load the service.
"""

import warnings

from kvevents.demo import (
    POLICIES,
    POLICY_LABELS,
    DemoConfig,
    DemoReport,
    PolicyResult,
    format_report,
    report_to_json,
    run_demo,
    run_policy,
    waves,
    write_plot,
)

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

warnings.warn(
    "kvevents.sim.demo moved to kvevents.demo; import the demo from there",
    DeprecationWarning,
    stacklevel=2,
)
