"""`python -m emulator ...`: hands over to tools/cli.py.

The commands (tour, bench, ...) use collectives and parallel, so they live in tools/, above every
package; this shim is the one place emulator/ names a package above it, and only when run.
"""

import sys

from tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
