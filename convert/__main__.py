"""`python -m convert ...`: see convert.cli."""

import sys

from convert.cli import main

if __name__ == "__main__":
    sys.exit(main())
