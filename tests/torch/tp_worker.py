"""Worker of tests/torch/test_tensor_parallel.py: one rank of a job running
one case of ps.torch.tensor_parallel; prints `ok: ...` per check (or exits
1 naming the first that failed) and saves its parameters (first and last,
each with the dimension it is split along) for the test's single-process
reference.
   tp_worker.py CASE OUT"""
import sys

import torch
from torch.nn import functional as F

import ps
from worker_checks import check, raises
import ps.torch
from ps.torch import tensor_parallel as tp
from tp_model import (BATCH, D, HIDDEN, SEED, SEQ, STEPS, Counter, DenseMLP, TpLM, TpMLP,
                      lm_data, mlp_data, optimizer)

case, out = sys.argv[1], sys.argv[2]
ps.init()
r, W = ps.rank(), ps.size()


def params(model):
    return {n: (p.detach().clone(), getattr(p, "partition_dim", None))
            for n, p in model.named_parameters()}


def handle(group):
    coll = ps._current().ring() if group is None else group._coll
    return coll.value if hasattr(coll, "value") else coll


def count_block(up, down, group, sp):
    """The collectives of one Column->Row pair, forward and backward, with
    an input that needs its gradient (a layer before it)."""
    rows = SEQ // up.tp_size if sp else SEQ
    x = torch.randn(rows, BATCH, D, requires_grad=True)
    with Counter() as fwd:
        y = down(F.gelu(up(x)))
    with Counter() as bwd:
        y.sum().backward()
    want = {"all-gather": 1, "reduce-scatter": 1} if sp else {"all-reduce": 1}
    mode = "sequence parallel" if sp else "tensor parallel"
    for what, c in (("forward", fwd), ("backward", bwd)):
        check(c.kinds() == want and c.handles() == {handle(group)},
              f"one Column->Row block, {mode}, {what}: {c.kinds()} on the tensor-parallel "
              f"group (Megatron's: {want})")
    check(x.grad is not None and x.grad.abs().sum() > 0, "the block's input has a gradient")
    up.zero_grad()
    down.zero_grad()


def train(model, loss_of, opt, group, sp, dp_rank=0, expect=None):
    first = params(model)
    for step in range(STEPS):
        opt.zero_grad()
        if step == 0:
            with Counter() as fwd:
                loss = loss_of(step, dp_rank)
            with Counter() as bwd:
                loss.backward()
            got = (fwd.kinds(), bwd.kinds())
            print(f"collectives of the whole model: forward {got[0]}, backward {got[1]}",
                  flush=True)
            if expect is not None:
                check(got == expect, f"the whole model's collectives: {got} (expected {expect})")
        else:
            loss = loss_of(step, dp_rank)
            loss.backward()
        if sp:
            n = tp.allreduce_sequence_parallel_grads(model, group)
            check(n == 3, f"step {step}: {n} sequence-parallel gradients summed (pre.weight, "
                  "pre.bias, down.bias)")
        opt.step()
        print(f"step {step}: loss {loss.item():.6f}", flush=True)
    return first


if case == "mlp":
    # group=None: the whole job (W=2) is the tensor-parallel group
    torch.manual_seed(SEED)
    model = TpMLP(DenseMLP(), None)
    count_block(model.up, model.down, None, False)

    def loss_of(step, _):
        x, y = mlp_data(step)
        return F.mse_loss(model(x), y)
    first = train(model, loss_of, optimizer(model.parameters()), None, False)
    torch.save({"tp": W, "tp_rank": r, "dp_rank": 0, "first": first, "last": params(model)},
               out % r)

