# Two commands for a fresh clone (Python 3.11+ and make): `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Polyaxon's server (haupt sandbox) in a venv of its own: its pins conflict with s3fs's.
SANDBOX_VENV := .venv-sandbox
SANDBOX_STAMP := $(SANDBOX_VENV)/.installed

.PHONY: demo test bench s3-server clean polyaxon-demo

# The project itself, editable (pyproject.toml): `from trainer import recovery`, the examples and
# `training-recovery` work from any directory once the venv is active. No build isolation: the
# setuptools pinned in requirements-dev.txt builds it, nothing else is fetched.
$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

$(SANDBOX_STAMP): requirements-sandbox.txt
	$(PYTHON) -m venv $(SANDBOX_VENV)
	$(SANDBOX_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -r requirements-sandbox.txt
	touch $(SANDBOX_STAMP)

# Interrupt a run at step 27 (exit 75), resume it, train an uninterrupted baseline, and
# prove the two final generations are bit-identical. Re-running replaces the demo outputs.
demo: $(STAMP)
	rm -rf outputs/recovery outputs/baseline
	$(PY) -m trainer --output outputs/recovery --interrupt-at-step 27; test $$? -eq 75
	$(PY) -m trainer --output outputs/recovery --resume
	$(PY) -m trainer --output outputs/baseline
	$(PY) -m trainer compare outputs/baseline/checkpoints/step-00000064 outputs/recovery/checkpoints/step-00000064
	$(PY) -m trainer list outputs/recovery
	$(PY) -m trainer report outputs/recovery

# The two venvs are independent: built side by side (on a fresh machine that is a minute less).
test:
	$(MAKE) --no-print-directory -j2 $(STAMP) $(SANDBOX_STAMP)
	$(PY) -m pytest -q -n 3 --dist loadgroup tests

# Optional: Polyaxon's own server and a local agent on this machine, then the bundle's three
# commands (run -u, ops resume, ops restart --copy) with its own files (docs/polyaxon.md).
# `make polyaxon-demo KEEP=1` leaves the server and its UI up afterwards, until Ctrl-C.
polyaxon-demo: $(STAMP) $(SANDBOX_STAMP)
	$(PY) -m trainer.integrations.polyaxon.demo --sandbox $(SANDBOX_VENV)/bin/haupt $(if $(KEEP),--keep)

# Quick checkpoint benchmarks (ratios against raw disk, torch.save and stock dcp.save measured
# in the same run; the store's against plain S3 clients on a loopback SeaweedFS it starts);
# see docs/checkpoint-modes.md for the full-size commands. `make bench JSON=DIR` also writes
# each one's results to DIR/NAME.json.
bench_json = $(if $(JSON),--json $(JSON)/$(1).json)
bench: $(STAMP)
	$(if $(JSON),mkdir -p $(JSON))
	$(PY) bench/checkpoint_bench.py --quick $(call bench_json,checkpoint_bench)
	$(PY) bench/loop_overhead.py --quick $(call bench_json,loop_overhead)
	$(PY) bench/reduction_bench.py --quick $(call bench_json,reduction_bench)
	$(PY) bench/store_bench.py --quick $(call bench_json,store_bench)
	$(PY) bench/goodput_sim.py --quick $(call bench_json,goodput_sim)

# A local S3 server (SeaweedFS, from requirements-dev.txt) to try `--output s3://BUCKET/RUN`:
# creates BUCKET, prints the `export AWS_...` lines (also in outputs/s3-server/env.sh), runs
# until Ctrl-C or SIGTERM. `make s3-server BUCKET=other` names another bucket.
BUCKET ?= my-bucket
s3-server: $(STAMP)
	$(PY) tests/s3server.py --dir outputs/s3-server --bucket $(BUCKET)

clean:
	rm -rf outputs outputs-polyaxon-demo .pytest_cache build *.egg-info
