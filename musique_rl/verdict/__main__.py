"""``python -m musique_rl.verdict --sweep <dir or id> | --experiment hNN`` (see cli.py)."""

import sys

from musique_rl.verdict.cli import main

sys.exit(main())
