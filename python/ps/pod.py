"""python3 -m ps.pod [--procs-per-pod K] -- CMD ARGS...: K ranks in one pod.

A pod with K devices runs K processes, one per device, as torchrun's
--nproc-per-node and Kubeflow's nprocPerNode do; this is the pod's
entrypoint that starts them (deploy/k8s/overlays/torch, docs/KUBERNETES.md,
"Processes per pod"). The ranks are laid out per pod: pod p runs ranks
p*K .. p*K+K-1, so the ranks of one pod are neighbours in the grid
(a tensor-parallel group of T <= K ranks, K a multiple of T, never leaves
its pod) and node-first all-reduce finds them on one node.

What it reads (the environment the manifest gives the pod):
  --procs-per-pod K or PS_PROCS_PER_POD      processes in this pod (default 1)
  PS_POD_INDEX, JOB_COMPLETION_INDEX or the hostname's -N: the pod's index p
  PS_WORLD_SIZE (or WORLD_SIZE)              ranks in the whole job, a multiple of K
  PS_PEER_TEMPLATE (optional)                one address per pod, {i} = the pod's
                                             index: local rank j listens on its
                                             port + j (ps-worker-{i}.ps-worker:7071)
What each process gets: PS_RANK = RANK = p*K+j, PS_WORLD_SIZE = WORLD_SIZE,
LOCAL_RANK = j, LOCAL_WORLD_SIZE = K, GROUP_RANK = p (torchrun's names; ps.torch's
local_rank() picks the device by LOCAL_RANK), and PS_PEERS, the ring of every
rank (PS_PEER_TEMPLATE removed: the two exclude each other).

With K = 1 the command replaces this process (exec: the script is the
container's process, as without the launcher). With K > 1 this process stays
as PID 1: it forwards SIGTERM and SIGINT to the ranks, reaps every child
(orphans of a script's data loaders included), and when one rank fails it
names it and stops the others (SIGTERM, then SIGKILL after the grace below),
so a pod never keeps half a job: it exits with the first failure's status
(129, a lost peer, stays retryable for the Job's podFailurePolicy; a rank
killed by signal N gives 128+N). Exit 2: bad usage or settings, named."""

import os
import re
import signal
import sys
import time

from ._settings import ConfigError, pod_index

USAGE = "usage: python3 -m ps.pod [--procs-per-pod K] -- CMD [ARGS...]"
# Seconds the other ranks get to exit after SIGTERM when one failed: below the
# torch Job's terminationGracePeriodSeconds (15), so the pod ends by itself.
STOP_GRACE_S = 10.0
_PORT_RE = re.compile(r"^(.*):([0-9]{1,5})$")


def _count(v, what):
    if not re.fullmatch(r"[0-9]+", str(v)) or int(v) < 1:
        raise ConfigError(f"{what}: {v!r} is not a positive integer")
    return int(v)


def parse_args(argv, env):
    """Returns (K, command)."""
    k = env.get("PS_PROCS_PER_POD") or "1"
    where = "PS_PROCS_PER_POD"
    i = 0
    while i < len(argv) and argv[i] != "--":
        a = argv[i]
        if a in ("-h", "--help"):
            print(__doc__)
            sys.exit(0)
        if a.startswith("--procs-per-pod="):
            k, where = a.split("=", 1)[1], "--procs-per-pod"
        elif a == "--procs-per-pod" and i + 1 < len(argv):
            k, where = argv[i + 1], "--procs-per-pod"
            i += 1
        else:
            raise ConfigError(f"unknown argument {a!r} ({USAGE})")
        i += 1
    cmd = argv[i + 1:]
    if i >= len(argv) or not cmd:
        raise ConfigError(f"no command after -- ({USAGE})")
    return _count(k, where), cmd


