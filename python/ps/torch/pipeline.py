"""Pipeline parallelism for PyTorch models, shaped like
torch.distributed.pipelining (PipelineStage, ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B), over libps's schedules and point-to-point calls.

    grid = ps.torch.grid(pp=2)
    stage = PipelineStage(my_half_of_the_model, grid.pp_rank, 2, group=grid.pp_group)
    sched = Schedule1F1B(stage, n_microbatches=4, loss_fn=torch.nn.functional.cross_entropy)
    opt = ps.torch.DistributedOptimizer(opt, stage.submod.named_parameters(),
                                        group=grid.dp_group)
    opt.zero_grad()
    if stage.is_first: sched.step(x)
    elif stage.is_last: out = sched.step(target=y, losses=losses)
    else: sched.step()
    opt.step()

The schedule is data: libps's ps_pipe_actions (pipeline.h) gives this rank's
ordered list of actions for one step (forward / backward of micro-batch i on
chunk c, the backward split into its input and weight halves for ZB-H1,
send / receive of activations and of their gradients, the data-parallel
reduction, the optimizer step), the same lists the built-in C trainer runs
(ps-worker/train/trainer3d.c). Nothing here derives a schedule; this module
only executes the list:

- Sends are posted asynchronously (isend) and waited for at the end of the
  step; each micro-batch has its own send buffer, so none is reused before
  its wait. libps runs a group's operations one at a time in the order they
  were posted (collective.c, its worker thread), so the sends leave in the
  list's order, as blocking sends would, while this thread computes: libps
  validates that the lists cannot deadlock with blocking sends
  (ps_pipe_validate), hence not with these. Receives are waited for where
  the list has them. Every wait is a ctypes call into libps, and ctypes
  releases the GIL around foreign calls (CDLL, not PyDLL), so other Python
  threads run while this one waits.
- A boundary carries one tensor or a tuple of them, of any shape and dtype,
  packed into one message per micro-batch. On the first step each sender
  sends a small metadata message first (the shapes, dtypes and which
  tensors need a gradient: floating tensors that require one); after it,
  every message has a fixed size, and every stage output is checked against
  the metadata before it is packed: a change raises PipeliningShapeError
  naming the stage, the micro-batch, the old and the new shape, before
  anything of it is sent, and the pipeline group is aborted with that
  message (ps_coll_abort), so the peer waiting for it fails with the same
  message instead of hanging. The gradients travel back the same way
  (the tensors that need one, zeros where autograd gave none).
- The gradient is that of the mean loss over the micro-batches: the last
  stage runs backward on loss / n_microbatches (as torch does) and appends
  the unscaled loss to `losses`.
- The data-parallel reduction (the list's REDUCE_GRADS): the backward
  passes of the step run inside no_sync() of every DistributedOptimizer that
  holds parameters of this rank's stages, so they only accumulate; then the
  tied parameters (tie()) get their gradients summed over their tie group,
  and then each such optimizer synchronises (allreduce, ZeRO-1's
  reduce-scatter or the shards): the tie sum comes first, as Megatron#844
  requires. The optimizer step (OPTIMIZER_STEP) is the caller's:
  optimizer.step() after schedule.step(), as with torch."""

import contextlib
import ctypes
import io

import torch

import ps
from ps import _lib

from . import groups as _groups

__all__ = ["PipelineStage", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
           "ScheduleZBH1", "PipeliningShapeError", "tie", "sync_tied"]


class PipeliningShapeError(RuntimeError):
    """A stage output whose shape, dtype or need of a gradient changed since
    the first step (torch.distributed.pipelining's name)."""


# -- libps's schedules (pipeline.h) --------------------------------------------

GPIPE, ONE_F_ONE_B, INTERLEAVED, ZBH1 = 0, 1, 2, 3
(FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD,
 REDUCE_GRADS, OPTIMIZER_STEP) = range(10)


def _actions(name, kind, stages, micro, chunks, stage):
    """libps's list of actions of pipeline rank `stage` for one step, as
    (op, micro, chunk, peer) tuples; ValueError with libps's reason when the
    shape is refused (ps_pipe_check)."""
    shape = _lib.PipeShape(kind, stages, micro, chunks)
    err = _lib.errbuf()
    if _lib.lib.ps_pipe_check(ctypes.byref(shape), err, len(err)) != _lib.OK:
        raise ValueError(f"{name}: {err.value.decode()}")
    out = ctypes.POINTER(_lib.PipeAction)()
    n = ctypes.c_size_t()
    st = _lib.lib.ps_pipe_actions(ctypes.byref(shape), stage, ctypes.byref(out), ctypes.byref(n),
                                  err, len(err))
    if st != _lib.OK:
        raise ValueError(f"{name}: {err.value.decode()}")
    try:
        return [(out[i].op, out[i].micro, out[i].chunk, out[i].peer_stage)
                for i in range(n.value)]
    finally:
        _lib.libc_free(out)


