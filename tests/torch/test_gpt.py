"""The GPT example (examples/torch/train_gpt.py) in a layout against one
process running the same script (t = p = d = 1) on the same global batch,
the same micro-batches accumulated: after 3 steps of SGD with momentum on a
tiny model
(2 layers, width 32, 4 heads, context 16, 8 sequences per replica in 2
micro-batches) the loss of every step and every rank's parameters equal the
single process's (the matching slice of each tensor) within 1e-5 relative
(the largest difference over the tensor's largest magnitude). Not Adam: the
gradient of attention's key bias is zero but for rounding (softmax ignores a
shift), and Adam's first steps turn any rounding into +-lr.
   test_gpt.py CASE
 ring-t2p2    W=4, allreduce: t=2 x p=2 (1F1B), the embedding tied across
              the two stages
 sum-t2d2     W=4, ps (2 shards, --optimizer sum): t=2 x d=2
 sum-p2d2     W=4, ps: p=2 (GPipe) x d=2
 ring-p3      W=3, allreduce: p=3 of 3 layers (a middle stage, which holds
              neither end of the tied embedding)
 ring-d4      W=4, allreduce: d=4, pure data parallelism
 ring-t2p2d2  W=8, allreduce: t=2 x p=2 x d=2 (meson -Dslow_tests=true)
 errors       bad settings exit 2 naming the option: t not dividing the
              heads or the padded vocabulary, p above the layers, an
              unknown schedule, no text, t x p not dividing W"""
import os
import re
import sys
import time

import harness
from harness import check, Job

harness.require_torch()
import torch  # noqa: E402

SCRIPT = os.path.join(harness.HERE, "..", "..", "examples", "torch", "train_gpt.py")
TINY = ["--layers", "2", "--width", "32", "--heads", "4", "--context", "16", "--steps", "3",
        "--micro-batches", "2", "--val-batches", "1", "--log-every", "1", "--optimizer", "sgd",
        "--lr", "0.1"]
ROWS, TOL = 8, 1e-5
case = sys.argv[1]
LAYOUTS = {"ring-t2p2": ("allreduce", 2, 2, 1, "1f1b"), "sum-t2d2": ("ps", 2, 1, 2, "1f1b"),
           "sum-p2d2": ("ps", 1, 2, 2, "gpipe"), "ring-d4": ("allreduce", 1, 1, 4, "1f1b"),
           "ring-p3": ("allreduce", 1, 3, 1, "1f1b"),
           "ring-t2p2d2": ("allreduce", 2, 2, 2, "1f1b")}
if not os.path.isdir("/usr/share/common-licenses"):
    harness.skip("no /usr/share/common-licenses (Debian's base-files)")


def run(name, world, sync, args, timeout=150):
    """Runs the script on `world` workers; returns each rank's saved file."""
    with Job(f"gpt-{name}") as job:
        if sync == "ps":
            job.start_shards(2, world, "--optimizer", "sum")
        out = job.path("r%d.pt")
        started = time.monotonic()
        job.start_workers(SCRIPT, world, sync, TINY + ["--save", out] + args,
                          env={"PS_PEER_TIMEOUT_MS": "20000"})
        codes = job.wait_workers(timeout)
        for r in range(world):
            check(codes[r] == 0, f"{name}: worker {r} exited {codes[r]}" +
                  ("" if codes[r] == 0 else ": " + job.log(f"worker-{r}.log")))
        print(f"{name}: {time.monotonic() - started:.1f} s", flush=True)
        print(job.log("worker-0.log")[-600:], flush=True)
        return [torch.load(out % r) for r in range(world)]


def rel(a, b):
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


