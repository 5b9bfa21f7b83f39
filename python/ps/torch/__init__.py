"""ps.torch: PyTorch training through ps, in both sync modes.

    opt = ps.torch.DistributedOptimizer(opt, model.named_parameters())
    ps.torch.broadcast_parameters(model.state_dict(), root_rank=0)
    ps.torch.broadcast_optimizer_state(opt, root_rank=0)
    ps.torch.broadcast_buffers(model)       # BatchNorm statistics: rank 0's
    ...
    ps.torch.join()                         # a rank out of data (optional)

What leaves when (optimizer.py has the engine): a hook on every parameter's
gradient accumulator fires when backward has produced that gradient; it is
copied into its bucket (gradients fused in reverse registration order, the
order backward produces them, up to bucket_bytes), and a full bucket leaves at
once: pushed to the shards (ps mode) or all-reduced on the ring (allreduce
mode) while backward goes on. When backward() returns (a callback at the end
of the pass waits for the buckets, as DDP's reducer does):

  - ps mode, shards with --optimizer sum (BytePS) and allreduce mode: p.grad
    is the mean of every rank's gradient (a parameter no rank has a gradient
    for keeps p.grad as torch left it) and step() steps the wrapped optimizer;
  - ps mode, a shard-side optimizer (sgd, momentum, adam, adamw): the shards
    applied the update with their own settings; step() puts the new
    parameters into the model, and refuses what the shards could not honour
    (parameter groups with different settings, an lr changed since, a
    gradient changed after backward).

Uneven inputs, buffers, the end (_rounds.py, buffers.py, _JobState below):
a rank that runs out of data calls join() and takes part in the others'
steps until all joined or finished; without it, ranks that run different
numbers of steps fail naming join. broadcast_buffers keeps a module's
buffers rank 0's; SyncBatchNorm takes batch statistics over every rank.

In ps mode the model starts from rank 0's parameters (rank 0 initialises the
shards, every rank pulls them back) when the optimizer is built; in allreduce
mode call broadcast_parameters, as with Horovod. Broadcasts and allreduce()
always go over the ring of the workers (in ps mode too, which needs
--peers/--peer-template: tools/ps-local -- CMD gives them).

The other collectives of the ring, on tensors, every rank calling them with
the same shapes in the same order (as torch.distributed and Horovod):
allgather (concatenated along dim 0, which may differ between the ranks),
allgather_object, reduce_scatter (dim 0 split in
ps.size() parts, this rank's part reduced), reduce (to root_rank), alltoall
(dim 0 split in ps.size() parts, part d to rank d) and broadcast. The
reductions take op="average", "sum", "max" or "min", on float32, float64,
float16, bfloat16, int8, uint8, int32 and int64 tensors, in the dtype's own
arithmetic as torch does it on the CPU (float16 and bfloat16 through
float32, rounded at every step; integers wrap); the average of integers
truncates toward zero (torch.div(..., rounding_mode="trunc")). Between two ranks
(torch.distributed's point-to-point calls): send(tensor, dst), recv(tensor,
src) and their isend / irecv, which return a Handle; only the two ranks
take part, messages from one rank to another arrive in the order sent, and
the receiving tensor must have the sent tensor's size in bytes.

Tensors handed to ps must be contiguous CPU tensors (the optimizer's
parameters may have any layout): float32 for the
optimizer and push_pull, the dtypes above for allreduce, reduce_scatter and
reduce, any dtype for broadcasts, allgather, alltoall, send and recv;
anything else raises TypeError naming the tensor."""

import ctypes
import hashlib
import io

import torch

import ps
from ps import _lib

from . import _rounds
from . import groups as _groups
from ._rounds import FINISHED
from .buffers import broadcast_buffers  # noqa: F401
from .groups import Grid, Group, grid, new_group  # noqa: F401
from .optimizer import DistributedOptimizer  # noqa: F401
from .sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm  # noqa: F401

