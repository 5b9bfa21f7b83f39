"""Multi-rank behaviour of ps.torch with 2 real workers (case_worker.py):
   test_ranks.py CASE MODE     MODE: sum (shards average) or ring
 broadcast  diverged ranks (parameters and momentum buffers) are equal to
            root 1's after broadcast_parameters / broadcast_optimizer_state
 unused     a parameter only rank 0 uses gets the mean of (its gradient,
            zeros) in p.grad when backward() returns, on both ranks, and one
            nobody uses stays put with p.grad as torch left it; each is said
            in a warning
 differ     ranks whose parameters differ in shape (differ) or name
            (differ-order) get a LayoutError, not a hang or mixed gradients;
            differ-shard: without a ring (ps mode) the shards refuse the
            rank that declared second with a LayoutError
 pushpull   push_pull of declared tensors (ps: through the shards, averaged
            or summed, step after step; an undeclared name is refused) and
            allreduce in a custom loop
 collectives allgather, reduce_scatter (every op), reduce (every root),
            alltoall, send/recv (each way, any dtype) and isend/irecv (both
            ways at once, larger than the socket buffers) against torch's own
            arithmetic on the inputs every rank can make, any dtype where
            bytes only move; allreduce (every op), reduce_scatter and reduce
            on every other dtype the reductions take, small and large, bit
            for bit as torch computes them; bad sizes, ops, roots, peers and
            dtypes refused on the caller's side (the ring still works)
 zero       DistributedOptimizer(shard_optimizer_state=True) trains to the
            same parameters, bit for bit, as the plain one (SGD with momentum
            and Adam, an lr schedule, padded chunks) with half the optimizer
            state per rank; its state_dict() and several parameter groups
            are refused
 gil        while a rank waits in libps, its other Python threads run (the
            GIL is released)
 kill       rank 1 is SIGKILLed in the middle of a step: rank 0 fails with a
            message naming what was lost, within the timeout
 lost-shard (sum only) shard 0 is SIGKILLed while both ranks train: after
            reconnect-timeout-ms both fail with RetryableError, exit 129,
            naming the shard"""
import os
import sys
import time

import harness
from harness import check, Job

harness.require_torch()
import torch  # noqa: E402
from model import TYPED, typed_input  # noqa: E402

case, mode = sys.argv[1], sys.argv[2]
sync = "ps" if mode == "sum" else "allreduce"
shard_args = ["--optimizer", "sum"]
if case == "kill":
    shard_args += ["--worker-timeout", "2", "--on-worker-timeout", "fail"]

