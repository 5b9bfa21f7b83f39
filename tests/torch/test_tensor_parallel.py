"""ps.torch.tensor_parallel (issue 33, Deliver 3) with real workers
(tp_worker.py) against a single-process reference (tp_model.py: the same
seed, data and SGD with momentum, 6 steps): every rank's parameters equal
the matching slice of the reference within 1e-5 relative (max |got - want|
over max |want|, per tensor), at the start exactly (Megatron's
initialisation: the full layer from one seed, then split).
   test_tensor_parallel.py CASE
 mlp      W=2, group=None (the whole job): a dense layer, then Column->Row
          (from_dense), then Column(gather_output)->Row(input_is_parallel=
          False); the collectives of one Column->Row block counted at libps:
          1 all-reduce forward, 1 backward
 lm       W=2, grid(tp=2).tp_group: VocabParallelEmbedding (vocabulary 13,
          padded to 14), a dense layer, Column->Row, the output layer tied to
          the embedding, vocab_parallel_cross_entropy; built with the layers'
          constructors; the block's counts and the whole model's (forward 5
          all-reduces, backward 2)
 lm-sp    the same with sequence_parallel=True: the block 1 all-gather + 1
          reduce-scatter each way, the dense layer and the row bias summed
          by allreduce_sequence_parallel_grads
 grid     W=4, grid(tp=2) x dp=2, DistributedOptimizer(group=grid.dp_group)
          on the ring; each data-parallel replica its own batch, the
          reference the mean of both replicas' gradients
 grid-sp  the same with sequence parallelism
 grid-ps  grid in sync mode ps (2 shards, --optimizer sum)
 tp4-sp   W=4, grid(tp=4), sequence parallelism, the vocabulary padded to 20
          (pad_vocab_to=20): the last rank's 5 rows are all padding
 errors   W=2: t not dividing a width or the vocabulary (naming pad_vocab_to),
          a rank not in the group, inputs of the wrong width, ids out of
          range; nothing reaches libps during the refusals"""
import sys
import time

import harness
from harness import check, Job

harness.require_torch()
import torch  # noqa: E402
from tp_model import SEED, STEPS, DenseLM, DenseMLP, lm_data, mlp_data, optimizer  # noqa: E402

case = sys.argv[1]
W = 4 if case.startswith(("grid", "tp4")) else 2
sync = "ps" if case.endswith("-ps") else "allreduce"
REL = 1e-5


def reference(case):
    """The dense model trained in one process: {name: first}, {name: last}."""
    torch.manual_seed(SEED)
    mlp = case == "mlp"
    model = DenseMLP() if mlp else DenseLM()
    first = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = optimizer(model.parameters())
    replicas = 2 if case.startswith("grid") else 1
    for step in range(STEPS):
        grads = []
        for q in range(replicas):
            model.zero_grad()
            if mlp:
                x, y = mlp_data(step, q)
                loss = torch.nn.functional.mse_loss(model(x), y)
            else:
                loss = model(*lm_data(step, q))
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = sum(gs) / len(gs)
        opt.step()
    return first, {n: p.detach().clone() for n, p in model.named_parameters()}


def my_slice(want, got, dim, tp_rank, t):
    """The part of the reference tensor want that tp rank tp_rank of t,
    holding got (split along dim; None: whole), has; the vocabulary padded
    with zeros."""
    if dim is None:
        return want
    n = got.shape[dim]
    if want.shape[dim] < t * n:
        pad = list(want.shape)
        pad[dim] = t * n - want.shape[dim]
        want = torch.cat([want, want.new_zeros(pad)], dim)
    return want.narrow(dim, tp_rank * n, n)


def compare(r, res, ref, which, tol):
    worst = 0.0
    for name, (got, dim) in res[which].items():
        want = my_slice(ref[name], got, dim, res["tp_rank"], res["tp"])
        if got.shape != want.shape:
            harness.fail(f"rank {r}: {name} has shape {tuple(got.shape)}, its slice of the "
                         f"reference {tuple(want.shape)}")
        err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
        if err > tol:
            harness.fail(f"rank {r} (tp rank {res['tp_rank']}): {which} {name} differs from "
                         f"its slice of the reference by {err:.2e} relative (> {tol})")
        worst = max(worst, err)
    return worst


with Job(f"tp-{case}") as job:
    if sync == "ps":
        job.start_shards(2, W, "--optimizer", "sum")
    out = job.path("r%d.pt")
    started = time.monotonic()
    job.start_workers("tp_worker.py", W, sync, [case, out], env={"PS_PEER_TIMEOUT_MS": "5000"})
    codes = job.wait_workers(120)
    took = time.monotonic() - started
    for r, (log, oks) in enumerate(job.workers_passed(codes)):
        for ln in log.splitlines():
            if ln.startswith("collectives of the whole model") or "Column->Row block" in ln:
                print(f"worker {r}: {ln}")
    if case != "errors":
        first, last = reference(case)
        moved = max(((last[n] - first[n]).abs().max() / first[n].abs().max()).item()
                    for n in first)
        check(moved > 0.05, f"the reference's parameters moved ({moved:.2f} relative)")
        for r in range(W):
            res = torch.load(out % r)
            check(set(res["last"]) == set(last), f"rank {r}: the reference's parameters")
            compare(r, res, first, "first", 0.0)
            check(True, f"rank {r} (tp rank {res['tp_rank']}, dp rank {res['dp_rank']}) "
                  "started from its slice of the dense model, exactly")
            worst = compare(r, res, last, "last", REL)
            check(True, f"rank {r}: after {STEPS} steps every parameter equals its slice of "
                  f"the reference (worst {worst:.1e} relative <= {REL})")
    print(f"case {case}: {took:.1f} s", flush=True)
