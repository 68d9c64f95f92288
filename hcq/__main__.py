"""`python -m hcq ...` is the `hcq` command."""
import sys

from hcq.cli import main

sys.exit(main())
