"""training-recovery: a PyTorch trainer whose runs survive the loss of their worker.

Run it as `training-recovery --output DIR` (or `python -m trainer --output DIR`); see README.md
for the contracts, docs/ for each topic and docs/architecture.md for the module map. Importing
the package imports nothing heavy: each command and `trainer.recovery` import what they need.
"""

__version__ = "0.1.0"  # the one place: pyproject.toml reads it from here

from trainer.origin import DISTRIBUTION, warn_if_mixed  # noqa: E402  (DISTRIBUTION marks this `trainer` as ours)

warn_if_mixed(__path__[0], __version__)
