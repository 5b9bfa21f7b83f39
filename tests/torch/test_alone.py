"""A script started on its own runs as a job of one (issue 35): plain
`/usr/bin/python3 examples/torch/train_cnn.py`, no launcher, no PS_* (nor
RANK, WORLD_SIZE, ...) in the environment, trains in allreduce mode as rank 0
of 1, as Horovod's and DDP's scripts do, and says so in one line on stderr.
What an explicit setting asks for is kept: PS_SYNC_MODE=ps without servers
still exits 2 naming --servers, with no job-of-one line."""
import os
import re
import subprocess

import harness
from harness import check

harness.require_torch()
harness.require_dataset()
script = os.path.join(harness.HERE, "..", "..", "examples", "torch", "train_cnn.py")
# what a launcher or a cluster would have set: none of it reaches the script
LAYOUT_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "JOB_COMPLETION_INDEX")


def run(extra_env, timeout):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PS_") and k not in LAYOUT_VARS}
    # the package from the build tree, as an installed one would be found
    env["PYTHONPATH"] = os.path.join(harness.BUILD, "python")
    env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = "1"
    env.update(extra_env)
    p = subprocess.run(["/usr/bin/python3", script, "--data", harness.DATA, "--epochs", "1",
                        "--max-steps", "5"], capture_output=True, text=True, timeout=timeout,
                       env=env)
    print(p.stdout[-1500:], p.stderr[-1500:], sep="\n")
    return p


p = run({}, 170)
check(p.returncode == 0, f"python3 train_cnn.py alone exited {p.returncode}")
lines = [ln for ln in p.stderr.splitlines() if "running as a job of one" in ln]
check(len(lines) == 1 and "sync mode allreduce, rank 0 of 1" in lines[0],
      f"one line says it runs as a job of one: {lines}")
check("training a CNN on 1 worker(s), sync mode allreduce" in p.stdout,
      "it trained in allreduce mode on 1 worker")
check(re.search(r"^accuracy=[0-9.]+ epochs=1$", p.stdout, re.M) is not None,
      "it ended with the test accuracy")

p = run({"PS_SYNC_MODE": "ps"}, 60)
check(p.returncode == 2 and "--sync-mode ps needs --servers" in p.stderr
      and "job of one" not in p.stderr,
      f"an explicit --sync-mode ps without servers still exits 2 naming --servers "
      f"(exit {p.returncode})")
