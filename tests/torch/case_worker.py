"""Worker of the multi-rank ps.torch tests: runs one named case and prints
`RESULT ...` lines the test reads (or dies the way the case says).
   case_worker.py CASE OUT"""
import os
import signal
import sys
import warnings

import torch

import ps
import ps.torch
from model import TYPED, typed_input

case, out = sys.argv[1], sys.argv[2]


def result(**kv):
    torch.save(kv, out % ps.rank())


def net(seed, hidden=8):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 3))


def data(rank):
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


ps.init()
r = ps.rank()

if case == "broadcast":
    # diverged ranks, then broadcast_parameters / broadcast_optimizer_state
    model = net(50 + r)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = data(r)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()  # local step: momentum buffers differ per rank
    ps.torch.broadcast_parameters(model.state_dict(), root_rank=1)
    ps.torch.broadcast_optimizer_state(opt, root_rank=1)
    buf = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    obj = ps.torch.broadcast_object({"rank": r, "list": [r] * 3}, root_rank=1)
    result(params=model.state_dict(), momentum=buf, obj=obj)

elif case == "unused":
    # a parameter only rank 0 uses, and one nobody uses
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(6, 3)
            self.b = torch.nn.Linear(6, 3)
            self.never = torch.nn.Linear(6, 3)

        def forward(self, x, use_b):
            return self.a(x) + (self.b(x) if use_b else 0)
    torch.manual_seed(3)
    model = M()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    opt = ps.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                        model.named_parameters())
    x, y = data(r)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x, use_b=(r == 0)), y)
        # this rank's own gradient (autograd.grad fires no hook)
        own_b = torch.autograd.grad(loss, model.b.weight, retain_graph=True)[0] if r == 0 \
            else torch.zeros(3, 6)
        loss.backward()
        after_b = model.b.weight.grad.clone()  # the mean, when backward() returns
        never_grad = model.never.weight.grad
        opt.step()
    result(start=start, params=model.state_dict(), own_b=own_b, after_b=after_b,
           never_grad=never_grad, warnings=[str(w.message) for w in caught])

elif case in ("differ", "differ-order"):
    hidden = 8 if r == 0 else 9
    model = net(1, hidden=hidden if case == "differ" else 8)
    named = list(model.named_parameters())
    if case == "differ-order" and r == 1:
        named = [(n + "_renamed", p) for n, p in named]
    try:
        ps.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named)
        result(error=None)
    except ps.LayoutError as e:
        result(error=str(e), kind=type(e).__name__)

elif case == "pushpull":
    # a custom loop: tensor-level push_pull (ps: declared on the shards) and
    # allreduce (the ring, both modes)
    a = torch.full((5,), float(r + 1))
    b = torch.arange(3000, dtype=torch.float32) * (r + 1)
    if ps.sync_mode() == "ps":
        ps.torch.declare([("a", a), ("b", b)])
    got = []
    for step in range(3):
        a2, b2 = a * (step + 1), b * (step + 1)
        ps.torch.push_pull(a2, name="a")
        ps.torch.push_pull(b2, average=False, name="b")
        got.append((a2.clone(), b2.clone()))
    try:
        ps.torch.push_pull(torch.zeros(2), name="c")
        undeclared = None
    except ps.PSError as e:
        undeclared = str(e)
    summed = ps.torch.allreduce(torch.full((4,), float(r)), average=False)
    result(got=got, undeclared=undeclared, summed=summed)

elif case == "gil":
    # while rank 1 waits for rank 0 in libps's all-reduce, another Python
    # thread of rank 1 must keep running. The event: that thread counts
    # SPIN iterations while rank 1 is in the call (far more than one GIL
    # switch interval before the call could give it) and says so in a
    # file; only then does rank 0 join (waiting 60 s at most), so rank 1
    # surely waited. A libps call that held the GIL would stop the thread:
    # no file, and rank 0 reports it never saw one.
    import threading
    import time
    SPIN = 1000000
    spun = out % 1 + ".spun"
    count = [0]
    waiting = [None]  # count when rank 1 entered the all-reduce
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1
            if waiting[0] is not None and count[0] - waiting[0] == SPIN:
                with open(spun + ".tmp", "w") as f:
                    f.write(str(count[0] - waiting[0]))
                os.rename(spun + ".tmp", spun)
    t = threading.Thread(target=spin)
    t.start()
    saw_spin = None
    if r == 0:
        deadline = time.monotonic() + 60
        while not os.path.exists(spun) and time.monotonic() < deadline:
            time.sleep(0.01)
        saw_spin = os.path.exists(spun)
    else:
        waiting[0] = count[0]
    before = count[0]
    value = ps.torch.allreduce(torch.ones(1000), average=False)
    during = count[0] - before
    stop.set()
    t.join()
    result(during=during, value=value, saw_spin=saw_spin)