__all__ = ["DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state",
           "broadcast_object", "broadcast", "broadcast_", "allreduce", "allreduce_",
           "allreduce_async_", "synchronize", "push_pull", "declare", "check_tensor",
           "allgather", "allgather_object", "reduce_scatter", "reduce", "alltoall", "send",
           "recv", "isend", "irecv", "join", "broadcast_buffers", "SyncBatchNorm",
           "convert_sync_batchnorm", "new_group", "grid", "Group", "Grid", "barrier"]


def check_tensor(t, what, float32=True, any_layout=False):
    """Raises TypeError unless t is a tensor ps can hand to C as it is
    (any_layout: one ps copies first, so it need not be contiguous)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise TypeError(f"{what}: a {t.device.type} tensor; ps.torch takes CPU tensors "
                        "(the GPU path is not built yet): move it with .cpu()")
    if t.is_sparse:
        raise TypeError(f"{what}: a sparse tensor; ps.torch takes dense tensors")
    if float32 and t.dtype != torch.float32:
        raise TypeError(f"{what}: dtype {t.dtype}; this takes float32 tensors: "
                        "convert with .float()")
    if not any_layout and not t.is_contiguous():
        raise TypeError(f"{what}: not contiguous; pass t.contiguous() (and copy back)")


# the dtypes the reductions take, as libps's ps_dtype
_DTYPES = {torch.float32: _lib.DTYPE_FLOAT32, torch.float64: _lib.DTYPE_FLOAT64,
           torch.float16: _lib.DTYPE_FLOAT16, torch.bfloat16: _lib.DTYPE_BFLOAT16,
           torch.int8: _lib.DTYPE_INT8, torch.uint8: _lib.DTYPE_UINT8,
           torch.int32: _lib.DTYPE_INT32, torch.int64: _lib.DTYPE_INT64}


def _reducible(t, what):
    """check_tensor for the reductions; returns t's ps_dtype."""
    check_tensor(t, what, float32=False)
    if t.dtype not in _DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in _DTYPES)
        raise TypeError(f"{what}: dtype {t.dtype}; ps.torch reduces {names} tensors")
    return _DTYPES[t.dtype]


def _job():
    return ps._current()


def _on(group, what):
    """The job, or with a group the view of it whose size, rank and ring are
    the group's (groups.py); raises when this rank is not in group."""
    return _groups.on(group, what)


def _ring(group=None, what="a collective"):
    job = _on(group, what)
    return job, (job.ring() if job.size > 1 else None)


def _coll(job):
    return job.ring() if job.size > 1 else None


def _in(group):
    return f" on {group}" if group is not None else ""


# -- all-reduce (the ring, both sync modes) ------------------------------------


class Handle:
    """An operation in flight; synchronize(handle) waits for it."""

    def __init__(self, job, req, tensor, what):
        self._job, self._req, self.tensor, self._what = job, req, tensor, what

    def wait(self):
        if self._req is None:
            return self.tensor
        req, self._req = self._req, None
        st = _lib.lib.ps_coll_wait(req)
        if st != _lib.OK:
            raise self._job.ring_error(st, self._what)
        return self.tensor


def allreduce_async_(tensor, average=True, name=None, op=None, group=None):
    """Starts an in-place all-reduce of tensor (sum, or mean with average;
    op="max" or "min", or any of reduce's ops, overrides average) over the
    ring (of group's ranks with a group); returns a Handle. Every rank must
    start the same all-reduces, with the same sizes and dtypes, in the same
    order."""
    what = f"allreduce of {name or 'a tensor'}"
    job = _on(group, what)
    dtype = _reducible(tensor, what)
    code = _redop(op, what) if op is not None else \
        _lib.REDOP_AVG if average else _lib.REDOP_SUM
    coll = _coll(job)
    if coll is None:
        return Handle(job, None, tensor, what)
    req = ctypes.c_void_p()
    st = _lib.lib.ps_coll_allreduce_typed_async(coll, tensor.data_ptr(), tensor.numel(), dtype,
                                                code, ctypes.byref(req))
    if st != _lib.OK:
        raise job.ring_error(st, what)
    return Handle(job, req, tensor, what)


