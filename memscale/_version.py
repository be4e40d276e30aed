"""memscale's version, in a module of its own so that the package's
modules can read it without importing the package (an import cycle)."""

__version__ = "0.1.0"
