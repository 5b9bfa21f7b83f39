"""Tensor parallelism (Megatron-LM's layers) over ps.torch's collectives.

    g = ps.torch.grid(tp=2).tp_group                 # or None: the whole job
    up = tp.ColumnParallelLinear(512, 2048, group=g)  # weight rows split: 1024 each
    down = tp.RowParallelLinear(2048, 512, group=g)   # weight columns split
    y = down(torch.nn.functional.gelu(up(x)))        # x, y: full width on every rank

One column-parallel layer followed by one row-parallel layer (an MLP,
attention's QKV then its output projection) costs exactly Megatron's
collectives: one all-reduce forward (the row layer's output, g) and one
backward (the column layer's input gradient, f). With sequence_parallel=True
the activations outside the pair are split along the sequence dimension,
DIM 0 (Megatron's [s, b, h] layout): the column layer all-gathers its input
forward and reduce-scatters its gradient backward, the row layer
reduce-scatters its output forward and all-gathers its gradient backward;
the same bytes as the two all-reduces, and 1/t of the activations between
the pairs.

Initialisation is Megatron's: a layer draws its full weight from torch's
generator exactly as the torch.nn layer of the same shape would
(nn.Linear, nn.Embedding), then keeps its own slice; so with the same seed
on every rank, t=1 and t=k start from the same model. from_dense(layer)
builds the slice of a full layer you already have.

The vocabulary-parallel embedding keeps rows [r*V/t, (r+1)*V/t) of the
table, looks up the ids in its range (the others give zeros) and
all-reduces; vocab_parallel_cross_entropy takes each rank's slice of the
logits and needs three all-reduces (the max, the target's logit, the sum of
the exponentials), none backward (the gradient softmax - onehot is local).
A vocabulary that t does not divide is padded (pad_vocab_to=): the padding
rows are zero, never looked up, and their logits are masked to -inf, so the
loss is the unpadded one.

Every collective here is one libps call on the group's ring (counted in
tests/torch/test_tensor_parallel.py by wrapping libps's entry points):
ps.torch.allreduce_ (sum; max for the cross-entropy), ps.torch.reduce_scatter
(sum, along dim 0), and an all-gather along dim 0 of equal parts straight
through ps_coll_allgather (ps.torch.allgather would first exchange the
shapes, a second collective; libps refuses parts of different sizes on every
rank, naming them). Errors (t not dividing a width or the vocabulary, a rank
not in the group, an input of the wrong width, ids out of range) are raised
before anything is sent."""

import torch
import torch.nn.functional as F
from torch import nn

from ps import _lib

from . import groups as _groups

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "parallel_lm_logits", "padded_vocab_size",
           "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
           "gather_from_tensor_parallel_region", "scatter_to_tensor_parallel_region",
           "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
           "scatter_to_sequence_parallel_region", "mark_sequence_parallel",
           "allreduce_sequence_parallel_grads"]


# -- the group ----------------------------------------------------------------


def _place(group, what):
    """(t, this rank's index in the group): the job's size and rank for
    group None. Raises PSError naming this rank and the group when it is
    not a member (groups.on), before anything is sent."""
    job = _groups.on(group, what)
    return job.size, job.rank


def _where(group):
    return "the job" if group is None else str(group)


def _divides(n, t, what, name, group, fix=""):
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{what}: {name}={n!r}; expected an int >= 1")
    if n % t:
        raise ValueError(f"{what}: {name}={n} does not split over the {t} ranks of "
                         f"{_where(group)} (tensor-parallel size t={t} must divide it){fix}")
    return n // t


def _last_dim(x, want, what, hint=""):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0 or x.shape[-1] != want:
        raise ValueError(f"{what}: the input's last dimension is "
                         f"{x.shape[-1] if x.dim() else '(a scalar)'} (shape "
                         f"{tuple(x.shape)}); expected {want}{hint}")


