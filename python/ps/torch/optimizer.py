"""DistributedOptimizer: the engine behind ps.torch (see __init__.py for
what a user sees).

Buckets. The parameters that need gradients when the optimizer is built, in
registration order, are cut into buckets walking backwards (backward
produces gradients roughly in reverse), each holding up to bucket_bytes (a
larger tensor gets its own). A bucket is one flat float32 tensor: each
gradient is copied into its slice by its hook, followed by one presence flag
per member (1 when this rank has a gradient for it), and the bucket leaves
when its last gradient arrived. In ps mode a bucket is one tensor of the
shards' layout, declared under a name that carries a digest of its members'
names and shapes, so ranks whose models differ are refused by the shards
(LAYOUT_MISMATCH) instead of mixing gradients; in allreduce mode buckets are
all-reduced strictly in index order (every rank must queue the same
collectives in the same order) and the members' names and shapes are checked
across ranks when the optimizer is built.

When. As DDP does, the averaged gradient is in p.grad when backward()
returns: the first gradient hook of a backward pass queues a callback that
the autograd engine runs when the pass ends; it waits for the buckets (which
left while backward ran), puts the mean into p.grad and returns, so
clipping, AMP's unscale_ and inspection after backward see the mean and
step() only steps. A pass inside no_sync(), or before the
backward_passes_per_step-th one, only accumulates locally (torch sums into
p.grad); the pass that synchronises copies the accumulated p.grad.
step() after a window that never reached that pass synchronises first.

Presence. The flags are averaged with the gradients: a parameter that no
rank had a gradient for keeps p.grad as torch left it (None stays None, so
optimizers skip it), one that some ranks had gets the mean with zeros for the
others. With a shard-side optimizer or sharded state (ZeRO-1) the shards or
the inner optimizer step the whole flat tensor: there a parameter without a
gradient is stepped with zeros, which a warning says once.

Requests in flight hold pointers into the buckets, so a bucket is never
written or freed until the round has waited for all of them, errors
included.

Rounds (_rounds.py). Every synchronisation is a round, numbered by the step
(self._step): in ps mode every bucket is pushed with step s and pulled at
version >= s+1, s starting at the shards' resume step of this rank (0 in a
new job); on the ring the round starts with the header that says which ranks
train, joined or finished. join() makes this rank take part in the others'
rounds with zeros until every rank joined or finished; then every rank takes
the model of the last rank to train.

Sharded optimizer state (allreduce mode, shard_optimizer_state=True; ZeRO
stage 1, as ps-worker --shard-optimizer-state): each bucket is padded to W
equal chunks and reduce-scattered (mean) instead of all-reduced; this rank's
chunks of every bucket are one flat parameter of an inner optimizer of the
user's class and hyper-parameters, which alone keeps state (1/W of it per
rank); step() gives that parameter the current values, steps the inner
optimizer and all-gathers the updated chunks of every rank in one operation
back into the model."""

import contextlib
import ctypes
import hashlib
import warnings
import weakref

import torch
from torch.autograd import Variable

import ps
from ps import _lib

from . import _rounds
from ._rounds import JOINED, TRAIN

DEFAULT_CHUNK_BYTES = 4 << 20  # libps's default (chunk_bytes 0), BytePS's
_NOT_HYPER = ("params", "initial_lr")  # keys of a param group that are not settings


