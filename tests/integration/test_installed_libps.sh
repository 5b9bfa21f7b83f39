#!/usr/bin/env bash
# installed_libps: libps as a program outside the tree sees it. The build is
# installed into a private DESTDIR (meson install --no-rebuild, which builds
# nothing and leaves the build dir as it is), and then only that tree is used:
#  - libps.so.0 has SONAME libps.so.0 and exports exactly the functions the
#    installed public headers declare (nothing internal: no other ps_*, no
#    auth_*, wire_*, log_*); the headers compile on their own with -std=c99
#    -Wpedantic;
#  - the installed examples/c/push_pull.c compiles with README's commands
#    as written: PKG_CONFIG_PATH set to the staged libps.pc's folder, then
#    `cc ... $(pkg-config --cflags --libs libps)` (libps.pc is relocatable,
#    meson's pkgconfig.relocatable: nothing redefines its prefix), and, once
#    more, statically against libps.a with `pkg-config --static --libs libps`;
#    a build directory whose libps.pc has an absolute prefix (configured
#    with pkgconfig.relocatable=false) is built with README's other line,
#    --define-variable=prefix=DESTDIR/PREFIX, and says so (not
#    PKG_CONFIG_SYSROOT_DIR: it moves the absolute paths of CUDA's libraries
#    in Libs.private into the DESTDIR too);
#  - both run against two real ps-server shards on 127.0.0.1 (port 0,
#    --port-file) with a 0600 token file: the static one configured through
#    PS_SERVERS / PS_AUTH_TOKEN_FILE / PS_LR, the shared one (through
#    LD_LIBRARY_PATH into the DESTDIR) with arguments, and each says "ok" and
#    exits 0; without the token, or with a missing token file, the example
#    exits 1 with the reason; two ranks of one job, rank 1 started first
#    (ps_wait_initialised holds its push until rank 0's ps_init), both say
#    "ok"; --shutdown makes the shards exit 0.
# In a sanitizer build the example is compiled with the same -fsanitize flags
# as the library it links (an instrumented libps needs the runtime first).
#   test_installed_libps.sh BUILD_DIR MESON B_SANITIZE CC [CC ARGS...]
# Exit 77 (skip) only if pkg-config, nm or readelf is missing.
set -euo pipefail
build="$(cd "$1" && pwd)"
meson="$2"
sanitize="$3"
shift 3
cc=("$@")
src="$(cd "$(dirname "$0")/../.." && pwd)"
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "installed_libps: FAIL: $*" >&2; exit 1; }
for tool in pkg-config nm readelf; do
  command -v "$tool" >/dev/null || skip "$tool is not installed"
done
[ -n "$meson" ] && [ -x "$meson" ] || fail "meson not found ('$meson')"
command -v "${cc[0]}" >/dev/null || fail "the build's C compiler ${cc[0]} is gone"

# meson points LD_LIBRARY_PATH into the build tree (the test depends on
# libps.so there); only the DESTDIR may be used here
unset LD_LIBRARY_PATH
umask 077
tmp="$(mktemp -d "${TMPDIR:-/tmp}/installed_libps.XXXXXX")"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---- install --------------------------------------------------------------
dest="$tmp/dest"
"$meson" install -C "$build" --destdir "$dest" --no-rebuild >"$tmp/install.log" 2>&1 ||
  { cat "$tmp/install.log" >&2; fail "meson install --destdir failed"; }
pc="$(find "$dest" -name libps.pc)"
[ -n "$pc" ] && [ "$(wc -l <<<"$pc")" = 1 ] || fail "expected one libps.pc under the DESTDIR, found: $pc"
# README's staged install: PKG_CONFIG_PATH is all pkg-config is told
export PKG_CONFIG_PATH="$(dirname "$pc")"
if grep -q '^prefix=${pcfiledir}/' "$pc"; then
  pcq() { pkg-config "$@"; }
else # a build directory configured before pkgconfig.relocatable=true
  abs="$(sed -n 's/^prefix=//p' "$pc")"
  echo "note: $pc has an absolute prefix: using --define-variable=prefix=$dest$abs (README)"
  pcq() { pkg-config --define-variable=prefix="$dest$abs" "$@"; }
