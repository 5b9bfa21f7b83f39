"""Groups of ranks and the 3D grid (torch.distributed's new_group, Megatron's
parallel state), over libps's groups (collective.h: ps_coll_split) and grid
(grid.h: ps_grid_new).

    g = ps.torch.new_group([0, 2])          # every rank calls it, in order
    ps.torch.allreduce_(t, group=g)         # on ranks 0 and 2 only
    grid = ps.torch.grid(tp=2, pp=2)        # dp = W / (tp * pp)
    opt = ps.torch.DistributedOptimizer(opt, model.named_parameters(),
                                        group=grid.dp_group)

A group reuses the job's connections (no new socket): each has its own
identifier and its own sequence of operations, so its messages never mix with
another group's. Inside a group, ranks are group ranks (root_rank, dst, src):
the position of the job rank in group.ranks. A rank that is not in a group
gets a Group whose rank is -1, and every call on it raises PSError naming
this rank and the group, before anything is sent.

The list passed to new_group is checked on the caller (ints, in range, no
duplicates: ValueError) and then across the ranks: a digest of it is
all-gathered over the job before the split, so ranks that pass different
lists all raise PSError naming two of them and their lists, instead of
forming a group nobody asked for (ps_coll_split would happily group the
ranks by their colors). Groups are closed with the job (ps.shutdown()).

DistributedOptimizer(group=) synchronises through the view of the job the
group gives (_GroupJob: its size, rank, ring and rounds), and in ps mode
through keys of its own on the shards (owned_layout, at the end)."""

import ctypes
import hashlib

import torch

import ps
from ps import _lib


class Group:
    """Ranks of the job that run collectives together.

    ranks: the job ranks of the group, group rank 0 first; size; rank: this
    rank's rank in the group, or -1 when it is not a member; id: libps's
    group identifier (the same on every member)."""

    def __init__(self, job, coll, ranks, rank, label, owner=None):
        self._job, self._coll = job, coll
        self.ranks = list(ranks)
        self.size = len(self.ranks)
        self.rank = rank
        self.id = _lib.lib.ps_coll_group_id(coll) if coll else 0
        self._label = label
        self._owner = owner  # the grid that owns the handle, or None: this group does
        self._as_job = None

    def __repr__(self):
        return self._label

    def job_rank(self, r):
        """The job rank of group rank r."""
        if not 0 <= r < self.size:
            raise ValueError(f"{self}: group rank {r} is not in 0..{self.size - 1}")
        return self.ranks[r]

    def _close(self):
        if self._coll is not None and self._owner is None:
            _lib.lib.ps_coll_close(self._coll)
        self._coll = None


class _GroupJob:
    """The job as a DistributedOptimizer or a collective of this group sees
    it: size, rank and the ring are the group's; the rest is the job's.
    Each group has its own rounds (_rounds.rounds_of keeps them here)."""

    def __init__(self, group):
        self._group = group
        self._real = group._job
        self.rounds = None

    def __getattr__(self, name):
        return getattr(self._real, name)

    @property
    def size(self):
        return self._group.size

    @property
    def rank(self):
        return self._group.rank

    @property
    def coll(self):
        return self._group._coll

    def ring(self):
        return self._group._coll

    def ring_configured(self):
        return True

    def ring_failed(self):
        return self.coll is not None and _lib.lib.ps_coll_status(self.coll) != _lib.OK

    def ring_error(self, st, what):
        where = "" if str(self._group) in what else f" on {self._group}"
        return self._real.ring_error(st, f"{what}{where}")


def on(group, what):
    """The job (group None) or the view of it that group gives (see
    _GroupJob); raises PSError when this rank is not in the group, naming
    both, before anything is sent."""
    job = ps._current()
    if group is None:
        return job
    if not isinstance(group, Group):
        raise TypeError(f"{what}: group= takes a group of ps.torch.new_group or "
                        f"ps.torch.grid, not a {type(group).__name__}")
    if group._job is not job or (group._coll is None and group.size > 1):
        raise ps.PSError(f"{what}: {group} belongs to a job that has ended (ps.shutdown())",
                         _lib.ERR_STATE)
    if group.rank < 0:
        buf = _lib.errbuf()
        why = _lib.lib.ps_coll_errmsg(group._coll, buf, len(buf)).decode() if group._coll \
            else f"job rank {job.rank} is not in this group"
        where = "" if str(group) in what else f" on {group}"
        raise ps.PSError(f"{what}{where}: called on rank {job.rank}, which is not in the "
                         f"group: {why}", _lib.ERR_STATE)
    if group._as_job is None:
        group._as_job = _GroupJob(group)
    return group._as_job