def barrier(group=None):
    """Returns once every rank of group has called it (None: ps.barrier(),
    the whole job)."""
    if group is None:
        return ps.barrier()
    job = _on(group, "barrier")
    coll = _coll(job)
    if coll is not None:
        _done(job, _lib.lib.ps_coll_barrier(coll), f"barrier on {group}")


def synchronize(handle):
    """Waits for an operation of allreduce_async_; returns its tensor."""
    return handle.wait()


def allreduce_(tensor, average=True, name=None, op=None, group=None):
    return allreduce_async_(tensor, average, name, op, group).wait()


def allreduce(tensor, average=True, name=None, op=None, group=None):
    """The all-reduced value of tensor, in a new tensor."""
    _reducible(tensor, f"allreduce of {name or 'a tensor'}")
    return allreduce_(tensor.clone(), average, name, op, group)


# -- broadcast ---------------------------------------------------------------


def _check_root(root_rank, group=None):
    n = ps.size() if group is None else group.size
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < n:
        where = "this job" if group is None else f"{group} (group ranks)"
        raise ValueError(f"root_rank {root_rank!r} is not a rank of {where} (0..{n - 1})")


def broadcast_(tensor, root_rank, name=None, group=None):
    """Copies root_rank's tensor into every other rank's, in place (any
    dtype; contiguous CPU). With a group, root_rank is a group rank."""
    what = f"broadcast of {name or 'a tensor'}"
    job = _on(group, what)
    check_tensor(tensor, what, float32=False)
    _check_root(root_rank, group)
    coll = _coll(job)
    if coll is None or tensor.numel() == 0:
        return tensor
    st = _lib.lib.ps_coll_broadcast(coll, tensor.data_ptr(),
                                    tensor.numel() * tensor.element_size(), root_rank)
    if st != _lib.OK:
        raise job.ring_error(st, what)
    return tensor


def broadcast(tensor, root_rank, name=None, group=None):
    return broadcast_(tensor.clone(), root_rank, name, group)


# -- all-gather, reduce-scatter, reduce, all-to-all ---------------------------

_OPS = {"average": _lib.REDOP_AVG, "sum": _lib.REDOP_SUM, "max": _lib.REDOP_MAX,
        "min": _lib.REDOP_MIN}


def _redop(op, what):
    if op not in _OPS:
        raise ValueError(f"{what}: op {op!r}; expected one of {', '.join(map(repr, _OPS))}")
    return _OPS[op]


def _split_dim0(tensor, what, n):
    if tensor.dim() == 0 or tensor.shape[0] % n:
        shape = tuple(tensor.shape)
        raise ValueError(f"{what}: dim 0 of shape {shape} does not split into {n} equal parts "
                         f"(one per rank)")
    return tensor.shape[0] // n


def _done(job, st, what):
    if st != _lib.OK:
        raise job.ring_error(st, what)


def allgather(tensor, name=None, group=None):
    """Every rank's tensor concatenated along dim 0, rank 0's first (any
    dtype). Dim 0 may differ between the ranks (Horovod's allgather); the
    other dimensions and the dtype must be the same on every rank, else
    every rank raises ValueError naming both."""
    what = f"allgather of {name or 'a tensor'}{_in(group)}"
    _on(group, what)
    check_tensor(tensor, what, float32=False)
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    return _allgather(tensor, what, group)[0]


