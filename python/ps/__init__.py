"""ps: data-parallel training through the ps parameter server or its ring
all-reduce, from Python (the C library libps underneath, through ctypes).

    import ps, ps.torch
    ps.init()                    # settings as ps-worker reads them (_settings.py)
    opt = ps.torch.DistributedOptimizer(opt, model.named_parameters())
    ...
    ps.shutdown()

One job per process: init() opens a ps_client to the shards (sync mode ps)
or the ring of the workers (sync mode allreduce). The ring is also what
broadcasts use in ps mode; there it is opened at the first collective call,
which every rank makes at the same point of its script.

Failures follow ps-worker's exit semantics: a lost shard or ring peer raises
RetryableError, and an uncaught one exits the process with 129 (retryable:
Kubernetes restarts it); a ConfigError exits 2 (bad usage); any other
PSError is permanent (1), except JobLostError (3: the job's state is gone,
restart every shard and worker). Importing ps installs the sys.excepthook that
does this (it leaves every other exception alone)."""

import atexit
import ctypes
import os
import sys
import threading
import warnings

from . import _lib
from ._settings import ConfigError

__all__ = ["init", "shutdown", "rank", "size", "local_rank", "local_size", "cross_rank",
           "cross_size", "sync_mode", "barrier", "is_initialized", "settings", "workers_lost",
           "PSError", "RetryableError", "LayoutError", "JobLostError", "ConfigError"]

EXIT_USAGE = 2
EXIT_RETRY = 129
EXIT_JOB_LOST = 3


class PSError(RuntimeError):
    """A libps call failed; .status is the ps_status, str() says why."""

    def __init__(self, message, status=None):
        super().__init__(message)
        self.status = status


class RetryableError(PSError):
    """A shard or ring peer was lost or never came up: the job should be
    restarted (exit 129 if uncaught)."""


class JobLostError(PSError):
    """The job's state is gone (a shard restarted without its checkpoint, a
    rollback a shard cannot follow, this process superseded by a restarted
    one): restarting this process alone cannot help; the message says what
    to restart (exit 3 if uncaught)."""


class LayoutError(PSError):
    """The ranks disagree on what they synchronise (names, shapes, order)."""


def _error(status, what, detail="", ring=False):
    # ps_strerror speaks of shards; a ring failure's detail names the peer.
    msg = f"{what}: {detail}" if ring and detail else f"{what}: {_lib.strerror(status)}"
    if detail and not ring:
        msg += f": {detail}"
    if status in (_lib.ERR_IO, _lib.ERR_CONNECT, _lib.ERR_ROLLBACK, _lib.ERR_CLOSED):
        if status == _lib.ERR_ROLLBACK:
            msg += " (a shard restarted from a checkpoint; restart the job to resume there)"
        return RetryableError(msg, status)
    if status == _lib.ERR_LAYOUT_MISMATCH:
        return LayoutError(msg, status)
    if status == _lib.ERR_STATE_LOST:
        return JobLostError(msg, status)
    return PSError(msg, status)


