"""``python -m infinity``: the command line."""

import sys

from infinity.cli.main import main

sys.exit(main())
