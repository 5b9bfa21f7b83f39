#!/usr/bin/env bash
# nccl_plugin: libps's NCCL backend is the plugin libps-nccl.so (issue 35,
# ps-worker/libps/coll/nccl_loader.c), so one libps serves CPU and GPU nodes.
#   test_nccl_plugin.sh elf BUILD_DIR PLUGIN
#     readelf -d: libps.so.0 needs no libnccl, libcudart or libcuda; the
#     plugin needs libnccl.so.2 and libcudart, has a RUNPATH and exports only
#     its entry table. Exit 77 where the build has no NCCL (PLUGIN '').
#   test_nccl_plugin.sh errors BUILD_DIR PLUGIN STUB
#     ps-worker --allreduce-backend nccl (world 1) exits 1 (permanent, as a
#     missing GPU) with the reason: PS_NCCL_PLUGIN naming a missing file (the
#     path), a plugin of another ABI version (both versions), a plugin whose
#     libraries do not load (dlerror's text), and, with the real plugin
#     where there is one, no GPU (or, on a GPU machine, the backend starts).
set -euo pipefail
mode="$1"
build="$(cd "$2" && pwd)"
plugin="$3"
fail() { echo "nccl_plugin: FAIL: $*" >&2; exit 1; }
command -v readelf >/dev/null || { echo "SKIP: readelf is not installed"; exit 77; }

if [ "$mode" = elf ]; then
  [ -n "$plugin" ] || { echo "SKIP: this build has no NCCL (no plugin to check)"; exit 77; }
  libps="$build/ps-worker/libps/libps.so.0"
  needed="$(readelf -d "$libps" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')"
  echo "libps.so.0 needs: $(echo $needed)"
  ! grep -E '^lib(nccl|cudart|cuda)\.so' <<<"$needed" ||
    fail "libps.so.0 links a CUDA library: a CPU node could not load it"
  pneeded="$(readelf -d "$plugin" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')"
  echo "$(basename "$plugin") needs: $(echo $pneeded)"
  grep -q '^libnccl\.so\.2$' <<<"$pneeded" || fail "the plugin does not need libnccl.so.2"
  grep -q '^libcudart\.so' <<<"$pneeded" || fail "the plugin does not need libcudart"
  runpath="$(readelf -d "$plugin" | sed -n 's/.*(RUNPATH).*\[\(.*\)\]/\1/p')"
  [ -n "$runpath" ] || fail "the plugin has no RUNPATH to its CUDA libraries"
  echo "$(basename "$plugin") RUNPATH: $runpath"
  exported="$(nm -D --defined-only "$plugin" | awk '{print $3}' | sed 's/@.*//' | sort -u)"
  [ "$exported" = ps_nccl_plugin ] || fail "the plugin exports '$(echo $exported)', not only ps_nccl_plugin"
  echo "nccl_plugin elf: ok"
  exit 0
fi

[ "$mode" = errors ] || fail "unknown mode $mode"
stub="$4"
# meson points LD_LIBRARY_PATH at the build tree, where the stub's library
# is: the dlopen()s here must see only what a node would
unset LD_LIBRARY_PATH
tmp="$(mktemp -d "${TMPDIR:-/tmp}/nccl_plugin.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
worker="$build/ps-worker/ps-worker"
# CASE PLUGIN_PATH: ps-worker asks for NCCL; exit status in rc, stderr in $tmp/CASE.err
run() {
  rc=0
  PS_NCCL_PLUGIN="$2" timeout 60 "$worker" --sync-mode allreduce --allreduce-backend nccl \
    --world-size 1 --rank 0 --peers 127.0.0.1:7071 --max-steps 1 --epochs 1 \
    >"$tmp/$1.out" 2>"$tmp/$1.err" || rc=$?
  [ "$rc" -lt 124 ] || { cat "$tmp/$1.err" >&2; fail "$1: ps-worker exited $rc (crashed or hung)"; }
}
expect() { # CASE STATUS TEXT
  [ "$rc" = "$2" ] || { cat "$tmp/$1.out" "$tmp/$1.err" >&2; fail "$1: ps-worker exited $rc, expected $2"; }
  grep -qF -- "$3" "$tmp/$1.err" || { cat "$tmp/$1.err" >&2; fail "$1: stderr does not say '$3'"; }
  echo "$1: exit $rc: $(grep -o 'error=.*' "$tmp/$1.err" | head -1)"
}

run missing "$tmp/no-such-dir/libps-nccl.so"
expect missing 1 "PS_NCCL_PLUGIN=$tmp/no-such-dir/libps-nccl.so: No such file or directory"

run wrong_abi "$stub"
abi="$(sed -n 's/^#define PS_NCCL_PLUGIN_ABI \([0-9]*\)u$/\1/p' \
  "$(dirname "$0")/../../ps-worker/libps/coll/nccl_plugin.h")"
[ -n "$abi" ] || fail "cannot read PS_NCCL_PLUGIN_ABI"
expect wrong_abi 1 "has plugin ABI version $((abi + 1)) but this libps needs version $abi"

# away from the library it needs (its RUNPATH is $ORIGIN-relative)
cp "$stub" "$tmp/libps-nccl.so"
run no_deps "$tmp/libps-nccl.so"
expect no_deps 1 "the NCCL plugin $tmp/libps-nccl.so was found but does not load: libnccl_plugin_stub_dep.so: cannot open shared object file"

if [ -n "$plugin" ]; then
  run real "$plugin"
  if [ "$rc" = 0 ]; then
    grep -q 'msg="nccl ready"' "$tmp/real.err" "$tmp/real.out" || fail "real: exit 0 without 'nccl ready'"
    echo "real: a GPU here: the plugin loaded and NCCL started"
  else
    expect real 1 "no usable CUDA GPU on this machine"
    grep -q 'msg="nccl plugin loaded"' "$tmp/real.err" "$tmp/real.out" ||
      fail "real: the plugin's load is not logged"
  fi
else
  echo "real: this build has no NCCL plugin"
fi
echo "nccl_plugin errors: ok"
