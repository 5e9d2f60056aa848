"""``python -m conformance.worker``: a rank process's entry point.

torchrun starts each rank with it (``torchrun ... -m conformance.worker --controller HOST:PORT``, README's
"Across nodes, on torchrun"); the local pool starts ranks that are fresh interpreters with it. The rank
process itself is :mod:`conformance.ranks.worker`.
"""

import sys

from conformance.ranks.worker import main

if __name__ == "__main__":
    sys.exit(main())
