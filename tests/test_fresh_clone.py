"""Every make target the README and docs/ show, run as a new user runs it: `make TARGET` in a fresh
`git clone` of this tree (support.clones's `fresh_clone`), from the clone's root, with relative paths as
the Makefile writes them. (`make bench` is run by test_bench.py, which checks each benchmark's
results there.)

Cost (measured on 2 cores shared with other work): the clone about 1 s; `make demo` about 20 s
(three 64-step runs, compare, list, report); `make s3-server` with a 2-epoch run about 15 s, and
its failing start 1 s; `make polyaxon-demo KEEP=1` about 110 s, on the live Polyaxon tests'
worker (`xdist_group`), so it never runs beside them. The checks of what the docs tell a new user, at the end, read files only.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest

from support.cli import REPO, finish, run_cli
from support.clones import fresh_clone, make, make_env
from support.limits import scaled, wait_until


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    return fresh_clone(tmp_path_factory.mktemp("fresh") / "training-recovery")


def start_make(clone: Path, *targets: str) -> subprocess.Popen:
    """`make TARGETS` as a background job (`&` leaves SIGINT ignored: the target must catch it itself)."""
    return subprocess.Popen(["make", *targets], cwd=clone, env=make_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))


def read_until(process: subprocess.Popen, prefix: str) -> list[str]:
    """The process's stdout lines up to and including the first one starting with `prefix`."""
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return lines
    raise AssertionError(f"make ended before printing {prefix!r}:\n{''.join(lines)}\n{process.stderr.read()}")


