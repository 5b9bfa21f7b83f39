"""Worker of test_ddp.py: one case of what DDP and Horovod users expect,
run by every rank; saves what the test compares (torch.save to OUT % rank).
   ddp_worker.py CASE OUT
The test recomputes the single-process reference from the same data
(model.py: global_batch, slice_of), so ranks, steps and hyper-parameters
here and there must agree: they come from CASES in test_ddp.py's way of
calling, not from here alone."""
import sys
import time
import warnings

import torch

import ps
import ps.torch
from model import cnn_bn, global_batch, slice_of, small

case, out = sys.argv[1], sys.argv[2]
ps.init()
r, w = ps.rank(), ps.size()
PER = 4  # examples per rank and step
ce = torch.nn.functional.cross_entropy


def save(**kv):
    torch.save(kv, out % r)


def params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Clip(torch.nn.Module):
    """A conv in channels_last and a linear layer (clip case)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.conv = torch.nn.Conv2d(2, 3, 3).to(memory_format=torch.channels_last)
        self.fc = torch.nn.Linear(3 * 6 * 6, 3)

    def forward(self, x):
        x = self.conv(x.to(memory_format=torch.channels_last))
        return self.fc(torch.relu(x).flatten(1))


class Parts(torch.nn.Module):
    """a: always used; b: used by rank 0 only; never: unused; c: frozen for
    the first steps, then trained (nones case)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(9)
        self.a = torch.nn.Linear(6, 3)
        self.b = torch.nn.Linear(6, 3)
        self.never = torch.nn.Linear(6, 3)
        self.c = torch.nn.Linear(6, 3)

    def forward(self, x, use_b):
        return self.a(x) + self.c(x) + (self.b(x) if use_b else 0)


if case == "clip":
    model = Clip()
    opt = ps.torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), model.named_parameters())
    ps.torch.broadcast_parameters(model.state_dict())
    first = None
    for t in range(6):
        x, y = slice_of(global_batch(t, w * PER, (2, 8, 8)), r, PER)
        opt.zero_grad()
        ce(model(x), y).backward()
        if first is None:  # the mean, as backward() left it
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        opt.step()
    save(params=params(model), first=first,
         cl=model.conv.weight.is_contiguous(memory_format=torch.channels_last)
         and not model.conv.weight.is_contiguous())

elif case == "syncbn":
    model = ps.torch.convert_sync_batchnorm(cnn_bn(3))
    kinds = sorted({type(m).__name__ for m in model.modules()})
    opt = ps.torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model.named_parameters())
    ps.torch.broadcast_parameters(model.state_dict())
    for t in range(6):
        x, y = slice_of(global_batch(t, w * PER, (1, 8, 8)), r, PER)
        opt.zero_grad()
        ce(model(x), y).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        evals = model(global_batch(99, 8, (1, 8, 8))[0])
    save(params=params(model), kinds=kinds, evals=evals)

elif case == "buffers":
    model = cnn_bn(3)
    control = torch.nn.BatchNorm1d(6)  # no broadcast: its buffers must differ
    opt = ps.torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model.named_parameters())
    ps.torch.broadcast_parameters(model.state_dict())
    ps.torch.broadcast_buffers(model)
    seen = []  # the buffers each forward started from
    model.register_forward_pre_hook(
        lambda m, i: seen.append(m[1].running_mean.clone()))
    for t in range(6):
        x, y = slice_of(global_batch(t, w * PER, (1, 8, 8)), r, PER)
        opt.zero_grad()
        ce(model(x), y).backward()
        opt.step()
        control(slice_of(global_batch(t, w * PER), r, PER)[0])
    model.eval()
    with torch.no_grad():
        evals = model(global_batch(99, 8, (1, 8, 8))[0])
    save(params=params(model), control=params(control), seen=seen, evals=evals)

elif case == "uneven":
    # rank 1 runs 5 steps more than rank 0, without join
    model = small(1)
    opt = ps.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        model.named_parameters())
    ps.torch.broadcast_parameters(model.state_dict())
    for t in range(4 + 5 * r):
        x, y = slice_of(global_batch(t, w * PER), r, PER)
        opt.zero_grad()
        ce(model(x), y).backward()
        opt.step()
    with open(out % r + ".done", "w") as f:
        f.write(str(time.time()))
    ps.shutdown()
    save(error=None)

elif case == "join":
    # rank 0 has 7 batches, rank 1 has 4: rank 1 joins. Two models under
    # one optimizer: an MLP (compared with single-process torch) and a CNN
    # with BatchNorm whose buffers broadcast_buffers keeps equal.
    mlp, bn = small(1), cnn_bn(3)
    model = torch.nn.ModuleDict({"mlp": mlp, "bn": bn})
    opt = ps.torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model.named_parameters())
    ps.torch.broadcast_parameters(model.state_dict())
    ps.torch.broadcast_buffers(model)
    steps = 7 - 3 * r
    for t in range(steps):
        x, y = slice_of(global_batch(t, w * PER), r, PER)
        xi, yi = slice_of(global_batch(50 + t, w * PER, (1, 8, 8)), r, PER)
        opt.zero_grad()
        (ce(mlp(x), y) + ce(bn(xi), yi)).backward()
        opt.step()
    last = ps.torch.join()
    # a next epoch after join: every rank trains again, evenly
    x, y = slice_of(global_batch(20, w * PER), r, PER)
    xi, yi = slice_of(global_batch(70, w * PER, (1, 8, 8)), r, PER)
    opt.zero_grad()
    (ce(mlp(x), y) + ce(bn(xi), yi)).backward()
    opt.step()
    save(params=params(model), last=last, steps=steps)

