"""``python -m smp.cli`` is the ``smp`` command."""
import sys

from .entry import main

if __name__ == "__main__":
    sys.exit(main())
