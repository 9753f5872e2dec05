"""training-recovery: a PyTorch trainer whose runs survive the loss of their worker.

Run it as `python -m trainer --output DIR`; see README.md for the contracts, docs/ for each topic and docs/architecture.md for the module map.
"""
