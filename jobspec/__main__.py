"""`python -m jobspec`: the same as the `jobspec` command."""

import sys

from jobspec.cli import main

sys.exit(main())
