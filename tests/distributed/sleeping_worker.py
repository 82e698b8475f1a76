"""Launched by tests/distributed/test_orphans.py through ``cadence launch``: records its pid, then waits forever
(as a training run would, from the launcher's point of view)."""

import os
import sys
import time
from pathlib import Path

Path(sys.argv[1], f"{os.environ['RANK']}.pid").write_text(str(os.getpid()))
while True:
    time.sleep(1)
