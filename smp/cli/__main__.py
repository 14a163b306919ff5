"""``python -m smp.cli`` is the ``smp`` command."""
import sys

from smp.cli.entry import main

if __name__ == "__main__":
    sys.exit(main())