def _allgather(tensor, what, group=None):
    """allgather's work: (the concatenation, every rank's dim 0)."""
    job, coll = _ring(group, what)
    if coll is None:
        return tensor.clone(), [tensor.shape[0]]
    rows = _gather_rows(job, coll, tensor, what)
    trail = tuple(tensor.shape[1:])
    if len(set(rows)) == 1:
        out = torch.empty((sum(rows),) + trail, dtype=tensor.dtype)
        _done(job, _lib.lib.ps_coll_allgather(coll, tensor.data_ptr(), out.data_ptr(),
                                              tensor.numel() * tensor.element_size()), what)
        return out, rows
    # different lengths: every rank sends the longest, padded, then the
    # padding is cut out
    most = max(rows)
    padded = torch.zeros((most,) + trail, dtype=tensor.dtype)
    padded[:tensor.shape[0]].copy_(tensor)
    every = torch.empty((job.size * most,) + trail, dtype=tensor.dtype)
    _done(job, _lib.lib.ps_coll_allgather(coll, padded.data_ptr(), every.data_ptr(),
                                          padded.numel() * padded.element_size()), what)
    return torch.cat([every[q * most:q * most + rows[q]] for q in range(job.size)]), rows


def _gather_rows(job, coll, tensor, what):
    """Every rank's dim 0, after checking that the rest of the shape and
    the dtype agree (a digest of them travels with it)."""
    desc = f"{tuple(tensor.shape[1:])}:{tensor.dtype}"
    digest = int.from_bytes(hashlib.sha256(desc.encode()).digest()[:6], "little")
    mine = torch.tensor([tensor.shape[0], digest], dtype=torch.int64)
    every = torch.empty(job.size, 2, dtype=torch.int64)
    _done(job, _lib.lib.ps_coll_allgather(coll, mine.data_ptr(), every.data_ptr(), 16),
          what + " (the shapes)")
    digests = every[:, 1].tolist()
    if len(set(digests)) > 1:
        other = next(q for q, d in enumerate(digests) if d != digests[job.rank])
        raise ValueError(f"{what}: the ranks' tensors differ beyond dim 0 (shape or dtype): "
                         f"this rank {ps.rank()} has shape {tuple(tensor.shape)} and "
                         f"{tensor.dtype}, rank {other} something else; only dim 0 may differ")
    return every[:, 0].tolist()


def allgather_object(obj, name=None, group=None):
    """A list of every rank's obj (anything torch.save takes), rank 0's
    first, on every rank (of group)."""
    what = f"allgather_object of {name or 'an object'}{_in(group)}"
    job, coll = _ring(group, what)
    if coll is None:
        return [obj]
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    every, sizes = _allgather(data, what, group)
    out, off = [], 0
    for n in sizes:
        out.append(torch.load(io.BytesIO(every[off:off + n].numpy().tobytes())))
        off += n
    return out


def reduce_scatter(tensor, op="average", name=None, group=None):
    """Dim 0 of tensor split in ps.size() (group.size) equal parts; returns
    this rank's part, reduced (op) over every rank (of group)."""
    what = f"reduce_scatter of {name or 'a tensor'}{_in(group)}"
    job = _on(group, what)
    dtype = _reducible(tensor, what)
    code = _redop(op, what)
    rows = _split_dim0(tensor, what, job.size)
    coll = _coll(job)
    out = torch.empty((rows,) + tuple(tensor.shape[1:]), dtype=tensor.dtype)
    if coll is None:
        return out.copy_(tensor)
    _done(job, _lib.lib.ps_coll_reduce_scatter_typed(coll, tensor.data_ptr(), out.data_ptr(),
                                                     out.numel(), dtype, code), what)
    return out


def reduce(tensor, root_rank=0, op="average", name=None, group=None):
    """A new tensor: on root_rank tensor reduced (op) over every rank (of
    group; root_rank a group rank), on the others a copy of their own."""
    what = f"reduce of {name or 'a tensor'}{_in(group)}"
    job = _on(group, what)
    dtype = _reducible(tensor, what)
    code = _redop(op, what)
    _check_root(root_rank, group)
    out = tensor.clone()
    coll = _coll(job)
    if coll is None:
        return out
    _done(job, _lib.lib.ps_coll_reduce_typed(coll, out.data_ptr(), out.numel(), dtype, code,
                                             root_rank), what)
    return out


