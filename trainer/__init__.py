"""training-recovery: a PyTorch trainer whose runs survive the loss of their worker.

Run it as `python -m trainer --output DIR`; see README.md and DESIGN.md for the contracts.
"""
