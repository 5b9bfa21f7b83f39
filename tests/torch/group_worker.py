"""Worker of tests/torch/test_groups.py: one rank of a W=4 job running one
case on groups and the grid; it checks what every rank can compute itself
(every input is made from the job rank) and prints `ok: ...` per check, or
exits 1 naming the first that failed; the optimizer cases save their final
parameters for the test's single-process reference.
   group_worker.py CASE OUT"""
import sys

import torch

import ps
from worker_checks import check, raises
import ps.torch
from model import group_model, group_step_data

case, out = sys.argv[1], sys.argv[2]
ps.init()
r, W = ps.rank(), ps.size()


def val(jr, shape=(2, 3), dtype=torch.float32):
    """Job rank jr's input: distinct per rank and exact in every dtype."""
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float64).reshape(shape) * (jr + 1) + 3 * jr).to(dtype)


def collectives_on(g, tag):
    """Every collective of ps.torch on group g against the values computed
    from its members' job ranks."""
    me, members = g.rank, g.ranks
    t = val(r)
    every = [val(q) for q in members]
    got = ps.torch.allreduce(t, average=False, group=g)
    check(torch.equal(got, sum(every)), f"{tag}: allreduce sum over {members}")
    got = ps.torch.allreduce(t, group=g)
    check(torch.allclose(got, sum(every) / len(members)), f"{tag}: allreduce average")
    for op, fn in (("max", torch.maximum), ("min", torch.minimum)):
        want = every[0]
        for e in every[1:]:
            want = fn(want, e)
        check(torch.equal(ps.torch.allreduce(t, op=op, group=g), want), f"{tag}: allreduce {op}")
    x = val(r, (5,), torch.int64)
    h = ps.torch.allreduce_async_(x, average=False, group=g)
    check(torch.equal(ps.torch.synchronize(h), sum(val(q, (5,), torch.int64) for q in members)),
          f"{tag}: allreduce_async_ of int64")
    b = val(r, (4,), torch.float16)
    ps.torch.broadcast_(b, 1, group=g)
    check(torch.equal(b, val(members[1], (4,), torch.float16)),
          f"{tag}: broadcast_ from group rank 1 (job rank {members[1]})")
    check(torch.equal(ps.torch.broadcast(val(r), 0, group=g), every[0]),
          f"{tag}: broadcast from group rank 0")
    mine = val(r, (1 + me, 3))  # dim 0 differs between the members
    want = torch.cat([val(q, (1 + i, 3)) for i, q in enumerate(members)])
    check(torch.equal(ps.torch.allgather(mine, group=g), want),
          f"{tag}: allgather in group order, dim 0 differing")
    rs = val(r, (2 * len(members), 3))
    part = ps.torch.reduce_scatter(rs, op="sum", group=g)
    full = sum(val(q, (2 * len(members), 3)) for q in members)
    check(torch.equal(part, full[2 * me:2 * me + 2]), f"{tag}: reduce_scatter, part {me}")
    red = ps.torch.reduce(t, root_rank=1, op="sum", group=g)
    check(torch.equal(red, sum(every) if me == 1 else t), f"{tag}: reduce to group rank 1")
    a2a = ps.torch.alltoall(val(r, (len(members), 3)), group=g)
    want = torch.cat([val(q, (len(members), 3))[me:me + 1] for q in members])
    check(torch.equal(a2a, want), f"{tag}: alltoall, part d to group rank d")
    if me == 0:
        ps.torch.send(val(r, (3,), torch.int32), 1, group=g)
    else:
        buf = torch.empty(3, dtype=torch.int32)
        check(ps.torch.recv(buf, 0, group=g) == 0 and
              torch.equal(buf, val(members[0], (3,), torch.int32)),
              f"{tag}: send / recv from group rank 0")
    peer = 1 - me
    big = val(r, (70000,))  # larger than a socket buffer: both ways at once
    inbox = torch.empty(70000)
    hs = [ps.torch.isend(big, peer, group=g), ps.torch.irecv(inbox, peer, group=g)]
    for h in hs:
        h.wait()
    check(torch.equal(inbox, val(members[peer], (70000,))), f"{tag}: isend / irecv both ways")
    ps.torch.barrier(group=g)
    obj = ps.torch.broadcast_object({"from": r}, root_rank=1, group=g)
    check(obj == {"from": members[1]}, f"{tag}: broadcast_object from group rank 1")
    check(ps.torch.allgather_object(r * 10, group=g) == [q * 10 for q in members],
          f"{tag}: allgather_object")
    params = {"w": val(r).clone()}
    ps.torch.broadcast_parameters(params, root_rank=1, group=g)
    check(torch.equal(params["w"], every[1]), f"{tag}: broadcast_parameters from group rank 1")