elif case == "collectives":
    # every rank's inputs are known to all: the test compares with torch
    def mine(q, shape, dtype=torch.float32):
        g = torch.Generator().manual_seed(100 + q)
        return torch.randint(-50, 50, shape, generator=g).to(dtype)
    got = {
        "allgather": ps.torch.allgather(mine(r, (3, 5))),
        "allgather_int": ps.torch.allgather(mine(r, (7,), torch.int64)),
        "reduce_scatter": {op: ps.torch.reduce_scatter(mine(r, (4, 3)), op=op)
                           for op in ("average", "sum", "max", "min")},
        "reduce": {root: ps.torch.reduce(mine(r, (1001,)), root_rank=root, op="sum")
                   for root in range(ps.size())},
        "alltoall": ps.torch.alltoall(mine(r, (6, 2), torch.float64)),
        "empty": ps.torch.allgather(torch.empty(0)),
    }
    # the reductions on every other dtype, small (rank-order sums) and large
    # (the ring's chunks): the test redoes them with torch's own arithmetic
    got["typed"] = {}
    for dt in TYPED:
        for n in (1002, 300002):
            x = typed_input(r, dt, n)
            got["typed"][(str(dt), n)] = {
                "allreduce": {op: ps.torch.allreduce(x, op=op)
                              for op in ("sum", "average", "max", "min")},
                "reduce_scatter": ps.torch.reduce_scatter(x, op="sum"),
                "reduce": ps.torch.reduce(x, root_rank=1, op="max"),
                "avg_inplace": ps.torch.allreduce_(x.clone()),
            }
    # between the two ranks: one way, the other way (int64), then both at
    # once with tensors larger than the socket buffers
    other = 1 - r
    if r == 0:
        ps.torch.send(mine(0, (5, 3)), dst=1)
        got["recv_int"] = torch.zeros(9, dtype=torch.int64)
        got["recv_from"] = ps.torch.recv(got["recv_int"], src=1)
    else:
        got["recv"] = torch.zeros(5, 3)
        got["recv_from"] = ps.torch.recv(got["recv"], src=0)
        ps.torch.send(mine(1, (9,), torch.int64), dst=0)
    big_in = torch.zeros(3 << 20)
    handles = [ps.torch.isend(mine(r, (3 << 20,)), dst=other),
               ps.torch.irecv(big_in, src=other)]
    got["big"] = [h.wait() for h in handles][1]
    errors = {}
    for label, call in (("split", lambda: ps.torch.reduce_scatter(torch.ones(3))),
                        ("alltoall-split", lambda: ps.torch.alltoall(torch.ones(5, 2))),
                        ("op", lambda: ps.torch.reduce(torch.ones(2), op="mean")),
                        ("root", lambda: ps.torch.reduce(torch.ones(2), root_rank=2)),
                        ("dtype", lambda: ps.torch.reduce_scatter(torch.ones(4).bool())),
                        ("dtype-allreduce",
                         lambda: ps.torch.allreduce(torch.ones(4, dtype=torch.complex64))),
                        ("self", lambda: ps.torch.send(torch.ones(2), dst=r)),
                        ("peer", lambda: ps.torch.recv(torch.ones(2), src=2)),
                        ("strided", lambda: ps.torch.send(torch.ones(4, 4).t(), dst=1 - r))):
        try:
            call()
            errors[label] = None
        except (TypeError, ValueError) as e:
            errors[label] = f"{type(e).__name__}: {e}"
    # and the ring still works after the refusals (nothing was sent)
    got["after"] = ps.torch.allreduce(torch.ones(3), average=False)
    result(got=got, errors=errors)

elif case == "zero":
    # the same model and data trained with the whole optimizer state and with
    # 1/W of it (shard_optimizer_state), SGD with momentum and Adam
    out_params, state, errors = {}, {}, {}
    for kind in ("sgd", "adam"):
        for sharded in (False, True):
            model = net(60, hidden=37)  # odd sizes: chunks with padding
            make = (lambda ps_: torch.optim.SGD(ps_, lr=0.1, momentum=0.9)) if kind == "sgd" \
                else (lambda ps_: torch.optim.Adam(ps_, lr=0.01))
            opt = ps.torch.DistributedOptimizer(make(model.parameters()),
                                                model.named_parameters(), bucket_bytes=200,
                                                shard_optimizer_state=sharded)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            for step in range(8):
                x, y = data(r * 100 + step)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                sched.step()
            out_params[(kind, sharded)] = {k: v.clone() for k, v in model.state_dict().items()}
            state[(kind, sharded)] = opt.state_bytes()
            if sharded:
                try:
                    opt.state_dict()
                    errors[kind] = None
                except ps.PSError as e:
                    errors[kind] = str(e)
    try:
        model = net(60)
        groups = [{"params": [model[0].weight]}, {"params": [model[0].bias], "lr": 0.5}]
        ps.torch.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1), shard_optimizer_state=True)
        errors["groups"] = None
    except ValueError as e:
        errors["groups"] = str(e)
    result(params=out_params, state=state, errors=errors)

elif case in ("kill", "lost-shard"):
    # kill: rank 1 dies (SIGKILL) in the middle of step 3; the others must
    # fail. lost-shard: train until the test kills a shard.
    model = net(1)
    opt = ps.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        model.named_parameters())
    x, y = data(r)
    for step in range(10**6 if case == "lost-shard" else 1000):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if case == "kill" and step == 3 and r == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        with open(out % r + ".step", "w") as f:
            f.write(str(step))
        opt.step()
    result(error=None)  # not reached: ps.RetryableError / PSError is uncaught

ps.shutdown()
