"""ps.torch.pipeline (issue 33, Deliver 2 and its tests in 5) with real
worker processes (pipe_worker.py) on 127.0.0.1:
   test_pipeline.py CASE SYNC     (SYNC: ring = allreduce mode, sum = ps mode
                                   with 2 shards running --optimizer sum)
 gpipe, 1f1b   pp=2 (W=2) with ScheduleGPipe / Schedule1F1B
 interleaved   pp=2 with 2 stages per rank (ScheduleInterleaved1F1B, 4 virtual
               stages)
 zbh1          pp=2 with ScheduleZBH1 (the backward split in two halves)
 one           pp=1 (W=1): the one stage is first and last
 dp            pp=2 x dp=2 (W=4), DistributedOptimizer(group=grid.dp_group):
               on the ring (ring) or through the shards (sum)
 tied          pp=2, the first stage's embedding tied to the last stage's
               output layer (tie)
 tied-zero     pp=2 x dp=2 on the ring, tied, Adam with
               shard_optimizer_state=True (ZeRO-1): the tie sum before the
               reduce-scatter
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
W = {"dp": 4, "tied-zero": 4, "one": 1}.get(case, 2)
TIED = case.startswith("tied")
KIND = "adam" if case == "tied-zero" else "sgd"
DP = W // (1 if case == "one" else 2)
STEPS, M, MB = 5, 4, 2

with Job(f"pipeline-{case}-{sync}") as job:
    if sync == "sum":
        job.start_shards(2, W, "--optimizer", "sum")
    out = job.path("r%d.pt")
    started = time.monotonic()
    job.start_workers("pipe_worker.py", W, "ps" if sync == "sum" else "allreduce", [case, out],
                      env={"PS_PEER_TIMEOUT_MS": "10000"})
    codes = job.wait_workers(120)
    took = time.monotonic() - started
    for r in range(W):
        log = job.log(f"worker-{r}.log")
        check(codes[r] == 0, f"worker {r} exited {codes[r]}" + ("" if codes[r] == 0 else
                                                               ": " + log))
        oks = [ln for ln in log.splitlines() if ln.startswith("ok: ")]
        check(len(oks) >= 1, f"worker {r}: {len(oks)} checks passed, e.g. "
              f"{oks[-1][4:] if oks else ''}")
        if case == "errors":
            print("\n".join(f"  rank {r} {ln}" for ln in oks), flush=True)
    if case != "errors":
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
        check(covered == set(range(4)), f"the ranks hold every block ({sorted(covered)})")
        start = [b.state_dict() for b in __import__("pipe_model").blocks(TIED)]
        moved = max((start[i][n] - w).abs().max().item() for i in range(4)
                    for n, w in want[i].items())
        check(moved > 1e-3, f"the parameters moved ({moved:.3f})")
    print(f"case {case} {sync}: {took:.1f} s", flush=True)
