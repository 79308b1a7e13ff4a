"""``python -m fedsub``: the command line, also as torchrun starts it
(``torchrun --nproc-per-node N -m fedsub run CONFIG``)."""

import sys

from fedsub.cli import main

sys.exit(main())
