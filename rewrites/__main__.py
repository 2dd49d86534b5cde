"""`python -m fx_rewrites` is the `fx-rewrites` command."""

from fx_rewrites.app.cli import main

raise SystemExit(main())
