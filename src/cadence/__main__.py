"""``python -m cadence ...`` is the ``cadence`` command, so ``cadence launch -m cadence fit ...`` runs it on N ranks."""

import sys

from cadence.cli import main

if __name__ == "__main__":
    sys.exit(main())
