"""What DDP and Horovod users expect of ps.torch, with 2 real workers
(ddp_worker.py) next to single-process torch on the global batch:
   test_ddp.py CASE MODE     MODE: sum (ps, shards average), ring, or
                             shard (ps, --optimizer momentum on the shards)
 clip     backward() leaves the mean in p.grad, so clip_grad_norm_ between
          backward() and step() clips the global gradient: the parameters
          equal single-process torch clipped on the global batch (within
          1e-6; the unclipped run is far away); a conv in channels_last
 syncbn   convert_sync_batchnorm: every BatchNorm becomes SyncBatchNorm and
          training equals single-process BatchNorm on the global batch
          (parameters, running statistics, evaluation; within 1e-5)
 buffers  broadcast_buffers: every forward starts from rank 0's buffers and
          after the last step every rank holds the same (a BatchNorm
          without it drifts apart)
 uneven   rank 1 runs 5 steps more than rank 0, without join: both fail
          within 10 s of rank 0's end, naming both ranks and join
 join     rank 0 has 7 batches, rank 1 4 and joins: both finish, equal to
          single-process torch on the batches there were (the mean of the
          ranks that train), BatchNorm buffers equal, and a next epoch
          after join trains evenly again
 nones    zero_grad(set_to_none=True) and AdamW: a parameter no rank uses
          keeps grad None and does not move; one used by rank 0 gets the
          mean with zeros; one frozen for 3 steps and then trained matches
          single-process torch
 state    optimizer state loaded before wrapping is kept; no_sync()
          accumulation equals single-process on 3 micro-batches
 shard    (shard only) several parameter groups, a changed lr and a
          gradient clipped after backward are refused, naming them
 misc     (ring only) variable-size allgather, allgather_object,
          local_size/cross_rank/cross_size, a parameter unfrozen after
          wrapping and a sparse gradient refused naming the parameter, and
          a mismatched collective after which every rank shuts down cleanly"""
import os
import sys
import time

import harness
from harness import check, Job

harness.require_torch()
import torch  # noqa: E402

from model import cnn_bn, global_batch, small  # noqa: E402

case, mode = sys.argv[1], sys.argv[2]
sync = "allreduce" if mode == "ring" else "ps"
W, PER = 2, 4
ce = torch.nn.functional.cross_entropy


