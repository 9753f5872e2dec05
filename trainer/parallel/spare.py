"""The warm spare: a restarted worker that skips the imports.

A kill -9 of one rank under `torchrun --max-restarts` cost about 3 s before the next step, and
2.5–3 s of it were the restarted worker's imports (torch, DCP, dynamo, the trainer) on a machine
where every rank restarts at once. So the first worker of each node (local rank 0), once it has
imported all of that and before it starts any thread, forks a *spare*: a process that keeps the
imports and waits on a Unix socket. A restarted worker (`python -m trainer`, before it imports
torch: trainer/__main__.py) asks the spare for a fork of itself: it sends its argv, environment,
working directory and standard streams, and the spare forks a child that takes them over and
runs the trainer as a fresh worker would. The thin process the agent started stays the agent's
child: it passes SIGTERM and SIGINT on, and ends as the worker ended (its status, or its signal).

What it guarantees, and why each rule is there:
- The child is the worker: its pid is the one the heartbeat publishes and a frozen peer's
  silence kills; its record says it came from the spare (`warm_spare`). A front process that is
  SIGKILLed (the agent's teardown) takes its worker with it: the spare sees the connection close
  and kills the child.
- The spare serves only its launch: its socket lies in a directory of this user's alone (0700),
  named after torchrun's run id and agent pid, and it checks the caller's uid (SO_PEERCRED), the
  interpreter, the argv and working directory (the launch's), and the variables read while
  libraries import (`READ_AT_IMPORT`). Anything else is refused, and the worker imports as before.
- No spare outlives its launch: it watches the agent's pid (a pidfd: no reuse), stops taking
  requests when the agent ends and exits once its last child has. It sits in a session of its
  own, so the agent's teardown of a worker's process group never reaches it.
- Any failure on the way (no spare, a stale socket, a refusal) costs the restarted worker a few
  milliseconds and it imports as before.
What it does not: a restarted worker runs the code the launch imported (a source edited between
restarts is picked up by a cold start only); SIGSTOP of the thin process does not stop the
worker (a signal nobody can catch). A user's script gets the same spare through the launch
entry (`torchrun ... -m trainer.launch script.py ARGS`, trainer/launch.py); run plainly
(`torchrun script.py`) it restarts cold.

Nothing here imports torch: the front side runs before anything heavy.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import struct
import sys

FRONT_ENV = "TRAINER_WARM_SPARE_FRONT"
"""In a worker forked by the spare: the pid of the thin process the agent started (its start is
the restart's, for the record's start-up age)."""
READ_AT_IMPORT = ("OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "TORCH", "PYTORCH_", "CUDA", "LD_", "PYTHON", "MALLOC_",
                  "LC_", "LANG", "NCCL_", "HF_", "TRANSFORMERS_", "TRAINER_")
"""Environment variables read while the interpreter starts or a library imports: a request whose
values differ from the spare's is refused (the worker would not be what a fresh one is)."""
PER_ROUND = ("TORCHELASTIC_", "TRAINER_WARM_SPARE_")
"""Of those, torchrun's own per-round variables (read at run time, never at import)."""
MAX_REQUEST = 1 << 20
CONNECT_TIMEOUT_S = 2.0
"""The front's bound on the spare's answer (a fork takes milliseconds); then it imports itself."""


def restarts_possible(env) -> bool:
    """Under torchrun with `--max-restarts` above 0, as one of several processes."""
    try:
        return int(env.get("TORCHELASTIC_MAX_RESTARTS") or 0) > 0 and int(env.get("WORLD_SIZE") or 1) > 1
    except ValueError:
        return False


def from_spare(env) -> bool:
    """Whether this worker was forked by the spare (its record says so)."""
    return bool(env.get(FRONT_ENV))


def address(env, agent_pid: int) -> str | None:
    """The spare's socket for this launch on this node, in a directory only this user can enter
    (created if missing); None where no such directory can be had."""
    base = env.get("XDG_RUNTIME_DIR") or ""
    uid = os.getuid()
    if not _private(base, uid):
        base = os.path.join("/tmp", f"training-recovery-{uid}")
        try:
            os.mkdir(base, 0o700)
        except FileExistsError:
            pass
        except OSError:
            return None
        if not _private(base, uid):
            return None
    launch = f"{env.get('TORCHELASTIC_RUN_ID', '')}\0{agent_pid}".encode()
    return os.path.join(base, f"trainer-spare-{hashlib.sha256(launch).hexdigest()[:24]}.sock")


def _private(folder: str, uid: int) -> bool:
    try:
        status = os.lstat(folder) if folder else None
    except OSError:
        return False
    return status is not None and status.st_uid == uid and (status.st_mode & 0o7077) == 0 and \
        os.path.isdir(folder) and not os.path.islink(folder)


