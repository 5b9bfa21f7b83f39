"""python3 -m ps.pod (issue 35: N processes per pod, ranks laid out per pod),
as the torch Job's pods run it: real child processes, the real environment.

- layout: pod 1 of a 4-rank job with 2 processes per pod runs ranks 2 and 3
  with LOCAL_RANK 0 and 1, and the ring of every rank, pod by pod, on the
  template's port + the local rank (PS_PEER_TEMPLATE removed);
- one process per pod: the command replaces the launcher (exec), the rank is
  the pod's index;
- bad settings exit 2 naming what is wrong, and start nothing;
- one rank failing stops the pod's other rank (it was sleeping) and the pod
  exits with the failure's status: 3, 129 (retryable), 128+9 for a SIGKILL;
- SIGTERM to the launcher (the kubelet deleting the pod) reaches every rank.
The training run of two such pods over the network is k8s_pods_torch_procs
(tests/k8s)."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import harness
from harness import check

PY = sys.executable
# one write per line: the ranks print at once into one pipe
ENV_DUMP = ("import json, os; os.write(1, (json.dumps({k: os.environ.get(k) for k in "
            "('PS_RANK', 'RANK', 'PS_WORLD_SIZE', 'WORLD_SIZE', 'LOCAL_RANK', "
            "'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'PS_PEERS', 'PS_PEER_TEMPLATE')}) + '\\n').encode())")


def env_of(**kw):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PS_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                   "JOB_COMPLETION_INDEX")}
    env.pop("PYTHONPATH", None)
    env.update(harness.package_env())
    env.update(kw)
    return env


def pod(args, env, timeout=60, **kw):
    return subprocess.run([PY, "-m", "ps.pod", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, **kw)


# -- layout ---------------------------------------------------------------
p = pod(["--procs-per-pod", "2", "--", PY, "-c", ENV_DUMP],
        env_of(PS_POD_INDEX="1", PS_WORLD_SIZE="4", PS_PEER_TEMPLATE="w-{i}.svc:7071"))
print(p.stdout, p.stderr)
check(p.returncode == 0, f"two ranks that exit 0: the pod exits 0 ({p.returncode})")
got = sorted((json.loads(ln) for ln in p.stdout.splitlines()), key=lambda d: d["PS_RANK"])
ring = "w-0.svc:7071,w-0.svc:7072,w-1.svc:7071,w-1.svc:7072"
want = [{"PS_RANK": str(r), "RANK": str(r), "PS_WORLD_SIZE": "4", "WORLD_SIZE": "4",
         "LOCAL_RANK": str(r - 2), "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
         "PS_PEERS": ring, "PS_PEER_TEMPLATE": None} for r in (2, 3)]
check(got == want, f"pod 1 of 2 runs ranks 2 and 3, local 0 and 1, the ring pod by pod: {got}")

# the flag's = form and JOB_COMPLETION_INDEX, as an Indexed Job sets it
p = pod(["--procs-per-pod=4", "--", PY, "-c", ENV_DUMP],
        env_of(JOB_COMPLETION_INDEX="0", PS_WORLD_SIZE="8"))
ranks = sorted(json.loads(ln)["PS_RANK"] for ln in p.stdout.splitlines())
check(p.returncode == 0 and ranks == ["0", "1", "2", "3"],
      f"--procs-per-pod=4 in pod 0 (JOB_COMPLETION_INDEX): ranks 0-3 ({ranks})")

# -- one process per pod: exec, the pod's index is the rank -----------------
p = pod(["--", PY, "-c", "import os, json; print(json.dumps([os.getpid(), os.getppid(), "
                         "os.environ['PS_RANK'], os.environ['PS_PEERS']]))"],
        env_of(PS_POD_INDEX="3", PS_WORLD_SIZE="5", PS_PEER_TEMPLATE="w-{i}:7071"))
print(p.stdout, p.stderr)
info = json.loads(p.stdout)
check(p.returncode == 0 and info[2] == "3" and info[3].split(",")[3] == "w-3:7071",
      f"PS_PROCS_PER_POD unset: one process, rank = pod index 3, its ring entry w-3:7071 ({info})")
p2 = subprocess.run([PY, "-c", "import subprocess, sys, json, os; "
                     "c = subprocess.run([sys.executable, '-m', 'ps.pod', '--', sys.executable, "
                     "'-c', 'import os; print(os.getppid())'], capture_output=True, text=True); "
                     "print(json.dumps([os.getpid(), int(c.stdout)]))"],
                    env=env_of(PS_POD_INDEX="0", PS_WORLD_SIZE="1"), capture_output=True, text=True,
                    timeout=60)
me, parent = json.loads(p2.stdout)
check(me == parent, f"with one process the command replaces ps.pod (exec): its parent is the "
                    f"caller {me}, not a launcher ({parent})")

# -- bad settings ---------------------------------------------------------
bad = [
    (["--procs-per-pod", "2"], dict(PS_POD_INDEX="0", PS_WORLD_SIZE="3"),
     "PS_WORLD_SIZE 3 is not a multiple of 2 processes per pod"),
    (["--procs-per-pod", "2"], dict(PS_POD_INDEX="2", PS_WORLD_SIZE="4"),
     "pod index 2 is not below 2 pods"),
    (["--procs-per-pod", "2"], dict(PS_POD_INDEX="0"),
     "2 processes per pod need PS_WORLD_SIZE"),
    (["--procs-per-pod", "0"], dict(PS_POD_INDEX="0", PS_WORLD_SIZE="4"),
     "--procs-per-pod: '0' is not a positive integer"),
    ([], dict(PS_PROCS_PER_POD="two", PS_POD_INDEX="0", PS_WORLD_SIZE="4"),
     "PS_PROCS_PER_POD: 'two' is not a positive integer"),
    (["--procs-per-pod", "2"], dict(PS_POD_INDEX="0", PS_WORLD_SIZE="4", PS_PEERS="a:1,b:1,c:1,d:1"),
     "PS_PEERS lists one address per rank"),
    (["--procs-per-pod", "2"], dict(PS_POD_INDEX="0", PS_WORLD_SIZE="4", PS_PEER_TEMPLATE="w:7071"),
     "expected HOST:PORT with {i}"),
    (["--procs-per-pod", "2"], dict(PS_POD_INDEX="0", PS_WORLD_SIZE="4",
                                    PS_PEER_TEMPLATE="w-{i}:65535"),
     "the ports 65535..65536 of 2 processes per pod are not all valid"),
    (["--nproc", "2"], dict(PS_POD_INDEX="0", PS_WORLD_SIZE="4"), "unknown argument '--nproc'"),
]
with tempfile.TemporaryDirectory() as d:
    marker = os.path.join(d, "ran")
    for args, kw, words in bad:
        p = pod([*args, "--", PY, "-c", f"open({marker!r}, 'w')"], env_of(**kw))
        check(p.returncode == 2 and words in p.stderr and not os.path.exists(marker),
              f"{args} {kw}: exit 2 naming it ({p.returncode}: {p.stderr.strip()})")
p = pod(["--procs-per-pod", "2"], env_of(PS_POD_INDEX="0", PS_WORLD_SIZE="2"))
check(p.returncode == 2 and "no command after --" in p.stderr, f"no command: {p.stderr.strip()}")

# -- one rank fails: the other is stopped, the pod exits with its status ----
SLEEPER = ("import os, signal, sys, time\n"
           "d = sys.argv[1]\n"
           "r = os.environ['LOCAL_RANK']\n"
           "open(os.path.join(d, 'pid-' + r), 'w').write(str(os.getpid()))\n"
           "if r == '1':\n"
           "    while not os.path.exists(os.path.join(d, 'pid-0')): time.sleep(0.01)\n"
           "    how = sys.argv[2]\n"
           "    if how == 'kill': os.kill(os.getpid(), signal.SIGKILL)\n"
           "    sys.exit(int(how))\n"
           "def term(*_):\n"
           "    open(os.path.join(d, 'term-' + r), 'w').close(); sys.exit(0)\n"
           "signal.signal(signal.SIGTERM, term)\n"
           "open(os.path.join(d, 'ready-' + r), 'w').close()\n"
           "time.sleep(600)\n")


def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


for how, want in (("3", 3), ("129", 129), ("kill", 128 + signal.SIGKILL)):
    with tempfile.TemporaryDirectory() as d:
        p = pod(["--procs-per-pod", "2", "--", PY, "-c", SLEEPER, d, how],
                env_of(PS_POD_INDEX="1", PS_WORLD_SIZE="4"), timeout=60)
        print(p.stderr)
        check(p.returncode == want, f"rank 3 {how}: the pod exits {want} ({p.returncode})")
        said = "exited with 3" if how == "3" else ("exited with 129" if how == "129"
                                                    else "was killed by SIGKILL")
        check(f"rank 3 (local rank 1 of pod 1) {said}: stopping the pod's other 1 rank(s)"
              in p.stderr, "the launcher names the failed rank and what it did")
        pid0 = int(open(os.path.join(d, "pid-0")).read())
        check(not alive(pid0) and (os.path.exists(os.path.join(d, "term-0"))
                                   or not os.path.exists(os.path.join(d, "ready-0"))),
              "rank 2 was stopped (SIGTERM) and is gone")

# -- SIGTERM to the pod reaches every rank ----------------------------------
with tempfile.TemporaryDirectory() as d:
    proc = subprocess.Popen([PY, "-m", "ps.pod", "--procs-per-pod", "2", "--", PY, "-c",
                             SLEEPER.replace("if r == '1':", "if False:"), d, "0"],
                            env=env_of(PS_POD_INDEX="0", PS_WORLD_SIZE="2"),
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(d, f"ready-{j}")) for j in (0, 1)):
        check(time.monotonic() < deadline and proc.poll() is None, "both ranks start")
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=60)
    err = proc.stderr.read()
    check(all(os.path.exists(os.path.join(d, f"term-{j}")) for j in (0, 1)),
          "SIGTERM to the launcher reached both ranks")
    check(rc == 0 and "stopping" not in err,
          f"both ranks exited 0 on SIGTERM: so does the pod, and no rank is called failed ({rc})")