with Job(f"{case}-{mode}") as job:
    if sync == "ps":
        job.start_shards(2, 2, *shard_args)
    out = job.path("r%d.pt")
    started = time.monotonic()
    job.start_workers("case_worker.py", 2, sync,
                      ["differ" if case == "differ-shard" else case, out],
                      env={"PS_PEER_TIMEOUT_MS": "3000", "PS_RECONNECT_TIMEOUT_MS": "2000"},
                      peers=case != "differ-shard")
    if case == "lost-shard":
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            steps = [open(out % r + ".step").read() if os.path.exists(out % r + ".step")
                     else "" for r in range(2)]
            if all(s.isdigit() and int(s) >= 3 for s in steps):
                break
            time.sleep(0.05)
        check(all(s.isdigit() for s in steps), f"both ranks are training (steps {steps})")
        victim = job.addrs[0]  # the tiny model is one key, on shard 0
        job.shards[0].kill()
        killed = time.monotonic()
        codes = job.wait_workers(60)
        took = time.monotonic() - killed
        for r in range(2):
            log = job.log(f"worker-{r}.log")
            check(codes[r] == 129, f"rank {r} exited 129 (retryable), got {codes[r]}")
            check("RetryableError" in log and victim in log,
                  f"rank {r}: RetryableError naming the shard {victim}: "
                  + log.strip().splitlines()[-1][-300:])
        check(took < 20, f"the ranks gave up {took:.1f} s after the shard died")
        sys.exit(0)
    if case == "differ-shard":
        # The rank that declared first waits at its first step for the
        # other, which is refused; see who that was.
        deadline = time.monotonic() + 60
        while all(w.poll() is None for w in job.workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        done = [r for r in range(2) if job.workers[r].poll() is not None]
        check(len(done) >= 1, "one rank ended")
        r = done[0]
        res = torch.load(out % r)
        check(res["error"] is not None and res["kind"] == "LayoutError",
              f"rank {r}: LayoutError: {res['error']}")
        check("shards hold a different layout" in res["error"],
              "the message says the shards hold a different layout")
        sys.exit(0)
    codes = job.wait_workers(90)
    took = time.monotonic() - started
    logs = [job.log(f"worker-{r}.log") for r in range(2)]
    if case != "kill":
        for r in range(2):
            check(codes[r] == 0, f"worker {r} exited {codes[r]}" +
                  ("" if codes[r] == 0 else ": " + logs[r]))
        res = [torch.load(out % r) for r in range(2)]

    if case == "broadcast":
        for name, want in res[1]["params"].items():
            check(torch.equal(res[0]["params"][name], want), f"{name} equal to root 1's")
        for a, b in zip(res[0]["momentum"], res[1]["momentum"]):
            check(torch.equal(a, b) and a.abs().sum() > 0,
                  "a momentum buffer equal to root 1's (and not zero)")
        check(res[0]["obj"] == {"rank": 1, "list": [1, 1, 1]}, "broadcast_object from root 1")

    elif case == "unused":
        p0, s0 = res[0]["params"], res[0]["start"]
        for r in range(2):
            check(torch.equal(res[r]["params"]["never.weight"], s0["never.weight"]),
                  f"rank {r}: the parameter no rank used did not move")
            check(res[r]["never_grad"] is None or not res[r]["never_grad"].any(),
                  f"rank {r}: its p.grad is as torch left it")
            check(any("never.weight" in w and "zeros" in w for w in res[r]["warnings"]),
                  f"rank {r}: a warning names never.weight and says it counts as zeros")
            check(torch.allclose(res[r]["after_b"], res[0]["own_b"] / 2, rtol=1e-6, atol=1e-8),
                  f"rank {r}: p.grad of b.weight after backward() is the mean of rank 0's "
                  "gradient and zeros")
        want_b = s0["b.weight"] - 0.5 * res[0]["own_b"] / 2
        check(torch.allclose(p0["b.weight"], want_b, rtol=1e-6, atol=1e-7),
              "b.weight (used by rank 0 only) moved by the mean of rank 0's gradient and zeros")
        check(torch.equal(res[0]["params"]["b.weight"], res[1]["params"]["b.weight"]),
              "both ranks hold the same b.weight")
        check(any("b.weight" in w for w in res[1]["warnings"]),
              "rank 1 was told b.weight got no gradient")

    elif case.startswith("differ"):
        for r in range(2):
            err = res[r]["error"]
            check(err is not None and res[r]["kind"] == "LayoutError",
                  f"rank {r}: LayoutError: {err}")
            check("differ" in err, f"rank {r}: the message says the parameters differ")

    elif case == "pushpull":
        for r in range(2):
            for step, (a, b) in enumerate(res[r]["got"]):
                check(torch.equal(a, torch.full((5,), 1.5 * (step + 1))),
                      f"rank {r} step {step}: push_pull averaged a")
                check(torch.allclose(b, torch.arange(3000.0) * 3 * (step + 1)),
                      f"rank {r} step {step}: push_pull summed b")
            if sync == "ps":
                check("'c' was not declared" in (res[r]["undeclared"] or ""),
                      f"rank {r}: an undeclared name is refused: {res[r]['undeclared']}")
            check(torch.equal(res[r]["summed"], torch.ones(4)), f"rank {r}: allreduce summed")

    elif case == "collectives":
        def mine(q, shape, dtype=torch.float32):
            g = torch.Generator().manual_seed(100 + q)
            return torch.randint(-50, 50, shape, generator=g).to(dtype)
        W = 2
        for r in range(W):
            got, errors = res[r]["got"], res[r]["errors"]
            check(torch.equal(got["allgather"], torch.cat([mine(q, (3, 5)) for q in range(W)])),
                  f"rank {r}: allgather")
            check(torch.equal(got["allgather_int"],
                              torch.cat([mine(q, (7,), torch.int64) for q in range(W)])),
                  f"rank {r}: allgather of int64")
            inputs = torch.stack([mine(q, (4, 3)) for q in range(W)])
            ref = {"sum": inputs.sum(0), "average": inputs.sum(0) / W,
                   "max": inputs.max(0).values, "min": inputs.min(0).values}
            for op, want in ref.items():
                check(torch.allclose(got["reduce_scatter"][op], want[2 * r:2 * r + 2],
                                     rtol=1e-6, atol=0),
                      f"rank {r}: reduce_scatter {op}")
            for root in range(W):
                want = (sum(mine(q, (1001,)) for q in range(W)) if r == root
                        else mine(r, (1001,)))
                check(torch.equal(got["reduce"][root], want), f"rank {r}: reduce to {root}")
            parts = [mine(q, (6, 2), torch.float64).chunk(W) for q in range(W)]
            check(torch.equal(got["alltoall"], torch.cat([parts[q][r] for q in range(W)])),
                  f"rank {r}: alltoall of float64")
            check(got["empty"].numel() == 0, f"rank {r}: allgather of an empty tensor")
            if r == 1:
                check(torch.equal(got["recv"], mine(0, (5, 3))), "rank 1: recv from rank 0")
            else:
                check(torch.equal(got["recv_int"], mine(1, (9,), torch.int64)),
                      "rank 0: recv of int64 from rank 1")
            check(got["recv_from"] == 1 - r, f"rank {r}: recv returns the source rank")
            check(torch.equal(got["big"], mine(1 - r, (3 << 20,))),
                  f"rank {r}: isend and irecv of 12 MiB both ways at once")
            check(torch.equal(got["after"], torch.full((3,), 2.0)),
                  f"rank {r}: the ring works after the refused calls")
            for dt in TYPED:
                for n in (1002, 300002):
                    x = [typed_input(q, dt, n) for q in range(W)]
                    s = x[0] + x[1]  # torch's arithmetic in dt (W = 2: no order to follow)
                    avg = (torch.div(s, W, rounding_mode="trunc") if not dt.is_floating_point
                           else (s.float() * (1.0 / W)).to(dt) if dt != torch.float64
                           else s * (1.0 / W))
                    ref = {"sum": s, "average": avg, "max": torch.maximum(x[0], x[1]),
                           "min": torch.minimum(x[0], x[1])}
                    typed = got["typed"][(str(dt), n)]
                    for op, want in ref.items():
                        check(torch.equal(typed["allreduce"][op], want),
                              f"rank {r}: allreduce {op} of {n} {dt} as torch's")
                    check(torch.equal(typed["avg_inplace"], avg),
                          f"rank {r}: allreduce_ of {n} {dt} in place")
                    check(torch.equal(typed["reduce_scatter"], s.chunk(W)[r]),
                          f"rank {r}: reduce_scatter of {n} {dt}")
                    check(torch.equal(typed["reduce"], ref["max"] if r == 1 else x[r]),
                          f"rank {r}: reduce max of {n} {dt} to rank 1")
            want_err = {"split": "ValueError: reduce_scatter of a tensor: dim 0 of shape (3,)",
                        "alltoall-split": "ValueError: alltoall of a tensor: dim 0 of shape (5, 2)",
                        "op": "ValueError: reduce of a tensor: op 'mean'",
                        "root": "ValueError: root_rank 2",
                        "dtype": "TypeError: reduce_scatter of a tensor: dtype torch.bool; "
                                 "ps.torch reduces float32, float64, float16, bfloat16",
                        "dtype-allreduce": "TypeError: allreduce of a tensor: dtype "
                                           "torch.complex64",
                        "self": f"ValueError: dst {r} is not another rank of this job",
                        "peer": "ValueError: src 2 is not another rank of this job",
                        "strided": "TypeError: send of a tensor to rank"}
            for label, start in want_err.items():
                check((errors[label] or "").startswith(start),
                      f"rank {r}: {label} refused: {errors[label]}")

    elif case == "zero":
        torch.manual_seed(60)  # case_worker's net(60, hidden=37): where training started
        start = torch.nn.Sequential(torch.nn.Linear(6, 37), torch.nn.ReLU(),
                                    torch.nn.Linear(37, 3)).state_dict()
        for kind in ("sgd", "adam"):
            check(all(not torch.equal(res[0]["params"][(kind, True)][n], v)
                      for n, v in start.items()), f"{kind}: every parameter moved in training")
        for r in range(2):
            p, st, err = res[r]["params"], res[r]["state"], res[r]["errors"]
            for kind in ("sgd", "adam"):
                for name, want in p[(kind, False)].items():
                    check(torch.equal(p[(kind, True)][name], want),
                          f"rank {r} {kind}: {name} equal bit for bit with and without sharding")
                plain, sharded = st[(kind, False)], st[(kind, True)]
                check(plain > 0 and sharded * 2 >= plain and sharded <= plain / 2 + 256,
                      f"rank {r} {kind}: optimizer state {sharded} bytes sharded, {plain} plain")
                check("1/W of the optimizer state" in (err[kind] or ""),
                      f"rank {r} {kind}: state_dict() of a sharded optimizer refused: {err[kind]}")
            check("parameter groups" in (err["groups"] or ""),
                  f"rank {r}: two parameter groups refused: {err['groups']}")
            if r == 0:
                print(f"ok: optimizer state per rank, plain/sharded: sgd {st[('sgd', False)]}/"
                      f"{st[('sgd', True)]}, adam {st[('adam', False)]}/{st[('adam', True)]} bytes")
        check(torch.equal(res[0]["params"][("adam", True)]["2.weight"],
                          res[1]["params"][("adam", True)]["2.weight"]),
              "both ranks hold the same parameters")

    elif case == "gil":
        check(torch.equal(res[1]["value"], torch.full((1000,), 2.0)), "the all-reduce summed")
        check(res[0]["saw_spin"], "rank 0 saw rank 1's other thread run 1,000,000 iterations "
              "while rank 1 waited in the all-reduce (within 60 s)")
        check(res[1]["during"] >= 1000000,
              f"another thread of rank 1 ran {res[1]['during']} loop iterations meanwhile")

    elif case == "kill":
        check(codes[1] == -9, f"rank 1 was killed (exit {codes[1]})")
        check(codes[0] != 0, f"rank 0 failed (exit {codes[0]}) instead of training on")
        if sync == "allreduce":
            check(codes[0] == 129, "rank 0 exited 129 (retryable) on the lost peer")
            check("rank 1" in logs[0], "rank 0's message names rank 1: " + logs[0][-300:])
        else:
            check("worker 1" in logs[0] or "rank 1" in logs[0],
                  "rank 0's message names worker 1: " + logs[0][-300:])
        check(took < 30, f"rank 0 gave up within the timeout ({took:.1f} s)")