def maxdiff(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def close(got, want, tol, what):
    for name, v in want.items():
        d = maxdiff(got[name], v)
        check(d <= tol, f"{what}: {name} within {tol:g} of single-process torch ({d:.2e})")


def equal_ranks(res, key, what):
    for name, v in res[0][key].items():
        check(torch.equal(v, res[1][key][name]), f"{what}: {name} equal on both ranks")


def run(env=None):
    with Job(f"ddp-{case}-{mode}") as job:
        if sync == "ps":
            opt = ["--optimizer", "momentum", "--lr", "0.1", "--momentum", "0.9"] \
                if mode == "shard" else ["--optimizer", "sum"]
            job.start_shards(2, W, *opt)
        out = job.path("r%d.pt")
        job.start_workers("ddp_worker.py", W, sync, [case, out],
                          env=dict({"PS_PEER_TIMEOUT_MS": "5000"}, **(env or {})))
        if case == "uneven":
            return uneven(job, out)
        codes = job.wait_workers(150)
        for r, c in enumerate(codes):
            check(c == 0, f"worker {r} exited {c}" + ("" if c == 0 else ": "
                  + job.log(f"worker-{r}.log")))
            check(os.path.exists(out % r + ".clean"), f"rank {r}: ps.shutdown() returned")
        return [torch.load(out % r) for r in range(W)]


def uneven(job, out):
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not os.path.exists(out % 0 + ".done"):
        time.sleep(0.02)
    check(os.path.exists(out % 0 + ".done"), "rank 0 finished its 4 steps")
    done_at = time.monotonic()
    codes = job.wait_workers(60)
    took = time.monotonic() - done_at
    for r in range(W):
        log = job.log(f"worker-{r}.log")
        check(codes[r] not in (0, None), f"rank {r} failed (exit {codes[r]}) instead of "
              "hanging or exiting 0")
        last = [ln for ln in log.splitlines() if "Error" in ln]
        msg = last[-1] if last else log[-400:]
        check("join" in msg and ("rank 0" in msg or "worker 0" in msg)
              and ("rank 1" in msg or "worker 1" in msg) and "step" in msg,
              f"rank {r}'s error names both ranks, their steps and join: {msg[-400:]}")
    # the event is each rank's error naming join (above), not the 5 s peer
    # timeout; wait_workers(60) is the bound on a hang
    print(f"uneven: both ranks failed {took:.1f} s after rank 0 finished")


def train(model, opt, batches, loss_of=None):
    for items in batches:
        opt.zero_grad()
        for x, y in items:
            (loss_of or (lambda m, x, y: ce(m(x), y)))(model, x, y).backward()
        opt.step()


def state_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


if case == "clip":
    res = run()

    def clip_model():
        torch.manual_seed(5)
        m = torch.nn.Module()
        m.conv = torch.nn.Conv2d(2, 3, 3)
        m.fc = torch.nn.Linear(3 * 6 * 6, 3)
        return m

    def fwd(m, x):
        return m.fc(torch.relu(m.conv(x)).flatten(1))

    out = {}
    for clip in (True, False):
        m = clip_model()
        opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
        first = None
        for t in range(6):
            x, y = global_batch(t, W * PER, (2, 8, 8))
            opt.zero_grad()
            ce(fwd(m, x), y).backward()
            if first is None:
                first = {n: p.grad.clone() for n, p in m.named_parameters()}
            if clip:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
            opt.step()
        out[clip] = (state_of(m), first)
    ref, first = out[True]
    for r in range(W):
        check(res[r]["cl"], f"rank {r}: the conv weight is still channels_last")
        close(res[r]["first"], first, 1e-6, f"rank {r}: p.grad after backward() is the mean")
        close(res[r]["params"], ref, 1e-6, f"rank {r}: clipped after backward()")
    far = max(maxdiff(out[False][0][n], v) for n, v in ref.items())
    check(far > 1e-3, f"clipping mattered: unclipped parameters are {far:.2e} away")

elif case == "syncbn":
    res = run()
    m = cnn_bn(3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    train(m, opt, [[global_batch(t, W * PER, (1, 8, 8))] for t in range(6)])
    m.eval()
    with torch.no_grad():
        evals = m(global_batch(99, 8, (1, 8, 8))[0])
    ref = state_of(m)
    for r in range(W):
        check("SyncBatchNorm" in res[r]["kinds"] and "BatchNorm2d" not in res[r]["kinds"],
              f"rank {r}: convert_sync_batchnorm converted every BatchNorm: {res[r]['kinds']}")
        close(res[r]["params"], ref, 1e-5, f"rank {r}: SyncBatchNorm")
        check(maxdiff(res[r]["evals"], evals) <= 1e-5,
              f"rank {r}: evaluation equals single-process ({maxdiff(res[r]['evals'], evals):.2e})")

elif case == "buffers":
    res = run()
    equal_ranks(res, "params", "broadcast_buffers")
    for t, (a, b) in enumerate(zip(res[0]["seen"], res[1]["seen"])):
        check(torch.equal(a, b), f"forward {t} started from the same running_mean on both ranks")
    check(torch.equal(res[0]["evals"], res[1]["evals"]), "both ranks evaluate alike")
    check(not torch.equal(res[0]["control"]["running_mean"], res[1]["control"]["running_mean"]),
          "a BatchNorm without broadcast_buffers drifts apart (the check can fail)")

elif case == "uneven":
    run()

elif case == "join":
    res = run()
    m = small(1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    batches = []
    for t in range(7):
        x, y = global_batch(t, W * PER)
        batches.append([(x, y) if t < 4 else (x[:PER], y[:PER])])
    batches.append([global_batch(20, W * PER)])
    train(m, opt, batches)
    ref = {f"mlp.{k}": v for k, v in state_of(m).items()}
    for r in range(W):
        close(res[r]["params"], ref, 1e-5, f"rank {r}: after join")
        check(res[r]["last"] == 0, f"rank {r}: join() returned 0, the last rank to train "
              f"(got {res[r]['last']})")
    equal_ranks(res, "params", "after join")

elif case == "nones":
    res = run()
    torch.manual_seed(9)
    m = torch.nn.ModuleDict({k: torch.nn.Linear(6, 3) for k in ("a", "b", "never", "c")})
    opt = torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.1)
    for t in range(6):
        for k in ("weight", "bias"):
            getattr(m["c"], k).requires_grad_(t >= 3)
        x, y = global_batch(t, W * PER)
        opt.zero_grad(set_to_none=True)
        loss = 0
        for r in range(W):
            xr, yr = x[r * PER:(r + 1) * PER], y[r * PER:(r + 1) * PER]
            out = m["a"](xr) + m["c"](xr) + (m["b"](xr) if r == 0 else 0)
            loss = loss + ce(out, yr) / W
        loss.backward()
        opt.step()
    ref = state_of(m)
    start = res[0]["start"]
    for r in range(W):
        close(res[r]["params"], ref, 1e-5, f"rank {r}: set_to_none, AdamW, unfreezing")
        check(torch.equal(res[r]["params"]["never.weight"], start["never.weight"]),
              f"rank {r}: never.weight (no rank's gradient) did not move")
        check(all(g["never.weight"] for g in res[r]["grads_none"]),
              f"rank {r}: never.weight's grad stayed None after every backward()")
        check(all(g["c.weight"] for g in res[r]["grads_none"][:3]),
              f"rank {r}: the frozen c.weight had no grad in steps 0-2")
        check(not any(g["b.weight"] for g in res[r]["grads_none"]),
              f"rank {r}: b.weight (rank 0's only) has the mean in p.grad")
        check(any("never.weight" in w for w in res[r]["warnings"]),
              f"rank {r}: a warning names never.weight")
    check(not torch.equal(ref["c.weight"], start["c.weight"]), "c trained after unfreezing")

elif case == "state":
    res = run()
    m = small(2)
    pre = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    train(m, pre, [[global_batch(200 + t, PER)] for t in range(2)])
    kept = {i: pre.state[p]["momentum_buffer"].clone() for i, p in enumerate(m.parameters())}
    fresh = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    fresh.load_state_dict(pre.state_dict())
    train(m, fresh, [[global_batch(10 * t + k, W * PER) for k in range(3)] for t in range(3)])
    ref = state_of(m)
    for r in range(W):
        check(len(res[r]["kept"]) == len(kept) and all(
            torch.equal(res[r]["kept"][i], v) for i, v in kept.items()),
            f"rank {r}: the {len(kept)} momentum buffers loaded before wrapping were kept")
        close(res[r]["params"], ref, 1e-5, f"rank {r}: loaded state, then no_sync")

elif case == "shard":
    res = run()
    for r in range(W):
        e = res[r]["errors"]
        check(e["groups"] and "parameter group 1" in e["groups"] and "weight_decay" in
              e["groups"] and "--optimizer sum" in e["groups"],
              f"rank {r}: two parameter groups refused: {e['groups']}")
        check(e["clip"] and "changed after backward" in e["clip"] and "0.weight" in e["clip"]
              and "--optimizer sum" in e["clip"], f"rank {r}: clipping refused: {e['clip']}")
        check(e["lr"] and "lr is 0.05" in e["lr"] and "scheduler" in e["lr"],
              f"rank {r}: an lr change refused: {e['lr']}")

elif case == "misc":
    res = run()
    for r in range(W):
        got, e = res[r]["got"], res[r]["errors"]
        check(got["sizes"] == (r, 2, 0, 1), f"rank {r}: local_rank, local_size, cross_rank, "
              f"cross_size on one node: {got['sizes']}")
        want = torch.cat([torch.arange(2 + 3 * q, dtype=torch.int64).reshape(-1, 1)
                          .repeat(1, 2) + 100 * q for q in range(W)])
        check(torch.equal(got["var"], want), f"rank {r}: allgather of 2 and 5 rows")
        check(torch.equal(got["same"], torch.cat([torch.full((2, 2), float(q))
                                                  for q in range(W)])),
              f"rank {r}: allgather of equal shapes")
        check(got["objects"] == [{"rank": q, "text": "x" * (5 + 40 * q)} for q in range(W)],
              f"rank {r}: allgather_object")
        check(e["trail"] and "beyond dim 0" in e["trail"],
              f"rank {r}: shapes that differ beyond dim 0 refused: {e['trail']}")
        check(e["unfreeze"] and "0.weight" in e["unfreeze"] and "requires_grad=True" in
              e["unfreeze"], f"rank {r}: unfreezing after wrapping refused: {e['unfreeze']}")
        check(e["sparse"] and "emb.weight" in e["sparse"] and "sparse" in e["sparse"],
              f"rank {r}: a sparse gradient refused, naming it: {e['sparse']}")
        check(e["mismatch"] and "disagree" in e["mismatch"],
              f"rank {r}: a mismatched collective fails: {e['mismatch']}")

else:
    harness.fail(f"unknown case {case}")