if case == "collectives":
    g02 = ps.torch.new_group([0, 2])
    g13 = ps.torch.new_group([1, 3])
    g20 = ps.torch.new_group([2, 0])  # reversed: job rank 2 is group rank 0
    mine, other = (g02, g13) if r % 2 == 0 else (g13, g02)
    check(mine.size == 2 and mine.rank == r // 2 and mine.ranks == [r % 2, r % 2 + 2],
          f"new_group: size 2, this rank {r} is group rank {r // 2} of {mine.ranks}")
    check(other.rank == -1 and other.ranks == [1 - r % 2, 3 - r % 2],
          f"new_group: rank -1 in the group this rank is not in ({other.ranks})")
    check(mine.id != 0 and mine.id != other.id and g20.id != g02.id,
          "every group has its own id")
    collectives_on(mine, f"group {mine.ranks}")
    if r % 2 == 0:
        check(g20.ranks == [2, 0] and g20.rank == (0 if r == 2 else 1),
              f"new_group([2, 0]): job rank 2 is group rank 0 (this rank is {g20.rank})")
        collectives_on(g20, "group [2, 0]")
    # the whole job as before, after the groups' traffic
    got = ps.torch.allreduce(val(r), average=False)
    check(torch.equal(got, sum(val(q) for q in range(W))), "allreduce on the whole job")
    check(ps.torch.allgather_object(r) == list(range(W)), "allgather_object on the whole job")
    # a rank calling on a group it is not in
    msg = raises(ps.PSError, lambda: ps.torch.allreduce_(val(r), group=other),
                 f"rank {r}", str(other.ranks), "not in")
    check(isinstance(ps.PSError(""), RuntimeError), "PSError is a RuntimeError")
    raises(ps.PSError, lambda: ps.torch.send(val(r), 0, group=other), f"rank {r}", "not in")
    raises(ps.PSError, lambda: ps.torch.barrier(group=other), f"rank {r}", "not in")
    raises(ps.PSError, lambda: ps.torch.DistributedOptimizer(
        torch.optim.SGD(group_model(0).parameters(), lr=0.1),
        group_model(0).named_parameters(), group=other), f"rank {r}", "not in")
    ps.barrier()
    check(torch.equal(ps.torch.allreduce(val(r), average=False, group=mine),
                      sum(val(q) for q in mine.ranks)), "the group works after the refusals")