def alltoall(tensor, name=None, group=None):
    """Dim 0 of tensor split in ps.size() (group.size) equal parts, part d
    sent to rank d (group rank d); returns the parts received, rank 0's
    first (any dtype)."""
    what = f"alltoall of {name or 'a tensor'}{_in(group)}"
    job = _on(group, what)
    check_tensor(tensor, what, float32=False)
    _split_dim0(tensor, what, job.size)
    coll = _coll(job)
    out = torch.empty_like(tensor)
    if coll is None:
        return out.copy_(tensor)
    _done(job, _lib.lib.ps_coll_alltoall(coll, tensor.data_ptr(), out.data_ptr(),
                                         tensor.numel() * tensor.element_size() // job.size),
          what)
    return out


# -- send and receive between two ranks ---------------------------------------


def _check_peer(peer, role, job, group):
    n, me = job.size, job.rank
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < n or peer == me:
        where = "this job" if group is None else f"{group} (group ranks)"
        raise ValueError(f"{role} {peer!r} is not another rank of {where} "
                         f"(0..{n - 1}, not this rank, {me})")


def _p2p(tensor, peer, sending, name, group):
    role = "dst" if sending else "src"
    what = f"{'send' if sending else 'recv'} of {name or 'a tensor'} " \
        f"{'to' if sending else 'from'} rank {peer}{_in(group)}"
    job = _on(group, what)
    check_tensor(tensor, what, float32=False)
    _check_peer(peer, role, job, group)
    coll = job.ring()
    req = ctypes.c_void_p()
    call = _lib.lib.ps_coll_send_async if sending else _lib.lib.ps_coll_recv_async
    st = call(coll, tensor.data_ptr(), tensor.numel() * tensor.element_size(), peer,
              ctypes.byref(req))
    if st != _lib.OK:
        raise job.ring_error(st, what)
    return Handle(job, req, tensor, what)


def isend(tensor, dst, name=None, group=None):
    """Starts sending tensor (any dtype; contiguous CPU) to rank dst (a group
    rank with a group); returns a Handle. The tensor must stay unchanged
    until the handle is waited."""
    return _p2p(tensor, dst, True, name, group)


def irecv(tensor, src, name=None, group=None):
    """Starts receiving the next tensor rank src sends this rank into tensor
    (the same size in bytes; else every rank fails naming both sizes);
    returns a Handle whose wait() returns tensor."""
    return _p2p(tensor, src, False, name, group)


def send(tensor, dst, name=None, group=None):
    """Sends tensor to rank dst; returns once it has left (the receiver may
    not have taken it yet)."""
    isend(tensor, dst, name, group).wait()


def recv(tensor, src, name=None, group=None):
    """Receives the next tensor rank src sends this rank into tensor, in
    place; returns src (as torch.distributed.recv)."""
    irecv(tensor, src, name, group).wait()
    return src


def _agree(description, root_rank, what, group=None):
    """Checks that every rank passes the same description (names, shapes):
    a mismatch raises LayoutError on every rank instead of a hang or
    garbage."""
    digest = torch.frombuffer(bytearray(hashlib.sha256(description.encode()).digest()),
                              dtype=torch.uint8)
    theirs = broadcast(digest, root_rank, "a description of " + what, group)
    differ = torch.tensor([0.0 if torch.equal(theirs, digest) else 1.0])
    allreduce_(differ, average=False, name="the check of " + what, group=group)
    if differ.item() > 0:
        me = ("is one of them" if not torch.equal(theirs, digest)
              else f"agrees with rank {root_rank}")
        raise ps.LayoutError(
            f"{what}: {int(differ.item())} rank(s) differ from rank {root_rank} in names, "
            f"shapes or dtypes; this rank {me}; it has: {description[:400]}")


def broadcast_object(obj, root_rank=0, name=None, group=None):
    """root_rank's obj (anything torch.save takes), on every rank (of group;
    root_rank a group rank)."""
    what = name or "an object"
    job, coll = _ring(group, f"broadcast_object of {what}")
    _check_root(root_rank, group)
    if coll is None:
        return obj
    if job.rank == root_rank:
        buf = io.BytesIO()
        torch.save(obj, buf)
        payload = bytearray(buf.getvalue())
    else:
        payload = bytearray()
    length = torch.tensor([len(payload)], dtype=torch.int64)
    broadcast_(length, root_rank, f"the size of {what}", group)
    if job.rank != root_rank:
        payload = bytearray(int(length.item()))
    if payload:
        data = torch.frombuffer(payload, dtype=torch.uint8)
        broadcast_(data, root_rank, what, group)
    if job.rank == root_rank:
        return obj
    return torch.load(io.BytesIO(bytes(payload)))


def _named(params, what):
    if isinstance(params, dict):
        items = list(params.items())
    else:
        items = list(params)
        if items and not (isinstance(items[0], tuple) and len(items[0]) == 2):
            raise TypeError(f"{what}: expected a state_dict or (name, tensor) pairs, "
                            "e.g. model.named_parameters()")
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"{what}: duplicate names {dup}")
    return sorted(items, key=lambda kv: kv[0])


