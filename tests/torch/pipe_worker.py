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
import ps.torch
from ps.torch import pipeline
from pipe_model import BLOCKS, Chain, blocks, loss_fn, optimizer, step_batch

# case: (schedule, pp, chunks per rank, tied, ZeRO-1, optimizer)
CASES = {
    "gpipe": ("gpipe", 2, 1, False, False, "sgd"),
    "1f1b": ("1f1b", 2, 1, False, False, "sgd"),
    "interleaved": ("interleaved", 2, 2, False, False, "sgd"),
    "zbh1": ("zbh1", 2, 1, False, False, "sgd"),
    "one": ("1f1b", 1, 1, False, False, "sgd"),
    "dp": ("1f1b", 2, 1, False, False, "sgd"),
    "tied": ("gpipe", 2, 1, True, False, "sgd"),
    "tied-zero": ("1f1b", 2, 1, True, True, "adam"),
}
SCHEDULES = {"gpipe": pipeline.ScheduleGPipe, "1f1b": pipeline.Schedule1F1B,
             "interleaved": pipeline.ScheduleInterleaved1F1B, "zbh1": pipeline.ScheduleZBH1}
STEPS, M, MB = 5, 4, 2  # steps, micro-batches, examples per micro-batch

case, out = sys.argv[1], sys.argv[2]
ps.init()
r = ps.rank()


def check(cond, msg):
    if not cond:
        print(f"FAIL rank {r}: {msg}", flush=True)
        sys.exit(1)
    print(f"ok: {msg}", flush=True)


def raises(kind, fn, *words):
    try:
        fn()
    except kind as e:
        msg = str(e)
        missing = [w for w in words if w not in msg]
        check(not missing, f"{kind.__name__} naming {words} (missing {missing}): {msg}")
        return msg
    except Exception as e:  # noqa: BLE001 (report what came instead)
        check(False, f"expected {kind.__name__}, got {type(e).__name__}: {e}")
    check(False, f"expected {kind.__name__}, nothing raised")


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
    print(f"rank {r}: {STEPS} steps in {time.monotonic() - started:.2f} s", flush=True)
    if lastst:
        check(len(losses) == STEPS * M and all(torch.isfinite(t) for t in losses),
              f"{len(losses)} losses appended, one per micro-batch")
    torch.save({"held": held, "params": {i: bs[i].state_dict() for i in held},
                "losses": [t.item() for t in losses]}, out % r)


def errors():
    """W=2, pp=2 (allreduce mode): a rank not in the group, a batch that
    n_microbatches does not divide, then a stage output that changes shape
    after the first step (the last check: the pipeline group is aborted)."""
    g = ps.torch.new_group([0])
    if r == 1:
        raises(ps.PSError, lambda: pipeline.PipelineStage(Chain(blocks()[:2]), 0, 1, group=g),
               "PipelineStage", "rank 1", "not in the group", "[0]")
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


if case == "errors":
    errors()
    sys.stdout.flush()
    os._exit(0)  # (the pipeline group was aborted on purpose: no orderly shutdown)
train()
ps.shutdown()
