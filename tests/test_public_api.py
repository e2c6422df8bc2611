"""The public surface: ``__all__`` lists exactly what each package exports."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import types

import pytest

import kvevents

PACKAGES = [
    "kvevents",
    "kvevents.publishers",
    "kvevents.publishers.offload",
    "kvevents.consumers",
    "kvevents.sim",
    "kvevents.demo",
    "kvevents.serve",
    "kvevents.jetstream",
    "kvevents.codec",
]

DEMO_NAMES = {
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
}
"""The demo's public names: in ``kvevents.demo`` (they left ``kvevents.sim``, a layer below)."""


def _public_names(mod: types.ModuleType) -> set[str]:
    return {
        name
        for name, value in vars(mod).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and name not in {"annotations"}
        # names imported from elsewhere (typing.Any, ...) are not part of the surface
        and str(getattr(value, "__module__", None) or "kvevents").startswith("kvevents")
    }


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_exact(name: str) -> None:
    mod = importlib.import_module(name)
    exported = set(getattr(mod, "__all__", []))
    torch_missing = importlib.util.find_spec("torch") is None
    for item in exported:
        if torch_missing and item in getattr(mod, "_TORCH_NAMES", ()):
            continue  # loaded lazily from the torch-only transfer module
        assert hasattr(mod, item), f"{name}.__all__ names missing {item}"
    assert _public_names(mod) - {"__version__"} <= exported
    assert len(exported) == len(mod.__all__), "duplicates in __all__"


def test_top_level_names() -> None:
    for name in (
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
        "KVEventBatch",
        "encode_batch",
        "decode_batch",
        "KVEventsError",
        "DecodeError",
    ):
        assert name in kvevents.__all__


def test_the_top_level_leaves_frames_to_the_codec() -> None:
    """The ZMQ frame helpers are :mod:`kvevents.codec`'s; the top level does not repeat
    them, nor the wire base classes an application never builds."""
    import kvevents.codec

    frames = {
        "END_SEQ",
        "LiveMessage",
        "ReplayReply",
        "pack_live",
        "pack_replay_end",
        "pack_replay_reply",
        "pack_replay_request",
        "pack_seq",
        "parse_live",
        "parse_replay_reply",
        "parse_replay_request",
        "unpack_seq",
    }
    assert frames <= set(kvevents.codec.__all__)
    assert not (frames | {"EventBatch", "KVCacheEvent"}) & set(kvevents.__all__)
    assert not any(hasattr(kvevents, name) for name in frames)


def test_errors_share_one_root() -> None:
    from kvevents import errors

    for name in errors.__all__:
        assert issubclass(getattr(errors, name), kvevents.KVEventsError)


def test_router_side_imports_without_torch() -> None:
    """A router installs without torch: importing the core and consumers must not load it."""
    code = (
        "import sys, kvevents, kvevents.consumers, kvevents.cli;"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_router_needs_no_numpy_cbor2_or_tqdm() -> None:
    """The core dependencies are what a router that follows events needs: the core, the
    consumers, the service and the command line load none of the extras' packages."""
    code = (
        "import sys, kvevents, kvevents.consumers, kvevents.cli, kvevents.jetstream;"
        "import kvevents.serve.app;"
        "loaded = [m for m in ('numpy', 'cbor2', 'tqdm', 'torch') if m in sys.modules];"
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("blocked", "code", "extra"),
    [
        ("cbor2", "from kvevents.hashing import none_hash; none_hash('sha256_cbor', 's')", "cbor"),
        ("numpy", "import kvevents.publishers.offload", "offload"),
    ],
)
def test_a_missing_extra_is_one_clear_error(blocked: str, code: str, extra: str) -> None:
    """Without the extra's package, what needs it raises MissingDependencyError naming
    the extra (an ImportError, so ``except ImportError`` still works)."""
    probe = (
        f"import sys; sys.modules[{blocked!r}] = None\n"
        "from kvevents.errors import MissingDependencyError\n"
        f"try:\n    {code}\n"
        "except MissingDependencyError as exc:\n    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True
    ).stdout
    assert blocked in out and f"kvevents[{extra}]" in out, out


def test_version_matches_pyproject() -> None:
    import re
    from pathlib import Path

    import kvevents
    from kvevents.version import __version__

    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    declared = re.search(r'^version = "([^"]+)"', text, re.M)
    assert declared is not None
    assert kvevents.__version__ == __version__ == declared.group(1)


def test_the_demo_lives_above_the_simulator() -> None:
    """``kvevents.demo`` exports the demo; ``kvevents.sim`` no longer does, and importing
    the simulator loads neither the demo nor the service it drives."""
    import kvevents.demo
    import kvevents.sim

    assert set(kvevents.demo.__all__) == DEMO_NAMES
    assert not DEMO_NAMES & set(kvevents.sim.__all__)
    code = (
        "import sys, kvevents.sim;"
        "loaded = [m for m in ('kvevents.demo', 'kvevents.serve') "
        "if m in sys.modules];"
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
