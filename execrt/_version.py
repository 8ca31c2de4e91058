"""The package version, in a leaf module any layer may import."""

__version__ = "0.1.0"
