from __future__ import annotations

from typing import Any

import pytest
import zmq


@pytest.fixture
def ctx_instance() -> zmq.Context[Any]:
    """The process-wide context the publisher uses by default (needed for inproc)."""
    return zmq.Context.instance()
