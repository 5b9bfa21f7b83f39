"""Worker of tests/torch/test_pipeline.py: one rank of a pipeline job
(ps.torch.pipeline) running one case; it trains STEPS steps and saves its
blocks' parameters for the test's single-process reference, or (case
errors) checks the errors, printing `ok: ...` per check.
   pipe_worker.py CASE OUT"""
import os
import sys
import time

import torch

import ps
from worker_checks import check, raises
import ps.torch
from ps.torch import pipeline
from pipe_model import BLOCKS, Chain, blocks, loss_fn, optimizer, step_batch

# case: (schedule, pp, chunks per rank, tied, ZeRO-1, optimizer)
CASES = {
    "gpipe": ("gpipe", 2, 1, False, False, "sgd"),
    "1f1b": ("1f1b", 2, 1, False, False, "sgd"),
    "interleaved": ("interleaved", 2, 2, False, False, "sgd"),
    "interleaved-one": ("interleaved", 1, 2, False, False, "sgd"),
    "zbh1": ("zbh1", 2, 1, False, False, "sgd"),
    "one": ("1f1b", 1, 1, False, False, "sgd"),
    "pp4": ("1f1b", 4, 1, False, False, "sgd"),
    "dp": ("1f1b", 2, 1, False, False, "sgd"),
    "tied": ("gpipe", 2, 1, True, False, "sgd"),
    "tied-zero": ("1f1b", 2, 1, True, True, "adam"),
    "tied-zero8": ("1f1b", 4, 1, True, True, "adam"),
}
SCHEDULES = {"gpipe": pipeline.ScheduleGPipe, "1f1b": pipeline.Schedule1F1B,
             "interleaved": pipeline.ScheduleInterleaved1F1B, "zbh1": pipeline.ScheduleZBH1}
STEPS, M, MB = 5, 4, 2  # steps, micro-batches, examples per micro-batch

case, out = sys.argv[1], sys.argv[2]
ps.init()
r = ps.rank()


def build(kind, pp, v, tied, grid):
    """This rank's stages (their blocks) and the schedule."""
    bs = blocks(tied)
    n = pp * v
    per = BLOCKS // n
    mine = [grid.pp_rank + c * pp for c in range(v)]  # its (virtual) stages
    stages, held = [], []
    for s in mine:
        idx = list(range(s * per, (s + 1) * per))
        held += idx
        stages.append(pipeline.PipelineStage(Chain([bs[i] for i in idx]), s, n,
                                             group=grid.pp_group))
    if kind == "interleaved":
        sched = SCHEDULES[kind](stages, M, loss_fn)
    else:
        sched = SCHEDULES[kind](stages[0], M, loss_fn)
    return bs, held, stages, sched


def train():
    kind, pp, v, tied, zero, okind = CASES[case]
    grid = ps.torch.grid(pp=pp)
    bs, held, stages, sched = build(kind, pp, v, tied, grid)
    if tied:  # the embedding (first stage) and the output layer (last), per replica
        last = pp - 1
        groups = [ps.torch.new_group([d + grid.dp * 0, d + grid.dp * last])
                  for d in range(grid.dp)]
        if 0 in held:
            pipeline.tie(bs[0].E, groups[grid.dp_rank])
        if BLOCKS - 1 in held:
            pipeline.tie(bs[-1].E, groups[grid.dp_rank])
    named = [(f"b{i}.{n}", p) for i in held for n, p in bs[i].named_parameters()]
    opt = optimizer([p for _, p in named], okind)
    if grid.dp > 1:
        opt = ps.torch.DistributedOptimizer(opt, named, group=grid.dp_group,
                                            shard_optimizer_state=zero)
    first = any(s.is_first for s in stages)
    lastst = any(s.is_last for s in stages)
    losses = []
    per_replica = M * MB
    started = time.monotonic()
    for step in range(STEPS):
        x, y = step_batch(step, grid.dp * per_replica, tied)
        lo, hi = grid.dp_rank * per_replica, (grid.dp_rank + 1) * per_replica
        opt.zero_grad()
        args = (x[lo:hi],) if first else ()
        if lastst:
            got = sched.step(*args, target=y[lo:hi], losses=losses)
            check(got is not None and got.shape[0] == per_replica,
                  f"step {step}: the last stage returns the batch's output "
                  f"{tuple(got.shape) if got is not None else None}")
        else:
            check(sched.step(*args) is None, f"step {step}: step() returns None off the last "
                  "stage")
        opt.step()
    print(f"rank {r}: {STEPS} steps in {time.monotonic() - started:.2f} s; at most "
          f"{sched.peak_activations} micro-batches' activations held", flush=True)
    if lastst:
        check(len(losses) == STEPS * M and all(torch.isfinite(t) for t in losses),
              f"{len(losses)} losses appended, one per micro-batch")
    torch.save({"held": held, "params": {i: bs[i].state_dict() for i in held},
                "losses": [t.item() for t in losses],
                "peak": sched.peak_activations, "pp_rank": grid.pp_rank}, out % r)


