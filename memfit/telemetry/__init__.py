"""Measuring: memory readings, metric records and their display."""
