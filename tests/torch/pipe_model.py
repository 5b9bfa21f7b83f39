"""The model and data of the pipeline tests (pipe_worker.py, test_pipeline.py):
four blocks, cut into stages, whose boundaries carry a tuple of three
tensors of different shapes and dtypes: h (float32 [n, 8]) and side (float64
[n, 3]) that need gradients, and ids (int64 [n]) that does not.

With tied=True the first block embeds tokens with E (10 x 8) and the last
block's output layer is a matrix of the same shape: in the reference one
parameter (the last block uses the first's), in a pipeline two copies tied
with ps.torch.pipeline.tie."""
import torch

BLOCKS = 4
WIDTH, SIDE, VOCAB, CLASSES = 8, 3, 10, 4


class First(torch.nn.Module):
    def __init__(self, tied):
        super().__init__()
        self.tied = tied
        if tied:
            self.E = torch.nn.Parameter(torch.randn(VOCAB, WIDTH) * 0.5)
        else:
            self.lin = torch.nn.Linear(6, WIDTH)
        self.mix = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        if self.tied:
            h, ids = self.E[x], x % 2
        else:
            h, ids = self.lin(x), (x[:, 0] > 0).long()
        side = h[:, :SIDE].double() * 0.5
        return torch.tanh(self.mix(h)), side, ids


class Middle(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.side = torch.nn.Linear(SIDE, WIDTH)
        self.emb = torch.nn.Embedding(2, WIDTH)

    def forward(self, h, side, ids):
        h2 = torch.tanh(self.lin(h) + self.side(side.float()) + self.emb(ids))
        return h2, side * 0.5 + h2[:, :SIDE].double(), ids


class Last(torch.nn.Module):
    def __init__(self, tied):
        super().__init__()
        self.tied = tied
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        if tied:
            self.E = torch.nn.Parameter(torch.randn(VOCAB, WIDTH) * 0.5)  # tied to First's
        else:
            self.out = torch.nn.Linear(WIDTH, CLASSES)

    def forward(self, h, side, ids):
        h = torch.tanh(self.lin(h)) + side.float().sum(1, keepdim=True) * 0.1
        return h @ self.E.t() if self.tied else self.out(h)


def blocks(tied=False):
    """The full model's blocks, the same on every process (one seed)."""
    torch.manual_seed(7)
    return [First(tied), Middle(), Middle(), Last(tied)]


class Chain(torch.nn.Module):
    """Some consecutive blocks: one stage (the tuple passes between them)."""

    def __init__(self, parts):
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)

    def forward(self, *xs):
        for b in self.parts:
            out = b(*xs)
            xs = out if isinstance(out, tuple) else (out,)
        return out


def reference_model(tied=False):
    bs = blocks(tied)
    if tied:
        bs[-1].E = bs[0].E  # one parameter
    return bs


def loss_fn(out, y):
    return torch.nn.functional.cross_entropy(out, y)


def step_batch(step, n, tied=False):
    """The global batch of a step: n examples."""
    g = torch.Generator().manual_seed(900 + step)
    if tied:
        x = torch.randint(0, VOCAB, (n,), generator=g)
        return x, torch.randint(0, VOCAB, (n,), generator=g)
    return torch.randn(n, 6, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def optimizer(params, kind):
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference(steps, dp, m, per_replica, tied, kind):
    """One process: each step, each data-parallel replica's slice in m
    micro-batches (loss / m each, accumulated), the replicas' gradients
    averaged, then the optimizer. Returns the blocks' state dicts."""
    bs = reference_model(tied)
    params = []
    for b in bs:
        for p in b.parameters():
            if all(p is not q for q in params):
                params.append(p)
    opt = optimizer(params, kind)
    model = Chain(bs)
    for step in range(steps):
        x, y = step_batch(step, dp * per_replica, tied)
        total = [torch.zeros_like(p) for p in params]
        for d in range(dp):
            for p in params:
                p.grad = None
            xs = x[d * per_replica:(d + 1) * per_replica].chunk(m)
            ys = y[d * per_replica:(d + 1) * per_replica].chunk(m)
            for xi, yi in zip(xs, ys):
                (loss_fn(model(xi), yi) / m).backward()
            for t, p in zip(total, params):
                t.add_(p.grad)
        for t, p in zip(total, params):
            p.grad = t / dp
        opt.step()
    return [b.state_dict() for b in bs]