def _seq_dim(x, t, what):
    """Sequence parallelism splits dim 0 (Megatron's [s, b, h])."""
    if x.dim() < 2:
        raise ValueError(f"{what}: sequence_parallel takes inputs of at least 2 dimensions, "
                         f"the sequence first ([s, b, h] or [s, h]); got shape {tuple(x.shape)}")
    if x.shape[0] % t:
        raise ValueError(f"{what}: the sequence dimension (dim 0) of shape {tuple(x.shape)} "
                         f"does not split over the {t} tensor-parallel ranks")


# -- the collectives (one libps call each) --------------------------------------


def _all_reduce(x, group, what, op="sum"):
    from . import allreduce_
    return allreduce_(x.contiguous().clone(), average=False, name=what, op=op, group=group)


def _all_gather0(x, group, what):
    """Every rank's x concatenated along dim 0, group rank 0's first; x has
    the same shape on every rank (libps fails every rank otherwise)."""
    job = _groups.on(group, what)
    if job.size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((job.size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype)
    st = _lib.lib.ps_coll_allgather(job.ring(), x.data_ptr(), out.data_ptr(),
                                    x.numel() * x.element_size())
    if st != _lib.OK:
        raise job.ring_error(st, what)
    return out


def _reduce_scatter0(x, group, what):
    from . import reduce_scatter
    return reduce_scatter(x.contiguous(), op="sum", name=what, group=group)


def _split(x, dim, t, r):
    n = x.shape[dim] // t
    return x.narrow(dim, r * n, n).contiguous()


def _gather_last(x, group, what):
    t, _ = _place(group, what)
    if t == 1:
        return x
    k = x.shape[-1]
    flat = x.reshape(-1, k)
    every = _all_gather0(flat, group, what)  # [t * N, k], rank 0's first
    return every.view(t, flat.shape[0], k).permute(1, 0, 2).reshape(*x.shape[:-1], t * k)


class _Copy(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, what):
        ctx.group, ctx.what = group, what
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, ctx.what + " (backward)"), None, None


class _Reduce(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group, what):
        return _all_reduce(x, group, what)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherLast(torch.autograd.Function):
    """All-gather along the last dimension forward, this rank's part of the
    gradient backward."""

    @staticmethod
    def forward(ctx, x, group, what):
        ctx.t, ctx.r = _place(group, what)
        return _gather_last(x, group, what) if ctx.t > 1 else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.t, ctx.r), None, None


class _ScatterLast(torch.autograd.Function):
    """This rank's part of the last dimension forward, all-gather of the
    gradient backward."""

    @staticmethod
    def forward(ctx, x, group, what):
        ctx.group, ctx.what = group, what
        t, r = _place(group, what)
        return _split(x, -1, t, r)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group, ctx.what + " (backward)"), None, None


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 0 forward, reduce-scatter (sum) backward."""

    @staticmethod
    def forward(ctx, x, group, what):
        ctx.group, ctx.what = group, what
        t, _ = _place(group, what)
        return _all_gather0(x, group, what) if t > 1 else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        t, _ = _place(ctx.group, ctx.what)
        if t == 1:
            return grad, None, None
        return _reduce_scatter0(grad, ctx.group, ctx.what + " (backward)"), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    """Reduce-scatter (sum) along dim 0 forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, what):
        ctx.group, ctx.what = group, what
        t, _ = _place(group, what)
        return _all_reduce(x, group, what) if t == 1 else _reduce_scatter0(x, group, what)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather0(grad, ctx.group, ctx.what + " (backward)"), None, None


class _ScatterSeq(torch.autograd.Function):
    """This rank's part of dim 0 forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, what):
        ctx.group, ctx.what = group, what
        t, r = _place(group, what)
        return _split(x, 0, t, r)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather0(grad, ctx.group, ctx.what + " (backward)"), None, None


def copy_to_tensor_parallel_region(x, group=None):
    """Megatron's f: x as it is; backward, its gradient all-reduced (sum)."""
    _place(group, "copy_to_tensor_parallel_region")
    return _Copy.apply(x, group, "copy_to_tensor_parallel_region")


