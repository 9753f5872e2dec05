"""The project installed as a user installs it (pyproject.toml), the name `trainer` shared with
another distribution (trainer/origin.py), and what importing the package costs.

A wheel is built here from a copy of the sources (setuptools, no build isolation: nothing is
fetched, and no build/ or .egg-info lands in the checkout), then installed into a fresh venv
whose dependencies are this venv's, through a `.pth` file: nothing is downloaded.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from support.cli import REPO, run_cli
from support.limits import CLI_TIMEOUT_S, scaled
from support.runs import generation, made_once

SITE = sysconfig.get_paths()["purelib"]
PIP = (sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet")
FOREIGN = ("tts_trainer_dummy", "0.0.36")
"""The dummy of Coqui's TTS trainer: another distribution with a top-level `trainer`."""


def build_wheel(folder: Path) -> None:
    """Our wheel into `folder`, built from a copy of the sources."""
    source = folder / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    shutil.copytree(REPO / "trainer", source / "trainer", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([*PIP, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(folder), str(source)],
                   check=True, capture_output=True, timeout=scaled(300))


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    return next(made_once(tmp_path_factory, "wheel", build_wheel).glob("training_recovery-*.whl"))


def fresh_venv(folder: Path) -> Path:
    """A venv without pip or packages of its own; this venv's site-packages after its own."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=scaled(120))
    python = folder / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "dependencies.pth").write_text(SITE + "\n")
    return python


def pip_install(python: Path, *what: str) -> None:
    result = subprocess.run([*PIP, "--python", str(python), "install", "--no-index", *what], capture_output=True,
                            text=True, timeout=scaled(300))
    assert result.returncode == 0, result.stderr[-2000:]


def user_env() -> dict:
    """A user's shell: nothing of ours on PYTHONPATH."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONUNBUFFERED": "1"}


def in_venv(python: Path, *args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), *args], cwd=cwd, env=env or user_env(), capture_output=True, text=True,
                          timeout=scaled(CLI_TIMEOUT_S))


# ----------------------------------------------------------------------------- installed from a wheel
def hf_baseline(tmp_path_factory) -> Path:
    """The HF example, uninterrupted, from the checkout (the state compares equal wherever the
    code was imported from): the same run as test_library.py's `example_baseline("hf-trainer")`,
    under its name, so the session makes it once."""
    def make(folder: Path) -> None:
        assert run_cli(REPO / "examples" / "hf_trainer.py", folder / "run").returncode == 0
    return made_once(tmp_path_factory, "library-hf-trainer", make) / "run"