def started_environment(env) -> dict:
    """The environment this process was started with (the trainer sets a few variables of its
    own as it runs: a fresh worker starts without them); `env` where /proc cannot say."""
    try:
        with open("/proc/self/environ", "rb") as started:
            pairs = [item.split(b"=", 1) for item in started.read().split(b"\0") if b"=" in item]
        return {os.fsdecode(name): os.fsdecode(value) for name, value in pairs}
    except OSError:
        return dict(env)


def import_environment(env) -> dict:
    return {name: value for name, value in env.items()
            if name.startswith(READ_AT_IMPORT) and not name.startswith(PER_ROUND)}


# ----------------------------------------------------------------------------- the front (no torch)
def run_from_spare(argv: list[str], env) -> int | None:
    """The exit status (negative: the signal) of the worker the spare forked for this process,
    once it ended; None: no spare served it, and this process runs the trainer itself."""
    if from_spare(env) or not restarts_possible(env) or not env.get("TORCHELASTIC_RESTART_COUNT", "0").strip("0"):
        return None  # the spare's own worker; or the first round, which has nothing to fork from
    where = address(env, os.getppid())
    if where is None or not os.path.exists(where):
        return None
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.settimeout(CONNECT_TIMEOUT_S)
        connection.connect(where)
        send_request(connection, {"argv": argv, "env": dict(env), "cwd": os.getcwd(), "executable": sys.executable},
                     [0, 1, 2])
        answer = read_line(connection).split()
    except OSError:
        connection.close()
        return None
    if answer[:1] != [b"pid"]:  # refused: it says why, the worker imports itself
        connection.close()
        return None
    return _follow(connection, int(answer[1]))


def _follow(connection: socket.socket, pid: int) -> int:
    """Pass the agent's stop signals on to worker `pid`, and wait for its status."""
    try:
        worker = os.pidfd_open(pid)
    except OSError:
        worker = None

    def relay(signum, frame) -> None:
        if worker is not None:
            signal.pidfd_send_signal(worker, signum)

    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, relay)
    connection.settimeout(None)
    try:
        return int(read_line(connection).split()[1])
    except (OSError, IndexError, ValueError):  # the spare itself is gone: the worker goes too
        if worker is not None:
            try:
                signal.pidfd_send_signal(worker, signal.SIGKILL)
            except OSError:
                pass
        return -signal.SIGKILL


