"""`meson install` puts the ps package where Debian's /usr/bin/python3 finds
it, pointing at the installed libps.so.0: installed into a DESTDIR, the
package's directory (DESTDIR stripped) is on this Python's default sys.path,
its _paths.py names the installed library, which exists, and the package
imported from the DESTDIR trains a step with ps.torch.
   test_installed.py BUILD MESON"""
import os
import shutil
import subprocess
import sys
import tempfile

import harness
from harness import check

harness.require_torch()
build, meson = sys.argv[1], sys.argv[2]
if not meson:
    harness.fail("meson not found")
tmp = tempfile.mkdtemp(prefix="ps-torch-installed-")
try:
    dest = os.path.join(tmp, "dest")
    p = subprocess.run([meson, "install", "-C", build, "--destdir", dest, "--no-rebuild"],
                       capture_output=True, text=True, timeout=300)
    check(p.returncode == 0, "meson install --destdir" + ("" if p.returncode == 0 else
                                                           ": " + p.stdout[-2000:] + p.stderr))
    inits = [os.path.join(d, "__init__.py") for d, _, fs in os.walk(dest)
             if d.endswith(os.path.join("dist-packages", "ps")) and "__init__.py" in fs]
    check(len(inits) == 1, f"one installed ps package: {inits}")
    pkg = os.path.dirname(inits[0])
    site = os.path.dirname(pkg)[len(dest):]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_LIBRARY_PATH")}
    q = subprocess.run(["/usr/bin/python3", "-c", "import sys; print('\\n'.join(sys.path))"],
                       capture_output=True, text=True, env=env)
    check(site in q.stdout.split(), f"{site} is on /usr/bin/python3's default sys.path")
    paths = {}
    exec(open(os.path.join(pkg, "_paths.py")).read(), paths)
    lib = paths["LIBPS"]
    check(lib.endswith("/libps.so.0") and os.path.exists(dest + lib),
          f"_paths.py names the installed {lib}")
    check(os.path.exists(os.path.join(pkg, "torch", "optimizer.py")), "ps.torch is installed")
    code = ("import torch, ps, ps.torch\n"
            "ps.init(sync_mode='allreduce', world_size=1)\n"
            "m = torch.nn.Linear(3, 1)\n"
            "o = ps.torch.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=1.0),"
            " m.named_parameters())\n"
            "before = m.weight.detach().clone()\n"
            "m(torch.ones(2, 3)).sum().backward(); o.step()\n"
            "assert not torch.equal(before, m.weight), 'no step'\n"
            "print('trained with', ps._lib.path); ps.shutdown()\n")
    env.update(PYTHONPATH=dest + site, PS_LIBPS=dest + lib)
    r = subprocess.run(["/usr/bin/python3", "-c", code], capture_output=True, text=True,
                       env=env, timeout=120)
    check(r.returncode == 0 and dest + lib in r.stdout,
          f"the installed package trains a step: {r.stdout.strip()} {r.stderr.strip()[-500:]}")
finally:
    shutil.rmtree(tmp, ignore_errors=True)
