"""Measuring and showing: memory readings, the profiler walk, metrics file and endpoints, bench cells, "
"plots, platform report."""
