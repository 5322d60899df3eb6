"""``python -m splitspec.cpu_actor``: the same process as ``python -m splitspec.cpu_actor.service``."""

import sys

from splitspec.cpu_actor.service import main

sys.exit(main())
