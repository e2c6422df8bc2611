"""``python -m kvevents``: the ``kvevents`` command line."""

import sys

from kvevents.cli import main

if __name__ == "__main__":
    sys.exit(main())