elif case == "nones":
    # zero_grad(set_to_none=True) and AdamW: `never` (no rank uses it) must
    # not move; b (rank 0 only) gets the mean with zeros; c is frozen for
    # steps 0-2 and trained after, as on one process
    model = Parts()
    start = params(model)
    opt = ps.torch.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1),
        model.named_parameters())
    ps.torch.broadcast_parameters(model.state_dict())
    grads_none = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(6):
            model.c.weight.requires_grad_(t >= 3)
            model.c.bias.requires_grad_(t >= 3)
            x, y = slice_of(global_batch(t, w * PER), r, PER)
            opt.zero_grad(set_to_none=True)
            ce(model(x, use_b=(r == 0)), y).backward()
            grads_none.append({n: p.grad is None for n, p in model.named_parameters()})
            opt.step()
    save(params=params(model), start=start, grads_none=grads_none,
         warnings=[str(m.message) for m in caught])

elif case == "state":
    # optimizer state loaded before wrapping is kept; then no_sync
    # accumulation: 2 micro-batches inside no_sync, the 3rd outside
    model = small(2)
    pre = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for t in range(2):  # the same on every rank: a checkpoint of a run before
        x, y = global_batch(200 + t, PER)
        pre.zero_grad()
        ce(model(x), y).backward()
        pre.step()
    ckpt = pre.state_dict()
    fresh = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fresh.load_state_dict(ckpt)
    opt = ps.torch.DistributedOptimizer(fresh, model.named_parameters())
    kept = {i: opt.state[p]["momentum_buffer"].clone()
            for i, p in enumerate(model.parameters()) if p in opt.state}
    for t in range(3):
        opt.zero_grad()
        for m in range(3):
            x, y = slice_of(global_batch(10 * t + m, w * PER), r, PER)
            if m < 2:
                with opt.no_sync():
                    ce(model(x), y).backward()
            else:
                ce(model(x), y).backward()
        opt.step()
    save(params=params(model), kept=kept)

elif case == "shard":
    # a shard-side optimizer (--optimizer momentum): what it cannot honour
    # is refused, naming it
    errors = {}
    model = small(4)
    try:
        groups = [{"params": [model[0].weight, model[0].bias], "weight_decay": 0.1},
                  {"params": [model[2].weight, model[2].bias], "weight_decay": 0.0}]
        ps.torch.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1, momentum=0.9),
                                      model.named_parameters())
        errors["groups"] = None
    except ValueError as e:
        errors["groups"] = str(e)
    opt = ps.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                        momentum=0.9),
                                        model.named_parameters())
    for label in ("clip", "lr"):
        x, y = slice_of(global_batch(0, w * PER), r, PER)
        opt.zero_grad()
        ce(model(x), y).backward()
        if label == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-4)
        else:
            opt.param_groups[0]["lr"] = 0.05
        try:
            opt.step()
            errors[label] = None
        except ps.PSError as e:
            errors[label] = str(e)
    save(errors=errors)

elif case == "misc":
    # allreduce mode: the other calls of Horovod and DDP users
    got = {}
    got["sizes"] = (ps.local_rank(), ps.local_size(), ps.cross_rank(), ps.cross_size())
    got["var"] = ps.torch.allgather(torch.arange(2 + 3 * r, dtype=torch.int64).reshape(-1, 1)
                                    .repeat(1, 2) + 100 * r)
    got["same"] = ps.torch.allgather(torch.full((2, 2), float(r)))
    got["objects"] = ps.torch.allgather_object({"rank": r, "text": "x" * (5 + 40 * r)})
    errors = {}
    try:
        ps.torch.allgather(torch.zeros(2, 3 if r == 0 else 4))
        errors["trail"] = None
    except ValueError as e:
        errors["trail"] = str(e)
    # a parameter frozen when the optimizer is built, trained later: refused
    model = small(6)
    model[0].weight.requires_grad_(False)
    opt = ps.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        model.named_parameters())
    model[0].weight.requires_grad_(True)
    x, y = global_batch(0, PER)
    try:
        ce(model(x), y).backward()
        errors["unfreeze"] = None
    except RuntimeError as e:
        errors["unfreeze"] = str(e)
    # a sparse gradient: refused, naming the parameter
    emb = torch.nn.Embedding(10, 3, sparse=True)
    eopt = ps.torch.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                         [("emb.weight", emb.weight)])
    try:
        emb(torch.tensor([1, 2])).sum().backward()
        errors["sparse"] = None
    except (TypeError, ps.PSError) as e:
        errors["sparse"] = str(e)
    # last: a mismatched collective fails every rank, and every rank can
    # still shut down cleanly
    try:
        ps.torch.allreduce(torch.ones(3 + r))
        errors["mismatch"] = None
    except ps.PSError as e:
        errors["mismatch"] = str(e)
    save(got=got, errors=errors)

else:
    raise SystemExit(f"unknown case {case}")

ps.shutdown()
with open(out % r + ".clean", "w") as f:
    f.write("shutdown returned")
