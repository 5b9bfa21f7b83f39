"""Every misuse of ps.torch a single process can show gets an error that
names what is wrong (no hang, no crash): bad tensors (non-contiguous,
non-float32, not on the CPU), duplicate or missing parameter names, a
backward pass after the window of backward_passes_per_step was synchronised
and before step(), step in skip_synchronize without synchronize, a bad root
rank, bad settings (with exit 2 when uncaught), an unreachable shard (exit
129 when uncaught)."""
import os
import subprocess
import sys

import harness
from harness import check

harness.require_torch()
import torch  # noqa: E402

import ps  # noqa: E402
import ps.torch  # noqa: E402


def raises(kind, words, fn, what):
    try:
        fn()
    except kind as e:
        msg = str(e)
        check(all(w in msg for w in words), f"{what}: {kind.__name__}: {msg}")
        return
    except Exception as e:  # noqa: BLE001
        harness.fail(f"{what}: expected {kind.__name__}, got {type(e).__name__}: {e}")
    harness.fail(f"{what}: no error")


# -- settings --------------------------------------------------------------
for kw, words in [
    (dict(sync_mode="bogus"), ["--sync-mode", "expected ps or allreduce"]),
    (dict(world_size=0), ["--world-size", "outside"]),
    (dict(world_size=2, rank=2), ["--rank", "below --world-size"]),
    (dict(rank="x"), ["--rank", "a number or auto"]),
    (dict(sync_mode="ps"), ["--servers or --server-template"]),
    (dict(sync_mode="ps", servers="nohostport"), ["--servers", "host:port"]),
    (dict(bogus_option=1), ["unknown option --bogus-option"]),
    (dict(sync_mode="allreduce", world_size=2, peers="127.0.0.1:1"),
     ["--peers", "1 addresses for --world-size 2"]),
    (dict(auth_token_file="/nonexistent/token", sync_mode="allreduce"),
     ["--auth-token-file", "/nonexistent/token"]),
]:
    raises(ps.ConfigError, words, lambda: ps.init(**kw), f"ps.init({kw})")
check(not ps.is_initialized(), "a failed ps.init() leaves nothing behind")
env = dict(os.environ, PS_WORLD_SIZE="many")
p = subprocess.run([sys.executable, "-c", "import ps; ps.init()"], env=env,
                   capture_output=True, text=True, timeout=60)
check(p.returncode == 2 and "--world-size (PS_WORLD_SIZE)" in p.stderr,
      f"an uncaught ConfigError exits 2 and names the variable (exit {p.returncode})")

# a shard nobody listens on: retryable, exit 129 when uncaught
s = __import__("socket").socket()
s.bind(("127.0.0.1", 0))
dead = "127.0.0.1:%d" % s.getsockname()[1]
s.close()
env = dict(os.environ, PS_SERVERS=dead, PS_CONNECT_TIMEOUT_MS="300")
p = subprocess.run([sys.executable, "-c", "import ps; ps.init()"], env=env,
                   capture_output=True, text=True, timeout=60)
check(p.returncode == 129 and "RetryableError" in p.stderr and dead in p.stderr,
      f"an unreachable shard: RetryableError naming it, exit 129 (exit {p.returncode}: "
      f"{p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ''})")

# -- tensors and the optimizer (one rank, allreduce mode: no peers needed) ---
ps.init(sync_mode="allreduce", world_size=1)
raises(ps.PSError, ["already called"], lambda: ps.init(), "ps.init() twice")
t = torch.arange(6.0).reshape(2, 3)
raises(TypeError, ["not contiguous"], lambda: ps.torch.allreduce(t.t()), "non-contiguous")
raises(TypeError, ["torch.bool", "reduces float32, float64, float16, bfloat16, int8"],
       lambda: ps.torch.allreduce(t.bool()), "bool")
double = torch.nn.Linear(2, 2).double()
raises(TypeError, ["parameter weight: dtype torch.float64", "takes float32"],
       lambda: ps.torch.DistributedOptimizer(torch.optim.SGD(double.parameters(), lr=0.1),
                                             double.named_parameters()),
       "float64 parameters in the optimizer")
raises(TypeError, ["meta tensor", "CPU tensors"],
       lambda: ps.torch.allreduce(torch.empty(3, device="meta")),
       "a tensor not on the CPU (meta stands in for cuda, which this torch lacks)")
raises(ValueError, ["root_rank 3"],
       lambda: ps.torch.broadcast_parameters({"t": t}, root_rank=3), "bad root rank")
raises(TypeError, ["state_dict or (name, tensor) pairs"],
       lambda: ps.torch.broadcast_parameters([t], root_rank=0), "broadcast of a bare list")

model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
raises(ValueError, ["duplicate names ['w']"],
       lambda: ps.torch.DistributedOptimizer(opt, [("w", model.weight), ("w", model.bias)]),
       "duplicate names")
raises(ValueError, ["misses 1 parameter"],
       lambda: ps.torch.DistributedOptimizer(opt, [("w", model.weight)]),
       "a parameter left unnamed")
raises(ValueError, ["backward_passes_per_step must be >= 1"],
       lambda: ps.torch.DistributedOptimizer(opt, model.named_parameters(),
                                             backward_passes_per_step=0), "bpps 0")

dopt = ps.torch.DistributedOptimizer(opt, model.named_parameters(), backward_passes_per_step=2)
check(isinstance(dopt, torch.optim.SGD), "the wrapped optimizer is still an SGD")
x = torch.randn(3, 4)
model(x).sum().backward()
model(x).sum().backward()  # the second of two: synchronised when it returns
raises(RuntimeError, ["backward() again before step()", "no_sync()"],
       lambda: model(x).sum().backward(), "a third backward before step()")
dopt.step()
dopt.zero_grad()
model(x).sum().backward()  # one pass of two: not synchronised yet
def step_skipped():
    with dopt.skip_synchronize():
        dopt.step()


raises(RuntimeError, ["without synchronize() first"], step_skipped,
       "step() in skip_synchronize() without synchronize()")
dopt.synchronize()
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
with dopt.skip_synchronize():
    dopt.step()
check(True, "synchronize(), clipping, then step() in skip_synchronize() works")
ps.shutdown()
check(not ps.is_initialized(), "shutdown() ends the job")