if case == "errors":
    import subprocess
    env = dict(os.environ, PS_WORLD_SIZE="4", PS_RANK="0", PS_SYNC_MODE="allreduce")
    for args, words in ((["--tensor-parallel", "3"], ["--tensor-parallel 3", "--heads 4"]),
                        (["--tensor-parallel", "4", "--heads", "8", "--pad-vocab", "6"],
                         ["--tensor-parallel 4", "--pad-vocab 6"]),
                        (["--pipeline-stages", "3"], ["--pipeline-stages 3", "--layers 2"]),
                        (["--pipeline-schedule", "zb-h1"], ["--pipeline-schedule", "zb-h1"]),
                        (["--micro-batches", "3"], ["--micro-batches 3", "--batch-size 8"]),
                        (["--width", "0"], ["--width"]),
                        (["--text", "/nonexistent"], ["--text /nonexistent"])):
        p = subprocess.run([sys.executable, SCRIPT, *TINY, "--batch-size", "8", *args],
                           capture_output=True, text=True, env=env, timeout=60)
        check(p.returncode == 2 and all(w in p.stderr for w in words),
              f"{' '.join(args)}: exit {p.returncode} naming {words}: {p.stderr.strip()[-200:]}")
    # t x p must divide W: W=2 workers asked for t=2 x p=2
    with Job("gpt-world") as job:
        job.start_workers(SCRIPT, 2, "allreduce", TINY + ["--tensor-parallel", "2",
                                                         "--pipeline-stages", "2"])
        codes = job.wait_workers(60)
        log = job.log("worker-0.log")
        check(codes == [2, 2] and "must divide the 2 workers" in log,
              f"t=2 x p=2 on 2 workers: exits {codes}, naming them: {log.strip()[-200:]}")
    sys.exit(0)

sync, t, p, d, sched = LAYOUTS[case]
for need, mod in ((t > 1, "tensor_parallel"), (p > 1, "pipeline")):
    if need and not os.path.exists(os.path.join(harness.BUILD, "python", "ps", "torch",
                                                mod + ".py")):
        harness.skip(f"no ps.torch.{mod} in this tree yet (issue 33)")
layout = ["--tensor-parallel", str(t), "--pipeline-stages", str(p), "--pipeline-schedule", sched]
more = ["--layers", str(p)] if p > 2 else []
ref = run("reference", 1, "allreduce", ["--batch-size", str(ROWS * d),
                                        "--micro-batches", str(2 * d)] + more)[0]
got = run(case, t * p * d, sync, layout + ["--batch-size", str(ROWS)] + more)
want = ref["params"]
last = [g for g in got if g["grid"]["pp"] == p - 1]
check(len(ref["losses"]) == 3, f"the reference recorded 3 losses: {ref['losses']}")
for g in last:
    errs = [abs(a - b) / abs(b) for a, b in zip(g["losses"], ref["losses"])]
    check(len(errs) == 3 and max(errs) <= TOL,
          f"{g['grid']}: the losses per step {g['losses']} equal the reference's "
          f"{ref['losses']} (largest relative difference {max(errs):.1e})")
seen = set()
worst = (0.0, "")
for r, g in enumerate(got):
    c = g["grid"]
    check((c["t"], c["p"], c["d"]) == (t, p, d) and r == c["tp"] + t * (c["dp"] + d * c["pp"]),
          f"rank {r} is tp {c['tp']}, pp {c['pp']}, dp {c['dp']} in Megatron's order")
    for name, v in g["params"].items():
        dim = g["split"].get(name)
        w = want[name] if dim is None else want[name].chunk(t, dim)[c["tp"]]
        if v.shape != w.shape:
            check(False, f"rank {r}: {name} has shape {tuple(v.shape)}, the reference's slice "
                  f"{tuple(w.shape)}")
        e = rel(v, w)
        worst = max(worst, (e, f"rank {r} {name}"))
        if e > TOL:
            check(False, f"rank {r}: {name} differs from the reference by {e:.1e} relative")
        seen.add(name)
check(seen == set(want), f"every tensor of the model is on some rank (missing "
      f"{sorted(set(want) - seen)}, unknown {sorted(seen - set(want))})")
check(worst[0] <= TOL, f"every rank's parameters equal the reference's slices within {TOL} "
      f"(largest relative difference {worst[0]:.1e}, {worst[1]})")
print(f"case {case}: ok", flush=True)
