"""The Python package's option table is ps-worker's (issue 31): every option
ps.init() takes that ps-worker also has carries the binary's default, help,
bounds and choices, read from `ps-worker --help=json` now, not from the
_options.json the build wrote. Bounds and choices are checked through the
parsers themselves (max accepted, max + 1 refused, ...), so a rule the Python
side applies differently fails too. Then a copy of the package with a
tampered _options.json must fail the same check: the check sees drift.
   test_options_table.py [--check]   (--check: only compare, exit 1 on drift)"""
import json
import os
import shutil
import subprocess
import sys
import tempfile


def binary_table():
    worker = os.path.join(os.environ["PS_BUILD_DIR"], "ps-worker", "ps-worker")
    p = subprocess.run([worker, "--help=json"], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        sys.exit(f"FAIL: ps-worker --help=json exited {p.returncode}: {p.stderr}")
    return {o["name"]: o for o in json.loads(p.stdout)["options"]}


def accepts(parse, v):
    try:
        parse(v)
        return True
    except ValueError:
        return False


def mismatches(settings, table):
    out = []
    own = {o[0] for o in settings.PYTHON_ONLY}
    for name, parse, default, help_ in settings.OPTIONS:
        o = table.get(name)
        if name in own:
            if o is not None:
                out.append(f"--{name}: declared Python-only, but ps-worker has it")
            continue
        if o is None:
            out.append(f"--{name}: ps-worker has no such option")
            continue
        if default != o["default"]:
            out.append(f"--{name}: default {default!r}, ps-worker {o['default']!r}")
        if help_ != o["help"]:
            out.append(f"--{name}: help differs from ps-worker's")
        if o["type"] in ("int", "size") and o["max"] is not None:
            lo, hi = o["min"], o["max"]
            for v, want in ((lo, True), (hi, True), (lo - 1, False), (hi + 1, False)):
                if v < 0 and o["type"] == "size":
                    continue
                if accepts(parse, str(v)) != want:
                    out.append(f"--{name}: {v} {'refused' if want else 'accepted'}, "
                               f"ps-worker's range is [{lo}, {hi}]")
        for c in o.get("choices", []):
            if not accepts(parse, c):
                out.append(f"--{name}: refuses {c!r}, one of ps-worker's choices")
        if o.get("choices") and accepts(parse, "no-such-choice"):
            out.append(f"--{name}: accepts a value outside {o['choices']}")
    return out


def check():
    import ps._settings as settings
    bad = mismatches(settings, binary_table())
    for m in bad:
        print("drift:", m)
    return 1 if bad else 0


def main():
    if sys.argv[1:] == ["--check"]:
        sys.exit(check())
    import ps._settings as settings
    table = binary_table()
    bad = mismatches(settings, table)
    if bad:
        sys.exit("FAIL: the Python table drifted from ps-worker's:\n  " + "\n  ".join(bad))
    n = len(settings.OPTIONS) - len(settings.PYTHON_ONLY)
    print(f"ok: {n} options match ps-worker's, {len(settings.PYTHON_ONLY)} are Python-only")

    # A tampered copy of the package: the same check must name each change.
    tmp = tempfile.mkdtemp(prefix="ps-options-table-")
    try:
        pkg = os.path.join(tmp, "ps")
        shutil.copytree(os.path.dirname(settings.__file__), pkg,
                        ignore=shutil.ignore_patterns("__pycache__"))
        path = os.path.join(pkg, "_options.json")
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        for o in doc["options"]:
            if o["name"] == "world-size":
                o["default"] = 2
            if o["name"] == "peer-timeout-ms":
                o["max"] += 1
        os.chmod(path, 0o644)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        env = dict(os.environ, PYTHONPATH=tmp)
        p = subprocess.run([sys.executable, __file__, "--check"], env=env, capture_output=True,
                           text=True, timeout=120)
        if p.returncode != 1 or "--world-size: default 2" not in p.stdout or \
                "--peer-timeout-ms: 100000001 accepted" not in p.stdout:
            sys.exit(f"FAIL: a tampered table passed or failed oddly (exit {p.returncode}):\n"
                     f"{p.stdout}{p.stderr}")
        print("ok: a tampered _options.json is caught:", p.stdout.strip().replace("\n", "; "))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
