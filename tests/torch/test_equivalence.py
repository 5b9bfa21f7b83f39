"""2 workers through ps.torch equal single-process PyTorch on the 2x batch
after 20+ steps, within 1e-5 relative, in the three ways a step can go:
shards in sum mode (the local SGD with momentum steps), a shard-side SGD
with momentum, and the ring (allreduce mode). The workers start from
different random parameters, so this also proves that ps.torch makes them
equal first (rank 0's)."""
import sys

import harness
from harness import check, Job

harness.require_torch()
harness.require_dataset()
import torch  # noqa: E402

from model import mlp, batches  # noqa: E402

STEPS, BATCH, LR, MOMENTUM = 25, 16, 0.1, 0.9


def reference():
    torch.manual_seed(100)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loss_fn = torch.nn.CrossEntropyLoss()
    for x, y in batches(harness.DATA, STEPS, 2 * BATCH):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return model.state_dict()


def run(case, mode, shard_args):
    with Job(case) as job:
        if mode == "ps":
            job.start_shards(2, 2, *shard_args)
        out = job.path("out%d.pt")
        job.start_workers("equiv_worker.py", 2, mode,
                          [out, str(STEPS), str(BATCH), str(LR), str(MOMENTUM)])
        codes = job.wait_workers(120)
        for r, c in enumerate(codes):
            check(c == 0, f"{case}: worker {r} exited {c}" + ("" if c == 0 else ": "
                  + job.log(f"worker-{r}.log")))
        return [torch.load(out % r) for r in range(2)]


def rel(a, b):
    return (a - b).norm().item() / max(b.norm().item(), 1e-30)


ref = reference()
torch.manual_seed(100)
init = mlp().state_dict()
check(all(rel(init[n], ref[n]) > 1e-3 for n in ref), "the reference moved away from its start")
cases = [
    ("sum", "ps", ["--optimizer", "sum"]),
    ("shard-momentum", "ps", ["--optimizer", "momentum", "--lr", str(LR),
                              "--momentum", str(MOMENTUM)]),
    ("ring", "allreduce", []),
]
only = sys.argv[1:] or [c[0] for c in cases]
for case, mode, args in cases:
    if case not in only:
        continue
    got = run(case, mode, args)
    for name, want in ref.items():
        e0, e1 = rel(got[0][name], want), rel(got[1][name], want)
        check(e0 <= 1e-5 and e1 <= 1e-5,
              f"{case}: {name} after {STEPS} steps: relative error {e0:.2e} (rank 0), "
              f"{e1:.2e} (rank 1) <= 1e-5")
