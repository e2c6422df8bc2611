"""``python -m kvevents.cli``: the ``kvevents`` command line."""

import sys

from kvevents.cli.entry import main

if __name__ == "__main__":
    sys.exit(main())
