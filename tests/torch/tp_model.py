"""The models and data of the tensor-parallel tests (tp_worker.py, and the
single-process reference of test_tensor_parallel.py): each dense model and
its tensor-parallel twin, built in the same order so that the same seed
gives the same weights (Megatron's initialisation), and the libps counter
that tells which collectives the layers issued."""
import torch
from torch import nn
from torch.nn import functional as F

V, D, HIDDEN, SEQ, BATCH = 13, 8, 16, 8, 3  # V=13: t=2 needs the vocabulary padded to 14
SEED, STEPS, LR = 5, 6, 0.5


class DenseMLP(nn.Module):
    """A dense layer, then a Column->Row pair (residual), then a
    Column(gather_output)->Row(input_is_parallel=False) pair."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(D, D)
        self.up = nn.Linear(D, HIDDEN)
        self.down = nn.Linear(HIDDEN, D)
        self.up2 = nn.Linear(D, 12)
        self.down2 = nn.Linear(12, D, bias=False)

    def forward(self, x):
        h = torch.tanh(self.pre(x))
        h = h + self.down(F.gelu(self.up(h)))
        return self.down2(torch.tanh(self.up2(h)))


class TpMLP(nn.Module):
    """DenseMLP's tensor-parallel twin, from the dense one (from_dense)."""

    forward = DenseMLP.forward

    def __init__(self, dense, group):
        super().__init__()
        from ps.torch import tensor_parallel as tp
        self.pre = dense.pre  # whole on every rank: its input gradient comes through f
        self.up = tp.ColumnParallelLinear.from_dense(dense.up, group=group)
        self.down = tp.RowParallelLinear.from_dense(dense.down, group=group)
        self.up2 = tp.ColumnParallelLinear.from_dense(dense.up2, group=group, gather_output=True)
        self.down2 = tp.RowParallelLinear.from_dense(dense.down2, group=group,
                                                     input_is_parallel=False)


class DenseLM(nn.Module):
    """Embedding, a dense layer, a Column->Row pair (residual), the output
    layer tied to the embedding; ids [SEQ, BATCH] (sequence first)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.pre = nn.Linear(D, D)
        self.up = nn.Linear(D, HIDDEN)
        self.down = nn.Linear(HIDDEN, D)

    def forward(self, ids, target):
        h = self.emb(ids)
        h = h + self.down(F.gelu(self.up(torch.tanh(self.pre(h)))))
        logits = h @ self.emb.weight.t()
        return F.cross_entropy(logits.reshape(-1, V), target.reshape(-1))


class TpLM(nn.Module):
    """DenseLM's twin, built with the layers' own constructors in the same
    order (so the same seed gives the same start), the vocabulary padded to
    a multiple of pad."""

    def __init__(self, group, sp, pad=2):
        super().__init__()
        from ps.torch import tensor_parallel as tp
        self.group, self.sp = group, sp
        self.emb = tp.VocabParallelEmbedding(V, D, group=group, pad_vocab_to=pad,
                                             sequence_parallel=sp)
        self.pre = nn.Linear(D, D)
        self.up = tp.ColumnParallelLinear(D, HIDDEN, group=group, sequence_parallel=sp)
        self.down = tp.RowParallelLinear(HIDDEN, D, group=group, sequence_parallel=sp)
        if sp:  # sees this rank's part of the sequence only
            tp.mark_sequence_parallel(self.pre)

    def forward(self, ids, target):
        from ps.torch import tensor_parallel as tp
        h = self.emb(ids)
        h = h + self.down(F.gelu(self.up(torch.tanh(self.pre(h)))))
        logits = tp.parallel_lm_logits(h, self.emb.weight, group=self.group,
                                       sequence_parallel=self.sp)
        return tp.vocab_parallel_cross_entropy(logits, target, group=self.group, vocab_size=V)


def mlp_data(step, replica=0):
    g = torch.Generator().manual_seed(1000 + 10 * step + replica)
    return torch.randn(SEQ, BATCH, D, generator=g), torch.randn(SEQ, BATCH, D, generator=g)


def lm_data(step, replica=0):
    g = torch.Generator().manual_seed(2000 + 10 * step + replica)
    ids = torch.randint(0, V, (SEQ + 1, BATCH), generator=g)
    return ids[:-1], ids[1:]


def optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


class Counter:
    """Counts the collectives that reach libps (every ps_coll_* entry point
    that moves data) while it is active, by the function's name, and the
    groups (handles) they ran on."""

    NAMES = ("ps_coll_allreduce", "ps_coll_allreduce_async", "ps_coll_allreduce_typed",
             "ps_coll_allreduce_typed_async", "ps_coll_broadcast", "ps_coll_barrier",
             "ps_coll_allgather", "ps_coll_reduce_scatter", "ps_coll_reduce_scatter_async",
             "ps_coll_reduce_scatter_typed", "ps_coll_reduce", "ps_coll_reduce_typed",
             "ps_coll_alltoall", "ps_coll_send", "ps_coll_recv", "ps_coll_send_async",
             "ps_coll_recv_async")
    KIND = {"allreduce": "all-reduce", "allgather": "all-gather",
            "reduce_scatter": "reduce-scatter"}

    def __init__(self):
        self.calls = []

    def __enter__(self):
        from ps import _lib
        self._saved = {}
        for name in self.NAMES:
            fn = getattr(_lib.lib, name)
            self._saved[name] = fn
            setattr(_lib.lib, name, self._wrap(name, fn))
        return self

    def _wrap(self, name, fn):
        def counted(*args):
            h = args[0]
            self.calls.append((name, h.value if hasattr(h, "value") else h))
            return fn(*args)
        return counted

    def __exit__(self, *exc):
        from ps import _lib
        for name, fn in self._saved.items():
            setattr(_lib.lib, name, fn)

    def kinds(self):
        """{'all-reduce': n, ...}: the calls by kind."""
        out = {}
        for name, _ in self.calls:
            base = name[len("ps_coll_"):].replace("_typed", "").replace("_async", "")
            k = self.KIND.get(base, base)
            out[k] = out.get(k, 0) + 1
        return out

    def handles(self):
        return {h for _, h in self.calls}
