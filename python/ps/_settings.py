"""The settings ps.init() reads: the same names, sources and precedence as
ps-worker (docs/ARCHITECTURE.md, Options), so one ConfigMap or one launcher serves both.

Sources, strongest first: keyword arguments of ps.init() and its `args` list
(`--name value` or `--name=value`, as ps-worker's flags), the environment
(PS_ + the upper-case name with '-' as '_'), the `key = value` file named by
`config` (or PS_CONFIG), then the defaults. RANK and WORLD_SIZE (torchrun,
Kubeflow) stand in for a missing rank and world-size. A bad value raises
ConfigError naming the option, as ps-worker's "option --x: ..." does.

The table (names, defaults, bounds, choices, help) is ps-worker's own,
written by the build from `ps-worker --help=json` into _options.json
(python/ps/meson.build); only the parse rules live here, driven by it.
tests/torch/test_options_table.py checks it against the binary."""

import json
import os
import re
import socket


class ConfigError(ValueError):
    """A setting is missing or malformed (bad usage: the process exits 2)."""


# Numbers are read as ps-worker's option table reads them (common/config.c),
# so a value means the same to both and nothing out of range reaches ctypes,
# which would wrap it silently (c_uint64(2**64 + 5) is 5): plain decimal
# digits with an optional '-', no space, '+', '_', 0x or suffix.
_INT_RE = re.compile(r"-?[0-9]+")


def _int(lo, hi, no_zero=None):
    """An integer in lo..hi; no_zero, if given, is why 0 is refused."""
    def parse(v):
        if isinstance(v, bool) or not (isinstance(v, int) or _INT_RE.fullmatch(str(v))):
            raise ValueError(f"{v!r} is not an integer")
        n = int(v)
        if not lo <= n <= hi:
            raise ValueError(f"{n} is outside {lo}..{hi}")
        if n == 0 and no_zero:
            raise ValueError(f"0 {no_zero}")
        return n
    return parse


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}
_SIZE_RE = re.compile(r"([0-9]+)([a-zA-Z]*)")


def _size(lo, hi):
    """Bytes in lo..hi: 4096, 64k, 4MiB, 2G (1024-based, config_parse_size)."""
    def parse(v):
        m = None if isinstance(v, (bool, int)) else _SIZE_RE.fullmatch(str(v))
        if isinstance(v, int) and not isinstance(v, bool):
            n = v
        elif m and m.group(2).lower() in _UNITS:
            n = int(m.group(1)) * _UNITS[m.group(2).lower()]
        else:
            raise ValueError(f"{v!r} is not a size (e.g. 1048576, 512KiB, 4MiB)")
        if not lo <= n <= hi:
            raise ValueError(f"{v} is outside {lo}..{hi} bytes")
        return n
    return parse


def _choice(*names):
    def parse(v):
        if v not in names:
            raise ValueError(f"{v!r}: expected " + " or ".join(names))
        return v
    return parse


def _str(v):
    return str(v)