def broadcast_parameters(params, root_rank=0, group=None):
    """Makes every rank's tensors equal to root_rank's, in place: params is
    a state_dict (model.state_dict(): parameters and buffers) or (name,
    tensor) pairs (model.named_parameters()), in any memory layout
    (channels_last too). They go in name order, packed into one broadcast.
    With a group: among its ranks, root_rank a group rank."""
    job = _on(group, "broadcast_parameters")
    _check_root(root_rank, group)
    items = _named(params, "broadcast_parameters")
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"broadcast_parameters: {name} is a {type(t).__name__}, not a tensor")
        check_tensor(t, f"broadcast_parameters: {name}", float32=False, any_layout=True)
    if _coll(job) is None:
        return
    _agree(";".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in items), root_rank,
           "broadcast_parameters", group)
    _rounds.broadcast_flat([t for _, t in items], root_rank, "broadcast_parameters", job)


def broadcast_optimizer_state(optimizer, root_rank=0, group=None):
    """Makes every rank's optimizer state (momentum buffers, step counts,
    hyper-parameters) equal to root_rank's. The state goes as one object
    (torch.save), so tensors and scalars alike arrive exactly."""
    job = _on(group, "broadcast_optimizer_state")
    _check_root(root_rank, group)
    state = broadcast_object(optimizer.state_dict(), root_rank, "the optimizer state", group)
    if job.rank != root_rank:
        optimizer.load_state_dict(state)


# -- push_pull through the shards (ps mode) ----------------------------------


def declare(named_tensors):
    """ps mode: declares the tensors push_pull will exchange, once per job on
    every rank (the shards hold one layout per job; a DistributedOptimizer
    declares its own, so use one or the other). Shards must run
    --optimizer sum."""
    from .optimizer import _Layout
    job = _job()
    if job.mode != "ps":
        raise ps.PSError("declare: only in sync mode ps (allreduce mode needs none)")
    items = _named(named_tensors, "declare")
    for n, t in items:
        check_tensor(t, f"declare: {n}")
    layout = _Layout(job, [(n, t.numel(), f"{n}:{tuple(t.shape)}") for n, t in items],
                     [t for _, t in items])
    if layout.optimizer != "sum":
        raise ps.PSError(f"push_pull needs shards with --optimizer sum; they run "
                         f"{layout.optimizer}")
    # A push to a key rank 0 has not initialised yet is refused: wait until
    # every key is (a pull of its current version waits for that).
    scratch = [torch.empty(t.numel()) for _, t in items]
    for i, buf in enumerate(scratch):
        layout.pull(i, layout.clock[i], buf)
    layout.wait_all("waiting for rank 0 to initialise the declared tensors")
    job.push_pull_layout = layout


