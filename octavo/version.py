"""octavo's version, in the lowest layer: every module that reports it imports it from here (not the package
facade, which imports the whole engine)."""
__version__ = "0.1.0"
