"""Helpers shared by the tests: tiny-run overrides, synthetic and recorded snapshots, paths."""