# -- stages ------------------------------------------------------------------


class PipelineStage:
    """Stage stage_index (0..num_stages-1) of a model cut into num_stages
    parts: module is this part. group is the pipeline group (a grid's
    pp_group; None = the whole job); stage s runs on its group rank
    s % group.size, so num_stages is the group's size, or a multiple of it
    for ScheduleInterleaved1F1B (virtual stages s, s + p, ... on one rank).
    On a rank that is not in group this raises PSError naming both."""

    def __init__(self, module, stage_index, num_stages, group=None):
        what = f"PipelineStage {stage_index}"
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"{what}: module is a {type(module).__name__}, not a torch.nn.Module")
        for name, v in (("stage_index", stage_index), ("num_stages", num_stages)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{what}: {name}={v!r}; expected an int")
        if num_stages < 1 or not 0 <= stage_index < num_stages:
            raise ValueError(f"{what}: stage_index {stage_index} is not in 0..{num_stages - 1} "
                             f"(num_stages={num_stages})")
        job = _groups.on(group, what)
        p = job.size
        if num_stages % p:
            raise ValueError(f"{what}: num_stages={num_stages} is not a multiple of the "
                             f"pipeline group's {p} ranks ({group or 'the whole job'})")
        if stage_index % p != job.rank:
            raise ValueError(f"{what}: stage {stage_index} runs on pipeline rank "
                             f"{stage_index % p} (stage_index mod {p}), but this is pipeline "
                             f"rank {job.rank} of {group or 'the whole job'}")
        self.submod = self.module = module
        self.stage_index, self.num_stages, self.group = stage_index, num_stages, group
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self._job, self._pp_size, self._pp_rank = job, p, job.rank
        self._meta_in = None  # [(shape, dtype, needs_grad)] of what this stage receives
        self._meta_out = None  # ...and of what it sends

    def __repr__(self):
        return f"pipeline stage {self.stage_index} of {self.num_stages}"


# -- packing a boundary's tensors into one message -----------------------------

_ALIGN = 16  # every tensor starts 16-byte aligned in the message (views of any dtype)


def _as_tuple(out, what):
    ts = out if isinstance(out, (tuple, list)) else (out,)
    for i, t in enumerate(ts):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: output {i} is a {type(t).__name__}; a stage returns a "
                            "tensor or a tuple of tensors")
        if t.device.type != "cpu" or t.is_sparse:
            raise TypeError(f"{what}: output {i} is a {'sparse ' if t.is_sparse else ''}"
                            f"{t.device.type} tensor; ps.torch sends dense CPU tensors")
    return tuple(ts)


def _describe(ts):
    return [(tuple(t.shape), t.dtype, bool(t.dtype.is_floating_point and t.requires_grad))
            for t in ts]


