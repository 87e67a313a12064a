import sys

from gspo.cli import entry

sys.exit(entry())
