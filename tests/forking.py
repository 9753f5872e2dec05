"""Trainer processes forked from one that imported torch already: the suite's CPU seam.

Every `python -m trainer` and `python compare.py` a test runs spends about 2 s of CPU importing
torch, DCP and dynamo before it does anything, and the suite runs hundreds of them: more than
half of its 2-core budget was imports. A pytest worker therefore starts one *zygote*
(`python tests/forking.py`, below) that imports those libraries once and then forks a child
for each request. The child is a real process with its own pid, stdin/stdout/stderr pipes,
working directory, environment, session and signals (kill -9, SIGTERM and process-group
signals reach it as they would reach `python -m trainer`); it runs the trainer's own
`__main__` through `runpy`, then ends the way an interpreter does (non-daemon threads joined,
atexit handlers run, the exit status of an uncaught exception or signal).

What a fork cannot reproduce, the real interpreter runs instead (`support.cli.run_cli` and
`support.cli.start` decide, through `forkable`): a `preexec_fn`, another command (torchrun), or an
environment that differs in what is read while torch is imported (OMP_*, TORCH_*, ...). Tests
of start-up itself (a signal while torch is still being imported) ask for the real interpreter
with `start(..., fresh=True)`, and `TEST_FORK=0` runs every process as a real interpreter.
tests/test_forking.py runs one probe (tests/forking_probe.py) both ways and holds them equal.
"""

from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

READ_AT_IMPORT = ("OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "TORCH", "PYTORCH_", "CUDA", "LD_", "PYTHON", "MALLOC_",
                  "LC_", "LANG", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "ACCELERATE_", "USE_TORCH",
                  "USE_TF", "USE_FLAX")
"""Environment variables a library or the interpreter reads while it is imported or starts (the
locale picks the standard streams' encoding; Hugging Face's libraries, which a request may have
the zygote import: `PRELOADABLE`): a child whose environment differs from the zygote's in one of
them needs the real interpreter."""
PRELOADED = ("numpy", "torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint",
             "torch.utils.data", "safetensors.torch")
PRELOADABLE = {"transformers": ("transformers.trainer", "transformers.training_args",
                                "transformers.models.gpt2.modeling_gpt2")}
"""Libraries a request may ask the zygote to import before it forks (once; every later child has
them too): transformers costs each rank of the HF example about 3 CPU-s more than torch. Only
libraries whose import sets nothing from the environment but what READ_AT_IMPORT holds equal,
starts no thread and changes no environment variable (not Lightning: its import reads the
process's rank, and sets variables)."""


def forkable(env: dict, zygote_env: dict) -> bool:
    """Whether a child with `env` behaves as a fresh interpreter would (see READ_AT_IMPORT)."""
    names = {name for name in (*env, *zygote_env) if name.startswith(READ_AT_IMPORT)}
    return all(env.get(name) == zygote_env.get(name) for name in names)


