"""`python -m rewrites` is the `fx-rewrites` command."""

from rewrites.cli import main

raise SystemExit(main())
