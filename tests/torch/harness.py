"""Harness of the ps.torch tests: real ps-server shards on 127.0.0.1 and
real worker processes (/usr/bin/python3 running a script of this folder),
with the settings a launcher gives them in the environment.

PS_BUILD_DIR names the meson build tree (the binaries, libps.so and the
importable package under python/). A test that cannot run here exits 77:
no torch in this Python, or no dataset where one is needed."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

SKIP = 77
HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = os.environ.get("PS_BUILD_DIR", "")
DATA = os.environ.get("PS_DATA_DIR", "/usr/share/datasets/fashion-mnist")
# PS_TEST_PACKAGE=installed: the package under test is the one this Python
# finds (the wheel in a virtual environment: test_wheel.py runs some of these
# tests there), not <build>/python; the workers then get no PYTHONPATH, and
# the binaries (shards, launcher) still come from PS_BUILD_DIR.
INSTALLED = os.environ.get("PS_TEST_PACKAGE") == "installed"


def package_env():
    """What a worker's environment needs to import the package under test."""
    return {} if INSTALLED else {"PYTHONPATH": os.path.join(BUILD, "python")}


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(SKIP)


def require_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        skip(f"no torch in {sys.executable} (apt-get install python3-torch)")


def require_dataset():
    if not any(os.path.exists(os.path.join(DATA, "train-images-idx3-ubyte" + s))
               for s in ("", ".gz")):
        skip(f"Fashion-MNIST is missing under {DATA} (apt-get install dataset-fashion-mnist)")


def fail(msg):
    print(f"FAIL: {msg}", flush=True)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)
    print(f"ok: {msg}", flush=True)


if INSTALLED:
    import ps as _ps  # noqa: E402
    if os.path.realpath(_ps.__file__).startswith(os.path.realpath(BUILD or "/nonexistent") + "/"):
        fail(f"PS_TEST_PACKAGE=installed, but ps is the build's: {_ps.__file__}")


def server_argv(listen, port_file, shard, num_shards, num_workers, *pairs):
    """ps-server's command line as common/server_argv.c builds it for the
    launcher and the C harness (through tests/torch/server_argv_tool.c):
    the fixed part, then the (flag, value) pairs."""
    tool = os.path.join(BUILD, "tests", "torch", "server-argv")
    out = subprocess.run([tool, os.path.join(BUILD, "ps-server", "ps-server"), listen, port_file,
                          str(shard), str(num_shards), str(num_workers), *pairs],
                         capture_output=True, check=True).stdout
    return out.decode().split("\0")[:-1]

