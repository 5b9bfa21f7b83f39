"""The wheel (issue 35, Deliver 2): tools/build-wheel makes
ps-<version>-py3-none-<platform>.whl from this build; pip installs it
(--no-index: no network) into a fresh virtual environment of /usr/bin/python3
with the system's site-packages visible (Debian's torch); there the CNN
example trains as a job of one, and with 2 workers through
build/tools/ps-local in both sync modes, with ps and libps.so.0 both the
venv's: PYTHONPATH, PS_BUILD_DIR and PS_LIBPS unset, and every libps mapped
into each process lies under the venv's ps/_libs. Then ps.torch tests of
this folder run in the venv's Python against the wheel's package
(PS_TEST_PACKAGE=installed, harness.py): DDP equivalence in both sync modes,
SyncBatchNorm, the grid's groups, tensor and pipeline parallelism, the
settings and ps.pod.
   test_wheel.py BUILD"""
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile

import harness
from harness import check

harness.require_torch()
harness.require_dataset()
build = os.path.realpath(sys.argv[1])
root = os.path.realpath(os.path.join(harness.HERE, "..", ".."))
for mod, pkg in (("ensurepip", "python3-venv"), ("pip", "python3-pip")):
    if subprocess.run(["/usr/bin/python3", "-c", "import " + mod]).returncode != 0:
        harness.skip(f"/usr/bin/python3 has no {mod} (install {pkg})")
script = os.path.join(root, "examples", "torch", "train_cnn.py")
# Run in the venv's Python: says where ps and libps came from, then the example.
PROBE = ("import runpy, sys, ps\n"
         "maps = sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libps' in l})\n"
         "print('PSFILE', ps.__file__); print('LIBPS', ps._lib.path); print('MAPPED', maps)\n"
         "sys.argv = [sys.argv[1]] + sys.argv[2:]\n"
         "runpy.run_path(sys.argv[0], run_name='__main__')\n")
# A wheel of a build with NCCL carries the plugin: libps loads it from beside
# itself (ps/_libs), not from the build tree; on a machine without a GPU the
# device count is 0 with the reason.
NCCL_PROBE = ("import ctypes, ps._lib as L\n"
              "L.lib.ps_nccl_built.restype = ctypes.c_bool\n"
              "why = ctypes.create_string_buffer(512)\n"
              "built = L.lib.ps_nccl_built(); n = L.lib.ps_nccl_device_count(why, 512)\n"
              "maps = sorted({l.split()[-1] for l in open('/proc/self/maps')"
              " if 'libps-nccl' in l})\n"
              "print('NCCL', built, n, why.value.decode(), maps)\n")
ARGS = [script, "--data", harness.DATA, "--epochs", "1", "--max-steps", "5"]


def run(cmd, timeout, env=None):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    print("$", " ".join(cmd[:6]), "...", p.returncode, p.stdout[-1500:], p.stderr[-1500:],
          sep="\n")
    return p


def check_venv_run(out, venv, n):
    site = os.path.realpath(os.path.join(venv, "lib"))
    files = re.findall(r"^PSFILE (.*)$", out, re.M)
    check(len(files) == n and all(os.path.realpath(f).startswith(site) for f in files),
          f"ps is the venv's ({site}), in each of {n}: {files}")
    maps = re.findall(r"^MAPPED \[(.*)\]$", out, re.M)
    libs = [m.strip("'\" ") for line in maps for m in line.split(",")]
    check(len(maps) == n and libs and all(
        os.path.realpath(x).startswith(site) and "/ps/_libs/libps.so.0" in x for x in libs),
        f"the libps loaded is the wheel's, under {site}/.../ps/_libs: {libs}")
    check(re.search(r"^accuracy=[0-9.]+ ", out, re.M) is not None, "the example trained")