def reduce_from_tensor_parallel_region(x, group=None):
    """Megatron's g: x all-reduced (sum); backward, the gradient as it is."""
    _place(group, "reduce_from_tensor_parallel_region")
    return _Reduce.apply(x, group, "reduce_from_tensor_parallel_region")


def gather_from_tensor_parallel_region(x, group=None):
    """Every rank's x concatenated along the last dimension (group rank 0's
    first); backward, this rank's part of the gradient."""
    _place(group, "gather_from_tensor_parallel_region")
    return _GatherLast.apply(x, group, "gather_from_tensor_parallel_region")


def scatter_to_tensor_parallel_region(x, group=None):
    """This rank's 1/t of x's last dimension; backward, the gradient
    all-gathered."""
    t, _ = _place(group, "scatter_to_tensor_parallel_region")
    _divides(x.shape[-1], t, "scatter_to_tensor_parallel_region", "the last dimension", group)
    return _ScatterLast.apply(x, group, "scatter_to_tensor_parallel_region")


def gather_from_sequence_parallel_region(x, group=None):
    """Every rank's x concatenated along dim 0 (the sequence); backward, the
    gradient reduce-scattered (sum) along dim 0."""
    _place(group, "gather_from_sequence_parallel_region")
    return _GatherSeq.apply(x, group, "gather_from_sequence_parallel_region")


def reduce_scatter_to_sequence_parallel_region(x, group=None):
    """x summed over the ranks, this rank's 1/t of dim 0 (the sequence) kept;
    backward, the gradient all-gathered along dim 0."""
    t, _ = _place(group, "reduce_scatter_to_sequence_parallel_region")
    _seq_dim(x, t, "reduce_scatter_to_sequence_parallel_region")
    return _ReduceScatterSeq.apply(x, group, "reduce_scatter_to_sequence_parallel_region")


def scatter_to_sequence_parallel_region(x, group=None):
    """This rank's 1/t of dim 0 (the sequence); backward, the gradient
    all-gathered along dim 0. For inputs every rank has whole."""
    t, _ = _place(group, "scatter_to_sequence_parallel_region")
    _seq_dim(x, t, "scatter_to_sequence_parallel_region")
    return _ScatterSeq.apply(x, group, "scatter_to_sequence_parallel_region")


# -- sequence-parallel parameters ----------------------------------------------


def mark_sequence_parallel(params):
    """Marks parameters (a module's, or an iterable) that sequence
    parallelism leaves whole on every rank but that see only this rank's
    part of the sequence (a LayerNorm or a dense layer between the pairs,
    RowParallelLinear's bias): their gradients are partial sums, which
    allreduce_sequence_parallel_grads adds up. Returns the parameters."""
    out = list(params.parameters() if isinstance(params, nn.Module) else params)
    for p in out:
        p.sequence_parallel = True
    return out


