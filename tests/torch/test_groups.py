"""Groups and the grid of ps.torch (issue 33, item 1) with W=4 real workers
(group_worker.py), allreduce mode unless said:
   test_groups.py CASE
 collectives  new_group([0, 2]), new_group([1, 3]) and new_group([2, 0])
              (reversed: job rank 2 is group rank 0): every collective and
              send/recv with group= against values computed from the
              members' job ranks, the two groups at once; the whole job
              after them; a rank calling on a group it is not in gets a
              PSError (a RuntimeError) naming it and the group
 grid         grid(tp, pp) for (2,1), (2,2), (1,2), (1,1), (4,1): Megatron's
              coordinates and groups, an allreduce on each group; tp not
              dividing W, pp=0, a float refused naming them
 errors       new_group's bad lists (duplicates, out of range, not ints),
              ranks passing different lists or grid settings (every rank
              fails naming both),
              bad roots and peers of a group; the ring works after them
 optimizer    DistributedOptimizer(group=grid(pp=2).dp_group): two stages with
              their own model (the same names), replicas started apart and
              made equal by broadcast_parameters(group=), 4 steps of SGD with
              momentum: every rank equals a single-process reference of its
              stage's two replicas averaged, within 1e-6
 zero         the same with shard_optimizer_state=True (ZeRO-1 over the
              group) and Adam
 optimizer-ps the optimizer case in sync mode ps (2 shards, --optimizer sum):
              each stage's buckets are keys of their own (owned by its
              replicas, named after them) on the shards
 momentum-ps  the same with the shards stepping (--optimizer momentum, lr 0.1,
              momentum 0.9, as the reference)
 uneven       DistributedOptimizer over grid(pp=2).dp_group, rank 3 stops a step
              early: ranks 2 and 3 fail with PSError naming join and both
              (by job rank; their group's round header), within the test's
              time
 overlap-ps   sync mode ps, rank 3 builds its optimizer over a group that
              overlaps rank 2's: every rank raises PSError naming both,
              before anything is declared"""
import sys
import time

import harness
from harness import check, Job

harness.require_torch()
import torch  # noqa: E402
from model import group_model, group_step_data  # noqa: E402

case = sys.argv[1]
W = 4
sync = "ps" if case.endswith("-ps") else "allreduce"


def reference(stage, zero):
    """Stage `stage` trained on one process: the mean of its two replicas'
    gradients (job ranks 2 * stage and 2 * stage + 1), 4 steps."""
    model = group_model(stage)
    if zero:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    replicas = [2 * stage, 2 * stage + 1]
    for step in range(4):
        grads = []
        for q in replicas:
            model.zero_grad()
            x, y = group_step_data(stage, q, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = sum(gs) / len(gs)
        opt.step()
    return model.state_dict()


with Job(f"groups-{case}") as job:
    if sync == "ps":
        job.start_shards(2, W, *(["--optimizer", "momentum", "--lr", "0.1", "--momentum", "0.9"]
                                 if case == "momentum-ps" else ["--optimizer", "sum"]))
    out = job.path("r%d.pt")
    started = time.monotonic()
    job.start_workers("group_worker.py", W, sync, [case, out],
                      env={"PS_PEER_TIMEOUT_MS": "5000"})
    codes = job.wait_workers(120)
    took = time.monotonic() - started
    job.workers_passed(codes)
    if case in ("optimizer", "zero", "optimizer-ps", "momentum-ps"):
        res = [torch.load(out % r) for r in range(W)]
        for stage in range(2):
            want = reference(stage, case == "zero")
            for r in (2 * stage, 2 * stage + 1):
                check(res[r]["stage"] == stage, f"rank {r} is in stage {stage}")
                for name, w in want.items():
                    got = res[r]["params"][name]
                    err = (got - w).abs().max().item()
                    check(got.shape == w.shape and err <= 1e-6,
                          f"rank {r} (stage {stage}): {name} equals the reference of its "
                          f"stage's replicas averaged (max error {err:.1e})")
            moved = max((want[n] - v).abs().max().item()
                        for n, v in group_model(stage).state_dict().items())
            check(moved > 1e-3, f"stage {stage}: the parameters moved ({moved:.3f})")
    print(f"case {case}: {took:.1f} s", flush=True)
