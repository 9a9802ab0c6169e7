"""Errors several modules raise and front-ends catch: here so that none of them imports another for it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration or usage error: reported in one line, exit code 2."""