def allreduce_sequence_parallel_grads(params, group=None):
    """Sums the gradients of the parameters marked sequence_parallel over
    the ranks of group, in one all-reduce (Megatron's layernorm all-reduce
    in finalize_model_grads). Call it after backward and before step(),
    with the same parameters on every rank of the group; with a
    DistributedOptimizer over the data-parallel group, after backward too
    (its p.grad is then the data-parallel mean, and the sum is linear).
    Returns the number of parameters summed."""
    what = "allreduce_sequence_parallel_grads"
    t, _ = _place(group, what)
    mods = params.parameters() if isinstance(params, nn.Module) else params
    marked = [p for p in mods if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if t == 1 or not marked:
        return len(marked)
    flat = torch.cat([p.grad.reshape(-1) for p in marked])
    flat = _all_reduce(flat, group, what)
    off = 0
    for p in marked:
        n = p.grad.numel()
        p.grad.copy_(flat[off:off + n].view_as(p.grad))
        off += n
    return len(marked)


# -- the layers ----------------------------------------------------------------


def _param(t, requires_grad=True):
    return nn.Parameter(t.detach().clone().contiguous(), requires_grad=requires_grad)


def _from_layer(cls, layer, kind, *setup):
    """cls's slice of the whole layer (an instance of kind): _setup(*setup),
    then _take(layer), without drawing a new weight as __init__ does."""
    if not isinstance(layer, kind):
        raise TypeError(f"{cls.__name__}.from_dense: expected a torch.nn.{kind.__name__}, got "
                        f"{type(layer).__name__}")
    obj = cls.__new__(cls)
    nn.Module.__init__(obj)
    obj._setup(*setup)
    return obj


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A's rows (the outputs) split over the t ranks of
    group: this rank computes out_features / t outputs. The input goes
    through f (identity forward, all-reduce of its gradient backward); with
    gather_output the outputs are all-gathered along the last dimension (and
    backward split again), else each rank keeps its part (for a
    RowParallelLinear with input_is_parallel). sequence_parallel: the input
    is this rank's part of the sequence (dim 0), all-gathered forward and
    reduce-scattered backward (then gather_output must be False)."""

    def __init__(self, in_features, out_features, bias=True, gather_output=False, group=None,
                 sequence_parallel=False):
        super().__init__()
        self._setup(in_features, out_features, gather_output, group, sequence_parallel)
        full = nn.Linear(in_features, out_features, bias=bias)  # torch's draws, then split
        self._take(full)

    @classmethod
    def from_dense(cls, layer, group=None, gather_output=False, sequence_parallel=False):
        """This rank's slice of the nn.Linear layer (its rows)."""
        obj = _from_layer(cls, layer, nn.Linear, layer.in_features, layer.out_features,
                          gather_output, group, sequence_parallel)
        obj._take(layer)
        return obj

    def _setup(self, in_features, out_features, gather_output, group, sequence_parallel):
        self._what = f"ColumnParallelLinear({in_features}, {out_features})"
        t, r = _place(group, self._what)
        _divides(in_features, 1, self._what, "in_features", group)
        self.out_per_rank = _divides(out_features, t, self._what, "out_features", group)
        if sequence_parallel and gather_output:
            raise ValueError(f"{self._what}: sequence_parallel=True takes gather_output=False "
                             "(the output stays split for a RowParallelLinear)")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = bool(gather_output), bool(sequence_parallel)
        self.group, self.tp_size, self.tp_rank = group, t, r

    def _take(self, full):
        r, k = self.tp_rank, self.out_per_rank
        self.weight = _param(full.weight[r * k:(r + 1) * k])
        self.weight.partition_dim = 0
        if full.bias is not None:
            self.bias = _param(full.bias[r * k:(r + 1) * k])
            self.bias.partition_dim = 0
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        _last_dim(x, self.in_features, self._what)
        if self.sequence_parallel:
            _seq_dim(x, 1, self._what)
            x = _GatherSeq.apply(x, self.group, f"{self._what}: the input's all-gather")
        else:
            x = _Copy.apply(x, self.group, f"{self._what}: the input (f)")
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = _GatherLast.apply(y, self.group, f"{self._what}: the output's all-gather")
        return y

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.out_per_rank} on tp rank {self.tp_rank} of {self.tp_size}), "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A's columns (the inputs) split over the t ranks of
    group: this rank multiplies its in_features / t inputs, the partial
    results are all-reduced (g: all-reduce forward, identity backward) and
    the bias is added once, after. input_is_parallel (default): x is this
    rank's part of the inputs (a ColumnParallelLinear's output); else x is
    whole and split here first (its gradient all-gathered backward).
    sequence_parallel: the output is reduce-scattered along dim 0 (the
    sequence) instead of all-reduced, all-gathered backward; the bias,
    whole on every rank, is then marked sequence_parallel (see
    allreduce_sequence_parallel_grads)."""

    def __init__(self, in_features, out_features, bias=True, input_is_parallel=True, group=None,
                 sequence_parallel=False):
        super().__init__()
        self._setup(in_features, out_features, input_is_parallel, group, sequence_parallel)
        self._take(nn.Linear(in_features, out_features, bias=bias))

    @classmethod
    def from_dense(cls, layer, group=None, input_is_parallel=True, sequence_parallel=False):
        """This rank's slice of the nn.Linear layer (its columns; the whole
        bias)."""
        obj = _from_layer(cls, layer, nn.Linear, layer.in_features, layer.out_features,
                          input_is_parallel, group, sequence_parallel)
        obj._take(layer)
        return obj

    def _setup(self, in_features, out_features, input_is_parallel, group, sequence_parallel):
        self._what = f"RowParallelLinear({in_features}, {out_features})"
        t, r = _place(group, self._what)
        _divides(out_features, 1, self._what, "out_features", group)
        self.in_per_rank = _divides(in_features, t, self._what, "in_features", group)
        if sequence_parallel and not input_is_parallel:
            raise ValueError(f"{self._what}: sequence_parallel=True takes input_is_parallel=True "
                             "(the input is a ColumnParallelLinear's split output)")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = bool(input_is_parallel)
        self.sequence_parallel = bool(sequence_parallel)
        self.group, self.tp_size, self.tp_rank = group, t, r

    def _take(self, full):
        r, k = self.tp_rank, self.in_per_rank
        self.weight = _param(full.weight[:, r * k:(r + 1) * k])
        self.weight.partition_dim = 1
        if full.bias is not None:
            self.bias = _param(full.bias)
            if self.sequence_parallel:
                self.bias.sequence_parallel = True
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        if self.input_is_parallel:
            _last_dim(x, self.in_per_rank, self._what,
                      f" (input_is_parallel: this rank's {self.in_per_rank} of the "
                      f"{self.in_features} inputs; pass input_is_parallel=False for whole "
                      "inputs)")
        else:
            _last_dim(x, self.in_features, self._what)
            x = _ScatterLast.apply(x, self.group, f"{self._what}: the input's split")
        if self.sequence_parallel:
            _seq_dim(x, self.tp_size, self._what)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = _ReduceScatterSeq.apply(y, self.group, f"{self._what}: the output's "
                                        "reduce-scatter")
        else:
            y = _Reduce.apply(y, self.group, f"{self._what}: the output's all-reduce (g)")
        return y + self.bias if self.bias is not None else y

    def extra_repr(self):
        return (f"in_features={self.in_features} ({self.in_per_rank} on tp rank "
                f"{self.tp_rank} of {self.tp_size}), out_features={self.out_features}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


def padded_vocab_size(num_embeddings, multiple):
    """The smallest multiple of `multiple` >= num_embeddings (Megatron pads
    to make_vocab_size_divisible_by x t): e.g. padded_vocab_size(65, 2) =
    66."""
    for name, v in (("num_embeddings", num_embeddings), ("multiple", multiple)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"padded_vocab_size: {name}={v!r}; expected an int >= 1")
    return -(-num_embeddings // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with the table's rows (the vocabulary) split over the t
    ranks of group: this rank holds ids [vocab_start, vocab_end), looks up
    the ids in its range (zeros for the others) and the results are
    all-reduced (reduce-scattered along dim 0, the sequence, with
    sequence_parallel: the ids are then [s, ...] with s divisible by t).
    pad_vocab_to=m pads the vocabulary with zero rows to a multiple of m (m a
    multiple of t, e.g. t) when t does not divide num_embeddings; ids must be
    in 0..num_embeddings-1."""

    def __init__(self, num_embeddings, embedding_dim, group=None, pad_vocab_to=None,
                 sequence_parallel=False):
        super().__init__()
        self._setup(num_embeddings, embedding_dim, group, pad_vocab_to, sequence_parallel)
        self._take(nn.Embedding(num_embeddings, embedding_dim).weight)

    @classmethod
    def from_dense(cls, layer, group=None, pad_vocab_to=None, sequence_parallel=False):
        """This rank's rows of the nn.Embedding layer (padding_idx, max_norm
        and sparse are not supported)."""
        if isinstance(layer, nn.Embedding) and (layer.padding_idx is not None or
                                                layer.max_norm is not None or layer.sparse):
            raise ValueError("VocabParallelEmbedding.from_dense: padding_idx, max_norm and "
                             "sparse are not supported")
        obj = _from_layer(cls, layer, nn.Embedding, getattr(layer, "num_embeddings", 0),
                          getattr(layer, "embedding_dim", 0), group, pad_vocab_to,
                          sequence_parallel)
        obj._take(layer.weight)
        return obj

    def _setup(self, num_embeddings, embedding_dim, group, pad_vocab_to, sequence_parallel):
        self._what = f"VocabParallelEmbedding({num_embeddings}, {embedding_dim})"
        t, r = _place(group, self._what)
        _divides(embedding_dim, 1, self._what, "embedding_dim", group)
        _divides(num_embeddings, 1, self._what, "num_embeddings", group)
        padded = num_embeddings
        if pad_vocab_to is not None:
            if isinstance(pad_vocab_to, bool) or not isinstance(pad_vocab_to, int) or \
                    pad_vocab_to < 1:
                raise ValueError(f"{self._what}: pad_vocab_to={pad_vocab_to!r}; expected an int "
                                 f">= 1, a multiple of t={t}")
            padded = padded_vocab_size(num_embeddings, pad_vocab_to)
        if padded % t:
            fix = padded_vocab_size(num_embeddings, t)
            what = f"the vocabulary of {num_embeddings} ids" + (
                "" if pad_vocab_to is None else
                f" padded to a multiple of {pad_vocab_to} ({padded} ids)")
            raise ValueError(f"{self._what}: {what} does not split over the {t} ranks of "
                             f"{_where(group)} (t={t} must divide it): pass pad_vocab_to={t} "
                             f"(pads it to {fix} ids; the {fix - num_embeddings} pad row(s) are "
                             "never looked up and vocab_parallel_cross_entropy masks their "
                             "logits)")
        per_rank = padded // t
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_padded, self.per_rank = padded, per_rank
        self.vocab_start, self.vocab_end = r * per_rank, (r + 1) * per_rank
        self.sequence_parallel = bool(sequence_parallel)
        self.group, self.tp_size, self.tp_rank = group, t, r

    def _take(self, full):
        rows = full.detach()
        pad = self.num_embeddings_padded - self.num_embeddings
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, self.embedding_dim)])
        self.weight = _param(rows[self.vocab_start:self.vocab_end])
        self.weight.partition_dim = 0

    def forward(self, ids):
        if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or \
                ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"{self._what}: expected a tensor of integer ids, got "
                            f"{getattr(ids, 'dtype', type(ids).__name__)}")
        _check_ids(ids, self.num_embeddings, self._what, "id")
        if self.sequence_parallel:
            _seq_dim(ids.unsqueeze(-1), self.tp_size, self._what)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return _ReduceScatterSeq.apply(out, self.group, f"{self._what}: the output's "
                                           "reduce-scatter")
        return _Reduce.apply(out, self.group, f"{self._what}: the output's all-reduce")

    def extra_repr(self):
        return (f"{self.num_embeddings} (padded to {self.num_embeddings_padded}; "
                f"{self.vocab_start}..{self.vocab_end - 1} on tp rank {self.tp_rank} of "
                f"{self.tp_size}), {self.embedding_dim}, "
                f"sequence_parallel={self.sequence_parallel}")


