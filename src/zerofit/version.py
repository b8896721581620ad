"""zerofit's version (a leaf: what checkpoints record, without importing the package's API)."""

__version__ = "0.1.0"
