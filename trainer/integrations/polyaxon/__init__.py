"""Polyaxon: tracking (the observer) and where a tracked run keeps its run directory."""
