"""Tier 0: recovery generations in memory, outside the process (`--memory-dir`); see tier.py."""
