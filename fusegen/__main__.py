"""`python -m fusegen`: the `fusegen` command."""
import sys

from .cli import main

sys.exit(main())