elif case == "grid":
    def megatron(tp, pp):
        dp = W // (tp * pp)
        return r % tp, (r // tp) % dp, r // (tp * dp), dp

    for tp, pp in ((2, 1), (2, 2), (1, 2), (1, 1), (4, 1)):
        g = ps.torch.grid(tp=tp, pp=pp)
        t_rank, d_rank, p_rank, dp = megatron(tp, pp)
        check((g.tp, g.pp, g.dp) == (tp, pp, dp), f"grid({tp}, {pp}): dp = {dp}")
        check((g.tp_rank, g.dp_rank, g.pp_rank) == (t_rank, d_rank, p_rank),
              f"grid({tp}, {pp}): rank {r} at tp {t_rank}, dp {d_rank}, pp {p_rank} "
              "(rank = tp_rank + tp * (dp_rank + dp * pp_rank))")
        base = r - t_rank
        check(g.tp_group.ranks == [base + i for i in range(tp)] and g.tp_group.rank == t_rank,
              f"grid({tp}, {pp}): tensor-parallel group {g.tp_group.ranks}")
        d0 = r - tp * d_rank
        check(g.dp_group.ranks == [d0 + tp * i for i in range(dp)] and
              g.dp_group.rank == d_rank, f"grid({tp}, {pp}): data-parallel group "
              f"{g.dp_group.ranks}")
        p0 = r - tp * dp * p_rank
        check(g.pp_group.ranks == [p0 + tp * dp * i for i in range(pp)] and
              g.pp_group.rank == p_rank, f"grid({tp}, {pp}): pipeline group {g.pp_group.ranks}")
        for name in ("tp", "dp", "pp"):
            grp = getattr(g, name + "_group")
            s = ps.torch.allreduce(torch.tensor([float(r)]), average=False, group=grp)
            check(s.item() == sum(grp.ranks), f"grid({tp}, {pp}): an allreduce on {name}_group")
    raises(ValueError, lambda: ps.torch.grid(tp=3), "tp=3", "4")
    raises(ValueError, lambda: ps.torch.grid(tp=2, pp=0), "pp=0")
    raises(ValueError, lambda: ps.torch.grid(tp=2.0), "tp=2.0")

elif case == "errors":
    raises(ValueError, lambda: ps.torch.new_group([0, 0]), "[0]", "more than once")
    raises(ValueError, lambda: ps.torch.new_group([0, 4]), "rank 4", "0..3")
    raises(ValueError, lambda: ps.torch.new_group([-1]), "rank -1")
    raises(ValueError, lambda: ps.torch.new_group([0, "1"]), "'1'", "list of ints")
    raises(ValueError, lambda: ps.torch.new_group([0, 1.0]), "1.0", "list of ints")
    raises(ValueError, lambda: ps.torch.new_group(2), "list of job ranks")
    raises(ValueError, lambda: ps.torch.new_group([]), "empty")
    # different lists on different ranks: every rank fails naming both
    mine = [0, 1] if r == 1 else [0, 2]
    msg = raises(ps.PSError, lambda: ps.torch.new_group(mine), "different",
                 "rank 0 passed [0, 2]", "rank 1 passed [0, 1]")
    raises(ps.PSError, lambda: ps.torch.grid(tp=2 if r == 1 else 1), "grid", "different settings",
           "rank 0 passed {'tp': 1, 'pp': 1}", "rank 1 passed {'tp': 2, 'pp': 1}")
    g = ps.torch.new_group([0, 2])  # the job's ring is still fine
    if r in (0, 2):
        raises(ValueError, lambda: ps.torch.broadcast(val(r), 2, group=g), "root_rank 2",
               "group ranks", "0..1")
        raises(ValueError, lambda: ps.torch.send(val(r), 2, group=g), "dst 2", "0..1")
        raises(ValueError, lambda: ps.torch.reduce_scatter(val(r, (3,)), group=g),
               "2 equal parts")
        raises(TypeError, lambda: ps.torch.allreduce(val(r), group=[0, 2]), "group=", "list")
        check(ps.torch.allgather_object(r, group=g) == [0, 2], "the group works after them")
    check(ps.torch.allgather_object(r) == list(range(W)), "the job works after them")

elif case in ("optimizer", "zero", "optimizer-ps", "momentum-ps"):
    # grid(pp=2): two "stages" with their own model (the same parameter
    # names), each trained by its two data-parallel replicas
    g = ps.torch.grid(pp=2)
    stage = g.pp_rank
    model = group_model(stage, perturb=g.dp_rank)  # replicas start apart...
    ps.torch.broadcast_parameters(model.state_dict(), root_rank=0, group=g.dp_group)
    if case == "zero":
        inner = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = ps.torch.DistributedOptimizer(inner, model.named_parameters(), group=g.dp_group,
                                        shard_optimizer_state=case == "zero", bucket_bytes=64)
    for step in range(4):
        x, y = group_step_data(stage, r, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    torch.save({"stage": stage, "dp_rank": g.dp_rank,
                "params": {k: v.detach().clone() for k, v in model.state_dict().items()}},
               out % r)
    check(True, f"rank {r} trained stage {stage} over {g.dp_group.ranks}")

elif case == "uneven":
    # rank 3 stops a step early: its group's ranks (2 and 3) fail naming
    # join and both by their job ranks, instead of rank 2 waiting for ever
    g = ps.torch.grid(pp=2)
    model = group_model(g.pp_rank)
    opt = ps.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        model.named_parameters(), group=g.dp_group)
    err = None
    try:
        for step in range(2 if r == 3 else 3):
            x, y = group_step_data(g.pp_rank, r, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        ps.shutdown()
    except ps.PSError as e:
        err = str(e)
    if r in (2, 3):
        check(err is not None and "rank 2 is at step 2" in err and "rank 3 finished" in err
              and "join" in err,
              f"rank {r} of {g.dp_group.ranks}: PSError naming join: {err}")
    else:
        check(True, f"rank {r} ended ({err})")
    sys.exit(0)

elif case == "overlap-ps":
    # ps mode: every rank builds its optimizer at once, each over its own
    # group; rank 3 picks a group that overlaps rank 2's
    g01, g23, g13 = (ps.torch.new_group(x) for x in ([0, 1], [2, 3], [1, 3]))
    g = g01 if r < 2 else g23 if r == 2 else g13
    model = group_model(0, perturb=1 if r == 1 else 0)
    raises(ps.PSError, lambda: ps.torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), group=g),
        "rank 2", "[2, 3]", "rank 3", "[1, 3]", "overlap")
    g = g01 if r < 2 else g23
    check(ps.torch.allgather_object(r, group=g) == g.ranks, "the groups work after the refusal")

else:
    raise SystemExit(f"unknown case {case}")

ps.shutdown()