def _offsets(meta):
    offs, total = [], 0
    for shape, dtype, _ in meta:
        offs.append(total)
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        total += -(-n // _ALIGN) * _ALIGN
    return offs, max(total, 1)  # (an empty message is one byte: every action sends one)


def _pack(ts, meta):
    offs, total = _offsets(meta)
    buf = torch.zeros(total, dtype=torch.uint8)
    for t, off in zip(ts, offs):
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        buf[off:off + flat.numel()].copy_(flat)
    return buf


def _unpack(buf, meta):
    offs, _ = _offsets(meta)
    out = []
    for (shape, dtype, _), off in zip(meta, offs):
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out.append(buf[off:off + n].view(dtype).reshape(shape))
    return out


def _fmt(meta_entry):
    shape, dtype, grad = meta_entry
    return f"{tuple(shape)} {str(dtype).replace('torch.', '')}" + \
        (" requiring grad" if grad else "")


# -- tied parameters -------------------------------------------------------------


def tie(parameter, group):
    """Ties parameter to its copies on the other ranks of group (an
    embedding on the first stage and the output layer on the last: group =
    new_group([first, last]), one per data-parallel replica): it is made
    equal to group rank 0's now (a broadcast), and every step its gradient
    is summed over group before the data-parallel synchronisation (the
    schedules do it; see sync_tied). Every rank of group calls tie with the
    same shapes in the same order."""
    if not isinstance(parameter, torch.Tensor) or not parameter.requires_grad:
        raise TypeError("tie: expects a parameter (a tensor that requires grad), got "
                        f"{type(parameter).__name__}")
    if not isinstance(group, _groups.Group):
        raise TypeError(f"tie: group= takes a group of ps.torch.new_group, not "
                        f"{type(group).__name__}")
    _groups.on(group, "tie")
    from . import broadcast_
    with torch.no_grad():
        if parameter.is_contiguous():
            broadcast_(parameter.data, 0, "a tied parameter", group)
        else:
            parameter.copy_(broadcast_(parameter.detach().contiguous(), 0,
                                       "a tied parameter", group))
    ties = _ties()
    if any(p is parameter for p, _ in ties):
        raise ValueError("tie: this parameter is tied already")
    ties.append((parameter, group))


def _ties():
    job = ps._current()
    if not hasattr(job, "pipeline_ties"):
        job.pipeline_ties = []
    return job.pipeline_ties


def sync_tied():
    """Sums the gradient of every tied parameter of this rank over its tie
    group (one all-reduce per group, the parameters in tie() order; a
    missing gradient counts as zeros). The schedules call it before the
    data-parallel reduction; call it yourself before optimizer.step() only
    in a training loop of your own."""
    from . import allreduce_
    by_group = {}
    for p, g in _ties():
        by_group.setdefault(id(g), (g, []))[1].append(p)
    for g, params in by_group.values():
        if g.size <= 1:
            continue
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([t.detach().reshape(-1) for t in grads])
        allreduce_(flat, average=False, name="the tied parameters' gradients", group=g)
        off = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.copy_(flat[off:off + n].view_as(p))
                off += n


# -- schedules ---------------------------------------------------------------------


def _optimizers_of(params):
    """The DistributedOptimizers of this job that hold one of params."""
    from . import _JobState
    ids = {id(p) for p in params}
    out = []
    for ext in ps._current().extensions:
        if isinstance(ext, _JobState):
            for o in ext.live_optimizers() + ext.live_group_optimizers():
                if o not in out and any(id(p) in ids for _, p in o._named):
                    out.append(o)
    return out


class _Micro:
    """What one micro-batch keeps on one chunk between its forward and its
    backward."""
    __slots__ = ("inputs", "outputs", "loss", "out_grads", "in_grads")

    def __init__(self):
        self.inputs = self.outputs = self.loss = self.out_grads = self.in_grads = None


class _Schedule:
    _kind = None
    _name = None

    def __init__(self, stages, n_microbatches, loss_fn=None):
        stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
        if not stages or not all(isinstance(s, PipelineStage) for s in stages):
            raise TypeError(f"{self._name}: expects PipelineStage objects, got {stages!r}")
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) \
                or n_microbatches < 1:
            raise ValueError(f"{self._name}: n_microbatches={n_microbatches!r}; expected an "
                             "int >= 1")
        s0 = stages[0]
        stages.sort(key=lambda s: s.stage_index)
        p, v = s0._pp_size, len(stages)
        for s in stages:
            if s.group is not s0.group or s.num_stages != s0.num_stages:
                raise ValueError(f"{self._name}: {s} and {s0} differ in group or num_stages")
        want = [s0._pp_rank + c * p for c in range(v)]
        if [s.stage_index for s in stages] != want or s0.num_stages != p * v:
            raise ValueError(
                f"{self._name}: pipeline rank {s0._pp_rank} of {p} holds stages {want} of "
                f"{p * v} (num_stages = {p} ranks x {v} stage(s) per rank), got stages "
                f"{[s.stage_index for s in stages]} of {s0.num_stages}")
        self._stages, self._m, self._loss_fn = stages, n_microbatches, loss_fn
        self._job, self._p, self._v = s0._job, p, v
        self._coll = self._job.ring() if p > 1 else None
        self._acts = _actions(self._name, self._kind, p, n_microbatches, v, s0._pp_rank)
        self._first = stages[0] if stages[0].is_first else None
        self._last = stages[-1] if stages[-1].is_last else None
        self._steps = 0

    # -- the step ------------------------------------------------------------------

    def step(self, *args, target=None, losses=None):
        """One training step: on the first stage the batch args (each split
        along dim 0 into n_microbatches), on the last the target (split
        alike) and losses (a list: each micro-batch's loss appended); no
        arguments elsewhere. Returns, on the last stage, its output for the
        whole batch (the micro-batches' outputs concatenated), else None."""
        inputs, targets = self._split_arguments(args, target, losses)
        self._micro = [[_Micro() for _ in range(self._m)] for _ in range(self._v)]
        self._pending = []
        self._outputs = [None] * self._m
        params = [p for s in self._stages for p in s.submod.parameters()]
        opts = _optimizers_of(params)
        try:
            with contextlib.ExitStack() as no_sync:
                for o in opts:
                    no_sync.enter_context(o.no_sync())
                for a in self._acts:
                    if a[0] == REDUCE_GRADS:
                        no_sync.close()
                        self._wait_sends()
                        sync_tied()
                        for o in opts:
                            o.synchronize()
                    elif a[0] != OPTIMIZER_STEP:  # (the caller's optimizer.step())
                        self._act(a, inputs, targets, losses)
                self._wait_sends()
        except BaseException as e:
            self._fail(e)
            raise
        finally:
            self._micro = self._pending = None
        self._steps += 1
        if self._last is None:
            return None
        return _merge(self._outputs)

    def _split_arguments(self, args, target, losses):
        what = f"{self._name}.step"
        if self._first is None and args:
            raise ValueError(f"{what}: stage {self._stages[0].stage_index} is not the first "
                             "stage: only stage 0 takes the batch (call step() here)")
        if self._first is not None and not args:
            raise ValueError(f"{what}: stage 0 takes the batch: step(x)")
        if self._last is None and (target is not None or losses is not None):
            raise ValueError(f"{what}: target= and losses= go to the last stage "
                             f"({self._stages[0].num_stages - 1}), not to this one")
        if self._last is not None and (target is None or self._loss_fn is None):
            raise ValueError(f"{what}: the last stage needs a loss_fn (given to the schedule) "
                             "and step(target=...)")
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"{what}: losses= takes a list (each micro-batch's loss is "
                            "appended)")
        inputs = [self._split(x, f"input {i}") for i, x in enumerate(args)]
        inputs = list(zip(*inputs)) if inputs else None
        targets = self._split(target, "target") if self._last is not None else None
        return inputs, targets

    def _split(self, x, name):
        what = f"{self._name}.step"
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what}: {name} is a {type(x).__name__}; expected a tensor")
        n = x.shape[0] if x.dim() else 0
        if x.dim() == 0 or n % self._m:
            raise ValueError(f"{what}: the batch of {n} ({name}, dim 0 of shape "
                             f"{tuple(x.shape)}) does not split into n_microbatches={self._m} "
                             f"equal micro-batches ({n} is not a multiple of {self._m})")
        return list(x.chunk(self._m))

    def _act(self, a, inputs, targets, losses):
        op, i, c, peer = a
        stage = self._stages[c]
        mb = self._micro[c][i]
        if op == FORWARD:
            self._forward(stage, mb, i, inputs, targets, losses)
        elif op == BACKWARD:
            self._backward(stage, mb, True, True)
        elif op == BACKWARD_INPUT:
            self._backward(stage, mb, True, False)
        elif op == BACKWARD_WEIGHT:
            self._backward(stage, mb, False, True)
        elif op == SEND_ACT:
            self._send_act(stage, mb, i, peer)
        elif op == RECV_ACT:
            mb.inputs = self._recv(stage, True, i, peer)
        elif op == SEND_GRAD:
            self._send_grad(stage, mb, i, peer)
        elif op == RECV_GRAD:
            mb.out_grads = self._recv(stage, False, i, peer)
        else:
            raise ValueError(f"{self._name}: unknown action {op} from libps")

    def _forward(self, stage, mb, i, inputs, targets, losses):
        if stage.is_first:
            mb.inputs = list(inputs[i])
        out = stage.submod(*mb.inputs)
        if stage.is_last:
            mb.loss = self._loss_fn(out, targets[i])
            if losses is not None:
                losses.append(mb.loss.detach())
            self._outputs[i] = _detach(out)
        else:
            mb.outputs = _as_tuple(out, f"{stage}, micro-batch {i}")

    def _backward(self, stage, mb, want_input, want_weight):
        """The backward of one micro-batch (want_input and want_weight), or
        ZB-H1's halves: B (the input gradients, the graph kept for W) and W
        (the weight gradients, accumulated into p.grad)."""
        if stage.is_last:
            outs, grads = [mb.loss / self._m], [None]
        else:
            need = [(o, g) for o, (_, _, rg), g in
                    zip(mb.outputs, stage._meta_out, _grads_iter(stage._meta_out, mb.out_grads))
                    if rg]
            outs, grads = [o for o, _ in need], [g for _, g in need]
        # the received activations that need a gradient (none on the first
        # stage; ZB-H1's W comes after their gradients left)
        ins = [] if stage.is_first or not want_input else \
            [t for t, (_, _, rg) in zip(mb.inputs, stage._meta_in) if rg]
        if want_input and want_weight:
            if outs:
                torch.autograd.backward(outs, grads)
            mb.in_grads = [t.grad for t in ins]
        elif want_input:
            mb.in_grads = [None] * len(ins)
            if outs and ins:
                mb.in_grads = list(torch.autograd.grad(outs, ins, grads, retain_graph=True,
                                                       allow_unused=True))
            return
        else:
            weights = [p for p in stage.submod.parameters() if p.requires_grad]
            if outs and weights:
                torch.autograd.backward(outs, grads, inputs=weights)
        mb.outputs = mb.loss = mb.out_grads = None
        if stage.is_first:
            mb.inputs = None

    def _send_act(self, stage, mb, i, peer):
        ts, what = mb.outputs, f"{stage}, micro-batch {i}"
        meta = _describe(ts)
        if stage._meta_out is None:
            stage._meta_out = meta
            self._send_meta(meta, peer, what)
        elif meta != stage._meta_out:
            k = next(j for j in range(max(len(meta), len(stage._meta_out)))
                     if j >= len(meta) or j >= len(stage._meta_out)
                     or meta[j] != stage._meta_out[j])
            old = _fmt(stage._meta_out[k]) if k < len(stage._meta_out) else "no tensor"
            new = _fmt(meta[k]) if k < len(meta) else "no tensor"
            raise PipeliningShapeError(
                f"{what} (step {self._steps}): output {k} is {new}, but was {old} on the "
                f"first step ({len(stage._meta_out)} output(s) then, {len(meta)} now); a stage's "
                "outputs keep their shapes, dtypes and requires_grad from the first step (the "
                "receiving stage sized its buffers by them)")
        self._isend(_pack(ts, meta), peer, f"the activations of {what}")

    def _send_grad(self, stage, mb, i, peer):
        meta = [e for e in stage._meta_in if e[2]]
        grads = [g if g is not None else torch.zeros(s, dtype=d)
                 for g, (s, d, _) in zip(mb.in_grads, meta)]
        self._isend(_pack(grads, meta), peer,
                    f"the input gradients of {stage}, micro-batch {i}")
        mb.inputs = mb.in_grads = None

    def _recv(self, stage, acts, i, peer):
        what = f"the {'activations' if acts else 'output gradients'} of {stage}, micro-batch {i}"
        if acts:
            if stage._meta_in is None:
                stage._meta_in = self._recv_meta(peer, what)
            meta = stage._meta_in
        else:
            meta = [e for e in stage._meta_out if e[2]]
        buf = torch.empty(_offsets(meta)[1], dtype=torch.uint8)
        self._wait(self._post(buf, peer, False, what), what)
        ts = _unpack(buf, meta)
        if acts:
            for t, (_, _, rg) in zip(ts, meta):
                t.requires_grad_(rg)
        return ts

    # -- messages --------------------------------------------------------------

    def _send_meta(self, meta, peer, what):
        data = io.BytesIO()
        torch.save([(s, str(d), g) for s, d, g in meta], data)
        payload = torch.frombuffer(bytearray(data.getvalue()), dtype=torch.uint8)
        self._isend(torch.tensor([payload.numel()], dtype=torch.int64), peer,
                    f"the size of the metadata of {what}")
        self._isend(payload, peer, f"the metadata of {what}")

    def _recv_meta(self, peer, what):
        n = torch.empty(1, dtype=torch.int64)
        self._wait(self._post(n, peer, False, "the metadata's size"), f"the metadata of {what}")
        payload = torch.empty(int(n.item()), dtype=torch.uint8)
        self._wait(self._post(payload, peer, False, "the metadata"), f"the metadata of {what}")
        raw = torch.load(io.BytesIO(payload.numpy().tobytes()))
        return [(tuple(s), getattr(torch, d.replace("torch.", "")), g) for s, d, g in raw]

    def _post(self, buf, peer, sending, what):
        if self._coll is None:
            raise ps.PSError(f"{self._name}: {what}: a pipeline of one rank sends nothing")
        req = ctypes.c_void_p()
        call = _lib.lib.ps_coll_send_async if sending else _lib.lib.ps_coll_recv_async
        st = call(self._coll, buf.data_ptr(), buf.numel() * buf.element_size(), peer,
                  ctypes.byref(req))
        if st != _lib.OK:
            raise self._error(st, what)
        return req

    def _isend(self, buf, peer, what):
        # buf stays referenced until its wait: libps reads it from its thread
        self._pending.append((self._post(buf, peer, True, what), buf, what))

    def _wait(self, req, what):
        st = _lib.lib.ps_coll_wait(req)  # (ctypes releases the GIL while libps waits)
        if st != _lib.OK:
            raise self._error(st, what)

    def _wait_sends(self):
        pending, self._pending = self._pending, []
        first = None
        for req, _buf, what in pending:
            st = _lib.lib.ps_coll_wait(req)
            if st != _lib.OK and first is None:
                first = self._error(st, f"sending {what}")
        if first is not None:
            raise first

    def _error(self, st, what):
        buf = _lib.errbuf()
        why = _lib.lib.ps_coll_errmsg(self._coll, buf, len(buf)).decode() if self._coll else ""
        group = self._stages[0].group or "the whole job"
        kind = ps.RetryableError if st in (_lib.ERR_IO, _lib.ERR_CONNECT, _lib.ERR_CLOSED) \
            else ps.PSError
        return kind(f"{self._name} on pipeline rank {self._stages[0]._pp_rank} ({group}), "
                    f"step {self._steps}: {what}: {_lib.strerror(st)}"
                    + (f": {why}" if why else ""), st)

    def _fail(self, e):
        """A step failed on this rank after it began: the pipeline group is
        aborted with the reason (the peers waiting for this rank fail naming
        it instead of hanging; harmless when the group failed already), then
        the sends in flight are waited for (they point into our buffers)."""
        if self._coll is not None:
            why = f"pipeline rank {self._stages[0]._pp_rank} failed: {type(e).__name__}: {e}"
            _lib.lib.ps_coll_abort(self._coll, why.encode()[:900])
        try:
            self._wait_sends()
        except ps.PSError:
            pass


