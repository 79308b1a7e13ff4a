"""``python -m fedsub.cli``: the same as the ``fedsub`` command."""

import sys

from fedsub.cli.commands import main

sys.exit(main())
