"""The `edgerun` subcommands: one module each, its parser beside its handler."""