def test_the_wheel_installed_in_a_fresh_venv_runs_the_hf_example_from_elsewhere_exact_after_a_kill_9(
        tmp_path, tmp_path_factory, wheel):
    python = fresh_venv(tmp_path / "venv")
    pip_install(python, f"training-recovery[hf] @ {wheel.as_uri()}")  # the extra resolves to what is there
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    where = in_venv(python, "-c", "import trainer; print(trainer.__file__)", cwd=elsewhere)
    assert where.stdout.startswith(str(tmp_path / "venv")) and where.stderr == "", where
    script = python.parent / "training-recovery"
    # The same command, the same exit code; each names itself as the user typed it (the usage line)
    for command, said in (([str(script)], "training-recovery"), ([str(python), "-m", "trainer"], "python -m trainer")):
        wrong = subprocess.run([*command, "list", str(tmp_path / "nothing"), "--nope"], cwd=elsewhere, env=user_env(),
                               capture_output=True, text=True, timeout=scaled(CLI_TIMEOUT_S))
        assert wrong.returncode == 2 and wrong.stderr.startswith("trainer: error: "), wrong
        assert wrong.stderr.rstrip().endswith(f"(see {said} list --help)"), wrong.stderr
    # A checkout on PYTHONPATH wins over the installed copy, silently (the suite runs that way).
    checkout = in_venv(python, "-c", "import trainer; print(trainer.__file__)", cwd=elsewhere,
                       env={**user_env(), "PYTHONPATH": str(REPO)})
    assert checkout.stdout.strip() == str(REPO / "trainer" / "__init__.py") and checkout.stderr == "", checkout

    example, run = REPO / "examples" / "hf_trainer.py", tmp_path / "run"
    killed = subprocess.Popen([str(python), str(example), str(run)], cwd=elsewhere, env=user_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in killed.stdout:
        if line.startswith("step=") and int(line.split()[0].split("=")[1]) >= 7:
            killed.kill()
            break
    assert killed.wait(timeout=scaled(300)) == -signal.SIGKILL
    assert generation(run, "step-00000005").is_dir()

    resumed = in_venv(python, str(example), str(run), cwd=elsewhere)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "restored step-00000005" in resumed.stdout + resumed.stderr
    same = in_venv(script, "compare", str(generation(hf_baseline(tmp_path_factory), "step-00000018")),
                   str(generation(run, "step-00000018")), cwd=elsewhere)  # the installed command, as docs say
    assert same.returncode == 0, same.stdout[-2000:] + same.stderr[-2000:]


# ----------------------------------------------------------------------------- the name clash
def foreign_wheel(folder: Path) -> Path:
    """A wheel of another distribution that installs a top-level `trainer` (as Coqui's does)."""
    name, version = FOREIGN
    info = f"{name}-{version}.dist-info"
    files = {"trainer/__init__.py": "from trainer.trainer import Trainer  # theirs\n",
             "trainer/trainer.py": "class Trainer:\n    pass\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests/test_install.py\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()}"
              f",{len(text.encode())}" for path, text in files.items()]
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name_in, text in files.items():
            archive.writestr(name_in, text)
        archive.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")
    return path


def test_another_distributions_trainer_beside_ours_is_named_in_one_line_whichever_came_last(tmp_path, wheel):
    python, theirs = fresh_venv(tmp_path / "venv"), foreign_wheel(tmp_path)
    name, version = FOREIGN
    pip_install(python, "--no-deps", str(theirs))
    pip_install(python, "--no-deps", str(wheel))
    # Ours last: our __init__ runs beside their module; one warning line, and ours still works.
    mixed = in_venv(python, "-c", "import trainer.errors", cwd=tmp_path)
    assert mixed.returncode == 0
    line, = mixed.stderr.splitlines()
    assert line.startswith("trainer: warning: ") and f"{name} {version}" in line and "trainer.py" in line, line
    assert "venv of its own" in line

    # Theirs last: their __init__ is `trainer`; our entry points refuse in one line.
    pip_install(python, "--no-deps", "--force-reinstall", str(theirs))
    imported = in_venv(python, "-c", "from trainer import recovery", cwd=tmp_path)
    assert imported.returncode == 1
    last = imported.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: `import trainer` found ") and f"{name} {version}" in last, last
    command = in_venv(python.parent / "training-recovery", "list", str(tmp_path), cwd=tmp_path)
    assert command.returncode == 2
    line, = command.stderr.splitlines()
    assert line.startswith("trainer: error: `import trainer` found ") and f"{name} {version}" in line, line
    assert "training-recovery" in line and "venv of its own" in line


def test_a_stale_copy_that_hides_the_installed_package_is_named_but_a_checkout_is_not(tmp_path, wheel):
    python = fresh_venv(tmp_path / "venv")
    pip_install(python, "--no-deps", str(wheel))
    shutil.copytree(REPO / "trainer", tmp_path / "old" / "trainer", ignore=shutil.ignore_patterns("__pycache__"))
    stale = in_venv(python, "-c", "import trainer", cwd=tmp_path, env={**user_env(), "PYTHONPATH": str(tmp_path / "old")})
    assert stale.returncode == 0
    line, = stale.stderr.splitlines()
    assert "stale copy" in line and str(tmp_path / "old") in line and "training-recovery 0.1.0" in line, line
    (tmp_path / "old" / "pyproject.toml").touch()  # now a checkout: run from on purpose
    checkout = in_venv(python, "-c", "import trainer", cwd=tmp_path,
                       env={**user_env(), "PYTHONPATH": str(tmp_path / "old")})
    assert checkout.returncode == 0 and checkout.stderr == ""


# ----------------------------------------------------------------------------- what an import costs
HEAVY = ("torch.distributed.checkpoint", "torch.distributed.tensor", "matplotlib", "pandas", "polyaxon", "s3fs", "obstore",
         "fsspec", "botocore", "transformers", "lightning", "accelerate", "trainer.inspect.report",
         "trainer.integrations.polyaxon.tracking", "trainer.storage.object.client", "trainer.recovery.hf",
         "trainer.recovery.lightning", "trainer.recovery.accelerated", "trainer.checkpoint.writer",
         "trainer.checkpoint.safe_load", "trainer.checkpoint.checkpointer", "trainer.checkpoint.export",
         "safetensors", "trainer.run.session", "trainer.run.restoring", "trainer.run.saving", "trainer.storage.base")
"""What neither the package, its entry point nor `from trainer import recovery` may import:
DCP (0.7 s, docs/development.md), the report, tracking, plotting, the store client, the
frameworks (each imported by its adapter alone), and the attempt's machinery (the session, the
checkpointer, the export, the backends: imported as a run opens)."""


def test_the_package_its_entry_point_and_recovery_import_nothing_heavy():
    probe = ("import json, sys\n"
             "import trainer, trainer.__main__\n"
             "entry = set(sys.modules)\n"
             "from trainer import recovery\n"
             "import trainer.cli\n"
             "print(json.dumps([sorted(entry), sorted(sys.modules)]))\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            capture_output=True, text=True, timeout=scaled(300))
    assert result.returncode == 0, result.stderr[-2000:]
    entry, recovery = json.loads(result.stdout)
    assert "torch" not in entry and "numpy" not in entry  # the entry point imports torch after its signal handlers
    assert "trainer.recovery.run" in recovery  # the probe can see what it looks for
    assert [name for name in recovery if name.startswith(HEAVY)] == []


def test_no_page_example_or_make_target_asks_for_pythonpath():
    """Installed, the package imports from anywhere: the README, docs/, the examples' usage lines
    and the Makefile no longer put the repository on PYTHONPATH."""
    pages = [REPO / "README.md", REPO / "Makefile", *(REPO / "docs").glob("*.md"), *(REPO / "examples").glob("*.py")]
    assert [str(page.relative_to(REPO)) for page in pages if "PYTHONPATH=" in page.read_text()] == []