def exit_as(status: int) -> None:
    """End this process as the worker ended: its exit status, or death by its signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    if status < 0:
        if -status != signal.SIGKILL:
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status & 0xFF)


def read_line(connection: socket.socket) -> bytes:
    """One answer line (tests/forking.py's zygote speaks the same framing)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(256)
        if not chunk:
            raise ConnectionError("the other end closed the connection")
        data += chunk
    return data


def send_request(connection: socket.socket, request: dict, fds: list[int]) -> None:
    """A JSON request, its length first, with `fds` passed along (SCM_RIGHTS)."""
    data = json.dumps(request).encode()
    socket.send_fds(connection, [len(data).to_bytes(8, "big") + data], fds)


def receive_request(connection: socket.socket, most_fds: int) -> tuple[dict, list[int]]:
    """What `send_request` sent: the request and the descriptors that came with it."""
    data, fds, _, _ = socket.recv_fds(connection, MAX_REQUEST, most_fds)
    size = int.from_bytes(data[:8], "big")
    request = data[8:]
    try:
        if size > MAX_REQUEST:
            raise ValueError("request too large")
        while len(request) < size:
            chunk = connection.recv(size - len(request))
            if not chunk:
                raise ConnectionError("the request was cut short")
            request += chunk
        return json.loads(request), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


# ----------------------------------------------------------------------------- the spare
def start_spare(env) -> int | None:
    """Fork this launch's spare from this process (local rank 0 of the first round, all imports
    done, no thread started yet). The spare's pid, or None when there is none (not possible
    here, or one already serves this launch)."""
    import threading

    agent = os.getppid()
    where = address(env, agent)
    if where is None or not hasattr(os, "pidfd_open") or threading.active_count() > 1 or _answers(where):
        return None  # a fork of a process with threads may inherit a lock one of them held
    try:
        os.unlink(where)  # a stale socket (a spare killed hard)
    except FileNotFoundError:
        pass
    except OSError:
        return None
    reader, writer = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    middle = os.fork()
    if middle == 0:  # detached: a session of its own, and not this worker's child
        os.close(reader)
        code = 1
        try:
            os.setsid()
            if os.fork() == 0:
                code = Spare(where, agent, env).serve(writer)
            else:
                code = 0
        finally:
            os._exit(code)
    os.close(writer)
    os.waitpid(middle, 0)
    with os.fdopen(reader, "rb") as ready:
        answer = ready.read()
    return int(answer) if answer.strip().isdigit() else None


def _answers(where: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(where)
        return True
    except OSError:
        return False
    finally:
        probe.close()


class Spare:
    """The spare's loop: fork a worker per request, report each one's status, end with the launch."""

    def __init__(self, where: str, agent: int, env):
        self.where, self.agent = where, agent
        self.argv, self.cwd, self.imported = list(sys.argv), os.getcwd(), import_environment(started_environment(env))
        self.agent_fd = -1
        self.children: dict[int, tuple[socket.socket, int]] = {}
        """A worker's pidfd: (its front's connection, its pid)."""

    def serve(self, ready_fd: int) -> int:
        for stop in (signal.SIGINT, signal.SIGTERM):
            signal.signal(stop, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
        try:
            agent = self.agent_fd = os.pidfd_open(self.agent)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(self.where)
            listener.listen(16)
        except OSError:
            os.close(ready_fd)
            return 1
        os.write(ready_fd, str(os.getpid()).encode())
        os.close(ready_fd)
        import select

        while listener is not None or self.children:
            waiting = [*([listener, agent] if listener is not None else []), *self.children,
                       *(connection for connection, _ in self.children.values())]
            ready, _, _ = select.select(waiting, [], [])
            if listener is not None and agent in ready:  # the launch ended: no new worker
                listener.close()
                listener = None
                self._forget()
                continue
            for pidfd in [fd for fd in self.children if fd in ready]:
                self._reap(pidfd)
            for pidfd, (connection, pid) in list(self.children.items()):
                if connection in ready:  # its front died (the agent's SIGKILL): so does the worker
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            if listener is not None and listener in ready:
                self._accept(listener)
        return 0

    def _forget(self) -> None:
        try:
            os.unlink(self.where)
        except OSError:
            pass

    def _accept(self, listener: socket.socket) -> None:
        connection, _ = listener.accept()
        try:
            connection.settimeout(CONNECT_TIMEOUT_S)
            request, fds = receive_request(connection, 3)
            refusal = self._refusal(connection, request, fds)
            if refusal:
                for fd in fds:
                    os.close(fd)
                connection.sendall(f"refused {refusal}\n".encode())
                connection.close()
                return
            pid = self._fork(request, fds, connection, listener)
            connection.settimeout(None)
            connection.sendall(f"pid {pid}\n".encode())
            self.children[os.pidfd_open(pid)] = (connection, pid)
        except (OSError, ValueError):
            connection.close()

    def _refusal(self, connection: socket.socket, request: dict, fds: list[int]) -> str | None:
        """Why this request is not served (None: it is)."""
        uid = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid != os.getuid():
            return "another user"
        if len(fds) != 3:
            return "no standard streams"
        if request.get("argv") != self.argv or request.get("cwd") != self.cwd:
            return "not this launch's command (argv or working directory)"
        if request.get("executable") != sys.executable:
            return "another interpreter"
        if import_environment(request.get("env") or {}) != self.imported:
            return "an environment that differs in variables read at import"
        return None

    def _fork(self, request: dict, fds: list[int], connection: socket.socket, listener: socket.socket) -> int:
        pid = os.fork()
        if pid:
            for fd in fds:
                os.close(fd)
            return pid
        code = 1
        try:
            front = connection_peer(connection)
            listener.close()
            connection.close()
            os.close(self.agent_fd)
            for other, _ in self.children.values():
                other.close()
            for fd in self.children:
                os.close(fd)
            become_worker(request, fds, front)
            code = run_program()
        finally:
            os._exit(code)

    def _reap(self, pidfd: int) -> None:
        connection, pid = self.children.pop(pidfd)
        os.close(pidfd)
        try:
            _, status = os.waitpid(pid, 0)
            connection.sendall(f"status {os.waitstatus_to_exitcode(status)}\n".encode())
        except OSError:
            pass  # the front is gone
        connection.close()


def run_program() -> int:
    """In the forked child: the program the front process runs (`sys.argv[0]`: trainer's
    `__main__.py` under `python -m trainer`, the console script, or `trainer/launch.py` running
    a user's script), as `__main__`, then the exit handlers, as an interpreter ends (the
    library's own decides a distributed script's status: trainer/recovery/run.py)."""
    import runpy
    import traceback

    from trainer import compat

    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = (stop.code or 0) & 0xFF
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter: the traceback, status 1
        traceback.print_exc()
        code = 1
    try:
        compat.run_exit_handlers()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def connection_peer(connection: socket.socket) -> int:
    """The pid of the process at the other end (the front)."""
    return struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]


def become_worker(request: dict, fds: list[int], front: int) -> None:
    """In the forked child: the front's streams, directory and environment, and the process-wide
    state a fresh interpreter starts with (random seeds, temporary folder, logging, hooks)."""
    import logging
    import random
    import tempfile

    for fd, target in zip(fds, (0, 1, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[FRONT_ENV] = str(front)
    sys.argv = list(request["argv"])
    random.seed()  # a fresh interpreter seeds from the OS
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    tempfile.tempdir = None  # read again from this environment
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    sys.excepthook = sys.__excepthook__
