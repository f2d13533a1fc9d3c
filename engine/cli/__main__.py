"""``python -m engine.cli`` runs the ``engine`` command."""

import sys

from engine.cli.main import main

sys.exit(main())