def push_pull(tensor, average=True, name=None):
    """In place: tensor becomes the mean (or sum) over every rank of their
    tensor of this name. ps mode: through the shards, for a name declared
    with declare(); allreduce mode: an allreduce_ (name only labels it)."""
    job = _job()
    if job.mode != "ps":
        return allreduce_(tensor, average, name)
    layout = getattr(job, "push_pull_layout", None)
    if layout is None or name not in layout.index:
        raise ps.PSError(f"push_pull: {name!r} was not declared: call "
                         "ps.torch.declare(named_tensors) on every rank first")
    check_tensor(tensor, f"push_pull of {name}")
    i = layout.index[name]
    if tensor.numel() != layout.counts[i]:
        raise ValueError(f"push_pull of {name}: {tensor.numel()} elements, declared with "
                         f"{layout.counts[i]}")
    step = layout.clock[i]
    out = torch.empty_like(tensor)
    layout.push(i, step, tensor)
    layout.pull(i, step + 1, out)
    layout.wait_all(f"push_pull of {name}")
    layout.clock[i] = step + 1
    if not average:
        out.mul_(job.size)
    tensor.copy_(out)
    return tensor



# -- the job's state, join, and the end of training ---------------------------


class _JobState:
    """What ps.torch keeps per job: its DistributedOptimizers (weakly) and
    the buffers of broadcast_buffers, and what it does when the job ends
    (ps.shutdown() calls before_barrier and after_barrier; the end of a
    script without it, at_exit)."""

    def __init__(self, job):
        self.job = job
        self.optimizers = []
        self.group_optimizers = []  # DistributedOptimizer(group=...): rounds of their own
        self.buffer_syncs = []
        self.barrier_passed = False  # ps mode: join() passed the shards' barrier

    def live_optimizers(self):
        return [o for o in (r() for r in self.optimizers) if o is not None]

    def live_group_optimizers(self):
        return [o for o in (r() for r in self.group_optimizers) if o is not None]

    def finish_groups(self):
        """The optimizers over groups (allreduce mode): each group's rounds
        closed with a FINISHED header over its own ring, in the order they
        were built, so a member still training fails naming join instead of
        waiting for this rank."""
        for o in self.live_group_optimizers():
            gjob = o._job
            if gjob.size <= 1 or gjob.ring_failed():
                continue
            rounds = _rounds.rounds_of(gjob)
            if not rounds.closed:
                h = _rounds.Header(gjob, FINISHED, o._step)
                rounds.conclude(h.wait(), f"DistributedOptimizer on {o._group}")

    def sync_buffers_of_round(self):
        """The buffers of broadcast_buffers, after a round's header: from
        their root_rank, or the lowest rank still training when it joined
        (DDP's authoritative rank)."""
        trainers = _rounds.rounds_of(self.job).last_trainers
        for s in self.buffer_syncs:
            s.sync(s.root if s.root in trainers else min(trainers))

    def serve_buffer_rounds(self, state, step):
        """ps mode: the buffer rounds of the ranks still training, taken
        part in (state JOINED or FINISHED) until every rank joined or
        finished."""
        rounds = _rounds.rounds_of(self.job)
        while True:
            h = _rounds.Header(self.job, state, step)
            rounds.conclude(h.wait(), "broadcast_buffers")
            if rounds.closed:
                return
            self.sync_buffers_of_round()

    def _step(self):
        return max([o._step for o in self.live_optimizers()] or [0])

    def finish(self, job):
        """This rank's training is over: the shards are told (ps mode), the
        ring's rounds closed with a FINISHED header (every rank learns it;
        a rank still training fails naming join), and if a rank sat out
        rounds, every rank takes the model of the last to train."""
        opts = self.live_optimizers()
        if job.mode != "ps" and not job.ring_failed():
            self.finish_groups()
        if job.mode == "ps":  # (ps.shutdown told the shards first)
            if (opts and self.buffer_syncs and job.size > 1 and not job.ring_failed()
                    and not _rounds.rounds_of(job).closed):
                self.serve_buffer_rounds(FINISHED, self._step())
            return self.barrier_passed
        if not self.optimizers or job.size <= 1 or job.ring_failed():
            return False
        rounds = _rounds.rounds_of(job)
        if not rounds.closed:
            # closes the rounds, or raises when another rank still trains
            h = _rounds.Header(job, FINISHED, self._step())
            rounds.conclude(h.wait(), "DistributedOptimizer")
            self.final_sync(rounds.final_root())
        return False

    def final_sync(self, root):
        if root is None:
            return
        for o in self.live_optimizers():
            o._final_sync(root)
        for s in self.buffer_syncs:
            s.sync(root)

    def before_barrier(self, job):
        return self.finish(job)

    def after_barrier(self, job):
        if job.mode != "ps" or self.barrier_passed:
            return
        self._after_barrier_ps(job)

    def _after_barrier_ps(self, job):
        """ps mode, after the barrier that ends join() or the training: the
        ranks that sat out steps take the model of the last to train; a rank
        that joined takes part in the steps again (ps_rejoin: a next epoch);
        then a second barrier, so that no rank pushes a step before every
        joined rank counts again (or the step would complete without it)."""
        root = None
        opts = [o for o in self.live_optimizers() if o._layout is not None]
        for o in opts:
            root = o._final_sync_ps()
        if root is not None and job.ring_configured() and job.size > 1:
            for s in self.buffer_syncs:
                s.sync(root)
        if job.left == _lib.LEAVE_JOINED:
            step = job.rejoin()
            for o in opts:
                o._step = step
        if job.declared:
            st = _lib.lib.ps_barrier(job.client)
            if st != _lib.OK:
                raise job.client_error(st, "the barrier after join()")
        return root

    def at_exit(self, job):
        self.finish(job)