class _Job:
    def __init__(self, cfg):
        self.cfg = cfg
        self.rank = cfg["rank"]
        self.size = cfg["world_size"]
        self.mode = cfg["sync_mode"]
        self.token = ctypes.c_void_p()
        self.client = None
        self.coll = None
        self.lock = threading.Lock()
        self.declared = False
        self.left = None  # ps mode: LEAVE_JOINED or LEAVE_FINISHED once the shards were told
        # What packages on top (ps.torch) do at the end of the job:
        # objects with before_barrier(job) (returns True when the barrier
        # was already passed), after_barrier(job) and at_exit(job).
        self.extensions = []

    # -- handles --------------------------------------------------------

    def open(self):
        path = self.cfg["auth_token_file"]
        if path:
            err = _lib.errbuf()
            st = _lib.lib.ps_token_load(path.encode(), ctypes.byref(self.token), err, len(err))
            if st != _lib.OK:
                raise ConfigError(f"option --auth-token-file: {err.value.decode()}")
        if self.mode == "ps":
            self._open_client()
        elif self.size > 1:
            self.ring()

    def reopen_client(self, chunk_bytes):
        """Reconnects with another chunk size (only before any declare:
        the chunk size is part of the layout)."""
        if self.declared:
            raise PSError("the chunk size cannot change after the layout was declared")
        _lib.lib.ps_client_free(self.client)
        self.client = None
        self._open_client(chunk_bytes)

    def _open_client(self, chunk_bytes=None):
        from ._settings import server_list
        servers = server_list(self.cfg)
        self.num_shards = len(servers)
        self._servers = _lib.cstrings(servers)
        o = _lib.ClientOpts()
        o.servers = self._servers
        o.num_servers = len(servers)
        o.rank = self.rank
        o.world_size = self.size
        self._job_id = self.cfg["job_id"].encode()
        o.job_id = self._job_id
        from ._settings import check_chunk_bytes
        o.chunk_bytes = (self.cfg["chunk_bytes"] if chunk_bytes is None
                         else check_chunk_bytes(chunk_bytes))
        o.connect_timeout_ms = self.cfg["connect_timeout_ms"]
        o.reconnect_timeout_ms = self.cfg["reconnect_timeout_ms"]
        o.auth_token = self.token
        self._transport = self.cfg["transport"].encode()
        o.transport = self._transport
        out = ctypes.c_void_p()
        err = _lib.errbuf()
        st = _lib.lib.ps_client_new(ctypes.byref(o), ctypes.byref(out), err, len(err))
        if st != _lib.OK:
            raise _error(st, f"cannot reach the shards {','.join(servers)}", err.value.decode())
        self.client = out

    def leave(self, kind):
        """ps mode: tells every shard this rank pushes no further step
        (ps_leave; FINISHED after JOINED keeps JOINED)."""
        if not self.declared or self.left in (kind, _lib.LEAVE_JOINED):
            return
        st = _lib.lib.ps_leave(self.client, kind)
        if st != _lib.OK:
            raise self.client_error(st, "telling the shards this rank " + (
                "joined" if kind == _lib.LEAVE_JOINED else "finished"))
        self.left = kind

    def rejoin(self):
        """ps mode: a rank that joined trains again; returns its next step."""
        step = ctypes.c_uint64()
        st = _lib.lib.ps_rejoin(self.client, ctypes.byref(step))
        if st != _lib.OK:
            raise self.client_error(st, "taking part in the steps again after join")
        self.left = None
        return step.value

    def ring_configured(self):
        from ._settings import peer_list
        return self.coll is not None or peer_list(self.cfg) is not None

    def ring(self):
        """The ring of the workers (opened on first use)."""
        with self.lock:
            if self.coll is not None:
                return self.coll
            from ._settings import peer_list
            peers = peer_list(self.cfg)
            if peers is None:
                raise ConfigError(
                    f"{'broadcasts and all-reduces' if self.mode == 'ps' else 'allreduce mode'}"
                    " need the ring of the workers: set --peers or --peer-template "
                    "(PS_PEERS, PS_PEER_TEMPLATE; tools/ps-local -- CMD sets them)")
            self._peers = _lib.cstrings(peers)
            o = _lib.CollOpts()
            o.rank = self.rank
            o.world_size = self.size
            o.peers = self._peers
            self._ring_job = self.cfg["job_id"].encode()
            o.job_id = self._ring_job
            self._listen = self.cfg["peer_listen"].encode() or None
            o.listen_addr = self._listen
            o.listen_fd = self.cfg["peer_listen_fd"]
            o.connect_timeout_ms = self.cfg["connect_timeout_ms"]
            o.peer_timeout_ms = self.cfg["peer_timeout_ms"]
            o.auth_token = self.token
            o.p2p = 1  # ps.torch.send / recv: every pair of ranks connected
            algo = self.cfg["allreduce_algorithm"]
            if algo == "node-first" and not self.cfg["node_name"]:
                raise ConfigError("option --allreduce-algorithm node-first: needs --node-name "
                                  "(PS_NODE_NAME: the node this rank runs on)")
            self._node = self.cfg["node_name"].encode()
            o.node_first = int(algo != "ring")
            o.node = self._node
            out = ctypes.c_void_p()
            err = _lib.errbuf()
            st = _lib.lib.ps_coll_open(ctypes.byref(o), ctypes.byref(out), err, len(err))
            if st != _lib.OK:
                raise _error(st, "cannot form the ring of the workers", err.value.decode(),
                             ring=True)
            self.coll = out
            return out

    # -- errors ---------------------------------------------------------

    def client_error(self, st, what):
        buf = _lib.errbuf()
        detail = _lib.lib.ps_errmsg(self.client, buf, len(buf)) if self.client else b""
        return _error(st, what, (detail or b"").decode())

    def ring_failed(self):
        """True once the ring failed (a lost rank, ranks that disagreed):
        nothing more can run on it."""
        return self.coll is not None and _lib.lib.ps_coll_status(self.coll) != _lib.OK

    def ring_error(self, st, what):
        buf = _lib.errbuf()
        detail = _lib.lib.ps_coll_errmsg(self.coll, buf, len(buf)) if self.coll else b""
        return _error(st, what, (detail or b"").decode(), ring=True)

    def close(self):
        # the groups of ps.torch (new_group, grid) before the job group they came from
        for close_group in reversed(getattr(self, "group_closers", [])):
            close_group()
        self.group_closers = []
        if self.coll is not None:
            _lib.lib.ps_coll_close(self.coll)
            self.coll = None
        if self.client is not None:
            _lib.lib.ps_client_free(self.client)
            self.client = None
        if self.token:
            _lib.lib.ps_token_free(self.token)
            self.token = ctypes.c_void_p()