fi
prefix="$(realpath -m "$(pcq --variable=prefix libps)")"
libdir="$(pcq --variable=libdir libps)"
incdir="$(pcq --variable=includedir libps)/libps"
case "$libdir" in "$dest"/*) ;; *) fail "libdir $libdir is not under the DESTDIR: libps.pc is not relocatable" ;; esac
for f in libps.so libps.so.0 libps.a "libps.so.$(pcq --modversion libps)"; do
  [ -e "$libdir/$f" ] || fail "$libdir/$f is not installed"
done
[ "$(readlink "$libdir/libps.so")" = libps.so.0 ] || fail "libps.so does not point to libps.so.0"
for h in ps.h collective.h collective_nccl.h; do
  [ -f "$incdir/$h" ] || fail "$incdir/$h is not installed"
done
# the BLAS kernel choice re-executes its caller: ps-worker's and ps-local's
# (ps-worker/blas), not libps's ABI
[ ! -e "$incdir/blas_kernel.h" ] || fail "blas_kernel.h is installed with libps"
example="$prefix/share/doc/ps/examples/c/push_pull.c"
[ -f "$example" ] || fail "the example is not installed at $example"
cmp -s "$example" "$src/examples/c/push_pull.c" || fail "the installed example differs from the source"

# ---- the ABI --------------------------------------------------------------
so="$libdir/libps.so.0"
soname="$(readelf -d "$so" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')"
[ "$soname" = libps.so.0 ] || fail "SONAME is '$soname', expected libps.so.0"
nm -D --defined-only "$so" | awk '$2 != "A" {sub(/@.*/, "", $3); print $3}' | sort -u >"$tmp/exported"
cat "$incdir"/*.h | grep -E '^[a-z]' | grep -oE '\bps_[a-z0-9_]+\(' | tr -d '(' | sort -u >"$tmp/declared"
[ -s "$tmp/declared" ] || fail "no function declarations found in $incdir"
extra="$(comm -23 "$tmp/exported" "$tmp/declared")"
missing="$(comm -13 "$tmp/exported" "$tmp/declared")"
[ -z "$extra" ] || fail "libps.so exports what no public header declares: $(echo $extra)"
[ -z "$missing" ] || fail "declared in a public header but not exported (add to libps.map): $(echo $missing)"
echo "libps.so.0: SONAME $soname, $(wc -l <"$tmp/exported") functions exported, all from the public headers"

# ---- the NCCL plugin (issue 35) --------------------------------------------
# libps.so.0 links no CUDA library in any build; an NCCL build installs the
# plugin where libps looks for it (<libdir>/ps), with a RUNPATH to its CUDA
plugin="$(realpath -m "$libdir/ps/libps-nccl.so")"  # libdir is ${pcfiledir}-relative (a relocatable libps.pc)
! readelf -d "$so" | grep -qE 'NEEDED.*\[lib(nccl|cudart|cuda)\.so' ||
  fail "the installed libps.so.0 links a CUDA library: $(readelf -d "$so" | grep -E 'nccl|cuda')"
if [ "${PS_TEST_HAVE_NCCL:-0}" = 1 ]; then
  [ -f "$plugin" ] || fail "the NCCL plugin is not installed at $plugin"
  readelf -d "$plugin" | grep -q 'RUNPATH' || fail "the installed plugin has no RUNPATH"
  echo "NCCL plugin: $plugin, RUNPATH $(readelf -d "$plugin" | sed -n 's/.*(RUNPATH).*\[\(.*\)\]/\1/p')"
else
  [ ! -e "$plugin" ] || fail "a build without NCCL installed $plugin"
fi

# ---- build like a user ----------------------------------------------------
flags=(-std=c99 -Wall -Wextra -Wpedantic -Werror -g)
[ "$sanitize" = none ] || flags+=("-fsanitize=$sanitize")
read -ra cflags <<<"$(pcq --cflags libps)"
read -ra libs <<<"$(pcq --libs libps)"
read -ra static_libs <<<"$(pcq --static --libs libps)"
for f in "${cflags[@]}" "${libs[@]}" "${static_libs[@]}"; do
  case "$f" in *"$src"* | *"$build"*) fail "pkg-config gave $f, a path into the source or build tree" ;; esac
done
printf '#include <collective_nccl.h>\n#include <collective.h>\n#include <ps.h>\nint main(void) { return ps_nccl_built() ? 0 : 1; }\n' >"$tmp/headers.c"
"${cc[@]}" "${flags[@]}" "${cflags[@]}" -c "$tmp/headers.c" -o "$tmp/headers.o" ||
  fail "the installed headers do not compile on their own"
# README's line: cc my_prog.c $(pkg-config --cflags --libs libps) -o my_prog
# shellcheck disable=SC2046 # split as the shell splits it for a user
"${cc[@]}" "${flags[@]}" "$example" $(pcq --cflags --libs libps) -o "$tmp/push_pull" ||
  fail "push_pull.c does not build with pkg-config --cflags --libs libps"
# libps.a instead of -lps, with what --static adds for it
static=()
for f in "${static_libs[@]}"; do [ "$f" = -lps ] && static+=("$libdir/libps.a") || static+=("$f"); done
"${cc[@]}" "${flags[@]}" "${cflags[@]}" "$example" -o "$tmp/push_pull_static" "${static[@]}" ||
  fail "push_pull.c does not link libps.a with pkg-config --static --libs libps"
grep -q 'NEEDED.*\[libps.so.0\]' <<<"$(readelf -d "$tmp/push_pull")" || fail "push_pull does not load libps.so.0"
# the installed libps finds its plugin with no help, moved (the DESTDIR) as
# it is: $ORIGIN/ps through dladdr (nccl_loader.c)
printf '#include <stdio.h>\n#include <collective_nccl.h>\nint main(void) {\n  char why[2048];\n  int n = ps_nccl_device_count(why, sizeof(why));\n  printf("%%d %%s\\n", n, why);\n  return 0;\n}\n' >"$tmp/nccl_probe.c"
"${cc[@]}" "${flags[@]}" "${cflags[@]}" "$tmp/nccl_probe.c" -o "$tmp/nccl_probe" "${libs[@]}" ||
  fail "nccl_probe.c does not build"
PS_NCCL_PLUGIN= LD_LIBRARY_PATH="$libdir" "$tmp/nccl_probe" >"$tmp/nccl_probe.out" 2>&1 ||
  { cat "$tmp/nccl_probe.out" >&2; fail "nccl_probe failed"; }
if [ "${PS_TEST_HAVE_NCCL:-0}" = 1 ]; then
  grep -qF "path=\"$plugin\"" "$tmp/nccl_probe.out" ||
    { cat "$tmp/nccl_probe.out" >&2; fail "libps did not load its installed plugin $plugin"; }
  grep -qE '^(0 no usable CUDA GPU|[1-9][0-9]* CUDA device)' "$tmp/nccl_probe.out" ||
    { cat "$tmp/nccl_probe.out" >&2; fail "the plugin answered neither devices nor why not"; }
else
  grep -qF "0 no NCCL backend on this node" "$tmp/nccl_probe.out" && grep -qF "$plugin" "$tmp/nccl_probe.out" ||
    { cat "$tmp/nccl_probe.out" >&2; fail "without a plugin, libps does not say where it looked"; }
fi
echo "NCCL backend through the installed libps: $(tail -1 "$tmp/nccl_probe.out")"
! grep -q 'libps\.so' <<<"$(readelf -d "$tmp/push_pull_static")" || fail "push_pull_static loads libps.so"

# ---- two shards with a token ----------------------------------------------
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$tmp/token"
[ "$(stat -c %a "$tmp/token")" = 600 ] || fail "token file mode is $(stat -c %a "$tmp/token")"
# start_shards [W]: two fresh shards of a job of W workers (1); their pids
# in pids, their addresses in servers
start_shards() {
  local workers="${1:-1}"
  pids=()
  for s in 0 1; do
    rm -f "$tmp/port$s"
    "$build/ps-server/ps-server" --listen 127.0.0.1:0 --port-file "$tmp/port$s" --http '' \
      --shard "$s" --num-shards 2 --num-workers "$workers" --optimizer sgd --lr 0.05 \
      --auth-token-file "$tmp/token" >"$tmp/server$s.log" 2>&1 &
    pids+=("$!")
  done
  for s in 0 1; do
    for _ in $(seq 300); do [ -s "$tmp/port$s" ] && break; sleep 0.1; done
    [ -s "$tmp/port$s" ] || { cat "$tmp/server$s.log" >&2; fail "shard $s did not start listening"; }
  done
  servers="$(cat "$tmp/port0"),$(cat "$tmp/port1")"
}
start_shards

# run NAME EXPECTED_STATUS ENV... -- PROGRAM ARGS...: output in $tmp/NAME.{out,err}
run() {
  local name="$1" want="$2" rc=0
  shift 2
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  env "${envs[@]}" timeout 60 "$@" >"$tmp/$name.out" 2>"$tmp/$name.err" || rc=$?
  if [ "$rc" != "$want" ]; then
    cat "$tmp/$name.out" "$tmp/$name.err" >&2
    fail "$name exited $rc, expected $want"
  fi
}
# shards_exit STATUS SECONDS WHAT: both shards exit with STATUS within SECONDS of WHAT
shards_exit() {
  local i rc
  for i in 0 1; do
    rc=0
    for _ in $(seq $(($2 * 10))); do kill -0 "${pids[$i]}" 2>/dev/null || break; sleep 0.1; done
    kill -0 "${pids[$i]}" 2>/dev/null && fail "shard $i still runs $2 s after $3"
    wait "${pids[$i]}" || rc=$?
    [ "$rc" = "$1" ] || { cat "$tmp/server$i.log" >&2; fail "shard $i exited $rc after $3, not $1"; }
  done
}
expect() { # FILE TEXT: FILE contains TEXT
  grep -qF -- "$2" "$tmp/$1" || { cat "$tmp/$1" >&2; fail "$1 does not say '$2'"; }
}

# refusals first: they must name the reason and leave the shards untouched
run no_token 1 PS_SERVERS="$servers" PS_AUTH_TOKEN_FILE= -- "$tmp/push_pull_static"
expect no_token.err "authentication required"
run bad_token 1 -- "$tmp/push_pull_static" "$servers" --token "$tmp/no-such-file"
expect bad_token.err "cannot open auth token file $tmp/no-such-file"
run no_shards 2 PS_SERVERS= -- "$tmp/push_pull_static"
expect no_shards.err "no shards given"

run static 0 PS_SERVERS="$servers" PS_AUTH_TOKEN_FILE="$tmp/token" PS_LR=0.05 -- "$tmp/push_pull_static"
expect static.out "2 shard(s), optimizer sgd, consistency bsp, authentication on"
expect static.out "ok: all 1000 values are w - lr * g"
# a second process of rank 0 pushing step 0 again: the shards hold that step
# from the first one, so the push is not a resend; it is refused (not dropped
# as a duplicate) and the shards stop with exit 3 (ps-server/lost.c)
run again 1 PS_SERVERS="$servers" PS_AUTH_TOKEN_FILE="$tmp/token" PS_LR=0.05 -- "$tmp/push_pull_static"
expect again.err "(a new process) pushed step 0"
shards_exit 3 30 "the stale push"
# two ranks, rank 1 first: it waits for rank 0's ps_init before it pushes
start_shards 2
rc1=0
LD_LIBRARY_PATH="$libdir" timeout 60 "$tmp/push_pull" "$servers" --token "$tmp/token" --lr 0.05 \
  --rank 1 --world-size 2 --shutdown >"$tmp/rank1.out" 2>"$tmp/rank1.err" &
rank1=$!
run rank0 0 PS_RANK=0 PS_WORLD_SIZE=2 LD_LIBRARY_PATH="$libdir" -- "$tmp/push_pull" "$servers" \
  --token "$tmp/token" --lr 0.05 --shutdown
wait "$rank1" || rc1=$?
[ "$rc1" = 0 ] || { cat "$tmp/rank1.out" "$tmp/rank1.err" >&2; fail "rank 1 exited $rc1"; }
for r in 0 1; do
  expect "rank$r.out" "rank $r of 2, 2 shard(s)"
  expect "rank$r.out" "ok: all 1000 values are w - lr * g"
done
shards_exit 0 10 "the two ranks' --shutdown"
# through libps.so, on fresh shards
start_shards
run shared 0 LD_LIBRARY_PATH="$libdir" -- "$tmp/push_pull" "$servers" --token "$tmp/token" --lr 0.05 --shutdown
expect shared.out "ok: all 1000 values are w - lr * g"
cat "$tmp/shared.out"
shards_exit 0 10 "--shutdown"
pids=()
echo "installed_libps: ok"