def _job_state(job):
    state = getattr(job, "torch_state", None)
    if state is None:
        state = job.torch_state = _JobState(job)
        job.extensions.append(state)
    return state


def join():
    """Horovod's join, DDP's Join: call it on a rank that ran out of data.
    It takes part in the other ranks' steps (with no gradient of its own:
    the mean is over the ranks that still train) until every rank has
    joined or finished (ps.shutdown()), then every rank takes the
    parameters, optimizer state and buffers of the last rank to train, so
    all end equal. Returns that rank. Serves one DistributedOptimizer and
    the buffers of broadcast_buffers; another collective started by a rank
    still training (an allreduce of your own, SyncBatchNorm) fails on every
    rank, naming the mismatch. Without join, a rank that runs more steps
    than another fails within seconds, naming both ranks and join."""
    job = _job()
    state = _job_state(job)
    opts = state.live_optimizers()
    grouped = state.live_group_optimizers()
    if grouped:
        raise ps.PSError(f"ps.torch.join(): this rank has a DistributedOptimizer on "
                         f"{grouped[0]._group}; join serves one DistributedOptimizer of the "
                         "whole job (join over a group is not done yet)")
    if len(opts) > 1:
        raise ps.PSError(f"ps.torch.join(): this job has {len(opts)} DistributedOptimizers; "
                         "join serves one (its rounds are the steps it takes part in)")
    opt = opts[0] if opts else None
    if job.mode == "ps":
        if opt is None or opt._layout is None:
            ps.barrier()
            return job.rank
        opt._join_ps()
        ps.barrier()
        state.barrier_passed = True
        state._after_barrier_ps(job)
        return opt._last_root if opt._last_root is not None else job.rank
    if opt is None or job.size <= 1:
        ps.barrier()
        return job.rank
    while opt._serve_round():
        pass
    rounds = _rounds.rounds_of(job)
    root = rounds.final_root()
    state.final_sync(root)
    return min(rounds.last_trainers) if rounds.last_trainers else job.rank