class Job:
    """Shards and workers of one test case; stop() kills what is left."""

    def __init__(self, name):
        if not BUILD:
            fail("PS_BUILD_DIR is not set (run through meson test)")
        self.dir = tempfile.mkdtemp(prefix=f"ps-torch-{name}-")
        self.shards = []
        self.workers = []
        self.addrs = []
        self.token = os.path.join(self.dir, "token")
        fd = os.open(self.token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, os.urandom(32).hex().encode())
        os.close(fd)

    def start_shards(self, n, workers, *args):
        self.shard_args = (n, workers, args)
        files = [self._spawn_shard(i, "127.0.0.1:0", "wb") for i in range(n)]
        for i, pf in enumerate(files):
            self.addrs.append(self._wait_port(i, pf))
        return self.addrs

    def restart_shard(self, i, *args):
        """Starts shard i again (after it died: no checkpoint unless args
        give one) on the address it had, appending to its log."""
        self.shard_args = self.shard_args[:2] + (args or self.shard_args[2],)
        pf = self._spawn_shard(i, self.addrs[i], "ab", restart=True)
        got = self._wait_port(i, pf)
        if got != self.addrs[i]:
            fail(f"shard {i} restarted on {got}, not {self.addrs[i]}")

    def _spawn_shard(self, i, listen, how, restart=False):
        n, workers, args = self.shard_args
        pf = os.path.join(self.dir, f"shard-{i}.port")
        if os.path.exists(pf):
            os.unlink(pf)
        log = open(os.path.join(self.dir, f"shard-{i}.log"), how)
        p = subprocess.Popen(
            server_argv(listen, pf, i, n, workers, "--http", "", "--log-level", "warn",
                        "--auth-token-file", self.token) + list(args),
            stdout=log, stderr=subprocess.STDOUT)
        if restart:
            self.shards[i] = p
        else:
            self.shards.append(p)
        return pf

    def _wait_port(self, i, pf):
        deadline = time.monotonic() + 15
        while not (os.path.exists(pf) and open(pf).read().strip()):
            if self.shards[i].poll() is not None:
                fail(f"shard {i} exited with {self.shards[i].returncode}: "
                     + self.log(f"shard-{i}.log"))
            if time.monotonic() > deadline:
                fail(f"shard {i} wrote no port file")
            time.sleep(0.02)
        return open(pf).read().strip()

    def start_workers(self, script, world, mode, args=(), env=None, peers=True):
        """Starts `world` workers running script with ps-local's environment
        (ring sockets bound here and handed over, in both modes)."""
        socks, addrs = [], []
        for _ in range(world if peers else 0):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(64)
            socks.append(s)
            addrs.append("127.0.0.1:%d" % s.getsockname()[1])
        for r in range(world):
            e = dict(os.environ)
            e.update(package_env())
            e.update({
                "PS_SYNC_MODE": mode, "PS_RANK": str(r), "PS_WORLD_SIZE": str(world),
                "RANK": str(r), "WORLD_SIZE": str(world),
                "PS_AUTH_TOKEN_FILE": self.token, "PS_CONNECT_TIMEOUT_MS": "20000",
                "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                "PS_DATA_DIR": DATA,
            })
            if mode == "ps":
                e["PS_SERVERS"] = ",".join(self.addrs)
            fds = ()
            if peers:
                e["PS_PEERS"] = ",".join(addrs)
                e["PS_PEER_LISTEN_FD"] = str(socks[r].fileno())
                fds = (socks[r].fileno(),)
            e.update(env or {})
            # appended: a worker started again keeps its earlier log
            log = open(os.path.join(self.dir, f"worker-{r}.log"), "ab")
            self.workers.append(subprocess.Popen(
                [sys.executable, os.path.join(HERE, script), *args],
                stdout=log, stderr=subprocess.STDOUT, env=e, pass_fds=fds))
        for s in socks:
            s.close()
        return self.workers

    def wait_workers(self, timeout=120):
        deadline = time.monotonic() + timeout
        codes = []
        for r, w in enumerate(self.workers):
            try:
                codes.append(w.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.stop()
                fail(f"worker {r} did not finish within {timeout} s: "
                     + self.log(f"worker-{r}.log"))
        return codes

    def workers_passed(self, codes):
        """Checks that every worker exited 0 after at least one "ok: " check
        (worker_checks.py); returns each worker's (log, its "ok: " lines)."""
        out = []
        for r, code in enumerate(codes):
            log = self.log(f"worker-{r}.log")
            check(code == 0, f"worker {r} exited {code}" + ("" if code == 0 else ": " + log))
            oks = [ln for ln in log.splitlines() if ln.startswith("ok: ")]
            check(len(oks) >= 1, f"worker {r}: {len(oks)} checks passed, e.g. "
                  f"{oks[-1][4:] if oks else ''}")
            out.append((log, oks))
        return out

    def log(self, name):
        try:
            with open(os.path.join(self.dir, name), errors="replace") as f:
                return f.read()[-3000:]
        except OSError:
            return "(no log)"

    def path(self, name):
        return os.path.join(self.dir, name)

    def stop(self):
        for p in self.workers + self.shards:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        import shutil
        shutil.rmtree(self.dir, ignore_errors=True)