def interrupt(process: subprocess.Popen, lines: list[str]) -> tuple[str, str]:
    """Ctrl-C to the process that printed `stop: Ctrl-C, or kill PID` (the target's Python),
    then make's remaining output; make exits 0 with it."""
    pid = int(re.search(r"or kill (\d+)", "".join(lines)).group(1))
    try:
        os.kill(pid, signal.SIGINT)
        out, err = finish(process, timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0 and "Traceback" not in err, f"exit {process.returncode}\n{out[-2000:]}\n{err}"
    return out, err


def test_make_demo_on_a_fresh_clone(clone):
    result = make(clone, "demo")
    assert "equal" in result.stdout.lower() or "identical" in result.stdout.lower(), result.stdout[-2000:]
    assert (clone / "outputs" / "recovery" / "checkpoints" / "step-00000064" / "manifest.json").is_file()


def test_make_s3_server_on_a_fresh_clone_serves_the_documented_run(clone):
    """docs/object-store.md: terminal 1 `make s3-server`, terminal 2 the printed exports and a run into
    s3://my-bucket; Ctrl-C (even to a background job) stops the server and its `weed`
    process. Its secret key is readable by this user only."""
    server = start_make(clone, "s3-server")
    lines = read_until(server, "# stop:")
    exports = dict(line.removeprefix("export ").strip().split("=", 1) for line in lines if line.startswith("export "))
    data = clone / "outputs" / "s3-server"
    try:
        for secret in (data / "env.sh", data / "s3-identities.json"):
            assert secret.stat().st_mode & 0o077 == 0, f"{secret} is readable by others"
        run = subprocess.run([".venv/bin/python", "-m", "trainer", "--output", "s3://my-bucket/runs/exp1",
                              "--epochs", "2"], cwd=clone, env={**make_env(), **exports}, capture_output=True,
                             text=True, timeout=scaled(600))
        assert run.returncode == 0, run.stderr[-3000:]
        listed = subprocess.run([".venv/bin/python", "-m", "trainer", "list", "s3://my-bucket/runs/exp1"], cwd=clone,
                                env={**make_env(), **exports}, capture_output=True, text=True, timeout=scaled(300))
        assert listed.returncode == 0 and "step-00000016" in listed.stdout, listed.stderr
        weed = [pid for pid in os.listdir("/proc") if pid.isdigit() and str(data) in cmdline(pid)]
        assert weed, "no weed process serves the data directory"
    finally:
        out, _ = interrupt(server, lines)
    assert "# stopped" in out
    assert not [pid for pid in weed if str(data) in cmdline(pid)]


def test_make_s3_server_names_its_log_when_the_server_cannot_start(clone):
    """A server that exits at once (here a `weed` that is /bin/false) is one line naming its log."""
    result = subprocess.run(["make", "s3-server"], cwd=clone, env={**make_env(), "WEED": "/bin/false"},
                            capture_output=True, text=True, timeout=scaled(120))
    ours = [line for line in result.stderr.splitlines() if not line.startswith("make")]
    assert result.returncode != 0 and len(ours) == 1, result.stderr
    assert ours[0].startswith("s3-server: error: weed server exited with 1 during startup"), ours
    assert ours[0].endswith(f"see its log, {clone / 'outputs' / 's3-server' / 'weed.log'}"), ours


@pytest.mark.xdist_group("polyaxon-sandbox")
def test_make_polyaxon_demo_keep_on_a_fresh_clone_serves_the_ui_offline(clone):
    """`make polyaxon-demo KEEP=1`: the three commands (stopped, resumed from step-00000024,
    a copy seeded from the newest generation), then the server stays up with each run's page
    served from the wheel's own bundles (no CDN), until Ctrl-C."""
    demo = start_make(clone, "polyaxon-demo", "KEEP=1")
    try:
        lines = read_until(demo, "stop: Ctrl-C")
    except BaseException:
        os.killpg(demo.pid, signal.SIGTERM)
        raise
    text = "".join(lines)
    try:
        assert "run -u, interrupted at step 27: run" in text and " stopped (exit 75)" in text, text
        assert "ops resume, same run: run" in text and "restored step-00000024" in text, text
        assert "seeded from run" in text, text
        pages = re.findall(r"(http://127\.0\.0\.1:\d+/ui/default/[\w-]+/runs/[0-9a-f]{32})", text)
        assert len(pages) == 2, text
        with urllib.request.urlopen(pages[0], timeout=30) as answer:
            html = answer.read().decode()
        scripts = re.findall(r'src="([^"]+\.js)"', html)
        assert scripts and not [s for s in scripts if s.startswith("http")], scripts  # nothing from a CDN
        host = pages[0].split("/ui/")[0]
        for script in scripts:
            with urllib.request.urlopen(f"{host}{script}", timeout=30) as answer:
                assert answer.status == 200, script
    finally:
        out, _ = interrupt(demo, lines)
    assert "stopping the server" in out
    wait_until(lambda: not any(str(clone) in cmdline(pid) and "haupt" in cmdline(pid) for pid in os.listdir("/proc")
                               if pid.isdigit()), "the sandbox server stopped", timeout=60)


def cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# ------------------------------------------------------------------------------- what the README tells a new user
def test_the_readme_activates_the_venv_before_its_first_bare_python():
    readme = (REPO / "README.md").read_text()
    assert readme.index("source .venv/bin/activate") < readme.index("python -m trainer --output")


def test_the_store_examples_can_be_followed_in_order():
    """docs/object-store.md: the first store example makes runs/exp1; the s3-server one, run
    after it, needs its own prefix (the same one again without --resume is refused, exit 73)."""
    page = (REPO / "docs" / "object-store.md").read_text()
    first, second = page.split("make s3-server                                  # terminal 1")[:2]
    made = set(re.findall(r"--output (s3://\S+) --interrupt-at-step", first))
    fresh = set(re.findall(r"--output (s3://\S+) --epochs", second.split("```")[0]))
    assert made and fresh and not made & fresh, (made, fresh)


def test_the_polyaxonfiles_say_what_auto_resume_copies_as_the_docs_do():
    docs = " ".join((REPO / "docs" / "polyaxon.md").read_text().split())
    assert "the run directory is beside that folder, so its generations are not downloaded by it" in docs
    for name in ("polyaxonfile.yaml", "pytorchjob.yaml"):
        text = " ".join(line.strip(" #") for line in (REPO / "polyaxonfiles" / name).read_text().splitlines())
        assert "so its generations are not downloaded by it" in text, name
        assert "kept generations" not in text, name


def test_the_help_says_what_each_option_does_there():
    """`list`/`verify` only check signatures; the local tier's default is a path a user can find."""
    for command in ("list", "verify"):
        shown = " ".join(run_cli(command, "--help", env={"COLUMNS": "400"}).stdout.split())
        assert "check each manifest's signature with this key: one not signed with it is not trusted (65)" in shown
        assert "sign every manifest written" not in shown and "else no signature check" in shown
    shown = " ".join(run_cli("--help", env={"COLUMNS": "400"}).stdout.split())  # no wrap inside a path
    assert "sign every manifest written" in shown
    assert ("default: $TRAINER_LOCAL_TIER, else TMPDIR/training-recovery/SCHEME/BUCKET/PREFIX, TMPDIR being the "
            "system's temporary folder") in shown, shown


def test_a_polyaxon_demo_whose_server_cannot_start_says_so_in_one_line_naming_its_log(tmp_path):
    result = subprocess.run([".venv/bin/python", "-m", "trainer.integrations.polyaxon.demo", "--sandbox", "/bin/false",
                             "--root", str(tmp_path / "demo")], cwd=REPO, env=make_env(), capture_output=True,
                            text=True, timeout=scaled(120))
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        f"polyaxon-demo: the Polyaxon sandbox exited 1; see {tmp_path / 'demo'}/server.log"], result.stderr
