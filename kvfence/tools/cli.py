"""Registers the tools' subcommands: ``kvfence audit`` and ``kvfence audit-log``."""

from __future__ import annotations

from kvfence.tools.audit import add_audit_parser
from kvfence.tools.auditlog import add_audit_log_parser


def add_audit_parsers(sub) -> None:
    """Add ``audit`` and ``audit-log`` to the ``kvfence`` subcommands ``sub``."""
    add_audit_parser(sub)
    add_audit_log_parser(sub)
