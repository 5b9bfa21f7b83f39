#!/usr/bin/env bash
# run-pods: the pod test of one overlay (see pods.mjs for what it emulates).
#   run-pods.sh [--secret random|none|no-key|empty] [--expect-failure TEXT] OVERLAY_DIR BUILD_DIR
# The namespace ps-job holds the Secret ps-auth as a user makes it: random
# (the default) runs the command docs/KUBERNETES.md gives, with
# --dry-run=client -o yaml; none, no-key (a Secret without the key token)
# and empty (token="") are the mistakes whose messages the pods must show,
# with --expect-failure naming the text the run must fail with.
# Makes a private "cluster" network namespace holding a bridge (10.244.0.1/24,
# no route anywhere else), runs pods.mjs inside it, and on any exit (pass,
# failure, timeout, signal) kills every process in the namespaces it made,
# deletes them and removes its files. Exit 77 (skip) when it cannot run here:
# not root, no iproute2/util-linux tools, no node or npm packages (npm ci in
# deploy/k8s/validate), no kubectl, no Fashion-MNIST, or an overlay whose
# options this ps-worker does not have yet; for an overlay that runs
# /usr/bin/python3 (overlays/torch): no python3-torch, or a sanitizer build
# (that Python cannot load an ASan libps.so).
# The pods' image is this machine's /usr with /usr/local replaced by what
# `meson install --destdir` of BUILD_DIR puts there (what deploy/Containerfile
# copies into the image), never the source tree.
set -euo pipefail
secret=random
expect=()
while [ $# -gt 2 ]; do
  case "$1" in
    --secret) secret="$2"; shift 2 ;;
    --expect-failure) expect=(--expect-failure "$2"); shift 2 ;;
    *) echo "run-pods: unknown option $1" >&2; exit 2 ;;
  esac
done
overlay="$1"
build="$2"
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
namespace=ps-job

skip() { echo "SKIP: $*"; exit 77; }
[ "$(id -u)" = 0 ] || skip "needs root (network namespaces, mounts)"
for t in ip unshare setpriv nsenter chroot node kubectl; do
  command -v "$t" >/dev/null || skip "$t is not installed"
done
[ -d "$root/deploy/k8s/validate/node_modules/yaml" ] ||
  skip "npm packages missing: run npm ci in deploy/k8s/validate"
ls /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte* >/dev/null 2>&1 ||
  skip "Fashion-MNIST is missing (apt-get install dataset-fashion-mnist)"
for b in ps-server/ps-server ps-worker/ps-worker; do
  [ -x "$build/$b" ] || skip "$build/$b is not built"
done
# Every option the overlay passes to ps-worker must exist in this build.
rendered="$(kubectl kustomize "$overlay")"
if grep -q '"/usr/bin/python3"\|- /usr/bin/python3$' <<<"$rendered"; then
  /usr/bin/python3 -c 'import torch, numpy' 2>/dev/null ||
    skip "/usr/bin/python3 has no torch or numpy (apt-get install python3-torch python3-numpy)"
  # The pods run the manifests' command as it is: an uninstrumented Python
  # cannot load a libps built with AddressSanitizer (the runtime must come
  # first), and the image has no such build. tests/torch preloads it instead.
  # (ldd's whole output first: with pipefail, `ldd | grep -q` fails whenever
  # grep stops reading before ldd is done writing, and the skip was missed)
  if grep -q 'libasan' <<<"$(ldd "$build/ps-worker/libps/libps.so.0")"; then
    skip "a sanitizer build: the image's /usr/bin/python3 cannot load an ASan libps.so (tests/torch covers ps.torch under ASan)"
  fi
fi
mode="$(printf '%s\n' "$rendered" | sed -n 's/^  sync-mode: //p' | head -1)"
if [ "$mode" = allreduce ]; then
  help="$("$build/ps-worker/ps-worker" --help)"
  for o in --peer-template --allreduce-backend; do
    grep -q -- "$o " <<<"$help" ||
      skip "this ps-worker has no $o yet (all-reduce mode is not built): overlay $(basename "$overlay") not run"
  done
fi

# A 3D job (components/grid, the grid keys above 1) needs a ps-worker with
# the grid's options.
owned=()
grid="$(printf '%s\n' "$rendered" | sed -n 's/^  \(tensor-parallel\|pipeline-stages\|micro-batches\): "\{0,1\}\([0-9]*\)"\{0,1\}$/\2/p' | sort -u | tr '\n' ' ')"
if [ -n "$grid" ] && [ "$grid" != "1 " ]; then
  help="$("$build/ps-worker/ps-worker" --help)"
  for o in --tensor-parallel --pipeline-stages --micro-batches --pipeline-schedule; do
    grep -q -- "$o " <<<"$help" ||
      skip "this ps-worker has no $o yet (3D jobs are not built): overlay $(basename "$overlay") not run"
  done
  # each worker owns keys of its (stage, tensor slice) only: its clock is 0 on the other shards
  owned=(--owned-keys 1)
