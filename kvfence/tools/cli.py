"""Registers the tools' subcommands: ``kvfence audit``."""

from __future__ import annotations

from kvfence.tools.audit import add_audit_parser


def add_audit_parsers(sub) -> None:
    """Add ``audit`` to the ``kvfence`` subcommands ``sub``."""
    add_audit_parser(sub)
