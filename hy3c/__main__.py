"""`python -m hy3c` runs the `hy3c` command line."""

from hy3c.cli import main

raise SystemExit(main())