def _register(job, closer):
    job.group_closers = getattr(job, "group_closers", [])
    job.group_closers.append(closer)


def _check_ranks(ranks, size):
    what = "new_group(ranks)"
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise ValueError(f"{what}: expected a list of job ranks (ints), got "
                         f"{type(ranks).__name__} {ranks!r}")
    ranks = list(ranks)
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int)]
    if bad:
        raise ValueError(f"{what}: {bad[0]!r} ({type(bad[0]).__name__}) in {ranks!r} is not a "
                         "rank: expected a list of ints")
    if not ranks:
        raise ValueError(f"{what}: an empty list; a group has at least one rank")
    out = [r for r in ranks if not 0 <= r < size]
    if out:
        raise ValueError(f"{what}: rank {out[0]} in {ranks} is not a rank of this job "
                         f"(0..{size - 1})")
    dups = sorted({r for r in ranks if ranks.count(r) > 1})
    if dups:
        raise ValueError(f"{what}: rank(s) {dups} more than once in {ranks}")
    return ranks


def _agree_on_ranks(job, coll, ranks, what="new_group", passed="lists of ranks"):
    """Every rank passed the same list: a digest of it all-gathered over the
    job (one 8-byte all-gather). On a mismatch every rank sees the same
    digests, so all of them gather the lists and raise naming two."""
    digest = int.from_bytes(hashlib.sha256(repr(ranks).encode()).digest()[:7], "little")
    mine = torch.tensor([digest], dtype=torch.int64)
    every = torch.empty(job.size, dtype=torch.int64)
    st = _lib.lib.ps_coll_allgather(coll, mine.data_ptr(), every.data_ptr(), 8)
    if st != _lib.OK:
        raise job.ring_error(st, "new_group (the check of the ranks)")
    digests = every.tolist()
    if len(set(digests)) == 1:
        return
    from . import allgather_object
    lists = allgather_object(ranks, name=f"{passed} of {what}")
    first = next(q for q, d in enumerate(digests) if d != digests[0])
    raise ps.PSError(f"{what}: the ranks called it with different {passed} (every rank must "
                     f"call {what} with the same one, in the same order): rank 0 passed "
                     f"{lists[0]}, rank {first} passed {lists[first]} (this rank, {job.rank}, "
                     f"passed {ranks})", _lib.ERR_STATE)


def new_group(ranks=None):
    """A group of the job ranks in ranks (None: every rank), group rank i
    being ranks[i]. Every rank of the job calls it, members or not, with the
    same list, in the same order relative to its other calls (as
    torch.distributed.new_group). Returns a Group; on a rank not in ranks its
    rank is -1 and every call on it raises PSError."""
    job = ps._current()
    ranks = list(range(job.size)) if ranks is None else _check_ranks(ranks, job.size)
    me = ranks.index(job.rank) if job.rank in ranks else -1
    label = f"group {ranks}"
    if job.size == 1:
        return Group(job, None, ranks, me, label)
    coll = job.ring()
    _agree_on_ranks(job, coll, ranks)
    out = ctypes.c_void_p()
    st = _lib.lib.ps_coll_split(coll, 0 if me >= 0 else _lib.COLL_UNDEFINED, max(me, 0),
                                ctypes.byref(out))
    if st != _lib.OK:
        raise job.ring_error(st, f"new_group({ranks})")
    g = Group(job, out, ranks, me, label)
    if me >= 0:  # libps orders members by key = position in ranks
        got = [_lib.lib.ps_coll_job_rank(out, r) for r in range(g.size)]
        assert got == ranks, f"libps formed {got} for {ranks}"
    _register(job, g._close)
    return g


