"""The import layers of ``kvevents``, checked on the source with ``ast`` (nothing is imported).

Rules, each over every module under ``kvevents/``:

* **layers**: a module imports only the layers :data:`LAYER_ALLOWED` lists for its own,
  inside a function too: the core (``kvevents/__init__.py``, every ``kvevents/*.py`` at
  the top level except the command line, and the packages in :data:`CORE_PACKAGES`)
  only the core; ``consumers`` the core; ``publishers`` the core; ``jetstream`` the core
  and ``consumers``; ``sim`` the core and ``publishers`` (so never the service);
  ``serve`` the core, ``consumers`` and ``jetstream`` (so never the simulator).  The
  applications (:data:`APP_TOP`, and each package's command line, :data:`APP_MODULES`)
  may import every layer, and no other layer imports them;
* **torch**: the core and ``consumers`` never import ``torch``, not even inside a
  function;
* **private**: no module imports a ``_private`` name from another kvevents module
  (``from kvevents.x import _y``), nor reaches one through an imported module
  (``x._y``, ``kvevents.x._y``).  A private *module* (``kvevents/pkg/_part.py``) may be
  imported by the modules of its own package ``kvevents.pkg`` only;
* **cycle**: the module-level imports among kvevents modules form no cycle (importing
  ``kvevents.a.b`` also runs ``kvevents/a/__init__.py``, so that is an edge too; imports
  under ``if TYPE_CHECKING:`` do not run and are no edge);
* **lazy**: no ``kvevents`` import inside a function, and no ``importlib.import_module``
  of a literal ``"kvevents..."`` name: imports inside functions are for optional
  third-party dependencies (torch, fastapi, nats-py) only, never a way round a cycle.
  The command line (:data:`APP_TOP`) is exempt: nothing imports it, so its lazy imports
  hide no cycle, and they keep ``kvevents --help`` from loading every layer (each command
  imports what it needs when it runs).

:data:`KNOWN_VIOLATIONS` lists the violations the tree had when this test was written,
each with the module that must fix it.  It may only shrink: the test fails on a violation
that is not listed, and on a listed one that no longer exists.  Run this file as a script
(``python tests/test_layers.py``) to print the violations it finds.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGE = "kvevents"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

CORE_PACKAGES = frozenset({"codec", "seqtrack"})
"""Top-level packages that belong to the core (the codec; sequence tracking)."""
APP_TOP = frozenset({"cli", "__main__", "demo"})
"""Top-level modules or packages of the applications: the command line, and the demo
(which drives ``kvevents serve`` in front of the simulator, so it sits above both).
They may import every layer."""
APP_MODULES = frozenset({"cli", "commands"})
"""Names of the modules that are a package's own command line (``kvevents.serve.cli``,
``kvevents.serve.commands``, ``kvevents.jetstream.cli``): what the ``kvevents`` command
runs, imported by nothing but the command line, so they belong to the applications."""
SIDE_PACKAGES = frozenset({"consumers", "publishers", "jetstream", "serve", "sim"})
"""Top-level packages that are neither core nor command line."""

LAYER_ALLOWED: dict[str, frozenset[str]] = {
    "core": frozenset({"core"}),
    "consumers": frozenset({"core", "consumers"}),
    "publishers": frozenset({"core", "publishers"}),
    "jetstream": frozenset({"core", "consumers", "jetstream"}),
    "sim": frozenset({"core", "publishers", "sim"}),
    "serve": frozenset({"core", "consumers", "jetstream", "serve"}),
}
"""The layers each layer may import (``app`` may import every layer, so it is absent)."""
NO_TORCH_LAYERS = frozenset({"core", "consumers"})
"""Layers that never import torch (the router installs without it)."""
OPTIONAL_DEPS = frozenset(
    {"torch", "numpy", "cbor2", "tqdm", "starlette", "uvicorn", "httpx", "matplotlib", "nats"}
)
"""Third-party packages of the optional extras (offload, sim, cbor, progress, serve, demo,
nats).  A kvevents
module that imports one at module level (directly or through another such module) needs
that extra: importing it inside a function is the lazy import of the extra, allowed."""

# The violations in the tree when this test was written.  Each is the key the test prints,
# under a comment naming the module that must remove it.  The lead empties this list as
# the refactoring branches merge; never add to it.
KNOWN_VIOLATIONS: frozenset[str] = frozenset(
    {
        # empty: every violation found when this test was written has been fixed
    }
)


# --- reading the tree --------------------------------------------------------------------


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def ancestors(mod: str) -> list[str]:
    """``kvevents.a.b`` -> ``["kvevents", "kvevents.a"]``."""
    parts = mod.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@dataclass(frozen=True)
class Import:
    """One name of one import statement."""

    importer: str
    lineno: int
    module: str  # the absolute module the statement names ("torch", "kvevents.x")
    name: str | None  # the name imported from it (``from module import name``), or None
    target: str  # the module this loads: ``module.name`` when that is a module, else module
    in_function: bool
    typing_only: bool  # under ``if TYPE_CHECKING:``

    @property
    def is_kvevents(self) -> bool:
        return self.module == PACKAGE or self.module.startswith(PACKAGE + ".")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@dataclass
class Tree:
    """Modules (dotted name -> whether it is a package) and their parsed source."""

    packages: dict[str, bool]
    asts: dict[str, ast.Module]
    imports: dict[str, list[Import]] = field(init=False)

    def __post_init__(self) -> None:
        self.imports = {m: self._imports_of(m, t) for m, t in self.asts.items()}

    @classmethod
    def from_disk(cls, root: Path = ROOT) -> Tree:
        packages: dict[str, bool] = {}
        asts: dict[str, ast.Module] = {}
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root.parent).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_pkg else parts)
            packages[name] = is_pkg
            asts[name] = ast.parse(path.read_text(encoding="utf-8"), str(path))
        return cls(packages, asts)

    @classmethod
    def from_sources(cls, sources: dict[str, str]) -> Tree:
        """A made-up tree: module name -> source; a name ending in ``/`` is a package."""
        packages = {name.rstrip("/"): name.endswith("/") for name in sources}
        asts = {name.rstrip("/"): ast.parse(src) for name, src in sources.items()}
        return cls(packages, asts)

    def layer(self, mod: str) -> str | None:
        """The layer of module ``mod`` (None: a top-level package nobody classified)."""
        parts = mod.split(".")
        if len(parts) == 1:
            return "core"
        top = parts[1]
        if top in APP_TOP:
            return "app"
        if top in SIDE_PACKAGES:
            return "app" if len(parts) == 3 and parts[2] in APP_MODULES else top
        if top in CORE_PACKAGES:
            return "core"
        if len(parts) == 2 and not self.packages.get(mod, False):
            return "core"  # a top-level kvevents/*.py module
        return None

    def _absolute(self, importer: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = importer.split(".")
        if not self.packages[importer]:
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def _imports_of(self, mod: str, tree: ast.Module) -> list[Import]:
        out: list[Import] = []

        def visit(node: ast.AST, in_function: bool, typing_only: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    visit(child, True, typing_only)
                elif isinstance(child, ast.If) and _is_type_checking(child.test):
                    visit(ast.Module(body=child.body, type_ignores=[]), in_function, True)
                    visit(ast.Module(body=child.orelse, type_ignores=[]), in_function, typing_only)
                elif isinstance(child, ast.Import):
                    for alias in child.names:
                        out.append(
                            Import(
                                mod,
                                child.lineno,
                                alias.name,
                                None,
                                alias.name,
                                in_function,
                                typing_only,
                            )
                        )
                elif isinstance(child, ast.ImportFrom):
                    source = self._absolute(mod, child)
                    for alias in child.names:
                        full = f"{source}.{alias.name}"
                        target = full if full in self.packages else source
                        out.append(
                            Import(
                                mod,
                                child.lineno,
                                source,
                                alias.name,
                                target,
                                in_function,
                                typing_only,
                            )
                        )
                else:
                    visit(child, in_function, typing_only)

        visit(tree, False, False)
        return out

    @functools.cached_property
    def optional_dep_modules(self) -> frozenset[str]:
        """Modules whose module-level imports reach an :data:`OPTIONAL_DEPS` package."""
        needs = {
            mod
            for mod, imps in self.imports.items()
            if any(
                not i.in_function and not i.typing_only and i.module.split(".")[0] in OPTIONAL_DEPS
                for i in imps
            )
        }
        grew = True
        while grew:
            grew = False
            for mod, imps in self.imports.items():
                if mod not in needs and any(
                    not i.in_function and not i.typing_only and i.target in needs for i in imps
                ):
                    needs.add(mod)
                    grew = True
        return frozenset(needs)

    def module_aliases(self, mod: str) -> dict[str, str]:
        """Local names that some import in ``mod`` binds to a kvevents module."""
        aliases: dict[str, str] = {}
        for node in ast.walk(self.asts[mod]):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] != PACKAGE:
                        continue
                    if alias.asname:
                        aliases[alias.asname] = alias.name
                    else:
                        aliases[PACKAGE] = PACKAGE  # ``import kvevents.x`` binds ``kvevents``
        for imp in self.imports[mod]:
            if imp.is_kvevents and imp.name is not None and imp.target != imp.module:
                aliases[imp.name] = imp.target  # ``from kvevents import x``, x a module
        for node in ast.walk(self.asts[mod]):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    full = f"{self._absolute(mod, node)}.{alias.name}"
                    if alias.asname and full in self.packages:
                        aliases[alias.asname] = full
        return aliases


# --- the rules: each yields the keys of the violations it finds --------------------------


def layer_violations(tree: Tree) -> Iterator[str]:
    for mod, imps in tree.imports.items():
        own = tree.layer(mod)
        allowed = LAYER_ALLOWED.get(own or "")
        for imp in imps:
            if imp.module.split(".")[0] == "torch" and own in NO_TORCH_LAYERS:
                yield f"layer: {mod} ({own}) imports torch"
            if allowed is None or not imp.is_kvevents:
                continue
            theirs = tree.layer(imp.target)
            if theirs not in allowed:
                yield f"layer: {mod} ({own}) imports {imp.target} ({theirs})"


def _attribute_chain(node: ast.Attribute) -> tuple[str, list[str]] | None:
    attrs: list[str] = []
    cur: ast.expr = node
    while isinstance(cur, ast.Attribute):
        attrs.append(cur.attr)
        cur = cur.value
    if not isinstance(cur, ast.Name):
        return None
    return cur.id, attrs[::-1]


def private_violations(tree: Tree) -> Iterator[str]:
    for mod, imps in tree.imports.items():
        for imp in imps:
            if not imp.is_kvevents:
                continue
            parts = imp.target.split(".")
            for i, part in enumerate(parts):
                if is_private(part) and not mod.startswith(".".join(parts[:i]) + "."):
                    yield f"private: {mod} imports private module {imp.target}"
                    break
            if imp.name is not None and imp.target == imp.module and is_private(imp.name):
                yield f"private: {mod} imports {imp.module}.{imp.name}"
        aliases = tree.module_aliases(mod)
        seen: set[str] = set()
        for node in ast.walk(tree.asts[mod]):
            chain = _attribute_chain(node) if isinstance(node, ast.Attribute) else None
            if chain is None or chain[0] not in aliases:
                continue
            cur = aliases[chain[0]]
            for attr in chain[1]:
                if f"{cur}.{attr}" in tree.packages:
                    cur = f"{cur}.{attr}"
                    continue
                key = f"private: {mod} reads {cur}.{attr}"
                if is_private(attr) and cur != mod and key not in seen:
                    seen.add(key)
                    yield key
                break


def lazy_violations(tree: Tree) -> Iterator[str]:
    for mod, imps in tree.imports.items():
        if tree.layer(mod) == "app":
            continue  # the command line: see the module docstring
        for imp in imps:
            if imp.in_function and imp.is_kvevents and imp.target not in tree.optional_dep_modules:
                yield f"lazy: {mod} imports {imp.target} inside a function"
        for node in ast.walk(tree.asts[mod]):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            arg = node.args[0]
            if (
                called in ("import_module", "__import__")
                and isinstance(arg, ast.Constant)
                and isinstance(arg.value, str)
                and arg.value.split(".")[0] == PACKAGE
            ):
                yield f"lazy: {mod} imports {arg.value} through importlib"


def module_graph(tree: Tree) -> dict[str, set[str]]:
    """The module-level, run-time import edges among kvevents modules."""
    graph: dict[str, set[str]] = {m: set() for m in tree.packages}
    for mod, imps in tree.imports.items():
        mine = set(ancestors(mod))  # already running when ``mod`` is imported
        for imp in imps:
            if not imp.is_kvevents or imp.in_function or imp.typing_only:
                continue
            for dep in [*ancestors(imp.target), imp.target]:
                if dep in tree.packages and dep != mod and dep not in mine:
                    graph[mod].add(dep)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component: list[str] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(found)


def cycle_violations(tree: Tree) -> Iterator[str]:
    for component in cycles(module_graph(tree)):
        yield "cycle: " + " <-> ".join(component)


def all_violations(tree: Tree) -> set[str]:
    return {
        *layer_violations(tree),
        *private_violations(tree),
        *lazy_violations(tree),
        *cycle_violations(tree),
    }


TREE = Tree.from_disk()


@functools.cache
def tree_violations() -> frozenset[str]:
    """The violations of the package on disk (computed once)."""
    return frozenset(all_violations(TREE))


# --- the tests ---------------------------------------------------------------------------


def test_every_module_has_a_layer() -> None:
    unclassified = sorted(m for m in TREE.packages if TREE.layer(m) is None)
    assert not unclassified, (
        f"unclassified modules {unclassified}: add their top-level package to "
        "CORE_PACKAGES, APP_TOP or SIDE_PACKAGES in tests/test_layers.py"
    )


def test_the_walk_sees_the_tree() -> None:
    """The checks read the real package (a walk that found nothing would pass anything)."""
    assert {"kvevents", "kvevents.errors", "kvevents.consumers"} <= set(TREE.packages)
    graph = module_graph(TREE)
    assert "kvevents.errors" in graph["kvevents"]
    assert "kvevents.consumers" in graph["kvevents.jetstream.snapshots"]
    assert TREE.layer("kvevents.consumers") == "consumers"
    assert TREE.layer("kvevents.hashing") == "core"


FAKE_BASE = {
    "kvevents/": "",
    "kvevents.errors": "",
    "kvevents.codec": "_frame = 1\n",
    "kvevents.consumers/": "",
    "kvevents.consumers.index": "_Layout = 1\nLayout = 2\n",
    "kvevents.publishers/": "",
    "kvevents.publishers.config": "",
    "kvevents.sim/": "",
    "kvevents.sim.http": "",
    "kvevents.serve/": "",
    "kvevents.serve.app": "",
    "kvevents.serve.cli": "",
    "kvevents.demo/": "",
}


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("kvevents.fake", "import torch\n", "layer: kvevents.fake (core) imports torch"),
        ("kvevents.fake", "def f():\n    import torch\n", "layer: kvevents.fake (core) imports torch"),
        ("kvevents.fake", "from kvevents.consumers import index\n", "layer: kvevents.fake (core) imports kvevents.consumers.index (consumers)"),
        ("kvevents.fake", "from kvevents.publishers.config import X\n", "layer: kvevents.fake (core) imports kvevents.publishers.config (publishers)"),
        ("kvevents.consumers.fake", "from ..publishers import config\n", "layer: kvevents.consumers.fake (consumers) imports kvevents.publishers.config (publishers)"),
        ("kvevents.consumers.fake", "import torch.nn\n", "layer: kvevents.consumers.fake (consumers) imports torch"),
        ("kvevents.consumers.fake", "from kvevents.consumers.index import _Layout\n", "private: kvevents.consumers.fake imports kvevents.consumers.index._Layout"),
        ("kvevents.consumers.fake", "from .index import _Layout\n", "private: kvevents.consumers.fake imports kvevents.consumers.index._Layout"),
        ("kvevents.fake", "import kvevents.codec\nkvevents.codec._frame\n", "private: kvevents.fake reads kvevents.codec._frame"),
        ("kvevents.fake", "from kvevents import codec as c\nc._frame\n", "private: kvevents.fake reads kvevents.codec._frame"),
        ("kvevents.fake", "def f():\n    from kvevents import errors\n", "lazy: kvevents.fake imports kvevents.errors inside a function"),
        ("kvevents.fake", "import importlib\nimportlib.import_module('kvevents.codec')\n", "lazy: kvevents.fake imports kvevents.codec through importlib"),
        ("kvevents.serve.fake", "from kvevents.sim.http import X\n", "layer: kvevents.serve.fake (serve) imports kvevents.sim.http (sim)"),
        ("kvevents.sim.fake", "from kvevents.serve import app\n", "layer: kvevents.sim.fake (sim) imports kvevents.serve.app (serve)"),
        ("kvevents.sim.fake", "from kvevents.demo import X\n", "layer: kvevents.sim.fake (sim) imports kvevents.demo (app)"),
        ("kvevents.serve.fake", "from kvevents.serve import cli\n", "layer: kvevents.serve.fake (serve) imports kvevents.serve.cli (app)"),
        ("kvevents.publishers.fake", "from kvevents.consumers import index\n", "layer: kvevents.publishers.fake (publishers) imports kvevents.consumers.index (consumers)"),
    ],
)  # fmt: skip
def test_a_planted_violation_is_found(module: str, source: str, expected: str) -> None:
    tree = Tree.from_sources({**FAKE_BASE, module: source})
    assert expected in all_violations(tree)


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("kvevents.fake", "from kvevents.errors import ConfigError\nimport msgspec\n"),
        ("kvevents.fake", "def f():\n    import fastapi\n"),
        ("kvevents.fake", "from kvevents import __version__\n"),
        ("kvevents.consumers.fake", "from kvevents.consumers.index import Layout\n"),
        ("kvevents.consumers.fake", "from kvevents.codec import decode\n"),
        ("kvevents.cli", "import torch\nfrom kvevents.publishers import config\n"),
        ("kvevents.publishers.fake", "import torch\n"),
        (
            "kvevents.serve.commands",
            "from kvevents.sim.http import X\nfrom kvevents.serve import app\n",
        ),
        ("kvevents.demo.fake", "from kvevents.sim.http import X\nfrom kvevents.serve import app\n"),
        ("kvevents.sim.fake", "from kvevents.publishers import config\n"),
    ],
)
def test_what_is_allowed_passes(module: str, source: str) -> None:
    assert all_violations(Tree.from_sources({**FAKE_BASE, module: source})) == set()


def test_a_private_module_is_open_to_its_own_package_only() -> None:
    base = {
        **FAKE_BASE,
        "kvevents.consumers.index_parts/": "",
        "kvevents.consumers.index_parts._join": "",
    }
    inside = {
        "kvevents.consumers.index_parts.table": "from kvevents.consumers.index_parts import _join\n"
    }
    outside = {
        "kvevents.consumers.router": "from kvevents.consumers.index_parts._join import Join\n"
    }
    assert all_violations(Tree.from_sources({**base, **inside})) == set()
    assert all_violations(Tree.from_sources({**base, **outside})) == {
        "private: kvevents.consumers.router imports private module "
        "kvevents.consumers.index_parts._join"
    }  # fmt: skip


def test_cycles_follow_package_inits_and_skip_type_checking() -> None:
    # a -> b.c runs b/__init__, which imports a: a cycle through the package
    looped = Tree.from_sources(
        {"kvevents/": "", "kvevents.a": "import kvevents.b.c\n", "kvevents.b/": "from kvevents import a\n", "kvevents.b.c": ""}
    )  # fmt: skip
    assert "cycle: kvevents.a <-> kvevents.b" in all_violations(looped)
    typed = Tree.from_sources(
        {
            "kvevents/": "",
            "kvevents.a": "from kvevents.b import X\n",
            "kvevents.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvevents.a import Y\n",
        }
    )
    assert all_violations(typed) == set()
    # a submodule importing its own package's name does not loop through the package
    own = Tree.from_sources({"kvevents/": "from kvevents.a import X\n", "kvevents.a": "from kvevents import errors\n", "kvevents.errors": ""})  # fmt: skip
    assert [v for v in all_violations(own) if v.startswith("cycle")] == []


def test_cycles_finds_every_component() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert cycles(graph) == [["a", "b", "c"], ["d", "e"]]


def test_a_lazy_import_of_a_module_that_needs_an_extra_is_allowed() -> None:
    tree = Tree.from_sources(
        {
            "kvevents/": "",
            "kvevents.gpu": "import torch\n",
            "kvevents.via": "from kvevents import gpu\n",
            "kvevents.user": "def f():\n    from kvevents import via\n    from kvevents import errors\n",
            "kvevents.errors": "",
        }
    )
    assert tree.optional_dep_modules == {"kvevents.gpu", "kvevents.via"}
    assert set(lazy_violations(tree)) == {
        "lazy: kvevents.user imports kvevents.errors inside a function"
    }
    assert "kvevents.publishers.offload.transfer" in TREE.optional_dep_modules


def test_no_new_violations() -> None:
    new = sorted(tree_violations() - KNOWN_VIOLATIONS)
    assert not new, "import-layer violations (rules: tests/test_layers.py):\n" + "\n".join(new)


def test_known_violations_are_still_there() -> None:
    """The allow-list cannot go stale: a fixed violation must leave KNOWN_VIOLATIONS."""
    gone = sorted(KNOWN_VIOLATIONS - tree_violations())
    assert not gone, "fixed, so remove from KNOWN_VIOLATIONS in tests/test_layers.py:\n" + (
        "\n".join(gone)
    )


if __name__ == "__main__":
    for violation in sorted(tree_violations()):
        print(("known  " if violation in KNOWN_VIOLATIONS else "NEW    ") + violation)