# ----------------------------------------------------------------------------- the client (pytest)
class Zygote:
    """One per pytest worker: started on first use, ends when the worker does (its stdin)."""

    def __init__(self, python: str, cwd: Path, env: dict):
        self.env = dict(env)
        folder = os.environ.get("TMPDIR", "/tmp")
        folder = folder if len(folder) < 64 else "/tmp"  # a Unix socket's path is at most 107 bytes
        self.address = str(Path(folder) / f"trainer-zygote-{os.getpid()}.sock")
        self.cpu_seconds = 0.0
        """CPU its children used, reported as each one ends (support/cpu.py's TEST_CPU_LOG counts it)."""
        self.process = subprocess.Popen([python, __file__, self.address], cwd=cwd, env=self.env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        if self.process.stdout.readline() != b"ready\n":
            raise RuntimeError("the trainer zygote did not start")

    def spawn(self, argv: list[str], cwd: Path, env: dict, new_session: bool, preload: str | None = None) -> "Forked":
        """A forked child running `argv` (["-m", "trainer", ...] or [script.py, ...]); `preload`
        (a key of PRELOADABLE) imported by the zygote first."""
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(self.address)
            request = json.dumps({"argv": argv, "cwd": str(cwd), "env": env, "new_session": new_session,
                                  "preload": preload}).encode()
            socket.send_fds(connection, [len(request).to_bytes(8, "big") + request], [out_write, err_write])
            pid = int(read_line(connection))
        except BaseException:
            connection.close()
            for fd in (out_read, err_read):
                os.close(fd)
            raise
        finally:
            os.close(out_write)
            os.close(err_write)
        return Forked(self, argv, pid, connection, os.fdopen(out_read, "r"), os.fdopen(err_read, "r"))

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def read_line(connection: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(64)
        if not chunk:
            raise ConnectionError("the trainer zygote closed the connection")
        data += chunk
    return data


class Forked(subprocess.Popen):
    """A forked child as a `subprocess.Popen` (communicate, wait, poll, kill, send_signal):
    its exit status comes from the zygote, its parent, over the connection."""

    def __init__(self, zygote: Zygote, argv, pid: int, connection: socket.socket, stdout, stderr):  # noqa: D107
        self._zygote, self.args, self.pid, self.returncode = zygote, argv, pid, None
        self.stdin, self.stdout, self.stderr = None, stdout, stderr
        self.text_mode, self.encoding, self.errors, self.universal_newlines = True, None, None, True
        self._communication_started, self._input, self._sigint_wait_secs = False, None, 0.25
        self._waitpid_lock, self._child_created, self._closed_child_pipe_fds = threading.Lock(), True, True
        self._fileobj2output = {}
        self._status = connection

    def _settle(self, timeout: float | None) -> None:
        self._status.settimeout(timeout)
        try:
            status, cpu = read_line(self._status).split()
        except TimeoutError as error:
            raise subprocess.TimeoutExpired(self.args, timeout) from error
        self._status.close()
        self.returncode = int(status)
        self._zygote.cpu_seconds += float(cpu)

    def _wait(self, timeout):
        if self.returncode is None:
            self._settle(timeout)
        return self.returncode

    def _internal_poll(self, _deadstate=None, **_):
        if self.returncode is None:
            ready, _, _ = select.select([self._status], [], [], 0)
            if ready:
                self._settle(None)
        return self.returncode

    def send_signal(self, sig):
        if self.returncode is None:
            os.kill(self.pid, sig)

    def __del__(self):
        pass


# ----------------------------------------------------------------------------- the zygote
def serve(address: str) -> None:
    """Import the libraries once, then fork a child per request until pytest's worker ends."""
    preload(PRELOADED)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(address):
        os.unlink(address)
    listener.bind(address)
    listener.listen(64)
    # A child's end wakes the loop (SIGCHLD through a wakeup pipe): no polling while idle, which
    # spent about 0.2 CPU-s a minute in each worker's zygote for a whole session.
    ended, ended_signal = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(ended_signal, warn_on_full_buffer=False)
    sys.stdout.buffer.write(b"ready\n")
    sys.stdout.flush()
    waiting: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([listener, sys.stdin, ended], [], [], 1.0 if waiting else None)
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            break  # pytest's worker ended
        if ended in ready:
            while True:
                try:
                    os.read(ended, 512)
                except BlockingIOError:
                    break
        if listener in ready:
            connection, _ = listener.accept()
            pid = fork_child(connection, listener, waiting, (ended, ended_signal))
            waiting[pid] = connection
            connection.sendall(f"{pid}\n".encode())
        reap(waiting)
    listener.close()
    os.unlink(address)


def preload(modules) -> None:
    import gc
    import importlib

    gc.disable()  # as trainer/cli.py's start-up: no collections over torch's import
    for name in modules:
        importlib.import_module(name)
    gc.freeze()
    gc.enable()


def reap(waiting: dict[int, socket.socket]) -> None:
    while waiting:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = waiting.pop(pid, None)
        if connection is not None:
            try:  # the status, and the CPU the child used (its own reaped children's included)
                cpu = usage.ru_utime + usage.ru_stime
                connection.sendall(f"{os.waitstatus_to_exitcode(status)} {cpu:.3f}\n".encode())
            except OSError:
                pass  # the test stopped listening
            connection.close()


def fork_child(connection: socket.socket, listener: socket.socket, waiting: dict, wakeup: tuple[int, int]) -> int:
    size_and_request, fds, _, _ = socket.recv_fds(connection, 1 << 20, 2)
    size = int.from_bytes(size_and_request[:8], "big")
    request = size_and_request[8:]
    while len(request) < size:
        request += connection.recv(size - len(request))
    request = json.loads(request)
    if request.get("preload"):
        preload(PRELOADABLE[request["preload"]])
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    code = 1
    try:
        signal.set_wakeup_fd(-1)  # SIGCHLD as a fresh interpreter has it: the default
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in wakeup:
            os.close(fd)
        listener.close()
        connection.close()
        for other in waiting.values():
            other.close()
        code = run_child(request, *fds)
    finally:
        os._exit(code)


def run_child(request: dict, stdout_fd: int, stderr_fd: int) -> int:
    """In the forked child: become `python ARGV` in the request's directory and environment."""
    import random
    import runpy

    if request["new_session"]:
        os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((devnull, 0), (stdout_fd, 1), (stderr_fd, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()  # a fresh interpreter seeds from the OS; forked children would share one sequence
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # so does numpy's global generator, on import
    sys.stdin = sys.__stdin__ = standard_stream(0, like=sys.__stdin__)
    sys.stdout = sys.__stdout__ = standard_stream(1, like=sys.__stdout__)
    sys.stderr = sys.__stderr__ = standard_stream(2, like=sys.__stderr__)
    argv = request["argv"]
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path[0] = str(Path(argv[0]).resolve().parent)
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = exit_code(stop.code)
    except KeyboardInterrupt:
        print_uncaught()
        finish_interpreter()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # as Python does: the status of a SIGINT
        code = 1
    except BaseException:  # noqa: BLE001 - an uncaught exception: its traceback and status 1
        print_uncaught()
        code = 1
    return finish_interpreter(code)


def print_uncaught() -> None:
    """The uncaught exception's traceback, from the program's first frame as a fresh interpreter
    prints it: without the frames of this module and of runpy above it."""
    kind, error, frames = sys.exc_info()
    while frames is not None and frames.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
        frames = frames.tb_next
    sys.excepthook(kind, error.with_traceback(frames), frames)


def exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def finish_interpreter(code: int = 0) -> int:
    """What an interpreter does at exit: join non-daemon threads, run atexit, flush."""
    import atexit

    try:
        threading._shutdown()
    except BaseException:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = code or 120
    return code


def standard_stream(fd: int, like):
    """A text stream on `fd` made as the interpreter makes its standard stream `like` (CPython's
    create_stdio): the zygote's encoding and error handler (the child's locale and PYTHON*
    variables are the zygote's, see READ_AT_IMPORT); with -u/PYTHONUNBUFFERED a raw writer and
    write-through; else line buffering on a terminal, and always on stderr."""
    import io

    unbuffered = like.write_through  # as the interpreter set it for the zygote: PYTHONUNBUFFERED
    if fd == 0:
        binary = io.BufferedReader(io.FileIO(fd, "r", closefd=False))
    else:
        raw = io.FileIO(fd, "w", closefd=False)
        binary = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(binary, encoding=like.encoding, errors=like.errors, write_through=unbuffered,
                            line_buffering=not unbuffered and (os.isatty(fd) or fd == 2))


if __name__ == "__main__":
    serve(sys.argv[1])
