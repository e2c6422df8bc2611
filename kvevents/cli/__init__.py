"""The ``kvevents`` command line: ``record``, ``inspect``, ``replay``, ``demo``, ``relay``
(and ``serve`` / ``sim serve`` / ``loadgen``, whose parsers :mod:`kvevents.serve.cli`
adds).

One module per command (:mod:`~kvevents.cli.record`, :mod:`~kvevents.cli.inspect`,
:mod:`~kvevents.cli.replay`, :mod:`~kvevents.cli.demo`, :mod:`~kvevents.cli.relay`), the
parser (:mod:`~kvevents.cli.parser`), the entry point (:mod:`~kvevents.cli.entry`) and
shared helpers (:mod:`~kvevents.cli.common`, :mod:`~kvevents.cli.progress`), and what
``record`` writes with (:mod:`~kvevents.cli.rawtap`).  Each command imports what it needs
lazily, so ``kvevents inspect`` starts fast and never imports torch.  Exit status: 0 on
success, 2 for a usage or input error (with a one-line ``kvevents: error: ...`` on
stderr), 130 when interrupted where a command has nothing to save.  Progress (a bar or a
status line) goes to stderr, and only when stderr is a terminal.  Also runnable as
``python -m kvevents`` (or ``python -m kvevents.cli``).
"""

from __future__ import annotations

from kvevents.cli.entry import main
from kvevents.cli.parser import build_parser

__all__ = ["build_parser", "main"]
