"""Byte units for display (bytes stay integers everywhere else)."""

MIB = 1 << 20
GIB = 1 << 30