elif case in ("lm", "lm-sp", "grid", "grid-sp", "grid-ps", "tp4-sp"):
    sp = case.endswith("-sp")
    t = 4 if case == "tp4-sp" else 2
    g = ps.torch.grid(tp=t)
    torch.manual_seed(SEED)
    # tp=4: padded to 20, 5 ids per rank; the last rank's are all padding
    padded, pad = (20, 20) if t == 4 else (14, 2)
    model = TpLM(g.tp_group, sp, pad)
    check(model.emb.num_embeddings_padded == padded and
          model.emb.weight.shape == (padded // t, D),
          f"the vocabulary padded to {padded}, rows {model.emb.vocab_start}.."
          f"{model.emb.vocab_end - 1} here")
    opt = optimizer(model.parameters())
    if case.startswith("grid"):
        first = params(model)  # before the optimizer: in ps mode it pulls the shards' values
        opt = ps.torch.DistributedOptimizer(opt, model.named_parameters(), group=g.dp_group)
    if not case.startswith("grid"):
        up = tp.ColumnParallelLinear(D, HIDDEN, group=g.tp_group, sequence_parallel=sp)
        down = tp.RowParallelLinear(HIDDEN, D, group=g.tp_group, sequence_parallel=sp)
        count_block(up, down, g.tp_group, sp)

    def loss_of(step, replica):
        ids, target = lm_data(step, replica)
        return model(ids, target)
    # the embedding, the block, the tied output layer and the cross-entropy
    expect = (({"reduce-scatter": 2, "all-gather": 2, "all-reduce": 3},
               {"reduce-scatter": 2, "all-gather": 2}) if sp else
              ({"all-reduce": 5}, {"all-reduce": 2}))
    got_first = train(model, loss_of, opt, g.tp_group, sp, g.dp_rank,
                      None if case.startswith("grid") else expect)
    if not case.startswith("grid"):
        first = got_first
    torch.save({"tp": t, "tp_rank": g.tp_rank, "dp_rank": g.dp_rank, "first": first,
                "last": params(model)}, out % r)

elif case == "errors":
    # every refusal below happens before anything reaches libps
    g0 = ps.torch.new_group([0])
    with Counter() as c:
        raises(ValueError, lambda: tp.ColumnParallelLinear(D, 15), "ColumnParallelLinear(8, 15)",
               "out_features=15", "2 ranks")
        raises(ValueError, lambda: tp.RowParallelLinear(15, D), "in_features=15", "t=2")
        raises(ValueError, lambda: tp.ColumnParallelLinear.from_dense(torch.nn.Linear(D, 9)),
               "out_features=9")
        raises(ValueError, lambda: tp.VocabParallelEmbedding(13, D), "vocabulary of 13 ids",
               "2 ranks", "pad_vocab_to=2", "14 ids")
        raises(ValueError, lambda: tp.VocabParallelEmbedding.from_dense(torch.nn.Embedding(13, D)),
               "pad_vocab_to=2")
        raises(ValueError, lambda: tp.VocabParallelEmbedding(13, D, pad_vocab_to=5),
               "padded to a multiple of 5 (15 ids)", "pad_vocab_to=2")
        raises(ValueError, lambda: tp.ColumnParallelLinear(D, HIDDEN, gather_output=True,
                                                           sequence_parallel=True),
               "gather_output=False")
        raises(ValueError, lambda: tp.RowParallelLinear(HIDDEN, D, input_is_parallel=False,
                                                        sequence_parallel=True),
               "input_is_parallel=True")
        col = tp.ColumnParallelLinear(D, HIDDEN)
        row = tp.RowParallelLinear(HIDDEN, D)
        raises(ValueError, lambda: col(torch.randn(3, 7)), "ColumnParallelLinear(8, 16)",
               "last dimension is 7", "expected 8")
        raises(ValueError, lambda: row(torch.randn(3, HIDDEN)), "last dimension is 16",
               "expected 8", "input_is_parallel")
        rsp = tp.RowParallelLinear(HIDDEN, D, sequence_parallel=True)
        raises(ValueError, lambda: rsp(torch.randn(3, BATCH, HIDDEN // 2)), "sequence dimension",
               "(3, 3, 8)")
        emb = tp.VocabParallelEmbedding(14, D)
        raises(ValueError, lambda: emb(torch.tensor([[3, 14]])), "id 14", "0..13")
        raises(TypeError, lambda: emb(torch.tensor([1.0])), "integer ids")
        ce = tp.vocab_parallel_cross_entropy
        raises(ValueError, lambda: ce(torch.randn(4, 7), torch.zeros(5, dtype=torch.long),
                                      vocab_size=13), "target of shape (5,)", "(4, 7)")
        raises(ValueError, lambda: ce(torch.randn(4, 7), torch.tensor([0, 1, 2, 13]),
                                      vocab_size=13), "target 13", "0..12")
        raises(ValueError, lambda: ce(torch.randn(4, 7), torch.zeros(4, dtype=torch.long),
                                      vocab_size=15), "vocab_size=15", "1..14")
        if r == 1:  # not in g0: every entry point refuses, naming this rank and the group
            for fn in (lambda: tp.ColumnParallelLinear(D, HIDDEN, group=g0),
                       lambda: tp.RowParallelLinear.from_dense(torch.nn.Linear(D, D), group=g0),
                       lambda: tp.VocabParallelEmbedding(14, D, group=g0),
                       lambda: ce(torch.randn(4, 7), torch.zeros(4, dtype=torch.long), group=g0),
                       lambda: tp.copy_to_tensor_parallel_region(torch.ones(2), g0)):
                raises(ps.PSError, fn, "rank 1", "group [0]", "not in the group")
        else:  # a group of one: t=1, the layers are dense
            one = tp.ColumnParallelLinear(D, 15, group=g0)
            check(one.weight.shape == (15, D) and one(torch.ones(2, D)).shape == (2, 15),
                  "a group of one rank holds the whole layer")
    check(c.calls == [], f"nothing reached libps during the refusals ({len(c.calls)} calls)")
    check(ps.torch.allgather_object(r) == list(range(W)), "the job works after them")

else:
    raise SystemExit(f"unknown case {case}")

ps.shutdown()