class Grid:
    """This rank's place in the 3D grid: tp, pp, dp (the axes' lengths),
    tp_rank, pp_rank, dp_rank, and its tp_group, pp_group and dp_group."""

    def __init__(self, job, handle, tp, pp, dp):
        self._handle = handle
        self.tp, self.pp, self.dp = tp, pp, dp
        if handle is None:
            self.tp_rank = self.pp_rank = self.dp_rank = 0
        else:
            c = _lib.lib.ps_grid_coords(handle)
            self.tp_rank, self.pp_rank, self.dp_rank = c.tp, c.pp, c.dp
        for axis, name in (("t", "tensor"), ("p", "pipeline"), ("d", "data")):
            coll = _lib.lib.ps_grid_group(handle, axis.encode()) if handle else None
            if coll:
                n = _lib.lib.ps_coll_world_size(coll)
                ranks = [_lib.lib.ps_coll_job_rank(coll, r) for r in range(n)]
                rank = _lib.lib.ps_coll_rank(coll)
            else:
                ranks, rank = [job.rank], 0
            setattr(self, f"{axis}p_group",
                    Group(job, coll, ranks, rank, f"{name}-parallel group {ranks}", owner=self))

    def __repr__(self):
        return (f"grid(tp={self.tp}, pp={self.pp}, dp={self.dp}): tp_rank {self.tp_rank}, "
                f"pp_rank {self.pp_rank}, dp_rank {self.dp_rank}")

    def _close(self):
        for g in (self.tp_group, self.pp_group, self.dp_group):
            g._coll = None
        if self._handle is not None:
            _lib.lib.ps_grid_free(self._handle)
            self._handle = None


def grid(tp=1, pp=1):
    """The tensor-, pipeline- and data-parallel groups of this rank over the
    whole job, in Megatron-LM's rank order (rank = tp_rank + tp * (dp_rank +
    dp * pp_rank), libps's grid.h): tensor-parallel ranks adjacent, then
    data-parallel, then pipeline. dp = W / (tp * pp); every rank calls it
    with the same tp and pp. Returns a Grid."""
    job = ps._current()
    for name, v in (("tp", tp), ("pp", pp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"grid: {name}={v!r}; expected an int >= 1")
    if job.size % (tp * pp):
        raise ValueError(f"grid: tp={tp} x pp={pp} = {tp * pp} does not divide the job's "
                         f"{job.size} ranks (dp = W / (tp x pp) must be a whole number)")
    dp = job.size // (tp * pp)
    if job.size == 1:
        return Grid(job, None, 1, 1, 1)
    coll = job.ring()
    _agree_on_ranks(job, coll, {"tp": tp, "pp": pp}, "grid", "settings")
    out = ctypes.c_void_p()
    err = _lib.errbuf()
    st = _lib.lib.ps_grid_new(coll, tp, pp, ctypes.byref(out), err, len(err))
    if st != _lib.OK:
        raise job.ring_error(st, f"grid(tp={tp}, pp={pp}): {err.value.decode()}")
    g = Grid(job, out, tp, pp, dp)
    _register(job, g._close)
    return g


def owned_layout(group, members, init):
    """ps mode, DistributedOptimizer(group=group): the shards hold one layout
    per job, so every rank of the job builds its optimizer at the same time
    (each over its own group: a grid's dp_group) and the layouts of every
    group are gathered over the job. Each group's tensors are named after
    its ranks ("ranks0-1/bucket0": two stages' "0.weight" never collide) and
    owned by them (ps_declare_owned: a step of its keys completes when its
    members pushed, the mean is over them); the group's first rank
    initialises them. A rank in two groups' owner sets is refused."""
    from . import allgather_object
    from .optimizer import _Layout
    job = group._job
    tag = "ranks" + "-".join(map(str, group.ranks))
    mine = [(f"{tag}/{n}", c, d) for n, c, d in members]
    every = allgather_object((tag, group.ranks, mine),
                             name="the layouts of the groups' DistributedOptimizers")
    base_of, group_first, declared, owners = {}, {}, [], []
    for q, (t, ranks, ms) in enumerate(every):
        strangers = [o for o in ranks if every[o][0] != t]
        if strangers:
            o = strangers[0]
            raise ps.PSError(
                f"DistributedOptimizer: rank {q} synchronises over group {ranks}, but rank {o} "
                f"builds its optimizer over group {every[o][1]}: in ps mode every rank builds "
                "its DistributedOptimizer at the same time, each over the one group it is in "
                "(the groups must not overlap: a grid's dp_group)", _lib.ERR_STATE)
        if t in base_of:
            first = group_first[t]
            if ms != every[first][2]:
                raise ps.LayoutError(
                    f"DistributedOptimizer over group {ranks}: rank {q}'s parameters differ "
                    f"from rank {first}'s in name, shape or order: {ms[:3]} against "
                    f"{every[first][2][:3]}")
            continue
        group_first[t] = q
        base_of[t] = len(declared)
        declared += ms
        owners += [list(ranks)] * len(ms)
    return _Layout(job, mine, init,
                   owned=(declared, owners, base_of[tag], job.rank == group.ranks[0]))