def _check_ids(ids, n, what, kind):
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= n:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{what}: {kind} {bad} is outside the vocabulary 0..{n - 1}")


def parallel_lm_logits(hidden, weight, group=None, sequence_parallel=False, bias=None):
    """This rank's slice of the logits of an output layer tied to a
    VocabParallelEmbedding (weight: its .weight, [V_padded / t, h]): hidden
    goes through f (or is all-gathered along dim 0 with sequence_parallel),
    then hidden @ weight^T. Feed the result to vocab_parallel_cross_entropy
    with vocab_size= the unpadded vocabulary."""
    what = "parallel_lm_logits"
    t, _ = _place(group, what)
    _last_dim(hidden, weight.shape[-1], what, " (the embedding's width)")
    if sequence_parallel:
        hidden = _GatherSeq.apply(hidden, group, f"{what}: the input's all-gather")
    else:
        hidden = _Copy.apply(hidden, group, f"{what}: the input (f)")
    return F.linear(hidden, weight, bias)


class _VocabCrossEntropy(torch.autograd.Function):
    """Per-token loss log(sum_v exp(z_v)) - z_target over the vocabulary
    split along the last dimension; three all-reduces forward, none
    backward."""

    @staticmethod
    def forward(ctx, logits, target, group, start, vocab_size, what):
        z = logits.detach().clone()
        n = z.shape[-1]
        if start + n > vocab_size:  # padding columns: never the answer, no mass
            z[..., max(0, vocab_size - start):] = float("-inf")
        zmax = _all_reduce(z.max(dim=-1)[0], group, f"{what}: the max", op="max")
        z -= zmax.unsqueeze(-1)
        outside = (target < start) | (target >= start + n)
        local = (target - start).masked_fill(outside, 0)
        picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        picked = _all_reduce(picked, group, f"{what}: the target logit")
        z.exp_()
        total = _all_reduce(z.sum(dim=-1), group, f"{what}: the sum of exponentials")
        z /= total.unsqueeze(-1)  # the softmax, kept for backward
        ctx.save_for_backward(z, outside, local)
        return total.log() - picked

    @staticmethod
    def backward(ctx, grad):
        softmax, outside, local = ctx.saved_tensors
        g = grad.unsqueeze(-1)
        out = softmax * g
        hit = (~outside).to(out.dtype).unsqueeze(-1) * g
        out.scatter_add_(-1, local.unsqueeze(-1), -hit)
        return out, None, None, None, None, None


