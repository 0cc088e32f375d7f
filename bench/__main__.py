"""``python -m bench`` (from a checkout of rdmaio): the comparative benchmark harness.

``tools/dev bench ARGS`` runs it inside the test host; ``python -m bench --help`` lists the options.
"""

import sys

from bench.driver import main

if __name__ == "__main__":
    sys.exit(main())
