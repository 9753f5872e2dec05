"""One attempt of a run: the loop and what it is made of (state, cadence, stepping, records)."""