_job = None
_uncaught = [False]  # the interpreter is ending on an exception


def _excepthook(kind, value, tb):
    _uncaught[0] = True
    _previous_hook(kind, value, tb)
    code = None
    if isinstance(value, RetryableError):
        code = EXIT_RETRY
    elif isinstance(value, ConfigError):
        code = EXIT_USAGE
    elif isinstance(value, JobLostError):
        code = EXIT_JOB_LOST
    if code is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


_previous_hook = sys.excepthook
sys.excepthook = _excepthook  # only our exceptions change the exit status


def init(args=None, **settings):
    """Joins the job. `args` is a list of ps-worker style flags (e.g.
    sys.argv[1:] of a script that takes only those); keyword arguments
    (servers=, rank=, world_size=, sync_mode=, ...) beat everything else.
    Raises ConfigError for bad settings and RetryableError when the shards
    or peers cannot be reached within connect_timeout_ms."""
    global _job
    if _job is not None:
        raise PSError("ps.init() was already called (call ps.shutdown() first)")
    from . import _settings
    cfg = _settings.parse(args, settings)
    if cfg[_settings.JOB_OF_ONE]:
        print(_settings.job_of_one_line(), file=sys.stderr, flush=True)
    job = _Job(cfg)
    try:
        job.open()
    except BaseException:
        job.close()
        raise
    _job = job
    return job


def _current():
    if _job is None:
        raise PSError("ps.init() has not been called")
    return _job


def is_initialized():
    return _job is not None


def rank():
    return _current().rank


def size():
    return _current().size


def local_rank():
    """This rank's index on its node (LOCAL_RANK, which ps-local and torchrun
    set; without it the job is taken as one node: the rank)."""
    return int(os.environ.get("LOCAL_RANK", _current().rank))


