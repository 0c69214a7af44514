"""Operator tools: the L0 capacity audit (``kvfence audit``) and the request audit log (``kvfence audit-log``)."""