def errors():
    """W=2, pp=2 (allreduce mode): a rank not in the group, a batch that
    n_microbatches does not divide, then a stage output that changes shape
    after the first step (the last check: the pipeline group is aborted)."""
    g = ps.torch.new_group([0])
    if r == 1:
        raises(ps.PSError, lambda: pipeline.PipelineStage(Chain(blocks()[:2]), 0, 1, group=g),
               "PipelineStage", "rank 1", "not in the group", "[0]")
        raises(ps.PSError, lambda: pipeline.tie(blocks()[0].mix.weight, g), "tie on group",
               "rank 1", "not in the group", "[0]")
    grid = ps.torch.grid(pp=2)
    bs, held, stages, sched = build("1f1b", 2, 1, False, grid)
    if r == 0:
        raises(ValueError, lambda: pipeline.PipelineStage(Chain(bs[:2]), 1, 2,
                                                          group=grid.pp_group),
               "stage 1", "pipeline rank 1", "this is pipeline rank 0")
        raises(ValueError, lambda: pipeline.ScheduleInterleaved1F1B([stages[0]], 3, loss_fn),
               "ScheduleInterleaved1F1B")
    opt = optimizer([p for i in held for p in bs[i].parameters()], "sgd")
    losses = []
    for step in range(3):
        x, y = step_batch(step, M * MB)
        opt.zero_grad()
        if r == 0:
            if step == 0:
                raises(ValueError, lambda: sched.step(x[:7]), "batch of 7",
                       "n_microbatches=4")
                raises(ValueError, lambda: sched.step(), "stage 0 takes the batch")
                raises(ValueError, lambda: sched.step(x[:0]), "batch of 0",
                       "n_microbatches=4")
            if step == 2:  # micro-batches of 3 examples instead of 2
                t0 = time.monotonic()
                raises(pipeline.PipeliningShapeError,
                       lambda: sched.step(step_batch(step, 12)[0]),
                       "pipeline stage 0", "micro-batch 0", "step 2", "(3, 8)", "(2, 8)")
                check(True, f"the sender raised within {time.monotonic() - t0:.2f} s")
                # (alive until the peer has checked: the abort carries the
                # message; a sender that exits first is named as lost instead)
                deadline = time.monotonic() + 60
                while not os.path.exists(out % 1 + ".done") and time.monotonic() < deadline:
                    time.sleep(0.05)
                return
            sched.step(x)
        else:
            if step == 2:
                t0 = time.monotonic()
                raises(ps.PSError, lambda: sched.step(target=y, losses=losses),
                       "Schedule1F1B", "pipeline rank 1", "micro-batch 0", "(3, 8)", "(2, 8)",
                       "PipeliningShapeError")
                check(time.monotonic() - t0 < 30,
                      f"the receiving stage failed within {time.monotonic() - t0:.2f} s "
                      "instead of waiting forever")
                open(out % 1 + ".done", "w").close()
                return
            sched.step(target=y, losses=losses)
        opt.step()
        check(True, f"step {step} done after the refused calls")


def gil():
    """W=2, pp=2: while the last stage waits in libps for its first
    activations, another Python thread of its process keeps running. The
    event: that thread counts SPIN iterations after the stage entered
    step() and says so in a file; only then does stage 0 send (waiting 60 s
    at most), so the last stage surely waited. A wait that held the GIL
    would stop the thread: no file, and stage 0 says it never saw one."""
    import threading
    SPIN = 1000000
    spun = out % 1 + ".spun"
    grid = ps.torch.grid(pp=2)
    bs, held, stages, sched = build("gpipe", 2, 1, False, grid)
    x, y = step_batch(0, M * MB)
    if r == 0:
        deadline = time.monotonic() + 60
        while not os.path.exists(spun) and time.monotonic() < deadline:
            time.sleep(0.01)
        check(os.path.exists(spun), "the last stage's other thread ran while it waited in "
              "step() (the file it writes after 1e6 iterations exists)")
        sched.step(x)
        return
    count, stop = [0], threading.Event()
    waiting = [None]

    def spin():
        while not stop.is_set():
            count[0] += 1
            if waiting[0] is not None and count[0] - waiting[0] == SPIN:
                with open(spun + ".tmp", "w") as f:
                    f.write(str(SPIN))
                os.rename(spun + ".tmp", spun)
    t = threading.Thread(target=spin)
    t.start()
    waiting[0] = count[0]
    before = count[0]
    sched.step(target=y, losses=[])
    during = count[0] - before
    stop.set()
    t.join()
    check(during >= SPIN, f"the other thread ran {during} iterations during step() (the "
          "GIL is released while libps waits)")


if case == "gil":
    gil()
    ps.shutdown()
    sys.exit(0)
if case == "errors":
    errors()
    sys.stdout.flush()
    os._exit(0)  # (the pipeline group was aborted on purpose: no orderly shutdown)
train()
ps.shutdown()
