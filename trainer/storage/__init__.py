"""Where a run directory lives: one backend interface, on local disk or in an object store."""