def _grads_iter(meta, grads):
    it = iter(grads or [])
    for _, _, rg in meta:
        yield next(it) if rg else None


def _detach(out):
    if isinstance(out, (tuple, list)):
        return tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in out)
    return out.detach() if isinstance(out, torch.Tensor) else out


def _merge(outputs):
    first = outputs[0]
    if isinstance(first, tuple):
        return tuple(_merge([o[k] for o in outputs]) for k in range(len(first)))
    if not isinstance(first, torch.Tensor):
        return outputs
    return torch.stack(outputs) if first.dim() == 0 else torch.cat(outputs)


class ScheduleGPipe(_Schedule):
    """GPipe: every micro-batch's forward, then every backward (stage s
    holds the activations of all n_microbatches)."""
    _kind, _name = GPIPE, "ScheduleGPipe"

    def __init__(self, stage, n_microbatches, loss_fn=None):
        super().__init__([stage], n_microbatches, loss_fn)


class Schedule1F1B(_Schedule):
    """1F1B (PipeDream-Flush): stage s warms up with p - s - 1 forwards, then
    alternates one forward and one backward: at most p - s micro-batches'
    activations held."""
    _kind, _name = ONE_F_ONE_B, "Schedule1F1B"

    def __init__(self, stage, n_microbatches, loss_fn=None):
        super().__init__([stage], n_microbatches, loss_fn)


class ScheduleInterleaved1F1B(_Schedule):
    """Megatron's interleaved 1F1B: each rank holds v >= 2 stages (virtual
    stages r, r + p, ..., r + (v-1)p of p*v), passed as a list;
    n_microbatches a multiple of p."""
    _kind, _name = INTERLEAVED, "ScheduleInterleaved1F1B"

    def __init__(self, stages, n_microbatches, loss_fn=None):
        if isinstance(stages, PipelineStage):
            stages = [stages]
        super().__init__(stages, n_microbatches, loss_fn)


class ScheduleZBH1(_Schedule):
    """Zero-bubble H1: 1F1B with the backward split into the input gradient
    (on the critical path) and the weight gradient (deferred into the
    bubbles), at 1F1B's activation memory."""
    _kind, _name = ZBH1, "ScheduleZBH1"

    def __init__(self, stage, n_microbatches, loss_fn=None):
        super().__init__([stage], n_microbatches, loss_fn)
