"""`python -m runner SPEC [--set k=v ...] [--nproc N]`: the image's entrypoint (see runner/process/supervisor.py)."""

import sys

from runner.process.supervisor import main

if __name__ == "__main__":
    sys.exit(main())
