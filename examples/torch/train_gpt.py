"""Train a small GPT character by character through ps, in 3D: tensor-parallel
attention and MLP, blocks split over pipeline stages, data-parallel replicas
(through the shards or the ring), in any layout t x p x d = W.

    tools/train-torch --example gpt --workers 8 --tensor-parallel 2 --pipeline-stages 2
    tools/ps-local --workers 4 --sync-mode allreduce -- /usr/bin/python3 \\
        examples/torch/train_gpt.py --tensor-parallel 2 --pipeline-stages 2

The text: every regular file of /usr/share/common-licenses (Debian's
base-files, on every Debian machine), symbolic links left out, concatenated
in sorted name order; the bytes are the characters; the last 10% is held out
for validation.

The model (GPT-2's shape: pre-norm blocks, learned positions, GELU MLP, an
output layer tied to the embedding) is built whole on every rank from one
seed, then cut: this rank keeps its stage's blocks (stage s of p takes the
s-th of p near-equal runs of blocks; the first stage also the embeddings, the
last the final norm and the output layer) and, with t > 1, its slice of each
layer (ps.torch.tensor_parallel's from_dense: attention's QKV and the MLP's
first layer column-parallel, their output layers row-parallel, the embedding
and the output layer vocabulary-parallel). So every layout starts from the
same weights as one process (t = p = d = 1), and trains the same model: the
gradient of a step is that of the mean loss over the global batch, the same
micro-batches accumulated. With p > 1 the embedding (first stage) and the
output layer (last stage) are two copies of one weight whose gradients
ps.torch.pipeline.tie sums before the data-parallel average.

The layout and schedule come from the flags or, as the Kubernetes overlay
gives them, the environment (PS_TENSOR_PARALLEL, PS_PIPELINE_STAGES,
PS_MICRO_BATCHES, PS_PIPELINE_SCHEDULE). A progress line every --log-every
steps (step, loss, samples/s), then the validation loss; --save writes each
rank's parameters (under the whole model's names) and the per-step losses,
which the tests compare with one process."""
import argparse
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import ps
import ps.torch

TEXT_DIR = "/usr/share/common-licenses"
SCHEDULES = ("gpipe", "1f1b")


# ---- the data ----

def text_files(directory):
    """The regular files of directory (no links), in sorted name order."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(n for n in names if os.path.isfile(os.path.join(directory, n))
                  and not os.path.islink(os.path.join(directory, n)))


def load_text(directory):
    """The corpus as int64 byte ids, and the sorted list of bytes that occur
    (id i is byte vocab[i])."""
    names = text_files(directory)
    raw = b"".join(open(os.path.join(directory, n), "rb").read() for n in names)
    vocab = sorted(set(raw))
    index = torch.full((256,), -1, dtype=torch.int64)
    index[torch.tensor(vocab)] = torch.arange(len(vocab))
    return index[torch.tensor(list(raw), dtype=torch.int64)], vocab


def batch(data, step, seed, rows, context):
    """Step `step`'s global batch: `rows` windows at offsets drawn from
    (seed, step), the same on every rank; inputs and next-byte targets."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, len(data) - context - 1, (rows,), generator=g)
    at = start[:, None] + torch.arange(context + 1)
    w = data[at]
    return w[:, :-1], w[:, 1:]


# ---- the model ----

class Block(nn.Module):
    """Pre-norm transformer block. qkv's outputs are laid out head by head
    (q, k, v of head 0, then of head 1, ...), so a column-parallel slice of it
    holds whole heads; proj's inputs are the heads in order, so a row-parallel
    slice takes the same heads."""

    def __init__(self, width, heads):
        super().__init__()
        self.head_dim = width // heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(self.ln1(x))
        h = qkv.shape[-1] // (3 * self.head_dim)  # the heads this rank holds
        q, k, v = qkv.view(b, t, h, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        att = (q @ k.transpose(-2, -1)) / self.head_dim ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, h * self.head_dim))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """The whole model, as one process trains it; stage() cuts it."""

    def __init__(self, vocab, width, heads, layers, context):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)


