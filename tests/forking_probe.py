"""Run by tests/test_forking.py twice, as a fresh interpreter and as a child forked from the
zygote (tests/forking.py): `python forking_probe.py MODE [ARG]` does one thing an interpreter
must do the same way in both.

    report STATUS   print what the process sees (argv, cwd, environment, signals, stdio, fds...)
                    as JSON on stdout, one line on stderr, then exit with STATUS
    wait            print "ready", then wait for a signal
    raise           an uncaught exception
    exit-message    sys.exit("a message")
    at-exit         return at once with a non-daemon thread still running and an atexit handler
"""

import atexit
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time


def disposition(handler) -> str:
    if handler in (signal.SIG_DFL, signal.SIG_IGN):
        return handler.name
    return getattr(handler, "__qualname__", repr(handler))


def stream(text_stream) -> dict:
    return {"fileno": text_stream.fileno(), "encoding": text_stream.encoding, "errors": text_stream.errors,
            "line_buffering": text_stream.line_buffering, "write_through": text_stream.write_through,
            "buffer": type(text_stream.buffer).__name__, "isatty": text_stream.isatty(),
            "is_dunder": text_stream is getattr(sys, f"__{name_of(text_stream)}__")}


def name_of(text_stream) -> str:
    return {0: "stdin", 1: "stdout", 2: "stderr"}[text_stream.fileno()]


def report() -> dict:
    import numpy

    listing = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    fds = sorted(int(fd) for fd in os.listdir(listing) if int(fd) != listing)
    os.close(listing)
    return {
        "name": __name__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "env": dict(os.environ),
        "inherited_env": sorted(subprocess.run(["env", "-0"], capture_output=True).stdout.decode().split("\0")),
        "signals": {signal.Signals(s).name: disposition(signal.getsignal(s)) for s in sorted(signal.valid_signals())
                    if s in signal.Signals.__members__.values() and signal.getsignal(s) is not None},
        "blocked": sorted(signal.Signals(s).name for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "stdin_read": sys.stdin.read(),
        "streams": [stream(s) for s in (sys.stdin, sys.stdout, sys.stderr)],
        "fds": fds, "threads": threading.active_count(), "flags": list(sys.flags),
        "session_leader": os.getsid(0) == os.getpid(), "group_leader": os.getpgrp() == os.getpid(),
        "umask": os.umask(0o022), "main_module": sys.modules["__main__"].__file__,
        "random": random.random(), "numpy_random": float(numpy.random.random()),
    }


def main() -> None:
    mode = sys.argv[1]
    if mode == "report":
        print(json.dumps(report()))
        print("a line on stderr", file=sys.stderr)
        sys.exit(int(sys.argv[2]))
    if mode == "wait":
        # SIGINT as a fresh interpreter of an interactive shell has it (KeyboardInterrupt), set
        # here: a suite started from a background shell or `nohup … &` hands it on ignored, and
        # Python then keeps it ignored, so the signal would never end the probe (issue 57).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print("ready", flush=True)
        # Short sleeps, not signal.pause(): a signal that lands after "ready" but before pause()
        # starts has its handler run then, and pause() waits for another that never comes (the
        # test timed out so, once in CI). A sleep returns on its own and lets the handler act.
        while True:
            time.sleep(0.05)
    if mode == "raise":
        raise RuntimeError("the probe's uncaught exception")
    if mode == "exit-message":
        sys.exit("a message")
    if mode == "at-exit":
        atexit.register(lambda: print("atexit handler ran", flush=True))
        threading.Thread(target=lambda: (time.sleep(0.2), print("non-daemon thread finished", flush=True))).start()
        return
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