def _load_worker_table():
    """ps-worker's option table as `ps-worker --help=json` printed it at build
    time (python/ps/meson.build writes _options.json next to this file)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_options.json")
    with open(path, encoding="utf-8") as f:
        return {o["name"]: o for o in json.load(f)["options"]}


WORKER_OPTIONS = _load_worker_table()

# The subset of ps-worker's table a script needs (the trainer's own options,
# such as --model or --epochs, are the script's): name, and a rule the table
# does not hold (ps-worker/main.c refuses --connect-timeout-ms 0 after parsing).
WORKER_SUBSET = [
    ("sync-mode", None), ("servers", None), ("transport", None), ("server-template", None),
    ("num-shards", None), ("rank", None), ("world-size", None), ("job-id", None),
    ("connect-timeout-ms", "is not a deadline (-1 = forever)"), ("chunk-bytes", None),
    ("peers", None), ("peer-template", None), ("peer-listen", None), ("peer-listen-fd", None),
    ("peer-timeout-ms", None), ("allreduce-algorithm", None), ("node-name", None),
    ("auth-token-file", None),
]


def _parser(o, no_zero=None):
    """The parse rule of a table entry, from its type, bounds and choices."""
    lo, hi = o.get("min"), o.get("max")
    if o["type"] == "int":
        return _int(-(1 << 63) if lo is None else lo, (1 << 63) - 1 if hi is None else hi,
                    no_zero)
    if o["type"] == "size":
        return _size(0 if lo is None else lo, (1 << 64) - 1 if hi is None else hi)
    if o["type"] == "string":
        return _choice(*o["choices"]) if o.get("choices") else _str
    raise RuntimeError(f"_options.json: option --{o['name']}: type {o['type']} has no parser")


def _from_table(name, no_zero=None):
    o = WORKER_OPTIONS[name]
    return (name, _parser(o, no_zero), o["default"], o["help"])


MAX_CHUNK_BYTES = WORKER_OPTIONS["chunk-bytes"]["max"]  # ps-worker --chunk-bytes's range


def check_chunk_bytes(v, where="chunk_bytes"):
    """A chunk size given outside the settings (ps.torch's automatic one),
    checked by the same rule before it reaches ctypes."""
    try:
        return _size(0, MAX_CHUNK_BYTES)(v)
    except ValueError as e:
        raise ConfigError(f"option --chunk-bytes ({where}): {e}") from None


# The Python package's own options, which ps-worker has not (libps's
# reconnect deadline; ps.torch's fusion size): name, parser, default, help.
PYTHON_ONLY = [
    ("reconnect-timeout-ms", _int(-1, 10**9, "is not a deadline (-1 = forever)"), 60000,
     "how long a lost shard is retried before its requests fail (-1 = forever; 0 is refused)"),
    ("bucket-bytes", _size(0, (1 << 64) - 1), 1 << 20,
     "ps.torch: gradients are fused into buckets of at most this size (0 = one per tensor)"),
]

# name, parser, default, help: ps-worker's entries, then the package's own.
OPTIONS = [_from_table(n, z) for n, z in WORKER_SUBSET]
OPTIONS += PYTHON_ONLY
_BY_NAME = {o[0]: o for o in OPTIONS}


def _key(name):
    return name.replace("_", "-").lower()


def _read_file(path):
    out = {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ConfigError(f"option --config: cannot read {path}: {e.strerror}") from None
    for n, raw in enumerate(lines, 1):
        line = re.sub(r"(^|\s)#.*$", "", raw).strip()
        if not line:
            continue
        if "=" not in line:
            raise ConfigError(f"{path}:{n}: expected `key = value`, got {raw.strip()!r}")
        k, v = (s.strip() for s in line.split("=", 1))
        if len(v) >= 2 and v[0] == v[-1] == '"':
            v = v[1:-1]
        out[_key(k)] = (v, f"{path}:{n}")
    return out


def _parse_args(args):
    out = {}
    it = iter(args)
    for a in it:
        if not a.startswith("--") or a == "--":
            raise ConfigError(f"unexpected argument {a!r} (settings are --name value)")
        name, eq, val = a[2:].partition("=")
        if not eq:
            try:
                val = next(it)
            except StopIteration:
                raise ConfigError(f"option --{name} needs a value") from None
        out[_key(name)] = (val, f"--{name}")
    return out


def pod_index(env=os.environ):
    """rank `auto`: PS_POD_INDEX (the apps.kubernetes.io/pod-index label),
    JOB_COMPLETION_INDEX (an Indexed Job) or the N of a hostname name-N."""
    for var in ("PS_POD_INDEX", "JOB_COMPLETION_INDEX"):
        if env.get(var, "") != "":
            v = env[var]
            if not re.fullmatch(r"[0-9]+", v):
                raise ConfigError(f"option --rank: auto: {var}={v!r} is not a number")
            return int(v)
    host = socket.gethostname()
    m = re.search(r"-(\d+)$", host)
    if not m:
        raise ConfigError(f"option --rank: auto: hostname {host!r} does not end in -N and "
                          "neither PS_POD_INDEX nor JOB_COMPLETION_INDEX is set")
    return int(m.group(1))


def expand(template, i, what):
    if "{i}" not in template:
        raise ConfigError(f"option --{what}: {template!r} has no {{i}}")
    return template.replace("{i}", str(i))


# The settings that say how a job is laid out: when none of them comes from
# any source (flags, ps.init(), PS_*, the config file, RANK / WORLD_SIZE), the
# script was started on its own (`python3 train.py`) and runs as a job of one
# in allreduce mode, as Horovod's and DDP's scripts do; parse() marks it with
# JOB_OF_ONE and ps.init() says so in one line.
LAYOUT_SETTINGS = ("sync-mode", "servers", "server-template", "num-shards", "rank",
                   "world-size", "peers", "peer-template")
JOB_OF_ONE = "job_of_one"


def parse(args=None, overrides=None, env=None):
    """Returns a dict of every option (keys with '_') after all sources,
    and JOB_OF_ONE: True when nothing said how the job is laid out."""
    env = os.environ if env is None else env
    overrides = {_key(k): (v, f"ps.init({k}=)") for k, v in (overrides or {}).items()}
    flags = _parse_args(args or [])
    flags.update(overrides)
    for k in flags:
        if k not in _BY_NAME and k != "config":
            raise ConfigError(f"unknown option --{k}")
    cfg_path = flags.get("config", (env.get("PS_CONFIG", ""), ""))[0]
    filed = _read_file(cfg_path) if cfg_path else {}
    for k, (_, where) in filed.items():
        if k not in _BY_NAME:
            raise ConfigError(f"{where}: unknown option {k!r}")
    out = {}
    given = set()
    for name, parser, default, _ in OPTIONS:
        envname = "PS_" + name.upper().replace("-", "_")
        if name in flags:
            raw, where = flags[name]
        elif env.get(envname) is not None:
            raw, where = env[envname], envname
        elif name in filed:
            raw, where = filed[name]
        elif name == "rank" and env.get("RANK") is not None:
            raw, where = env["RANK"], "RANK"
        elif name == "world-size" and env.get("WORLD_SIZE") is not None:
            raw, where = env["WORLD_SIZE"], "WORLD_SIZE"
        else:
            out[name.replace("-", "_")] = default
            continue
        given.add(name)
        try:
            out[name.replace("-", "_")] = parser(raw)
        except ValueError as e:
            raise ConfigError(f"option --{name} ({where}): {e}") from None
    rank = out["rank"]
    if rank == "auto":
        rank = pod_index(env)
    else:
        try:
            rank = _int(0, 65535)(rank)
        except ValueError as e:
            raise ConfigError(f"option --rank: {e} (a number or auto)") from None
    if rank >= out["world_size"]:
        raise ConfigError(f"option --rank: {rank} is not below --world-size {out['world_size']}")
    out["rank"] = rank
    out[JOB_OF_ONE] = not given.intersection(LAYOUT_SETTINGS)
    if out[JOB_OF_ONE]:
        out["sync_mode"] = "allreduce"
    return out


def job_of_one_line():
    """What ps.init() prints when parse() chose a job of one."""
    return ("ps: nothing says how the job is laid out (no rank, world size, servers or peers "
            "in the flags, ps.init() or PS_* environment): running as a job of one, sync mode "
            "allreduce, rank 0 of 1 (tools/ps-local -- CMD starts a real job)")


def server_list(cfg):
    if cfg["servers"] and cfg["server_template"]:
        raise ConfigError("options --servers and --server-template exclude each other")
    if cfg["server_template"]:
        if cfg["num_shards"] < 1:
            raise ConfigError("option --server-template needs --num-shards >= 1")
        return [expand(cfg["server_template"], i, "server-template")
                for i in range(cfg["num_shards"])]
    if not cfg["servers"]:
        raise ConfigError("--sync-mode ps needs --servers or --server-template "
                          "(PS_SERVERS; tools/ps-local -- CMD sets it)")
    servers = [s.strip() for s in cfg["servers"].split(",")]
    if any(":" not in s for s in servers):
        raise ConfigError(f"option --servers: {cfg['servers']!r} is not a list of host:port")
    return servers


def peer_list(cfg):
    """The ring's addresses, or None when none are configured."""
    if cfg["peers"] and cfg["peer_template"]:
        raise ConfigError("options --peers and --peer-template exclude each other")
    w = cfg["world_size"]
    if cfg["peer_template"]:
        return [expand(cfg["peer_template"], i, "peer-template") for i in range(w)]
    if not cfg["peers"]:
        return None
    peers = [s.strip() for s in cfg["peers"].split(",")]
    if len(peers) != w:
        raise ConfigError(f"option --peers: {len(peers)} addresses for --world-size {w}")
    return peers
