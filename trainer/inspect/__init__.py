"""Read-only commands over a run directory: list, verify, report, timeline, compare."""
