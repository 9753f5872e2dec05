"""A launch in miniature for tests/test_spare.py, torch-free: an *agent* (`PROBE_ROLE=agent`)
starts *workers* (this same file, `PROBE_ROLE=worker`) as torchrun's agent does, as its own
children, on commands from its stdin:

    start {"argv": [...], "env": {...}}   ->  started PID
    wait PID                              ->  status PID RETURNCODE

A worker of the first round (TORCHELASTIC_RESTART_COUNT=0) forks the warm spare as the trainer's
first worker does (trainer/parallel/spare.py `start_spare`) and says `spare PID`. A worker of a
later round asks the spare first (`run_from_spare`, as trainer/__main__.py does); whoever runs it
(the spare's child, or itself when no spare served it) says `worker pid=... from_spare=...` and
then does what PROBE_ACTION says: `exit:N` (N < 0: die by signal -N), or `wait` (until SIGTERM: 75).
"""

import json
import os
import signal
import subprocess
import sys

from trainer.parallel.spare import FRONT_ENV, exit_as, from_spare, run_from_spare, start_spare


def agent() -> None:
    children = {}
    for line in sys.stdin:
        verb, _, rest = line.strip().partition(" ")
        if verb == "start":
            request = json.loads(rest)
            child = subprocess.Popen([sys.executable, __file__, *request["argv"]], env=request["env"])
            children[child.pid] = child
            print(f"started {child.pid}", flush=True)
        elif verb == "wait":
            print(f"status {rest} {children.pop(int(rest)).wait()}", flush=True)


def worker() -> None:
    if (status := run_from_spare(sys.argv, os.environ)) is not None:
        exit_as(status)
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        print(f"spare {start_spare(os.environ)}", flush=True)
        return
    action = os.environ.get("PROBE_ACTION", "exit:0")
    if action == "wait":  # before it says it runs: the test signals it then
        signal.signal(signal.SIGTERM, lambda *_: os._exit(75))
    print(f"worker pid={os.getpid()} from_spare={from_spare(os.environ)} front={os.environ.get(FRONT_ENV)} "
          f"argv={','.join(sys.argv[1:])}", flush=True)
    if action == "wait":
        while True:
            signal.pause()
    code = int(action.split(":")[1])
    if code < 0:
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    agent() if os.environ.get("PROBE_ROLE") == "agent" else worker()