fi

prefix="pk$(( $$ % 100000 ))"
cluster="$prefix-c"
work="$(mktemp -d "${TMPDIR:-/tmp}/ps-pods-XXXXXX")"
chmod 755 "$work"

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  # (ls, not `ip netns list`: that one asks every namespace for its id and
  # complains about half-deleted ones)
  for ns in $(ls /run/netns 2>/dev/null | grep "^$prefix-" || true); do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
  done
  sleep 0.2
  for ns in $(ls /run/netns 2>/dev/null | grep "^$prefix-" || true); do
    ip netns del "$ns" 2>/dev/null || echo "run-pods: could not delete netns $ns" >&2
  done
  rm -rf "$work"
  left="$(ls /run/netns 2>/dev/null | grep -c "^$prefix-" || true)"
  [ "$left" = 0 ] || { echo "run-pods: $left namespaces left behind" >&2; rc=1; }
  exit $rc
}
runner=""
trap cleanup EXIT
# wait (below) returns at once on a signal, so the runner is stopped and the
# namespaces cleaned up now, not when the runner would have finished
trap '[ -z "$runner" ] || kill "$runner" 2>/dev/null; exit 143' TERM
trap '[ -z "$runner" ] || kill "$runner" 2>/dev/null; exit 130' INT

# The Secret, created in the namespace before the overlay is applied.
objects=()
case "$secret" in
random)
  # exactly the guide's command, as a user pastes it (README gives the same)
  cmd="$(grep -m1 '^kubectl create secret generic ps-auth ' "$root/docs/KUBERNETES.md" || true)"
  [ -n "$cmd" ] || { echo "run-pods: docs/KUBERNETES.md gives no 'kubectl create secret generic ps-auth' command" >&2; exit 1; }
  bash -c "$cmd --dry-run=client -o yaml" >"$work/secret.yaml" ||
    { echo "run-pods: the documented command failed: $cmd" >&2; exit 1; } ;;
none) ;;
no-key) kubectl create secret generic ps-auth -n "$namespace" --from-literal=tokn="$(head -c 32 /dev/urandom | base64)" \
          --dry-run=client -o yaml >"$work/secret.yaml" ;;
empty) kubectl create secret generic ps-auth -n "$namespace" --from-literal=token= \
         --dry-run=client -o yaml >"$work/secret.yaml" ;;
*) echo "run-pods: --secret $secret: not random, none, no-key or empty" >&2; exit 2 ;;
esac
[ "$secret" = none ] || objects=(--objects "$work/secret.yaml")

# The image's /usr/local.
meson install -C "$build" --destdir "$work/stage" --no-rebuild --quiet >"$work/install.log" 2>&1 ||
  { echo "run-pods: meson install --destdir failed:" >&2; tail -20 "$work/install.log" >&2; exit 1; }
mkdir -p "$work/stage/usr/local"
# A build that links libraries from elsewhere under /usr/local (CUDA and
# NCCL, found in /usr/local/cuda on this machine) belongs in an image from a
# base that has them in the same place (nvidia/cuda): those directories, and
# the links to them, join the image's /usr/local.
extra=()
tops="$(for f in "$work"/stage/usr/local/bin/* "$work"/stage/usr/local/lib/*/libps.so* \
                 "$work"/stage/usr/local/lib/libps.so*; do
          if [ -f "$f" ]; then ldd "$f" 2>/dev/null || true; fi
        done | awk '$3 ~ /^\/usr\/local\// {print $3}' | xargs -r readlink -f |
        sed -n 's|^/usr/local/\([^/]*\)/.*|\1|p' | sort -u)"
for t in $tops; do
  if [ -e "$work/stage/usr/local/$t" ]; then continue; fi
  mkdir -p "$work/stage/usr/local/$t"
  extra+=(--image-dir "/usr/local/$t")
  for l in /usr/local/*; do
    if [ -L "$l" ] && [ "$(readlink -f "$l")" = "/usr/local/$t" ]; then
      ln -s "$(readlink "$l")" "$work/stage/usr/local/${l##*/}"
    fi
  done
done

ip netns add "$cluster"
ip -n "$cluster" link set lo up
ip -n "$cluster" link add br0 type bridge
ip -n "$cluster" addr add 10.244.0.1/24 dev br0
ip -n "$cluster" link set br0 up
# nsenter, not `ip netns exec`: that one gives the runner a private mount
# namespace, and the pod namespaces it creates would then be mounted (named)
# only there, out of reach of the cleanup above
nsenter --net="/run/netns/$cluster" node "$here/pods.mjs" --overlay "$overlay" --usr-local "$work/stage/usr/local" \
  --work "$work" --prefix "$prefix" --timeout-s "${PS_POD_TIMEOUT_S:-120}" \
  --namespace "$namespace" "${objects[@]}" "${expect[@]}" "${extra[@]}" "${owned[@]}" &
runner=$!
wait "$runner"
