"""``python -m mixprec``: the command line (also what ``torchrun -m mixprec train`` runs)."""

import sys

from mixprec.cli.main import main

sys.exit(main())