def vocab_parallel_cross_entropy(logits, target, group=None, vocab_size=None, reduction="mean"):
    """F.cross_entropy over logits split along the vocabulary: logits
    [..., V_padded / t] is this rank's slice (ids rank*V_padded/t onwards),
    target [...] the global ids. vocab_size: the unpadded vocabulary (pad
    columns are masked to -inf); None: every column is a word. reduction:
    "mean" (over the tokens, as F.cross_entropy), "sum" or "none". The
    gradient is (softmax - onehot) x the loss's gradient, computed locally."""
    what = "vocab_parallel_cross_entropy"
    t, r = _place(group, what)
    if not isinstance(logits, torch.Tensor) or not logits.dtype.is_floating_point \
            or logits.dim() == 0:
        raise TypeError(f"{what}: logits must be a floating tensor [..., V/t]")
    if not isinstance(target, torch.Tensor) or target.dtype.is_floating_point:
        raise TypeError(f"{what}: target must be a tensor of integer ids")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"{what}: target of shape {tuple(target.shape)} does not match logits "
                         f"of shape {tuple(logits.shape)} (expected {tuple(logits.shape[:-1])})")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{what}: reduction={reduction!r}; expected 'mean', 'sum' or 'none'")
    n = logits.shape[-1]
    padded = n * t
    if vocab_size is None:
        vocab_size = padded
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or \
            not 0 < vocab_size <= padded:
        raise ValueError(f"{what}: vocab_size={vocab_size!r}; the {t} ranks' logits hold "
                         f"{padded} columns ({n} each), so expected 1..{padded}")
    _check_ids(target, vocab_size, what, "target")
    loss = _VocabCrossEntropy.apply(logits, target.long(), group, r * n, vocab_size, what)
    if reduction == "mean":
        return loss.mean()
    return loss.sum() if reduction == "sum" else loss
