"""The application layer, above the backends: the `fx-rewrites` command line, the demo and its gallery."""