tmp = tempfile.mkdtemp(prefix="ps-wheel-test-")
try:
    dist = os.path.join(tmp, "dist")
    p = run([os.path.join(root, "tools", "build-wheel"), "--build", build, "--out", dist,
             "--no-rebuild"], 120)
    check(p.returncode == 0, f"tools/build-wheel exited {p.returncode}")
    plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    whl = [f for f in os.listdir(dist) if f.endswith(".whl")]
    check(len(whl) == 1 and re.fullmatch(rf"ps-[0-9.]+-py3-none-{plat}\.whl", whl[0]),
          f"one wheel ps-<version>-py3-none-{plat}.whl: {whl}")
    whl = os.path.join(dist, whl[0])
    names = zipfile.ZipFile(whl).namelist()
    for want in ("ps/__init__.py", "ps/_paths.py", "ps/_options.json", "ps/torch/optimizer.py",
                 "ps/_libs/libps.so.0"):
        check(want in names, f"the wheel carries {want}")
    # every module of the build's copy of the package (<build>/python/ps), so
    # one installed without tag python-runtime cannot go missing
    built = os.path.join(build, "python", "ps")
    mods = ["ps/" + os.path.relpath(os.path.join(d, f), built) for d, _, fs in os.walk(built)
            for f in fs if f.endswith((".py", ".json")) and f != "_paths_installed.py"]
    check(mods and set(mods) <= set(names),
          f"the wheel carries the whole package: missing {sorted(set(mods) - set(names))}")
    check(not [n for n in names if n.endswith(("ps-server", "ps-worker", ".a", ".h"))],
          "no binaries, static library or headers in the wheel")

    venv = os.path.join(tmp, "venv")
    p = run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", "--without-pip", venv],
            60)
    check(p.returncode == 0, "python3 -m venv --system-site-packages")
    py = os.path.join(venv, "bin", "python")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PS_") and k not in ("PYTHONPATH", "LD_LIBRARY_PATH")}
    env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = "1"
    p = run([py, "-m", "pip", "install", "--no-index", "--no-deps", "--no-cache-dir",
             "--disable-pip-version-check", whl], 120, env)
    check(p.returncode == 0, "pip install --no-index the wheel into the venv")

    # a job of one: plain `python train_cnn.py` in the venv, from a neutral cwd
    os.chdir(tmp)
    p = run([py, "-c", PROBE] + ARGS, 120, env)
    check(p.returncode == 0, f"the example in the venv exited {p.returncode}")
    check_venv_run(p.stdout, venv, 1)

    if "ps/_libs/libps-nccl.so" in names:
        p = run([py, "-c", NCCL_PROBE], 60, env)
        m = re.search(r"^NCCL (True|False) (\d+) (.*) \[(.*)\]$", p.stdout, re.M)
        check(p.returncode == 0 and m and m.group(1) == "True"
              and m.group(4).strip("'").startswith(os.path.realpath(venv))
              and m.group(4).strip("'").endswith("/ps/_libs/libps-nccl.so"),
              f"the wheel's NCCL plugin is the one libps loads: {m and m.group(0)}")

    # 2 workers on the ring through the build's launcher; it puts <build>/python
    # first on PYTHONPATH for a command, which -E keeps out of the venv's Python
    # (rank 0 writes to ps-local's stdout, rank 1 to its log)
    launcher = os.path.join(build, "tools", "ps-local")
    # in both sync modes (ps mode: 1 shard, the build's ps-server)
    for mode in (["--sync-mode", "allreduce"], ["--shards", "1"]):
        logs = os.path.join(tmp, "logs" + mode[1])
        p = run([launcher, *mode, "--workers", "2", "--keep-logs", logs, "--",
                 py, "-E", "-c", PROBE] + ARGS, 150, env)
        check(p.returncode == 0, f"2 workers in the venv, {mode}: ps-local exited {p.returncode}")
        with open(os.path.join(logs, "worker-1.log")) as f:
            check_venv_run(p.stdout + f.read(), venv, 2)

    # ps.torch's own tests, run by the venv's Python on the wheel's package
    # (the shards are the build's ps-server); harness.py fails any process
    # that imports it and finds the build's ps
    tenv = dict(env, PS_TEST_PACKAGE="installed", PS_BUILD_DIR=build, PS_DATA_DIR=harness.DATA,
                PYTHONDONTWRITEBYTECODE="1")
    where = run([py, "-c", "import ps, ps.torch, ps.pod; print(ps.__file__)"], 60, tenv)
    check(where.returncode == 0 and os.path.realpath(where.stdout.strip()).startswith(
        os.path.realpath(venv)), f"the venv's Python imports the wheel's ps: {where.stdout}")
    for case in (["test_equivalence.py", "sum"], ["test_equivalence.py", "ring"],
                 ["test_ddp.py", "syncbn", "ring"], ["test_groups.py", "grid"],
                 ["test_tensor_parallel.py", "mlp"], ["test_pipeline.py", "1f1b", "ring"],
                 ["test_settings.py"], ["test_pod.py"]):
        p = run([py, os.path.join(harness.HERE, case[0]), *case[1:]], 180, tenv)
        check(p.returncode == 0, f"ps.torch's {' '.join(case)} in the venv exited {p.returncode}")
finally:
    os.chdir("/")
    shutil.rmtree(tmp, ignore_errors=True)