class Stage(nn.Module):
    """Blocks [lo, hi) of a GPT, with the embeddings when first and the final
    norm and output layer when last. Parameter names are the whole model's
    (blocks.3.qkv.weight), so a rank's parameters name their full tensor."""

    def __init__(self, gpt, lo, hi, first, last):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = gpt.wte, gpt.wpe
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in range(lo, hi)})
        if last:
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x):
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for b in self.blocks.values():
            x = b(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


def stage_range(layers, stages, s):
    """Stage s's blocks: near-equal runs, the longer ones first."""
    base, extra = divmod(layers, stages)
    lo = s * base + min(s, extra)
    return lo, lo + base + (1 if s < extra else 0)


def split_tensor_parallel(stage, group):
    """Replaces this stage's layers by this rank's slices of them (Megatron's
    pairs: column then row), from the whole layers. Returns {parameter name:
    the dimension it is split along} for the tests."""
    from ps.torch import tensor_parallel as tp
    split = {}
    for name, b in stage.blocks.items():
        for col, row in (("qkv", "proj"), ("fc", "out")):
            setattr(b, col, tp.ColumnParallelLinear.from_dense(getattr(b, col), group=group))
            setattr(b, row, tp.RowParallelLinear.from_dense(getattr(b, row), group=group))
            split.update({f"blocks.{name}.{col}.weight": 0, f"blocks.{name}.{col}.bias": 0,
                          f"blocks.{name}.{row}.weight": 1})
    if stage.first:
        stage.wte = tp.VocabParallelEmbedding.from_dense(stage.wte, group=group)
        split["wte.weight"] = 0
    if stage.last:
        # the output layer: column-parallel (its input's gradient is summed
        # over the group), its logits split by vocabulary like the embedding
        stage.head = tp.ColumnParallelLinear.from_dense(stage.head, group=group)
        split["head.weight"] = 0
        if stage.first:
            stage.head.weight = stage.wte.weight  # one stage: one tensor, as the whole model
    return split


# ---- training ----

def options(argv=None):
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tensor-parallel", type=int, default=int(env("PS_TENSOR_PARALLEL", "1")),
                   help="t, ranks per tensor-parallel group (default: PS_TENSOR_PARALLEL or 1)")
    p.add_argument("--pipeline-stages", type=int, default=int(env("PS_PIPELINE_STAGES", "1")),
                   help="p, pipeline stages (default: PS_PIPELINE_STAGES or 1); d = W / (t p)")
    p.add_argument("--micro-batches", type=int, default=int(env("PS_MICRO_BATCHES", "4")),
                   help="micro-batches per step (default: PS_MICRO_BATCHES or 4)")
    p.add_argument("--pipeline-schedule", default=env("PS_PIPELINE_SCHEDULE", "1f1b"),
                   help="gpipe or 1f1b (default: PS_PIPELINE_SCHEDULE or 1f1b)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--pad-vocab", type=int, default=64,
                   help="the vocabulary is padded to a multiple of this (t must divide it)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="sequences per step and data-parallel replica")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    p.add_argument("--lr", type=float, default=None, help="default 1e-2 (adam), 0.1 (sgd)")
    p.add_argument("--momentum", type=float, default=0.9, help="sgd's")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--text", default=TEXT_DIR, help="a directory of text files")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--val-batches", type=int, default=8,
                   help="batches of --batch-size held-out windows for the validation loss")
    p.add_argument("--save", default="",
                   help="write each rank's parameters and losses to SAVE %% rank (tests)")
    a = p.parse_args(argv)
    for name in ("tensor_parallel", "pipeline_stages", "micro_batches", "layers", "width",
                 "heads", "context", "pad_vocab", "batch_size", "steps", "log_every"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, not {getattr(a, name)}")
    if a.pipeline_schedule not in SCHEDULES:
        p.error(f"--pipeline-schedule {a.pipeline_schedule!r}: this script runs "
                f"{' or '.join(SCHEDULES)}")
    t = a.tensor_parallel
    checks = [(a.width % a.heads, f"--heads {a.heads} must divide --width {a.width}"),
              (a.heads % t, f"--tensor-parallel {t} must divide --heads {a.heads}"),
              (a.pad_vocab % t, f"--tensor-parallel {t} must divide --pad-vocab {a.pad_vocab}"),
              (a.pipeline_stages > a.layers,
               f"--pipeline-stages {a.pipeline_stages} is more than --layers {a.layers}"),
              (a.batch_size % a.micro_batches, f"--micro-batches {a.micro_batches} must "
               f"divide --batch-size {a.batch_size}")]
    if not text_files(a.text):
        p.error(f"--text {a.text}: no readable directory with files in it (Debian's "
                f"{TEXT_DIR} is in base-files)")
    for bad, what in checks:
        if bad:
            p.error(what)
    if a.lr is None:
        a.lr = 1e-2 if a.optimizer == "adam" else 0.1
    return a, p


def main():
    a, parser = options()
    torch.set_num_threads(1)  # one core per process on a shared machine
    ps.init()
    world, t, p = ps.size(), a.tensor_parallel, a.pipeline_stages
    if world % (t * p):
        parser.error(f"--tensor-parallel {t} x --pipeline-stages {p} must divide the "
                     f"{world} workers")
    grid = ps.torch.grid(tp=t, pp=p)
    d = grid.dp
    first, last = grid.pp_rank == 0, grid.pp_rank == p - 1
    # the losses are known on the last stage; rank 0 prints them (a
    # launcher shows rank 0's output), from the last stage's first rank
    reporter = t * d * (p - 1)

    def tell_rank0(*values):
        """values on the reporter, sent to rank 0; what rank 0 got, else None."""
        v = torch.tensor(values if ps.rank() == reporter else [0.0] * len(values),
                         dtype=torch.float64)
        if reporter and ps.rank() == reporter:
            ps.torch.send(v, 0)
        elif reporter and ps.rank() == 0:
            ps.torch.recv(v, reporter)
        return v.tolist() if ps.rank() == 0 else None

    data, chars = load_text(a.text)
    cut = len(data) * 9 // 10
    train, val = data[:cut], data[cut:]
    vocab = -(-len(chars) // a.pad_vocab) * a.pad_vocab

    torch.manual_seed(a.seed)
    gpt = GPT(vocab, a.width, a.heads, a.layers, a.context)
    lo, hi = stage_range(a.layers, p, grid.pp_rank)
    model = Stage(gpt, lo, hi, first, last)
    split = split_tensor_parallel(model, grid.tp_group) if t > 1 else {}
    if t > 1 and last:
        from ps.torch.tensor_parallel import vocab_parallel_cross_entropy

        def loss_fn(logits, y):  # every column a word, as the whole model's
            return vocab_parallel_cross_entropy(logits, y, grid.tp_group)
    else:
        def loss_fn(logits, y):
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    tie = None
    if p > 1:
        # one group per (tensor slice, replica): its first and last stage
        # hold the two copies of the embedding; every rank forms every group
        from ps.torch import pipeline
        for dp in range(d):
            for tp in range(t):
                ranks = [tp + t * (dp + d * 0), tp + t * (dp + d * (p - 1))]
                g = ps.torch.new_group(ranks)
                if g.rank >= 0:
                    tie = g
        if first or last:  # (the stages between hold neither)
            pipeline.tie(model.wte.weight if first else model.head.weight, tie)

    m = a.micro_batches
    if a.optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum)
    # the replicas' mean gradient, once per step: after the m backward passes
    # here, or (p > 1) where the schedule's list says (it accumulates the
    # micro-batches under no_sync, sums the tied copies, then synchronises)
    opt = ps.torch.DistributedOptimizer(opt, model.named_parameters(), group=grid.dp_group,
                                        backward_passes_per_step=m if p == 1 else 1)
    if p > 1:
        stage = pipeline.PipelineStage(model, grid.pp_rank, p, group=grid.pp_group)
        kind = pipeline.ScheduleGPipe if a.pipeline_schedule == "gpipe" else pipeline.Schedule1F1B
        schedule = kind(stage, m, loss_fn)
    if ps.rank() == 0:
        print(f"training a {a.layers}-layer GPT (width {a.width}, {a.heads} heads, context "
              f"{a.context}, vocabulary {len(chars)} padded to {vocab}) on {world} worker(s): "
              f"t={t} x p={p} x d={d}, sync mode {ps.sync_mode()}, {a.optimizer}, "
              f"{m} micro-batches of {a.batch_size // m}"
              + (f", {a.pipeline_schedule}" if p > 1 else ""), flush=True)

    rows = a.batch_size
    losses, since, seen, wall = [], time.monotonic(), 0, 0.0
    for step in range(a.steps):
        x, y = batch(train, step, a.seed, rows * d, a.context)
        x, y = x[grid.dp_rank * rows:][:rows], y[grid.dp_rank * rows:][:rows]
        opt.zero_grad()
        mb = []
        if p == 1:
            for xm, ym in zip(x.chunk(m), y.chunk(m)):
                loss = loss_fn(model(xm), ym)
                (loss / m).backward()
                mb.append(loss.detach())
        elif first:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=mb)
        else:
            schedule.step()
        opt.step()
        seen += rows * d
        if last:
            loss = torch.stack([v.detach().reshape(()) for v in mb]).mean()
            if d > 1:
                loss = ps.torch.allreduce(loss.reshape(1), group=grid.dp_group)[0]
            losses.append(loss.item())
        if (step + 1) % a.log_every == 0 or step + 1 == a.steps:
            took = time.monotonic() - since
            wall += took
            got = tell_rank0(losses[-1] if last else 0.0, seen / took)
            if got:
                print(f"step {step + 1}/{a.steps} loss {got[0]:.4f} samples/s {got[1]:.1f}",
                      flush=True)
            since, seen = time.monotonic(), 0

    got = tell_rank0(evaluate(model, val, a, grid, loss_fn), wall)
    if got:
        val_loss, wall = got
        print(f"validation loss {val_loss:.4f} (perplexity {torch.tensor(val_loss).exp():.2f})",
              flush=True)
        print(f"summary val_loss={val_loss:.4f} steps={a.steps} wall_s={wall:.2f} "
              f"samples_per_s={a.steps * rows * d / wall:.1f}", flush=True)
    if a.save:
        def whole(n):  # the output layer is the embedding, tied
            return "wte.weight" if n == "head.weight" else n
        torch.save({"grid": dict(tp=grid.tp_rank, pp=grid.pp_rank, dp=grid.dp_rank, t=t, p=p,
                                 d=d),
                    "params": {whole(n): v.detach().clone()
                               for n, v in model.named_parameters()},
                    "split": {whole(n): dim for n, dim in split.items()},
                    "losses": losses}, a.save % ps.rank())
    ps.shutdown()
    return 0


