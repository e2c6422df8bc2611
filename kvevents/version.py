"""The package version, in a module of its own so that any layer can read it without
importing the package's public API (``kvevents/__init__.py`` imports every layer)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
"""Keep equal to ``version`` in ``pyproject.toml`` (a test checks)."""