def local_size():
    """Ranks on this node (LOCAL_WORLD_SIZE, which ps-local and torchrun set;
    without it the job is taken as one node: size())."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", _current().size))


def cross_size():
    """Nodes of the job, each with local_size() ranks (Horovod's cross_size:
    the ranks of one local index across the nodes)."""
    return max(1, size() // local_size())


def cross_rank():
    """This rank's node, 0..cross_size()-1, with ranks numbered node by node
    (as ps-local, torchrun and the Kubernetes recipe place them)."""
    return rank() // local_size()


def workers_lost():
    """The ranks the shards went on without (--on-worker-timeout continue:
    their data was no longer used), sorted; [] when none was lost (and
    always in allreduce mode, where a lost rank stops the job)."""
    job = _current()
    if job.mode != "ps" or job.client is None:
        return []
    ranks = (ctypes.c_int * job.size)()
    count = ctypes.c_int()
    st = _lib.lib.ps_lost_workers(job.client, ranks, job.size, ctypes.byref(count))
    if st != _lib.OK:
        raise job.client_error(st, "asking the shards which workers they lost")
    return sorted(ranks[i] for i in range(min(count.value, job.size)))


def sync_mode():
    """'ps' or 'allreduce'."""
    return _current().mode


def settings():
    """The settings init() resolved (a copy)."""
    return dict(_current().cfg)


def barrier():
    """Returns once every rank called barrier()."""
    job = _current()
    if job.mode == "ps" and (job.declared or not job.ring_configured()):
        # The shards' barrier counts ranks that declared a layout; a job
        # that never did (and has no ring) has nothing to wait for.
        if job.declared:
            st = _lib.lib.ps_barrier(job.client)
            if st != _lib.OK:
                raise job.client_error(st, "barrier")
    elif job.size > 1:
        st = _lib.lib.ps_coll_barrier(job.ring())
        if st != _lib.OK:
            raise job.ring_error(st, "barrier")


def shutdown():
    """Leaves the job in order: this rank says it is done (a rank still
    training then fails at once, naming join, instead of waiting for it),
    waits for every rank (barrier), rank 0 tells the shards that training is
    over (they exit), and everything is closed. Warns when the shards went
    on without a lost worker. After an error of the ring (raised earlier)
    it leaves without waiting for the others. Safe to call twice."""
    global _job
    job = _job
    if job is None:
        return
    error = None
    try:
        passed = False
        if job.mode == "ps":
            # first: a rank still training learns at once that this one is
            # done (the shards refuse its step, naming join)
            job.leave(_lib.LEAVE_FINISHED)
        for ext in job.extensions:
            try:
                passed = bool(ext.before_barrier(job)) or passed
            except PSError as e:
                error = error or e
        if error is None and not passed:
            _barrier_at_end(job)
        if error is None:
            for ext in job.extensions:
                ext.after_barrier(job)
        if job.mode == "ps" and job.rank == 0 and error is None:
            st = _lib.lib.ps_shutdown_servers(job.client)
            if st != _lib.OK:
                raise job.client_error(st, "shutdown of the shards")
        _warn_lost(job)
        if error is not None:
            raise error
    finally:
        _job = None
        job.close()


def _barrier_at_end(job):
    if job.mode == "ps" and job.declared:
        st = _lib.lib.ps_barrier(job.client)
        if st != _lib.OK:
            raise job.client_error(st, "barrier")
    elif job.size > 1 and job.ring_configured():
        if job.ring_failed():
            buf = _lib.errbuf()
            why = _lib.lib.ps_coll_errmsg(job.coll, buf, len(buf)).decode()
            warnings.warn(f"ps.shutdown(): the ring failed earlier ({why}): leaving without "
                          "waiting for the other ranks", stacklevel=3)
            return
        st = _lib.lib.ps_coll_barrier(job.ring())
        if st != _lib.OK:
            raise job.ring_error(st, "barrier")


def _warn_lost(job):
    if job.mode != "ps" or job.client is None:
        return
    try:
        lost = workers_lost()
    except PSError:
        return
    if lost:
        warnings.warn(f"ps: the shards went on without worker(s) {lost} (--on-worker-timeout "
                      "continue): the steps after each loss averaged fewer ranks and the lost "
                      "ranks' data was not used; ps.workers_lost() says which", stacklevel=3)


@atexit.register
def _at_exit():
    # No barrier here: the other ranks may be gone. A script that ends
    # normally without ps.shutdown() still says it is done (a rank still
    # training fails at once, naming join); one that ends on an exception
    # only closes. Closing tells ring peers this rank left; the shards
    # notice the closed connections.
    global _job
    if _job is None:
        return
    job, _job = _job, None
    try:
        if not _uncaught[0]:
            if job.mode == "ps":
                job.leave(_lib.LEAVE_FINISHED)
            for ext in job.extensions:
                ext.at_exit(job)
    except PSError as e:
        print(f"ps: at exit: {e}", file=sys.stderr, flush=True)
        job.close()
        os._exit(1)
    job.close()