def evaluate(model, val, a, grid, loss_fn):
    """The mean loss over --val-batches batches of consecutive held-out
    windows, each replica taking every d-th batch; the stages pass the
    activations on with send/recv (no schedule: nothing to overlap without a
    backward). Returns the loss on the last stage's ranks, NaN elsewhere."""
    p, d = grid.pp, grid.dp
    first, last = grid.pp_rank == 0, grid.pp_rank == p - 1
    starts = torch.arange(0, len(val) - a.context - 1, a.context)
    starts = starts[:a.val_batches * a.batch_size]
    total = torch.zeros(2, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for i in range(grid.dp_rank, -(-len(starts) // a.batch_size), d):
            at = starts[i * a.batch_size:][:a.batch_size, None] + torch.arange(a.context + 1)
            x, y = val[at][:, :-1], val[at][:, 1:]
            h = x if first else torch.empty(len(x), a.context, a.width)
            if not first:
                ps.torch.recv(h, grid.pp_rank - 1, group=grid.pp_group)
            h = model(h)
            if not last:
                ps.torch.send(h.contiguous(), grid.pp_rank + 1, group=grid.pp_group)
            else:
                total += torch.tensor([loss_fn(h, y).item() * len(x), len(x)],
                                      dtype=torch.float64)
    model.train()
    if last and d > 1:
        total = ps.torch.allreduce(total, average=False, group=grid.dp_group)
    return (total[0] / total[1]).item() if last else float("nan")


if __name__ == "__main__":
    sys.exit(main())
