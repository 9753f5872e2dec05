"""Generations and exports: layout-level sealed directories, manifests, the atomic publish, DCP writes and reads."""
