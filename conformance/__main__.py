"""``python -m conformance``: the same as the ``conform`` command."""

import sys

from conformance.controller.cli import main

sys.exit(main())