def layout(k, env):
    """The environment of each of the pod's K ranks: a list of K dicts."""
    try:
        p = pod_index(env)
    except ConfigError as ex:
        raise ConfigError(f"the pod's index: {ex}") from None
    wv, wwhere = ((env["PS_WORLD_SIZE"], "PS_WORLD_SIZE") if env.get("PS_WORLD_SIZE")
                  else (env.get("WORLD_SIZE"), "WORLD_SIZE"))
    if not wv:
        if k > 1:
            raise ConfigError(f"{k} processes per pod need PS_WORLD_SIZE, the ranks of the "
                              "whole job (num-workers)")
        wv, wwhere = "1", "a job of one"
    w = _count(wv, wwhere)
    if w % k:
        raise ConfigError(f"{wwhere} {w} is not a multiple of {k} processes per pod: the "
                          "pods would not hold every rank (num-workers must be worker-pods x "
                          "procs-per-pod)")
    pods = w // k
    if p >= pods:
        raise ConfigError(f"pod index {p} is not below {pods} pods ({wwhere} {w} / {k} "
                          "processes per pod)")
    peers = None
    template = env.get("PS_PEER_TEMPLATE", "")
    if env.get("PS_PEERS") and k > 1:
        raise ConfigError("PS_PEERS lists one address per rank; with processes per pod give "
                          "PS_PEER_TEMPLATE, one address per pod ({i} = the pod's index; "
                          "local rank j listens on its port + j)")
    if template:
        m = _PORT_RE.match(template)
        if "{i}" not in template or not m:
            raise ConfigError(f"PS_PEER_TEMPLATE {template!r}: expected HOST:PORT with {{i}} "
                              "(the pod's index) in HOST")
        base = int(m.group(2))
        if not 1 <= base <= 65536 - k:
            raise ConfigError(f"PS_PEER_TEMPLATE {template!r}: the ports {base}..{base + k - 1} "
                              f"of {k} processes per pod are not all valid")
        host = m.group(1)
        peers = ",".join(f"{host.replace('{i}', str(r // k))}:{base + r % k}"
                         for r in range(w))
    out = []
    for j in range(k):
        e = dict(env)
        r = p * k + j
        e.update(PS_RANK=str(r), RANK=str(r), PS_WORLD_SIZE=str(w), WORLD_SIZE=str(w),
                 LOCAL_RANK=str(j), LOCAL_WORLD_SIZE=str(k), GROUP_RANK=str(p))
        if peers is not None:
            e.pop("PS_PEER_TEMPLATE", None)
            e["PS_PEERS"] = peers
        out.append(e)
    return out


def _status(st):
    """A waitpid status as an exit code, and how to say it."""
    if os.WIFSIGNALED(st):
        n = os.WTERMSIG(st)
        return 128 + n, f"was killed by {signal.Signals(n).name}"
    code = os.WEXITSTATUS(st)
    return code, f"exited with {code}"


def supervise(cmd, envs):
    """Starts one process per environment; returns the pod's exit code."""
    pids = {}
    stopping = []  # signals this process got: the ranks were told, not failed

    def forward(signum, _frame):
        stopping.append(signum)
        for pid in pids:
            _kill(pid, signum)
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    # held while forking: a signal then reaches every rank once they all exist
    # (forward runs at the unblock below), never a half-made child's handler
    stops = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    for e in envs:
        pid = os.fork()
        if pid == 0:
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
                os.execvpe(cmd[0], cmd, e)
            except OSError as ex:
                print(f"ps.pod: rank {e['PS_RANK']}: cannot run {cmd[0]!r}: {ex}",
                      file=sys.stderr, flush=True)
            os._exit(127)
        pids[pid] = e
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
    code = 0
    deadline = None
    while pids:
        try:
            if deadline is None:
                pid, st = os.waitpid(-1, 0)
            else:
                pid, st = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    if time.monotonic() >= deadline:
                        for left in pids:
                            _kill(left, signal.SIGKILL)
                        deadline = None
                    time.sleep(0.05)
                    continue
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        e = pids.pop(pid, None)
        if e is None:
            continue  # an orphan we reaped as PID 1
        c, said = _status(st)
        if c != 0 and code == 0:
            code = c
            if not stopping:
                print(f"ps.pod: rank {e['PS_RANK']} (local rank {e['LOCAL_RANK']} of pod "
                      f"{e['GROUP_RANK']}) {said}: stopping the pod's other "
                      f"{len(pids)} rank(s)", file=sys.stderr, flush=True)
            for left in pids:
                _kill(left, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
    return code


def _kill(pid, sig):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def main(argv=None, env=None):
    env = dict(os.environ if env is None else env)
    try:
        k, cmd = parse_args(sys.argv[1:] if argv is None else argv, env)
        envs = layout(k, env)
    except ConfigError as ex:
        print(f"ps.pod: {ex}", file=sys.stderr, flush=True)
        return 2
    if k == 1:
        try:
            os.execvpe(cmd[0], cmd, envs[0])
        except OSError as ex:
            print(f"ps.pod: cannot run {cmd[0]!r}: {ex}", file=sys.stderr, flush=True)
            return 127
    return supervise(cmd, envs)


if __name__ == "__main__":
    sys.exit(main())
