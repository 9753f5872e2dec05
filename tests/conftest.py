"""Registers the shared fixtures and hooks; the helpers live in tests/support/, one module per
concern (its __init__ lists them), and test files import them from there."""

from support.cpu import pytest_collection_finish, pytest_runtest_protocol, pytest_sessionstart  # noqa: F401 - hooks
from support.runs import baseline, baseline_2p, short_baseline  # noqa: F401 - fixtures
from support.s3 import s3_bucket, s3_server  # noqa: F401 - fixtures

# Transitional: every name conftest used to define, for branches that still `from conftest import`.
from forking import Zygote, forkable  # noqa: F401, E402
from s3server import SeaweedServer  # noqa: F401, E402
from support.cli import (FORK_ENV, REPO, TRAINER, compare, finish, forked, one_error_line, run_cli,  # noqa: F401, E402
                         start, train, trainer_env, wait_for_line, zygote, zygote_environment)
from support.clones import INSTALLS, VENVS, fresh_clone, git, make, make_env  # noqa: F401, E402
from support.cpu import cpu_seconds  # noqa: F401, E402
from support.limits import (CLI_TIMEOUT_S, TIMEOUT_SCALE, TIMEOUT_SCALE_ENV, scaled, timeout_scale,  # noqa: F401, E402
                            wait_until)
from support.polyaxon import (COMBINES, FLAG, JOB_FILE, POLYAXON, POLYAXONFILES, PRESETS, check_all,  # noqa: F401, E402
                              polyaxon_check, preset_targets, trainer_argv)
from support.runs import FINAL, SHORT, SHORT_FINAL, attempts, generation, made_once, png_size  # noqa: F401, E402
from support.s3 import INHERITED_AWS, S3Bucket, committed, keys, store_env  # noqa: F401, E402
from support.torchrun import TORCHRUN, TORCHRUN_CHILD_FAILED, clean_environment, free_port, torchrun  # noqa: F401, E402
