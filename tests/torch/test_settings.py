"""ps's settings and data loader refuse what ps-worker refuses (issue 30):
numbers in ps-worker's syntax only (no space, sign, 0x, '_' or overflow, which
ctypes would wrap: PS_CHUNK_BYTES=99999999999999999999 became a small chunk),
chunk sizes in ps-worker's range whether they come from the settings or from
ps.torch's own choice, --connect-timeout-ms 0 refused as by ps-worker, and
Fashion-MNIST labels outside 0..9 refused with ps-worker/train/data.c's
words. Needs numpy (not torch); every case is tried, then all failures are
reported."""
import os
import struct
import sys
import tempfile

import harness

try:
    import numpy  # noqa: F401
except ImportError:
    harness.skip(f"no numpy in {sys.executable}")

import ps  # noqa: E402
from ps import _settings, data  # noqa: E402

failures = []


def expect(cond, what):
    print(("ok: " if cond else "FAIL: ") + what, flush=True)
    if not cond:
        failures.append(what)


def refused(env, words, what, **overrides):
    try:
        cfg = _settings.parse(overrides=overrides, env=env)
    except ps.ConfigError as e:
        msg = str(e)
        expect(all(w in msg for w in words), f"{what}: {msg}")
        return
    expect(False, f"{what}: accepted as " + repr({k: cfg[k] for k in
                                                   ("chunk_bytes", "world_size",
                                                    "connect_timeout_ms", "rank",
                                                    "peer_listen_fd")}))


# -- sizes -----------------------------------------------------------------
for v in ["99999999999999999999", "18446744073709551621", "2GiB", "-1", " 4096", "4096 ",
          "+4096", "0x1000", "1_024", "4 KiB", "4KiBx", ""]:
    refused({"PS_CHUNK_BYTES": v}, ["--chunk-bytes", "PS_CHUNK_BYTES"], f"PS_CHUNK_BYTES={v!r}")
refused({}, ["--chunk-bytes", "ps.init(chunk_bytes=)"], "chunk_bytes=2**64+5",
        chunk_bytes=2**64 + 5)
for v, n in [("4096", 4096), ("64k", 65536), ("4KiB", 4096), ("1MB", 1 << 20), ("1GiB", 1 << 30),
             ("0", 0)]:
    try:
        got = _settings.parse(env={"PS_CHUNK_BYTES": v})["chunk_bytes"]
    except ps.ConfigError as e:
        got = e
    expect(got == n, f"PS_CHUNK_BYTES={v!r} is {n} (got {got})")

# -- integers --------------------------------------------------------------
for v in [" 2", "2 ", "+2", "0x2", "2_0", "1e1", "2.0", ""]:
    refused({"PS_WORLD_SIZE": v}, ["--world-size", "PS_WORLD_SIZE"], f"PS_WORLD_SIZE={v!r}")
refused({"PS_PEER_LISTEN_FD": "0x5"}, ["--peer-listen-fd"], "PS_PEER_LISTEN_FD='0x5'")
refused({"PS_CONNECT_TIMEOUT_MS": "0"}, ["--connect-timeout-ms", "-1 = forever"],
        "PS_CONNECT_TIMEOUT_MS=0")
refused({"PS_RECONNECT_TIMEOUT_MS": "0"}, ["--reconnect-timeout-ms"], "PS_RECONNECT_TIMEOUT_MS=0")
refused({"PS_RANK": "auto", "PS_POD_INDEX": " 1", "PS_WORLD_SIZE": "2"}, ["--rank", "PS_POD_INDEX"],
        "PS_POD_INDEX=' 1'")
refused({"PS_RANK": "+1", "PS_WORLD_SIZE": "2"}, ["--rank"], "PS_RANK='+1'")
cfg = _settings.parse(overrides={"world_size": 2, "connect_timeout_ms": -1},
                      env={"PS_RANK": "1"})
expect(cfg["world_size"] == 2 and cfg["rank"] == 1 and cfg["connect_timeout_ms"] == -1,
       "ints as Python ints and plain digits are taken")

# -- a chunk size chosen by ps.torch (reopen_client) -----------------------
cfg = _settings.parse(overrides={"servers": "127.0.0.1:1", "connect_timeout_ms": 1}, env={})
job = ps._Job(cfg)
try:
    job._open_client(2**64 + 5)
    expect(False, "chunk_bytes 2**64+5 reached libps and connected")
except ps.ConfigError as e:
    expect("--chunk-bytes" in str(e) and "chunk_bytes" in str(e), f"chunk_bytes 2**64+5: {e}")
except Exception as e:  # noqa: BLE001
    expect(False, f"chunk_bytes 2**64+5 reached libps: {type(e).__name__}: {e}")


# -- the data loader -------------------------------------------------------
def idx(path, magic, dims, payload):
    with open(path, "wb") as f:
        f.write(struct.pack(">I" + "I" * len(dims), magic, *dims) + bytes(payload))


with tempfile.TemporaryDirectory() as d:
    idx(os.path.join(d, "train-images-idx3-ubyte"), 0x803, (3, 2, 2), [0] * 12)
    idx(os.path.join(d, "train-labels-idx1-ubyte"), 0x801, (3,), [1, 200, 9])
    try:
        data.fashion_mnist(d)
        expect(False, "label 200 accepted")
    except ValueError as e:
        expect("label 200 at index 1 is outside 0..9" in str(e)
               and "train-labels-idx1-ubyte" in str(e), f"label 200: {e}")
    idx(os.path.join(d, "train-labels-idx1-ubyte"), 0x801, (3,), [1, 0, 9])
    x, y = data.fashion_mnist(d)
    expect(list(y) == [1, 0, 9] and x.shape == (3, 1, 2, 2), "labels 0..9 are taken")

if failures:
    print(f"FAIL: {len(failures)} case(s)", flush=True)
    sys.exit(1)
print("test_settings: ok")
