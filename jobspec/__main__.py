import sys

from jobspec.cli import main

sys.exit(main())
