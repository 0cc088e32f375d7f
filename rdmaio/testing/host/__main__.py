"""``python -m rdmaio.testing.host [options] -- CMD [ARGS...]``: see :mod:`rdmaio.testing.host`."""

import sys

from rdmaio.testing.host.cli import main

sys.exit(main())
