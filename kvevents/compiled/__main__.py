"""``python -m kvevents.compiled {build,clean,status}``: the optional compiled core."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvevents.compiled import MODULES, describe, status
from kvevents.compiled.build import BuildError, build, clean


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvevents.compiled",
        description="Build, remove or inspect the optional mypyc-compiled core "
        "(a source or editable checkout only; KVEVENTS_PURE_PYTHON=1 forces pure Python).",
    )
    p.add_argument(
        "command",
        choices=("build", "clean", "status"),
        help="build: compile in place (needs mypy, setuptools, a C compiler); "
        "clean: remove the compiled files; status: which build imports pick",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="show mypyc's output")
    args = p.parse_args(argv)
    if args.command == "status":
        st = status()
        print(describe())
        for module in st.stale:
            print(f"  changed since the build: {module}")
        return 0
    if args.command == "clean":
        print(f"removed {len(clean())} files")
        return 0
    try:
        files = build(verbose=args.verbose)
    except BuildError as e:
        print(f"kvevents.compiled: {e}", file=sys.stderr)
        return 1
    print(f"built {len(files)} extension files for {len(MODULES)} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
