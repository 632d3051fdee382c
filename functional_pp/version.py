"""The package version (one place; the package and the command line read it)."""
__version__ = "0.2.0"