def _auto_chunk_bytes(total_bytes, num_shards):
    """The model's bytes per shard rounded up to 4 KiB, at most 4 MiB (as
    ps-worker's --chunk-bytes 0)."""
    per = -(-total_bytes // num_shards)
    per = -(-per // 4096) * 4096
    return min(per, DEFAULT_CHUNK_BYTES)


def _shard_optimizer(job):
    """What shard 0 runs (--optimizer), asked before anything is declared."""
    stats = _lib.ShardStats()
    st = _lib.lib.ps_stats(job.client, 0, ctypes.byref(stats))
    if st != _lib.OK:
        raise job.client_error(st, "asking shard 0 for its optimizer")
    return stats.optimizer.decode() or "unknown", stats.consistency.decode()


class _Layout:
    """ps mode: tensors declared on the shards, and their requests."""

    def __init__(self, job, members, init_values, owned=None):
        """members: (name, count, description) per tensor; rank 0
        initialises each with init_values[i] (flat float32 tensors).
        owned (DistributedOptimizer over a group, groups.owned_layout):
        (every group's members, their owners, where this rank's members
        start among them, whether this rank initialises them): the whole
        job's layout is declared with its owners, this rank's members are
        tensors base.. of it."""
        self.job = job
        self.base = owned[2] if owned else 0
        self.names = [m[0] for m in members]
        self.counts = [m[1] for m in members]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.pending = []
        if job.declared:
            raise ps.PSError("the shards hold one layout per job and this process declared it "
                             "already (one DistributedOptimizer or one declare() per job)")
        if job.cfg["chunk_bytes"] == 0:
            # ps-worker's auto chunk size: 4 MiB, or less so that a small
            # model still spreads over every shard (the client takes it at
            # connection, so reconnect with it).
            every = owned[0] if owned else members
            chunk = _auto_chunk_bytes(sum(m[1] for m in every) * 4, job.num_shards)
            if chunk != DEFAULT_CHUNK_BYTES:
                job.reopen_client(chunk)
        c = job.client
        declared = owned[0] if owned else members
        wire = []
        for name, count, desc in declared:
            digest = hashlib.sha256(desc.encode()).hexdigest()[:16]
            wire.append(f"{name}#{digest}")
        names = _lib.cstrings(wire)
        counts = (ctypes.c_uint64 * len(declared))(*[m[1] for m in declared])
        if owned:
            sets = [(ctypes.c_int * len(o))(*o) for o in owned[1]]
            ptrs = (ctypes.POINTER(ctypes.c_int) * len(sets))(
                *[ctypes.cast(a, ctypes.POINTER(ctypes.c_int)) for a in sets])
            nums = (ctypes.c_int * len(sets))(*[len(o) for o in owned[1]])
            st = _lib.lib.ps_declare_owned(c, len(declared), names, counts, ptrs, nums)
        else:
            st = _lib.lib.ps_declare(c, len(declared), names, counts)
        if st == _lib.ERR_LAYOUT_MISMATCH:
            raise ps.LayoutError(
                "the shards hold a different layout: the ranks' parameters differ in name, "
                "shape or order (or the shards belong to another job): "
                + job.client_error(st, "declare").args[0])
        if st != _lib.OK:
            raise job.client_error(st, "declaring the parameters on the shards")
        job.declared = True
        self.optimizer, self.consistency = _shard_optimizer(job)
        if (owned[3] if owned else job.rank == 0):
            for i, v in enumerate(init_values):
                v = v.detach().reshape(-1).contiguous()
                st = _lib.lib.ps_init(c, self.base + i, v.data_ptr())
                if st != _lib.OK:
                    raise job.client_error(st, f"initialising {self.names[i]} on the shards")
        step = ctypes.c_uint64()
        st = _lib.lib.ps_resume_step(c, ctypes.byref(step))
        if st != _lib.OK:
            raise job.client_error(st, "asking the shards where this rank resumes")
        self.clock = [step.value] * len(members)

    def _start(self, fn, i, arg, buf, what):
        req = ctypes.c_void_p()
        st = fn(self.job.client, self.base + i, arg, buf.data_ptr(), None, None,
                ctypes.byref(req))
        if st != _lib.OK:
            raise self.job.client_error(st, f"{what} of {self.names[i]}")
        self.pending.append((req, arg if fn is _lib.lib.ps_pull_async else None, i, buf))

    def push(self, i, step, grad):
        self._start(_lib.lib.ps_push_async, i, step, grad, "push")

    def pull(self, i, min_version, out):
        self._start(_lib.lib.ps_pull_async, i, min_version, out, "pull")

    def wait_all(self, what):
        """Waits for every request (all of them, even after a failure: they
        hold pointers into our buffers), then raises the first failure."""
        first = None
        pending, self.pending = self.pending, []
        for req, min_version, i, _buf in pending:
            version = ctypes.c_uint64()
            st = _lib.lib.ps_wait(req, ctypes.byref(version))
            if st != _lib.OK and first is None:
                first = self.job.client_error(st, f"{what}: {self.names[i]}")
            elif st == _lib.OK and min_version is not None and version.value < min_version:
                first = first or ps.PSError(
                    f"{what}: {self.names[i]}: the shard answered version {version.value}, "
                    f"below the {min_version} asked for")
        if first is not None:
            raise first

    def clocks(self):
        """Every rank's clock (its next step), the lowest over the shards."""
        w = self.job.size
        low = [None] * w
        buf = (ctypes.c_uint64 * w)()
        for shard in range(self.job.num_shards):
            for r in range(w):
                buf[r] = _lib.UINT64_MAX  # a shard without keys reports none
            st = _lib.lib.ps_worker_clocks(self.job.client, shard, buf, w)
            if st != _lib.OK:
                raise self.job.client_error(st, f"asking shard {shard} for the ranks' clocks")
            for r in range(w):
                if buf[r] != _lib.UINT64_MAX and (low[r] is None or buf[r] < low[r]):
                    low[r] = buf[r]
        return [c or 0 for c in low]


class _Bucket:
    def __init__(self, index, members, flags):
        self.index = index
        self.members = members  # (name, param, offset, numel)
        self.numel = sum(m[3] for m in members)
        self.nflags = len(members) if flags else 0
        self.size = self.numel + self.nflags  # elements on the wire
        self.flat = torch.zeros(self.size, dtype=torch.float32)
        self.flags = self.flat[self.numel:].numpy()  # (a numpy view: element writes are cheap)
        self.out = None  # ps mode: what the pull brings back
        self.waiting = len(members)
        self.launched = False
        self.req = None  # allreduce mode: the collective in flight

    def description(self):
        flags = f";flags:{self.nflags}" if self.nflags else ""
        return ";".join(f"{n}:{tuple(p.shape)}" for n, p, _, _ in self.members) + flags


def _hyper(group):
    return {k: v for k, v in group.items() if k not in _NOT_HYPER}


class _DistributedOptimizer:
    """Methods mixed into a subclass of the user's optimizer class (see
    DistributedOptimizer)."""

    def __init__(self, original, named_parameters, backward_passes_per_step, bucket_bytes,
                 shard_optimizer_state=False, group=None):
        super(self.__class__, self).__init__(original.param_groups)
        # Keep what the user's optimizer already had: its defaults and any
        # state loaded into it (load_state_dict before wrapping).
        self.defaults = original.defaults
        for p, s in original.state.items():
            self.state[p] = s
        from . import groups
        self._group = group
        self._job = groups.on(group, "DistributedOptimizer")  # a group: its view of the job
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got "
                             f"{backward_passes_per_step}")
        self._bpps = backward_passes_per_step
        if bucket_bytes is None:
            bucket_bytes = self._job.cfg["bucket_bytes"]
        self._named, self._frozen = self._name_parameters(named_parameters)
        self._num_params = sum(len(g["params"]) for g in self.param_groups)
        self._shard_side = False
        self._layout = None
        self._inner = None
        kind = None
        if self._job.mode == "ps":
            kind, _ = _shard_optimizer(self._job)
            self._shard_side = kind != "sum"
            if self._shard_side:
                self._check_groups(kind)
        flags = not shard_optimizer_state
        self._buckets = self._make_buckets(bucket_bytes, flags)
        self._bucket_of = {}
        for b in self._buckets:
            for j, m in enumerate(b.members):
                self._bucket_of[id(m[1])] = (b, m, j)
        # the window since the last synchronisation
        self._passes = 0
        self._touched = set()  # parameters whose hook fired in it
        self._filled = set()  # ...and whose gradient is in its bucket
        self._in_backward = False
        self._syncing_pass = False
        self._no_sync = False
        self._round_done = False  # synchronised, step() not taken yet
        self._next_launch = 0
        self._header = None
        self._scale = None
        self._skip = False
        self._warned = set()
        self._step = 0
        self._last_root = None
        if self._job.size > 1 and (self._job.mode == "allreduce" or (
                group is None and self._job.ring_configured())):
            # (ps mode over a group: groups.owned_layout checks over the job)
            # Every rank learns of a mismatch (in ps mode the shards would
            # refuse only the rank that declared second).
            from . import _agree
            _agree("|".join(b.description() for b in self._buckets), 0,
                   "DistributedOptimizer parameters", group)
        if self._job.mode == "ps":
            self._setup_ps()
            self._step = self._layout.clock[0]
        if shard_optimizer_state:
            self._setup_sharded()
        self._hyper0 = [_hyper(g) for g in self.param_groups]
        self._hooks = []
        self._grad_accs = []
        for _, p in self._named:
            acc = p.expand_as(p).grad_fn.next_functions[0][0]
            self._hooks.append(acc.register_hook(self._make_hook(p)))
            self._grad_accs.append(acc)
        from . import _job_state
        self._state = _job_state(self._job)
        (self._state.optimizers if group is None else
         self._state.group_optimizers).append(weakref.ref(self))

    # -- construction ---------------------------------------------------------

    def _name_parameters(self, named_parameters):
        in_groups = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is None:
            named = [(f"param.{i}", p) for i, p in enumerate(in_groups)]
        else:
            named = list(named_parameters)
            if named and not (isinstance(named[0], tuple) and len(named[0]) == 2):
                raise TypeError("named_parameters: expected (name, parameter) pairs, e.g. "
                                "model.named_parameters()")
        names = [n for n, _ in named]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"named_parameters: duplicate names {dups}")
        seen = {id(p) for _, p in named}
        unnamed = [i for i, p in enumerate(in_groups) if id(p) not in seen]
        if unnamed:
            raise ValueError(f"named_parameters misses {len(unnamed)} parameter(s) of the "
                             f"optimizer (positions {unnamed[:5]} in its param_groups): pass "
                             "model.named_parameters() of the model the optimizer trains")
        in_opt = {id(p) for p in in_groups}
        out, frozen = [], []
        for n, p in named:
            if id(p) not in in_opt:
                continue
            if not p.requires_grad:
                frozen.append((n, p))
                continue
            _check_parameter(p, n)
            out.append((n, p))
        if not out:
            raise ValueError("DistributedOptimizer: no parameter needs a gradient")
        return out, frozen

    def _check_groups(self, kind):
        """A shard-side optimizer runs one set of hyper-parameters: refuse
        parameter groups that ask for others."""
        first = _hyper(self.param_groups[0])
        for i, g in enumerate(self.param_groups[1:], 1):
            h = _hyper(g)
            diff = sorted(k for k in set(first) | set(h) if first.get(k) != h.get(k))
            if diff:
                k = diff[0]
                raise ValueError(
                    f"DistributedOptimizer: parameter group {i} sets {k}={h.get(k)!r} and group 0 "
                    f"{k}={first.get(k)!r}, but the shards run one {kind} optimizer with their own "
                    "settings (--lr, --momentum, --weight-decay, ...) for every parameter: these "
                    "groups cannot be honoured. Run the shards with --optimizer sum (your "
                    "optimizer then steps on every worker, groups and all) or use one group")

    def _make_buckets(self, bucket_bytes, flags):
        buckets, cur, size = [], [], 0
        for name, p in reversed(self._named):
            nbytes = p.numel() * 4
            if cur and (bucket_bytes == 0 or size + nbytes > bucket_bytes):
                buckets.append(cur)
                cur, size = [], 0
            cur.append((name, p))
            size += nbytes
        if cur:
            buckets.append(cur)
        out = []
        for i, group in enumerate(buckets):
            members, off = [], 0
            for name, p in group:
                members.append((name, p, off, p.numel()))
                off += p.numel()
            out.append(_Bucket(i, members, flags))
        return out

    def _setup_ps(self):
        job = self._job
        init = []
        for b in self._buckets:
            with torch.no_grad():
                for _, p, off, n in b.members:
                    b.flat[off:off + n].view_as(p).copy_(p)
            init.append(b.flat)
        members = [(f"bucket{b.index}", b.size, b.description()) for b in self._buckets]
        if self._group is None:
            self._layout = _Layout(job, members, init)
        else:  # the whole job's layout, each group's buckets owned by its ranks
            from .groups import owned_layout
            self._layout = owned_layout(self._group, members, init)
        for b in self._buckets:
            b.out = torch.empty(b.size, dtype=torch.float32)
            b.out_flags = b.out[b.numel:].numpy()
        # Every rank starts from what the shards hold: rank 0's parameters
        # (or, after a restart with a shard-side optimizer, the trained ones).
        step = self._layout.clock[0]
        if step == 0 or self._shard_side:
            self._pull_parameters(step, "pulling the initial parameters")

    def _pull_parameters(self, version, what):
        for b in self._buckets:
            self._layout.pull(b.index, version, b.out)
        self._layout.wait_all(what)
        with torch.no_grad():
            for b in self._buckets:
                for _, p, off, n in b.members:
                    p.copy_(b.out[off:off + n].view_as(p))

    def _setup_sharded(self):
        job = self._job
        if job.mode != "allreduce":
            raise ValueError("shard_optimizer_state: allreduce mode only (in ps mode the "
                             "shards hold the optimizer state)")
        if len(self.param_groups) != 1:
            raise ValueError(f"shard_optimizer_state: the optimizer has "
                             f"{len(self.param_groups)} parameter groups; the sharded state "
                             "takes one (the same hyper-parameters for every parameter)")
        W, total = max(job.size, 1), 0
        for b in self._buckets:
            b.chunk = -(-b.numel // W)
            b.flat = torch.zeros(W * b.chunk, dtype=torch.float32)  # the tail stays zero
            b.shard_off = total
            total += b.chunk
        self._shard_len = total
        self._shard = torch.nn.Parameter(torch.zeros(total, dtype=torch.float32))
        self._shard.grad = torch.zeros(total, dtype=torch.float32)  # the reduce-scatters' output
        self._stage = torch.zeros(W * total, dtype=torch.float32)
        hyper = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        base = self.__class__.__mro__[1]
        try:
            self._inner = base([self._shard], **hyper)
        except TypeError as e:
            raise ValueError(f"shard_optimizer_state: cannot build a {base.__name__} for this "
                             f"rank's shard from the hyper-parameters {sorted(hyper)}: {e}")

    def _shard_step(self, closure):
        """The sharded step: this rank's chunk of every bucket updated by the
        inner optimizer, then every rank's chunks all-gathered into the model."""
        loss = closure() if closure is not None else None
        job = self._job
        W, r, total = max(job.size, 1), job.rank if job.size > 1 else 0, self._shard_len
        group = self._inner.param_groups[0]
        for k, v in self.param_groups[0].items():  # an lr scheduler changes the outer group
            if k != "params":
                group[k] = v
        with torch.no_grad():
            for b in self._buckets:
                flat = torch.cat([p.detach().reshape(-1) for _, p, _, _ in b.members])
                lo, hi = min(r * b.chunk, b.numel), min((r + 1) * b.chunk, b.numel)
                piece = self._shard[b.shard_off:b.shard_off + b.chunk]
                piece.zero_()
                piece[:hi - lo].copy_(flat[lo:hi])
        self._inner.step()
        if job.size > 1:
            mine = self._stage[r * total:(r + 1) * total]
            with torch.no_grad():
                mine.copy_(self._shard)
            st = _lib.lib.ps_coll_allgather(job.coll, mine.data_ptr(), self._stage.data_ptr(),
                                            total * 4)
            if st != _lib.OK:
                raise job.ring_error(st, "all-gather of the updated parameters")
        else:
            with torch.no_grad():
                self._stage.copy_(self._shard)
        with torch.no_grad():
            regions = self._stage.view(W, total)
            for b in self._buckets:
                flat = regions[:, b.shard_off:b.shard_off + b.chunk].reshape(-1)
                for _, p, off, n in b.members:
                    p.copy_(flat[off:off + n].view_as(p))
        return loss

    def state_bytes(self):
        """Bytes of optimizer state this rank holds (tensors in its state)."""
        opt = self._inner if self._inner is not None else self
        return sum(v.numel() * v.element_size() for s in opt.state.values()
                   for v in s.values() if isinstance(v, torch.Tensor))

    # -- the hooks and the end of backward --------------------------------------

    def _make_hook(self, p):
        key = id(p)

        def hook(*_):
            try:
                if not self._in_backward:
                    self._begin_backward()
                if self._syncing_pass and key in self._filled:
                    name = self._bucket_of[key][1][0]
                    raise RuntimeError(
                        f"ps.torch: the gradient of {name} arrived twice in one backward pass "
                        "(torch.utils.checkpoint with use_reentrant=True around a part that "
                        "uses it, and it is used outside too?): its first part had already "
                        "left; use checkpoint(..., use_reentrant=False)")
                self._touched.add(key)
                if self._syncing_pass:
                    self._fill(p)
            except BaseException as e:
                self._fail_round(e)
                raise
        return hook

    def _begin_backward(self):
        if self._round_done:
            raise RuntimeError(
                "ps.torch: backward() again before step(): the gradients of the last backward "
                "pass were already averaged into p.grad; call step() (or zero_grad() to drop "
                "them) first, or accumulate passes with no_sync() or backward_passes_per_step "
                "(inside one backward() this is torch.utils.checkpoint with use_reentrant=True "
                "around the last layers, whose inner backward pass ended first: use "
                "use_reentrant=False)")
        self._check_structure()
        self._in_backward = True
        self._syncing_pass = not self._no_sync and self._passes + 1 >= self._bpps
        Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self):
        self._in_backward = False
        self._passes += 1
        if self._syncing_pass:
            self._syncing_pass = False
            self._round()

    def _check_structure(self):
        """Refuses what the buckets cannot follow, naming the parameter."""
        for name, p in self._frozen:
            if p.requires_grad:
                raise RuntimeError(
                    f"ps.torch: {name} needs a gradient now but did not when DistributedOptimizer "
                    "was built, so it has no place in the synchronised buckets and the ranks "
                    "would diverge: build the DistributedOptimizer with every parameter that "
                    "will ever train set to requires_grad=True (freeze it afterwards: a frozen "
                    "parameter simply gets no gradient), or leave it out of the optimizer")
        n = sum(len(g["params"]) for g in self.param_groups)
        if n != self._num_params:
            raise RuntimeError(
                f"ps.torch: the optimizer holds {n} parameters, {self._num_params} when "
                "DistributedOptimizer was built (add_param_group afterwards?): the new ones "
                "would not be synchronised; build the DistributedOptimizer after adding them")

    def _fill(self, p, zeros=False):
        key = id(p)
        if key in self._filled:
            return
        b, (name, _, off, n), j = self._bucket_of[key]
        self._filled.add(key)
        g = None if zeros else p.grad
        with torch.no_grad():
            dst = b.flat[off:off + n]
            if g is None:
                dst.zero_()
            else:
                if g.is_sparse or g.dtype != torch.float32 or g.device.type != "cpu":
                    raise TypeError(
                        f"ps.torch: the gradient of {name} is a {'sparse ' if g.is_sparse else ''}"
                        f"{g.dtype} tensor on {g.device}; DistributedOptimizer takes dense float32 "
                        "CPU gradients" + (" (an nn.Embedding with sparse=True: build it with "
                                           "sparse=False)" if g.is_sparse else ""))
                dst.view_as(p).copy_(g)
            if b.nflags:
                b.flags[j] = 0.0 if g is None else 1.0
        b.waiting -= 1
        if b.waiting == 0:
            self._launch_ready()

    def _launch_ready(self):
        if self._job.mode == "ps":
            for b in self._buckets:
                if b.waiting == 0 and not b.launched:
                    self._launch(b)
            return
        while (self._next_launch < len(self._buckets)
               and self._buckets[self._next_launch].waiting == 0):
            self._launch(self._buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, b, state=TRAIN):
        b.launched = True
        job = self._job
        if job.mode == "ps":
            self._layout.push(b.index, self._step, b.flat)
            self._layout.pull(b.index, self._step + 1, b.out)
            return
        if job.size <= 1:
            return
        if b.index == 0 and state == TRAIN:
            self._header = _rounds.Header(job, TRAIN, self._step)
        req = ctypes.c_void_p()
        if self._inner is not None:
            mean = self._shard.grad[b.shard_off:b.shard_off + b.chunk]
            st = _lib.lib.ps_coll_reduce_scatter_async(job.coll, b.flat.data_ptr(),
                                                       mean.data_ptr(), b.chunk, _lib.REDOP_AVG,
                                                       ctypes.byref(req))
            what = "reduce-scatter"
        else:
            st = _lib.lib.ps_coll_allreduce_async(job.coll, b.flat.data_ptr(), b.size,
                                                  _lib.REDOP_AVG, ctypes.byref(req))
            what = "all-reduce"
        if st != _lib.OK:
            raise job.ring_error(st, f"{what} of gradient bucket {b.index}")
        b.req = req

    # -- the round ---------------------------------------------------------------

    def _round(self):
        """Synchronises this window's gradients (this rank trains)."""
        self._state.barrier_passed = False  # training goes on after a join()
        try:
            for name, p in self._named:
                if id(p) in self._filled:
                    continue
                had = id(p) in self._touched and p.grad is not None
                if not had:
                    self._warn_unused(name)
                self._fill(p, zeros=not had)
            self._launch_ready()
            states = self._wait_round()
            self._write_results()
            self._after_round(states)
        except BaseException as e:
            self._fail_round(e)
            raise
        self._reset_window()
        self._step += 1
        self._round_done = True

    def _warn_unused(self, name):
        if name in self._warned:
            return
        self._warned.add(name)
        if self._shard_side or self._inner is not None:
            where = "the shards' optimizer" if self._shard_side else "the sharded optimizer state"
            warnings.warn(
                f"ps.torch: {name} got no gradient on this rank in step {self._step}: zeros were "
                f"reduced in its place, and {where} steps it with them (momentum, weight decay "
                "and Adam move it, where torch skips a parameter whose gradient is None)",
                stacklevel=4)
        else:
            warnings.warn(
                f"ps.torch: {name} got no gradient on this rank in step {self._step}: it counts "
                "as zeros in the mean of the ranks that have one; when no rank has one, p.grad "
                "is left as torch left it (the same every later time)", stacklevel=4)

    def _wait_round(self):
        """Waits for the header and every bucket; the header first, so that
        when the ranks turn out uneven the ring is failed before waiting for
        buckets a rank will never reduce. Returns the header's states (ring)."""
        first, states = None, None
        header, self._header = self._header, None
        if header is not None:
            try:
                states = header.wait()
                _rounds.rounds_of(self._job).conclude(states, "DistributedOptimizer")
            except ps.PSError as e:
                first = e
        if self._job.mode == "ps":
            try:
                self._layout.wait_all("reducing the gradients through the shards")
            except ps.PSError as e:
                first = first or e
        else:
            for b in self._buckets:
                if b.req is None:
                    continue
                req, b.req = b.req, None
                st = _lib.lib.ps_coll_wait(req)
                if st != _lib.OK and first is None:
                    first = self._job.ring_error(st, f"all-reduce of gradient bucket {b.index}")
        if first is not None:
            raise _explain(self, first)
        self._scale = None
        trainers = _rounds.rounds_of(self._job).trainers
        if states is not None and 0 < trainers < self._job.size:
            self._scale = self._job.size / trainers
        return states

    def _write_results(self):
        scale = self._scale
        if self._inner is not None:
            if self._job.size <= 1:
                with torch.no_grad():  # one rank: its chunk is the whole bucket
                    for b in self._buckets:
                        self._shard.grad[b.shard_off:b.shard_off + b.numel].copy_(
                            b.flat[:b.numel])
            elif scale is not None:
                self._shard.grad.mul_(scale)
            return  # the gradients went to the shard, p.grad keeps this rank's own
        if self._shard_side:
            return  # the new parameters wait in b.out for step()
        with torch.no_grad():
            for b in self._buckets:
                ps_mode = self._job.mode == "ps"
                src, present = (b.out, b.out_flags) if ps_mode else (b.flat, b.flags)
                if scale is not None:
                    src[:b.numel].mul_(scale)
                for j, (_, p, off, n) in enumerate(b.members):
                    if b.nflags and present[j] <= 0:
                        continue  # no rank had a gradient: p.grad stays as torch left it
                    view = src[off:off + n].view_as(p)
                    if p.grad is None:
                        p.grad = torch.empty_like(p).copy_(view)
                    else:
                        p.grad.copy_(view)

    def _after_round(self, states):
        """The buffers of broadcast_buffers, once per round (their header:
        the ring's round header, or in ps mode one of their own)."""
        if not self._state.buffer_syncs or self._job.size <= 1 or self._group is not None:
            return  # (broadcast_buffers follows the optimizers of the whole job)
        if states is None:
            h = _rounds.Header(self._job, TRAIN, self._step)
            _rounds.rounds_of(self._job).conclude(h.wait(), "broadcast_buffers")
        self._state.sync_buffers_of_round()

    def _fail_round(self, e):
        """A round went wrong on this rank: every request in flight is
        waited for (they point into our buffers) and, on the ring, the other
        ranks are told, so that none waits for an operation this rank will
        never start."""
        job = self._job
        in_flight = self._header is not None or any(b.launched for b in self._buckets)
        if job.coll is not None and not isinstance(e, ps.RetryableError) and (
                in_flight or isinstance(e, ps.PSError)):
            # (a lost shard or peer is seen by every rank on its own: no abort)
            _rounds.abort(job, str(e) if isinstance(e, ps.PSError) else
                          f"rank {job.rank} failed in its gradient synchronisation: "
                          f"{type(e).__name__}: {e}")
        if self._header is not None:
            self._header.abandon()
            self._header = None
        if self._layout is not None:
            try:
                self._layout.wait_all("after a failure")
            except ps.PSError:
                pass
        for b in self._buckets:
            if b.req is not None:
                req, b.req = b.req, None
                _lib.lib.ps_coll_wait(req)
        self._in_backward = False
        self._syncing_pass = False
        self._reset_window()

    def _reset_window(self):
        self._passes = 0
        self._touched.clear()
        self._filled.clear()
        self._next_launch = 0
        for b in self._buckets:
            b.waiting = len(b.members)
            b.launched = False

    # -- join and the end of training -------------------------------------------

    def _serve_round(self):
        """One round of the others as a rank that joined (allreduce mode):
        zeros for every bucket, no step. False once every rank has joined
        or finished."""
        job = self._job
        self._check_idle("join()")
        h = _rounds.Header(job, JOINED, self._step)
        states = _rounds.rounds_of(job).conclude(h.wait(), "DistributedOptimizer")
        if _rounds.rounds_of(job).closed:
            return False
        try:
            for b in self._buckets:
                b.flat.zero_()
                b.waiting = 0
            for b in self._buckets:
                self._launch(b, state=JOINED)
            self._wait_round()
            if self._inner is not None:
                self._shard.grad.mul_(job.size / _rounds.rounds_of(job).trainers)
                self._shard_step(None)
            self._after_round(states)
        except BaseException as e:
            self._fail_round(e)
            raise
        self._reset_window()
        self._step = max(self._step, max(s for _, s in states))
        return True

    def _check_idle(self, what):
        if self._in_backward or self._round_done or self._passes:
            raise RuntimeError(f"ps.torch: {what} while this rank has gradients not yet stepped "
                               "(call step() first, or zero_grad() to drop them)")

    def _join_ps(self):
        """ps mode: the shards go on without this rank; it serves the
        buffer rounds (if any) and waits for the others (the barrier)."""
        self._check_idle("join()")
        self._job.leave(_lib.LEAVE_JOINED)
        if self._state.buffer_syncs and self._job.size > 1:
            self._state.serve_buffer_rounds(JOINED, self._step)

    def _final_sync_ps(self):
        """After the barrier that ends join() or the training (ps mode): a
        rank that sat out steps takes the model of the rank that trained
        longest. Every rank decides alike: from every rank's step gathered
        over the ring (the shards' clocks change as ranks rejoin), or, with
        no ring (or a lost worker on it), from the shards' clocks, where
        only a shard-side pull is possible. Returns the rank whose model the
        ring carried (the buffers follow), else None."""
        job = self._job
        lost = set(ps.workers_lost())
        ring = job.ring_configured() and job.size > 1 and not lost
        if ring:
            from . import allgather
            steps = allgather(torch.tensor([self._step], dtype=torch.int64),
                              "the ranks' steps after join()").tolist()
        else:
            steps = self._layout.clocks()
        live = [r for r in range(job.size) if r not in lost]
        top = max(steps[r] for r in live)
        root = min(r for r in live if steps[r] == top)
        behind = steps[job.rank] < top
        self._last_root = root
        synced = None
        if any(steps[r] != top for r in live):
            if self._shard_side:
                if behind:
                    self._pull_parameters(top, "pulling the parameters after join()")
            elif ring:
                self._final_sync(root)
                synced = root
            elif behind:
                warnings.warn("ps.torch: this rank joined before the others finished and "
                              "its model cannot be brought up to theirs (no ring of the "
                              "workers, or a lost worker): it is behind", stacklevel=3)
        self._step = top
        return synced

    def _final_sync(self, root):
        """Every rank takes root's parameters and optimizer state (after a
        join: the ranks that sat out rounds are behind)."""
        if self._inner is not None:
            return  # the all-gathers kept every rank's model current
        params = [p for g in self.param_groups for p in g["params"]]
        _rounds.broadcast_flat(params, root, "the final parameters after join()")
        from . import broadcast_optimizer_state
        broadcast_optimizer_state(self, root)

    # -- the public methods -----------------------------------------------------

    def synchronize(self):
        """Makes sure this window's gradients are reduced and in place
        (p.grad, or the shards' new parameters). backward() does it already
        (its last pass of a window); this does it for a window that ended
        early, and is a no-op otherwise (Horovod's synchronize)."""
        if self._round_done:
            return
        if self._in_backward:
            raise RuntimeError("ps.torch: synchronize() during backward()")
        self._round()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Horovod's: step() inside this block does not synchronize (the
        gradients are already reduced when backward() returns)."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's: backward passes inside this block accumulate into p.grad
        locally; the first backward after it synchronises the sum."""
        old, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = old

    def step(self, closure=None):
        if self._in_backward:
            raise RuntimeError("ps.torch: step() during backward()")
        if not self._round_done:
            if self._skip:
                raise RuntimeError("ps.torch: step() inside skip_synchronize() without "
                                   "synchronize() first: the gradients are not reduced yet")
            self._round()
        self._round_done = False
        if self._shard_side:
            return self._shard_side_step(closure)
        if self._inner is not None:
            return self._shard_step(closure)
        return super(self.__class__, self).step(closure)

    def _shard_side_step(self, closure):
        """The shards applied the update; the new parameters go into the
        model. What the shards could not honour is refused, naming it."""
        changed = []
        with torch.no_grad():
            for b in self._buckets:
                for j, (name, p, off, n) in enumerate(b.members):
                    if (b.flags[j] > 0 and p.grad is not None and
                            not torch.equal(p.grad, b.flat[off:off + n].view_as(p))):
                        changed.append(name)
                    p.copy_(b.out[off:off + n].view_as(p))
        for i, (g, h0) in enumerate(zip(self.param_groups, self._hyper0)):
            h = _hyper(g)
            diff = sorted(k for k in set(h0) | set(h) if h0.get(k) != h.get(k))
            if diff:
                k = diff[0]
                raise ps.PSError(
                    f"ps.torch: parameter group {i}'s {k} is {h.get(k)!r} now and was "
                    f"{h0.get(k)!r} when DistributedOptimizer was built (an lr scheduler?), but "
                    f"the shards run their own {self._layout.optimizer} optimizer with their own "
                    "settings: the change cannot be honoured. Run the shards with --optimizer "
                    "sum (your optimizer and scheduler then step on every worker), or give the "
                    "shards the schedule (ps-server --lr-schedule)")
        if changed:
            order = {name: i for i, (name, _) in enumerate(self._named)}
            changed.sort(key=order.get)
            raise ps.PSError(
                f"ps.torch: the gradient of {changed[0]} was changed after backward() (gradient "
                "clipping, AMP's unscale_?), but the shards had already applied the update with "
                f"the gradient as backward() left it ({len(changed)} parameter(s) differ): "
                "run the shards with --optimizer sum, where p.grad holds the mean after "
                "backward() and your optimizer steps on what you made of it")
        return closure() if closure is not None else None

    def state_dict(self):
        if self._inner is not None:
            raise ps.PSError("shard_optimizer_state: this rank holds only its 1/W of the "
                             "optimizer state; state_dict() and broadcast_optimizer_state() "
                             "of a sharded optimizer are not supported yet")
        return super(self.__class__, self).state_dict()

    def load_state_dict(self, state_dict):
        if self._inner is not None:
            raise ps.PSError("shard_optimizer_state: load_state_dict() of a sharded optimizer "
                             "is not supported yet")
        return super(self.__class__, self).load_state_dict(state_dict)

    def zero_grad(self, set_to_none=False):
        if self._in_backward or any(b.launched for b in self._buckets):
            raise RuntimeError("ps.torch: zero_grad() while gradients are being reduced: "
                               "call step() or synchronize() first")
        if self._round_done:
            if self._shard_side:
                raise RuntimeError(
                    "ps.torch: zero_grad() after backward() without step(): the shards already "
                    "applied this step's update (a shard-side optimizer); call step() to take "
                    "the new parameters")
            self._round_done = False  # the averaged gradients are dropped
        self._reset_window()
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    @property
    def shard_side(self):
        """True when the shards run the optimizer (ps mode, not sum)."""
        return self._shard_side


def _explain(opt, e):
    """A ring disagreement during the gradients' round: say what this rank
    was doing, and the likely cause."""
    if (isinstance(e, ps.PSError) and e.status == _lib.ERR_STATE and opt._job.mode != "ps"
            and "disagree" in str(e)):
        return ps.PSError(
            f"{e}: this rank was synchronising step {opt._step} of its DistributedOptimizer; if "
            "the ranks run different numbers of steps, a rank that runs out of data must call "
            "ps.torch.join()", e.status)
    return e


def _check_parameter(p, name):
    """What DistributedOptimizer takes: dense float32 CPU parameters, in any
    memory layout (channels_last too: gradients are copied, not viewed)."""
    if p.device.type != "cpu":
        raise TypeError(f"parameter {name}: a {p.device.type} tensor; ps.torch takes CPU "
                        "parameters (the GPU path is not built yet): keep the model on the CPU")
    if p.is_sparse:
        raise TypeError(f"parameter {name}: a sparse tensor; ps.torch takes dense parameters")
    if p.dtype != torch.float32:
        raise TypeError(f"parameter {name}: dtype {p.dtype}; DistributedOptimizer takes "
                        "float32 parameters: convert the model with model.float()")


def DistributedOptimizer(optimizer, named_parameters=None, backward_passes_per_step=1,
                         bucket_bytes=None, shard_optimizer_state=False, group=None):
    """Wraps optimizer so that every rank steps on the gradients of every rank.

    Returns an object of a subclass of optimizer's class (built here), so
    step, zero_grad, state_dict and param_groups behave as before, and the
    optimizer's state (e.g. loaded with load_state_dict before wrapping) is
    kept. Call it on every rank with the same model. named_parameters
    (model.named_parameters()) names every parameter the optimizer holds;
    backward() leaves the mean over the ranks in p.grad;
    backward_passes_per_step > 1 (or passes inside no_sync()) accumulates
    backward passes locally (their sum) before the gradients leave;
    bucket_bytes overrides the fusion size (settings: bucket-bytes, default
    1 MiB; 0 = one bucket per tensor). In allreduce mode
    shard_optimizer_state=True keeps 1/W of the optimizer state per rank
    (ZeRO-1, see the top of optimizer.py): one parameter group; p.grad then
    holds this rank's own gradient (the reduced mean goes to the shard), and
    state_dict() is refused. group (ps.torch.new_group, a grid's dp_group):
    the mean is over that group's ranks only: on its own ring (ZeRO-1 shards
    the state over it), or in ps mode through keys of the group's own on the
    shards (groups.owned_layout: every rank builds its optimizer at once,
    each over the one group it is in)."""
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               {k: v for k, v in _DistributedOptimizer.__dict__.items()
                if k not in ("__dict__", "__weakref__")})
    return cls(optimizer, named_parameters, backward_passes_per_step, bucket_bytes,
               shard_optimizer_state, group)
