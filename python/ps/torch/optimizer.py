"""DistributedOptimizer: the engine behind ps.torch (see __init__.py for
what a user sees).

Buckets. The parameters that need gradients, in registration order, are cut
into buckets walking backwards (backward produces gradients roughly in
reverse), each holding up to bucket_bytes (a larger tensor gets its own).
A bucket is one flat float32 tensor: each gradient is copied into its slice
by its hook, and the bucket leaves when its last gradient arrived. In ps mode
a bucket is one tensor of the shards' layout, declared under a name that
carries a digest of its members' names and shapes, so ranks whose models
differ are refused by the shards (LAYOUT_MISMATCH) instead of mixing
gradients; in allreduce mode buckets are all-reduced strictly in index order
(every rank must queue the same collectives in the same order) and the
members' names and shapes are checked across ranks when the optimizer is
built.

Requests in flight hold pointers into the buckets, so a bucket is never
written or freed until synchronize() has waited for all of them, errors
included.

Step protocol (ps mode, any --consistency): at step s every bucket is
pushed with step s and pulled at version >= s+1; s starts at the shards'
resume step of this rank (0 in a new job).

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

import torch

import ps
from ps import _lib


DEFAULT_CHUNK_BYTES = 4 << 20  # libps's default (chunk_bytes 0), BytePS's


def _auto_chunk_bytes(total_bytes, num_shards):
    """The model's bytes per shard rounded up to 4 KiB, at most 4 MiB (as
    ps-worker's --chunk-bytes 0)."""
    per = -(-total_bytes // num_shards)
    per = -(-per // 4096) * 4096
    return min(per, DEFAULT_CHUNK_BYTES)


class _Layout:
    """ps mode: tensors declared on the shards, and their requests."""

    def __init__(self, job, members, init_values):
        """members: (name, count, description) per tensor; rank 0
        initialises each with init_values[i] (flat float32 tensors)."""
        self.job = job
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
            chunk = _auto_chunk_bytes(sum(self.counts) * 4, job.num_shards)
            if chunk != DEFAULT_CHUNK_BYTES:
                job.reopen_client(chunk)
        c = job.client
        wire = []
        for name, count, desc in members:
            digest = hashlib.sha256(desc.encode()).hexdigest()[:16]
            wire.append(f"{name}#{digest}")
        names = _lib.cstrings(wire)
        counts = (ctypes.c_uint64 * len(members))(*self.counts)
        st = _lib.lib.ps_declare(c, len(members), names, counts)
        if st == _lib.ERR_LAYOUT_MISMATCH:
            raise ps.LayoutError(
                "the shards hold a different layout: the ranks' parameters differ in name, "
                "shape or order (or the shards belong to another job): "
                + job.client_error(st, "declare").args[0])
        if st != _lib.OK:
            raise job.client_error(st, "declaring the parameters on the shards")
        job.declared = True
        stats = _lib.ShardStats()
        st = _lib.lib.ps_stats(c, 0, ctypes.byref(stats))
        if st != _lib.OK:
            raise job.client_error(st, "asking shard 0 for its optimizer")
        self.optimizer = stats.optimizer.decode() or "unknown"
        self.consistency = stats.consistency.decode()
        if job.rank == 0:
            for i, v in enumerate(init_values):
                v = v.detach().reshape(-1).contiguous()
                st = _lib.lib.ps_init(c, i, v.data_ptr())
                if st != _lib.OK:
                    raise job.client_error(st, f"initialising {self.names[i]} on the shards")
        step = ctypes.c_uint64()
        st = _lib.lib.ps_resume_step(c, ctypes.byref(step))
        if st != _lib.OK:
            raise job.client_error(st, "asking the shards where this rank resumes")
        self.clock = [step.value] * len(members)

    def _start(self, fn, i, arg, buf, what):
        req = ctypes.c_void_p()
        st = fn(self.job.client, i, arg, buf.data_ptr(), None, None, ctypes.byref(req))
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


class _Bucket:
    def __init__(self, index, members):
        self.index = index
        self.members = members  # (name, param, offset, numel)
        self.numel = sum(m[3] for m in members)
        self.flat = torch.zeros(self.numel, dtype=torch.float32)
        self.out = None  # ps mode: what the pull brings back
        self.waiting = len(members)
        self.launched = False
        self.req = None  # allreduce mode: the collective in flight

    def description(self):
        return ";".join(f"{n}:{tuple(p.shape)}" for n, p, _, _ in self.members)


class _DistributedOptimizer:
    """Methods mixed into a subclass of the user's optimizer class (see
    DistributedOptimizer)."""

    def __init__(self, params, named_parameters, backward_passes_per_step, bucket_bytes,
                 shard_optimizer_state=False):
        super(self.__class__, self).__init__(params)
        self._job = ps._current()
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got "
                             f"{backward_passes_per_step}")
        self._bpps = backward_passes_per_step
        if bucket_bytes is None:
            bucket_bytes = self._job.cfg["bucket_bytes"]
        self._named = self._name_parameters(named_parameters)
        self._buckets = self._make_buckets(bucket_bytes)
        self._bucket_of = {}
        for b in self._buckets:
            for m in b.members:
                self._bucket_of[id(m[1])] = (b, m)
        self._counts = {id(p): 0 for _, p in self._named}
        self._filled = set()
        self._next_launch = 0
        self._synchronized = False
        self._skip = False
        self._warned_unused = set()
        self._shard_side = False
        self._layout = None
        if self._job.size > 1 and (self._job.mode == "allreduce" or
                                   self._job.ring_configured()):
            # Every rank learns of a mismatch (in ps mode the shards would
            # refuse only the rank that declared second).
            from . import _agree
            _agree("|".join(b.description() for b in self._buckets), 0,
                   "DistributedOptimizer parameters")
        if self._job.mode == "ps":
            self._setup_ps()
        self._inner = None
        if shard_optimizer_state:
            self._setup_sharded()
        self._hooks = []
        self._grad_accs = []
        for name, p in self._named:
            acc = p.expand_as(p).grad_fn.next_functions[0][0]
            self._hooks.append(acc.register_hook(self._make_hook(name, p)))
            self._grad_accs.append(acc)

    # -- construction ---------------------------------------------------------

    def _name_parameters(self, named_parameters):
        from . import check_tensor
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
        out = []
        for n, p in named:
            if id(p) not in in_opt or not p.requires_grad:
                continue
            check_tensor(p, f"parameter {n}")
            out.append((n, p))
        if not out:
            raise ValueError("DistributedOptimizer: no parameter needs a gradient")
        return out

    def _make_buckets(self, bucket_bytes):
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
            out.append(_Bucket(i, members))
        return out

    def _setup_ps(self):
        job = self._job
        init = []
        for b in self._buckets:
            with torch.no_grad():
                for _, p, off, n in b.members:
                    b.flat[off:off + n].copy_(p.reshape(-1))
            init.append(b.flat)
        self._layout = _Layout(
            job, [(f"bucket{b.index}", b.numel, b.description()) for b in self._buckets], init)
        kind = self._layout.optimizer
        self._shard_side = kind != "sum"
        for b in self._buckets:
            b.out = torch.empty(b.numel, dtype=torch.float32)
        # Every rank starts from what the shards hold: rank 0's parameters
        # (or, after a restart with a shard-side optimizer, the trained ones).
        step = self._layout.clock[0]
        if step == 0 or self._shard_side:
            for b in self._buckets:
                self._layout.pull(b.index, step, b.out)
            self._layout.wait_all("pulling the initial parameters")
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

    # -- the hooks ------------------------------------------------------------

    def _make_hook(self, name, p):
        def hook(*_):
            key = id(p)
            count = self._counts[key] + 1
            if count > self._bpps:
                raise RuntimeError(
                    f"ps.torch: the gradient of {name} was computed {count} times since the "
                    f"last step(), more than backward_passes_per_step={self._bpps}: call "
                    "step() (or synchronize()) after every backward_passes_per_step "
                    "backward passes, or raise backward_passes_per_step")
            self._counts[key] = count
            if count == self._bpps:
                self._fill(p)
        return hook

    def _fill(self, p, zeros=False):
        b, (_, _, off, n) = self._bucket_of[id(p)]
        if id(p) in self._filled:
            return
        self._filled.add(id(p))
        with torch.no_grad():
            if zeros or p.grad is None:
                b.flat[off:off + n].zero_()
            else:
                g = p.grad
                if g.is_sparse or g.dtype != torch.float32 or g.device.type != "cpu":
                    raise TypeError(f"ps.torch: the gradient of a parameter is {g.dtype} "
                                    f"on {g.device} (sparse={g.is_sparse}); only dense "
                                    "float32 CPU gradients are supported")
                b.flat[off:off + n].copy_(g.reshape(-1))
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

    def _launch(self, b):
        b.launched = True
        job = self._job
        if job.mode == "ps":
            step = self._layout.clock[b.index]
            self._layout.push(b.index, step, b.flat)
            self._layout.pull(b.index, step + 1, b.out)
        elif job.size > 1 and self._inner is not None:
            req = ctypes.c_void_p()
            mean = self._shard.grad[b.shard_off:b.shard_off + b.chunk]
            st = _lib.lib.ps_coll_reduce_scatter_async(job.coll, b.flat.data_ptr(),
                                                       mean.data_ptr(), b.chunk, _lib.REDOP_AVG,
                                                       ctypes.byref(req))
            if st != _lib.OK:
                raise job.ring_error(st, f"reduce-scatter of gradient bucket {b.index}")
            b.req = req
        elif job.size > 1:
            req = ctypes.c_void_p()
            st = _lib.lib.ps_coll_allreduce_async(job.coll, b.flat.data_ptr(), b.numel,
                                                  _lib.REDOP_AVG, ctypes.byref(req))
            if st != _lib.OK:
                raise job.ring_error(st, f"all-reduce of gradient bucket {b.index}")
            b.req = req

    # -- the public methods -----------------------------------------------------

    def synchronize(self):
        """Waits until every gradient of this step is reduced and puts the
        result in place (p.grad, or the parameters with a shard-side
        optimizer). Parameters whose gradient was not computed in this step
        count as zeros (as Horovod does): another rank may have one."""
        if self._synchronized:
            return
        for name, p in self._named:
            if id(p) not in self._filled:
                if self._counts[id(p)] == 0 and name not in self._warned_unused:
                    self._warned_unused.add(name)
                    warnings.warn(f"ps.torch: {name} got no gradient in this step: zeros were "
                                  "reduced in its place (the same every later time)",
                                  stacklevel=3)
                self._fill(p, zeros=self._counts[id(p)] == 0)
        self._launch_ready()
        self._wait_all()
        if self._inner is not None and self._job.size <= 1:
            with torch.no_grad():  # one rank: its chunk is the whole bucket
                for b in self._buckets:
                    self._shard.grad[b.shard_off:b.shard_off + b.numel].copy_(b.flat[:b.numel])
        with torch.no_grad():
            for b in self._buckets:
                if self._inner is not None:
                    break  # the gradients went to the shard, p.grad keeps this rank's own
                src = b.out if self._job.mode == "ps" else b.flat
                for _, p, off, n in b.members:
                    view = src[off:off + n].view_as(p)
                    if self._shard_side:
                        p.copy_(view)
                    elif p.grad is None:
                        p.grad = view.clone()
                    else:
                        p.grad.copy_(view)
        if self._layout is not None:
            self._layout.clock = [c + 1 for c in self._layout.clock]
        self._reset()
        self._synchronized = True

    def _wait_all(self):
        first = None
        if self._job.mode == "ps":
            try:
                self._layout.wait_all("reducing the gradients through the shards")
            except ps.PSError as e:
                first = e
        else:
            for b in self._buckets:
                if b.req is None:
                    continue
                req, b.req = b.req, None
                st = _lib.lib.ps_coll_wait(req)
                if st != _lib.OK and first is None:
                    first = self._job.ring_error(st, f"all-reduce of gradient bucket {b.index}")
        if first is not None:
            raise first

    def _reset(self):
        for key in self._counts:
            self._counts[key] = 0
        self._filled.clear()
        self._next_launch = 0
        for b in self._buckets:
            b.waiting = len(b.members)
            b.launched = False

    @contextlib.contextmanager
    def skip_synchronize(self):
        """step() inside this block does not synchronize: call synchronize()
        yourself first (gradient clipping, AMP's unscale_)."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self, closure=None):
        if not self._skip:
            self.synchronize()
        elif not self._synchronized:
            raise RuntimeError("ps.torch: step() inside skip_synchronize() without "
                               "synchronize() first: the gradients are not reduced yet")
        self._synchronized = False
        if self._shard_side:
            # The shards applied the update and synchronize() pulled it in.
            return closure() if closure is not None else None
        if self._inner is not None:
            return self._shard_step(closure)
        return super(self.__class__, self).step(closure)

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
        if any(b.launched for b in self._buckets):
            raise RuntimeError("ps.torch: zero_grad() while gradients are being reduced: "
                               "call step() or synchronize() first")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    @property
    def shard_side(self):
        """True when the shards run the optimizer (ps mode, not sum)."""
        return self._shard_side


def DistributedOptimizer(optimizer, named_parameters=None, backward_passes_per_step=1,
                         bucket_bytes=None, shard_optimizer_state=False):
    """Wraps optimizer so that step() uses the gradients of every rank.

    Returns an object of a subclass of optimizer's class (built here), so
    step, zero_grad, state_dict and param_groups behave as before. Call it on
    every rank with the same model. named_parameters (model.named_parameters())
    names every parameter the optimizer holds; backward_passes_per_step > 1
    accumulates that many backward passes locally (their sum) before the
    gradients leave; bucket_bytes overrides the fusion size (settings:
    bucket-bytes, default 1 MiB; 0 = one bucket per tensor). In allreduce mode
    shard_optimizer_state=True keeps 1/W of the optimizer state per rank
    (ZeRO-1, see the top of optimizer.py): one parameter group; p.grad then
    holds this rank's own gradient (the reduced mean goes to the shard), and
    state_dict() is refused."""
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               {k: v for k, v in _DistributedOptimizer.__dict__.items()
                if k not in ("__dict__", "__weakref__")})
    return cls(optimizer.param_groups, named_parameters, backward_passes_per_step,
               bucket_bytes, shard_optimizer_state)
