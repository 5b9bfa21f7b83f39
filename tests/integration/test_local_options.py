#!/usr/bin/env python3
"""ps-local and the binaries agree on every option (issue 31): ps-local
forwards ps-worker's and ps-server's entries instead of declaring copies, so
each of its options is either its own (OWN, with why) or the binary's entry:
the same type, a default and bounds the binary accepts, the same choices,
and the binary's help and default unless ps-local overrides them on purpose
(the override lists below; an override that no longer differs fails too, so
the lists cannot go stale). Every dump must be one JSON document.
   test_local_options.py BUILD_DIR"""
import json
import os
import subprocess
import sys

# ps-local's own options; worker-timeout is text passed on as given, so
# that the shards' default applies when the user gives none.
OWN = {"shards", "workers", "lr-schedule", "bin-dir", "keep-logs", "no-auth", "worker-timeout"}
# across hosts (tools/launch/local_nodes.c)
OWN |= {"nodes", "node-rank", "rendezvous", "rendezvous-timeout", "workers-per-node",
        "shards-per-node"}
# Defaults ps-local chooses for its runs (batch 256, lr 0.2), or leaves
# unset so that the mode decides (optimizer, log-level, on-worker-timeout).
DEFAULT_OVERRIDES = {"batch-size", "lr", "optimizer", "log-level", "on-worker-timeout"}
# Help that says what the option means to a ps-local run.
HELP_OVERRIDES = {"lr", "momentum", "optimizer", "log-level", "auth-token-file"}
# Bounds ps-local keeps narrower than the binary's.
BOUND_OVERRIDES = {"seed", "max-steps"}


def table(path):
    p = subprocess.run([path, "--help=json"], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        sys.exit(f"FAIL: {path} --help=json exited {p.returncode}: {p.stderr}")
    try:
        doc = json.loads(p.stdout)
    except json.JSONDecodeError as e:
        sys.exit(f"FAIL: {path} --help=json is not one JSON document: {e}")
    return {o["name"]: o for o in doc["options"]}


def within(v, o):
    return (o["min"] is None or v >= o["min"]) and (o["max"] is None or v <= o["max"])


def problems(local, binaries):
    out = []
    for name, o in local.items():
        owners = [(b, t[name]) for b, t in binaries.items() if name in t]
        if name in OWN:
            continue
        if not owners:
            out.append(f"--{name}: in no binary's table and not declared ps-local's own")
            continue
        prog, b = owners[0]
        if o["type"] != b["type"]:
            out.append(f"--{name}: type {o['type']}, {prog} says {b['type']}")
            continue
        if (o["default"] != b["default"]) != (name in DEFAULT_OVERRIDES):
            out.append(f"--{name}: default {o['default']!r}, {prog}'s {b['default']!r}"
                       f" ({'an undeclared' if name not in DEFAULT_OVERRIDES else 'a stale'} override)")
        if (o["help"] != b["help"]) != (name in HELP_OVERRIDES):
            out.append(f"--{name}: help {'differs from' if name not in HELP_OVERRIDES else 'equals'}"
                       f" {prog}'s ({'undeclared' if name not in HELP_OVERRIDES else 'stale'} override)")
        if (o["min"], o["max"]) != (b["min"], b["max"]):
            if name not in BOUND_OVERRIDES:
                out.append(f"--{name}: range {o['min']}..{o['max']}, {prog}'s {b['min']}..{b['max']}")
            elif not (within(o["min"], b) and within(o["max"], b)):
                out.append(f"--{name}: range {o['min']}..{o['max']} outside {prog}'s")
        elif name in BOUND_OVERRIDES:
            out.append(f"--{name}: declared a narrower range, but it is {prog}'s (stale)")
        d = o["default"]
        if d not in (None, "") and o["type"] in ("int", "uint", "float", "size") and not within(d, b):
            out.append(f"--{name}: default {d} outside {prog}'s range {b['min']}..{b['max']}")
        if "choices" in b:
            extra = set(o.get("choices") or b["choices"]) - set(b["choices"])
            if extra:
                out.append(f"--{name}: choices {sorted(extra)} that {prog} refuses")
            if d not in (None, "") and d not in b["choices"]:
                out.append(f"--{name}: default {d!r} that {prog} refuses")
    return out


def main():
    build = sys.argv[1]
    local = table(os.path.join(build, "tools", "ps-local"))
    binaries = {"ps-worker": table(os.path.join(build, "ps-worker", "ps-worker")),
                "ps-server": table(os.path.join(build, "ps-server", "ps-server"))}
    found = problems(local, binaries)
    # The check must see drift: a copy of ps-worker's table with one help
    # text and one bound changed has to be reported.
    tampered = json.loads(json.dumps(binaries))
    tampered["ps-worker"]["epochs"]["help"] += " (changed)"
    tampered["ps-worker"]["transport"]["help"] = "other"
    tampered["ps-worker"]["seed"]["max"] = 10
    seen = problems(local, tampered)
    if len(seen) < len(found) + 3:
        found.append(f"the check missed a tampered table: {seen}")
    for p in found:
        print("FAIL:", p)
    forwarded = sum(1 for n in local if n not in OWN)
    print(f"ps-local: {len(local)} options, {forwarded} forwarded from the binaries, "
          f"{len(found)} problems")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
