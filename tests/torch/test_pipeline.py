"""ps.torch.pipeline (issue 33, Deliver 2 and its tests in 5) with real
worker processes (pipe_worker.py) on 127.0.0.1:
   test_pipeline.py CASE SYNC     (SYNC: ring = allreduce mode, sum = ps mode
                                   with 2 shards running --optimizer sum,
                                   momentum = the shards stepping)
 gpipe, 1f1b   pp=2 (W=2) with ScheduleGPipe / Schedule1F1B
 interleaved   pp=2 with 2 stages per rank (ScheduleInterleaved1F1B, 4 virtual
               stages); interleaved-one: pp=1 with 2 stages (W=1: libps's list
               has no sends, the stages hand on in the process)
 zbh1          pp=2 with ScheduleZBH1 (the backward split in two halves)
 one           pp=1 (W=1): the one stage is first and last
 pp4           pp=4 (W=4) with Schedule1F1B: two stages in the middle
 dp            pp=2 x dp=2 (W=4), DistributedOptimizer(group=grid.dp_group):
               on the ring (ring) or through the shards (sum, momentum)
 tied          pp=2, the first stage's embedding tied to the last stage's
               output layer (tie)
 tied-zero     pp=2 x dp=2 on the ring, tied, Adam with
               shard_optimizer_state=True (ZeRO-1): the tie sum before the
               reduce-scatter
 gil           while the last stage waits in libps, its process's other Python
               threads run (an event, not a time: see pipe_worker.gil)
 tied-zero8    the same with pp=4 x dp=2 (W=8; meson -Dslow_tests=true)
 errors        a rank not in the group, a batch n_microbatches does not
               divide, a stage output whose shape changes after the first step
               (the peer fails naming it instead of hanging)
Every stage boundary carries a tuple (float32 [n, 8], float64 [n, 3], int64
[n]). After 5 steps (4 micro-batches each) every rank's blocks equal a
single-process reference (pipe_model.reference: each replica's micro-batches
accumulated with loss / m, the replicas averaged, the same optimizer) within
1e-5 relative per tensor."""
import sys
import time

import harness
from harness import check, Job

harness.require_torch()
import torch  # noqa: E402
from pipe_model import reference  # noqa: E402

case, sync = sys.argv[1], sys.argv[2]
W = {"dp": 4, "tied-zero": 4, "one": 1, "interleaved-one": 1, "pp4": 4,
     "tied-zero8": 8}.get(case, 2)
PP = {"one": 1, "interleaved-one": 1, "pp4": 4, "tied-zero8": 4}.get(case, 2)
TIED = case.startswith("tied")
KIND = "adam" if case.startswith("tied-zero") else "sgd"
DP = W // PP
STEPS, M, MB = 5, 4, 2

with Job(f"pipeline-{case}-{sync}") as job:
    if sync == "sum":
        job.start_shards(2, W, "--optimizer", "sum")
    elif sync == "momentum":  # the shards step, as the reference's SGD
        job.start_shards(2, W, "--optimizer", "momentum", "--lr", "0.1", "--momentum", "0.9")
    out = job.path("r%d.pt")
    started = time.monotonic()
    job.start_workers("pipe_worker.py", W, "allreduce" if sync == "ring" else "ps", [case, out],
                      env={"PS_PEER_TIMEOUT_MS": "10000"})
    codes = job.wait_workers(120)
    took = time.monotonic() - started
    for r, (log, oks) in enumerate(job.workers_passed(codes)):
        if case in ("errors", "gil"):
            print("\n".join(f"  rank {r} {ln}" for ln in oks), flush=True)
    if case not in ("errors", "gil"):
        want = reference(STEPS, DP, M, M * MB, TIED, KIND)
        covered = set()
        for r in range(W):
            res = torch.load(out % r)
            for i in res["held"]:
                covered.add(i)
                for name, w in want[i].items():
                    got = res["params"][i][name]
                    err = (got - w).abs().max().item() / max(w.abs().max().item(), 1e-12)
                    check(got.shape == w.shape and err <= 1e-5,
                          f"rank {r}: block {i} {name} equals the reference (relative "
                          f"error {err:.1e})")
            # activations held (micro-batches between forward and backward)
            p = PP
            s = res["pp_rank"]
            if case in ("gpipe", "tied"):
                check(res["peak"] == M, f"rank {r}: GPipe holds all {M} micro-batches' "
                      f"activations ({res['peak']})")
            elif not case.startswith("interleaved") and case != "zbh1":
                check(res["peak"] <= p - s, f"rank {r} (stage {s}): 1F1B holds at most p - s = "
                      f"{p - s} micro-batches' activations ({res['peak']})")
            elif case == "zbh1":  # W deferred: p at most (1F1B's peak over the stages)
                check(res["peak"] <= p, f"rank {r} (stage {s}): ZB-H1 holds at most p = {p} "
                      f"micro-batches' activations ({res['peak']})")
            else:
                print(f"rank {r}: interleaved held at most {res['peak']} micro-batches' "
                      "activations (over its 2 stages)", flush=True)
        check(covered == set(range(4)), f"the ranks hold every block ({sorted(covered)})")
        start = [b.state_dict() for b in __import__("pipe_model").blocks(TIED)]
        moved = max((start[i][n] - w).abs().max().item() for i in range(4)
                    for n, w in want[i].items())
        check(moved > 1e-3, f"the parameters moved ({moved:.3f})")
    print(f"case {case} {sync}: {took:.1f} s", flush=True)
