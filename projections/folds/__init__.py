"""Fold modules, one per domain; importing this package registers them all."""

from . import messages  # noqa: F401
