"""`python -m fibquant.cli` = the `fibquant` command."""
import sys

from fibquant.cli import main

sys.exit(main())
