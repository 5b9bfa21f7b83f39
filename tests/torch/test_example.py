"""The CNN example (examples/torch/train_cnn.py) through the launcher, as
README says to run it: tools/ps-local -- /usr/bin/python3 train_cnn.py.
 ps mode, 2 shards (sum) + 2 workers, 2 epochs: a progress line per epoch and
 a final test accuracy of at least 0.88; allreduce mode: the same script
 runs on the ring (a short run)."""
import os
import re
import subprocess

import harness
from harness import check

harness.require_torch()
harness.require_dataset()
script = os.path.join(harness.HERE, "..", "..", "examples", "torch", "train_cnn.py")
launcher = os.path.join(harness.BUILD, "tools", "ps-local")


def run(args, timeout):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # ps-local puts <build>/python there itself
    p = subprocess.run([launcher, *args, "--", "/usr/bin/python3", script, "--data",
                        harness.DATA, *extra[args[0]]], capture_output=True, text=True,
                       timeout=timeout, env=env)
    print(p.stdout[-2000:], p.stderr[-2000:], sep="\n")
    return p


extra = {"--shards": ["--epochs", "2"], "--sync-mode": ["--epochs", "1", "--max-steps", "30"]}
p = run(["--shards", "2", "--workers", "2"], 600)
check(p.returncode == 0, f"ps mode: ps-local exited {p.returncode}")
epochs = re.findall(r"^epoch (\d)/2 .*test accuracy ([0-9.]+)", p.stdout, re.M)
check([e for e, _ in epochs] == ["1", "2"], f"a progress line per epoch: {epochs}")
m = re.search(r"^accuracy=([0-9.]+) epochs=2$", p.stdout, re.M)
check(m is not None, "a final accuracy line")
check(float(m.group(1)) >= 0.88, f"test accuracy {m.group(1)} >= 0.88 after 2 epochs")

p = run(["--sync-mode", "allreduce", "--workers", "2"], 300)
check(p.returncode == 0, f"allreduce mode: ps-local exited {p.returncode}")
check("sync mode allreduce" in p.stdout and re.search(r"^accuracy=", p.stdout, re.M),
      "the same script trained on the ring")
