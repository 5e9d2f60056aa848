"""``python -m conformance.worker``: a rank process's entry point.

torchrun starts each rank with it (``torchrun ... -m conformance.worker --controller HOST:PORT``, README's
"Across nodes, on torchrun"); the local pool starts ranks that are fresh interpreters with it. The rank
process itself is :mod:`conformance.ranks.worker`.
"""

import sys
from typing import List, Optional

from conformance.ranks import remote_worker, worker


def main(argv: Optional[List[str]] = None) -> int:
    """Run a rank: torchrun's (``--controller HOST:PORT``, :func:`conformance.ranks.remote_worker.main`), or the
    local pool's (``FD [PARENT_PID]``, :func:`conformance.ranks.worker.main`). Returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].startswith("--"):  # torchrun ... -m conformance.worker --controller HOST:PORT
        return remote_worker.main(argv)
    return worker.main(argv)


if __name__ == "__main__":
    sys.exit(main())
