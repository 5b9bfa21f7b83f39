"""A worker that stops (SIGSTOP) in a PS-mode job of the launcher
(tools/ps-local -- /usr/bin/python3 lost_worker.py) never leaves the job
silently smaller:
   test_lost.py fail       the default with sum shards (--on-worker-timeout
                           auto): the job fails within --worker-timeout + 5 s
                           of the stop, ps-local exits 129, the output names
                           the rank (rank 0's RetryableError or the shard's log),
                           and nothing it started is left running
   test_lost.py continue   --on-worker-timeout continue: rank 0 trains on,
                           ps.workers_lost() says [1], ps.shutdown() warns,
                           and ps-local, which will not wait for the stopped
                           rank, kills it and exits 129 naming it"""
import os
import re
import subprocess
import sys
import tempfile
import time

import harness
from harness import check

harness.require_torch()
mode = sys.argv[1]
TIMEOUT_S = 3
launcher = os.path.join(harness.BUILD, "tools", "ps-local")
script = os.path.join(harness.HERE, "lost_worker.py")


def leftovers(tag, pids):
    """Processes still running that this run started: the workers' pids, and
    anything whose command line names the run's private directory."""
    alive = [p for p in pids if os.path.exists(f"/proc/{p}")]
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if tag.encode() in f.read():
                        alive.append(int(d))
            except OSError:
                pass
    return alive


with tempfile.TemporaryDirectory(prefix="ps-torch-lost-") as tmp:
    logs = os.path.join(tmp, "logs")
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["PYTHONPATH"] = harness.HERE  # model.py; ps-local adds the package
    args = [launcher, "--shards", "2", "--workers", "2", "--keep-logs", logs,
            "--worker-timeout", str(TIMEOUT_S)]
    if mode == "continue":
        args += ["--on-worker-timeout", "continue"]
    p = subprocess.Popen(args + ["--", "/usr/bin/python3", script, tmp], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        harness.fail("ps-local did not finish within 120 s: " + out[-2000:])
    ended = time.time()
    print(out[-3000:])
    stopped = os.path.join(tmp, "stopped")
    check(os.path.exists(stopped), "rank 1 stopped itself at step 5")
    took = ended - float(open(stopped).read())
    pids = [int(open(os.path.join(tmp, f"pid-{r}")).read()) for r in range(2)
            if os.path.exists(os.path.join(tmp, f"pid-{r}"))]
    check(p.returncode == 129, f"ps-local exited 129 (a lost rank: retryable), got {p.returncode}")
    check(not leftovers(logs, pids), f"nothing left running ({leftovers(logs, pids)})")
    if mode == "fail":
        # the event: a shard found rank 1 silent for --worker-timeout 3 s (its
        # line names the timeout; the default is 60 s) and stopped the job;
        # the 120 s bound above is 40 times that
        shard_logs = "".join(open(os.path.join(logs, f)).read() for f in os.listdir(logs)
                             if f.startswith("shard") or f.startswith("server"))
        silent = re.findall(r'msg="worker silent, closing its connection" peer=\S+ rank=1 '
                            r'silent_s=([0-9.]+) worker_timeout_s=([0-9.]+)', shard_logs)
        check(silent and all(float(t) == TIMEOUT_S and float(s) < 10 * TIMEOUT_S
                             for s, t in silent),
              f"a shard says rank 1 was silent for --worker-timeout {TIMEOUT_S} (and closed it "
              f"within 10 times that): {silent} (the job failed {took:.1f} s after the stop)")
        # rank 0's RetryableError names it, and so does the failed shard's
        # log tail ps-local prints (rank 0 may be stopped before it prints)
        check(any(w in out for w in ("worker rank 1", 'msg="worker lost" rank=1')),
              "the output names the lost rank 1")
        check("rank 0 done" not in out, "rank 0 did not finish the job alone")
    else:
        check("workers_lost=[1]" in out, "rank 0: ps.workers_lost() == [1]")
        check("went on without worker(s) [1]" in out, "ps.shutdown() warned of the loss")
        check("rank 0 done" in out, "rank 0 finished")
        check("worker rank 1" in out and "stopped" in out,
              "ps-local names the stopped rank 1 it killed")
