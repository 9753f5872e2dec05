"""Shared test helpers, one module per concern; test files import them from here, never from
each other (tests/conftest.py only registers the fixtures and hooks):

- `limits`: every wall-clock limit through `scaled()`, and `wait_until`;
- `cli`: the real CLI in a (forked, tests/forking.py) subprocess, a live trainer, its lines;
- `runs`: what a run leaves (generations, attempt records, PNGs) and the shared baselines;
- `torchrun`: several processes under torchrun, a free port, a launcher-clean environment;
- `s3`: a real S3 server (tests/s3server.py) and a fresh bucket per test;
- `polyaxon`: the bundle's polyaxonfiles and presets, `polyaxon check`;
- `clones`: a fresh clone of this tree for the README's make targets;
- `cpu`: what each test costs in CPU seconds (TEST_CPU_LOG), and the collector frozen.
"""
