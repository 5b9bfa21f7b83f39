#!/usr/bin/env bash
# ps-local across hosts (--nodes 2, tools/launch/local_nodes.c, rendezvous.c):
#  - a 2-node job, 2 workers each, trains the built-in trainer to the same
#    summary accuracy as the one-node job with 4 workers (same seed, steps);
#  - a worker killed on node 1 stops node 0 within 20 s with
#    "node 1 (HOST) failed";
#  - node 0 alone: the rendezvous times out naming node 1;
#  - (loopback) garbage and an oversized length on the rendezvous port are
#    refused, as is a HELLO without the token's proof, and the job still
#    trains; bad flags exit 2 naming the option.
#   test_local_nodes.sh BUILD_DIR loopback   two ps-local on 127.0.0.1 (no root)
#   test_local_nodes.sh BUILD_DIR netns      two simulated hosts (tools/faults/
#                                            netns-hosts; exit 77 without root)
set -euo pipefail
build="${1:?usage: test_local_nodes.sh BUILD_DIR loopback|netns}"
mode="${2:?usage: test_local_nodes.sh BUILD_DIR loopback|netns}"
here="$(cd "$(dirname "$0")" && pwd)"
hosts="$here/../../tools/faults/netns-hosts"
local_bin="$build/tools/ps-local"
name="psln$$"
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  [ "$mode" = netns ] && "$hosts" down "$name"
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$work"/*.err; do echo "== $f"; tail -n 15 "$f"; done; exit 1; }

port=$((20000 + $$ % 20000))
if [ "$mode" = netns ]; then
  rc=0
  "$hosts" up "$name" --hosts 2 --rate 1gbit >/dev/null || rc=$?
  [ "$rc" = 0 ] || { [ "$rc" = 77 ] && exit 77; echo "FAIL: netns-hosts up: $rc"; exit 1; }
  h0=10.201.0.1 h1=10.201.0.2
  on() { local h="$1"; shift; ip netns exec "$name-h$h" "$@"; }
else
  h0=127.0.0.1 h1=127.0.0.1
  on() { shift; "$@"; }
fi
head -c 48 /dev/urandom | base64 >"$work/token"
chmod 600 "$work/token"
train=(--epochs 1 --max-steps 30 --seed 7)

# node I ARGS...: ps-local node I in the background, output in $work/nI.{out,err}
node() {
  local i="$1"
  shift
  on "$i" "$local_bin" --nodes 2 --node-rank "$i" --rendezvous "$h0:$port" --workers-per-node 2 \
    --auth-token-file "$work/token" "$@" >"$work/n$i.out" 2>"$work/n$i.err" &
  pids+=($!)
}
acc() { sed -n 's/^summary accuracy=\([^ ]*\).*/\1/p' "$1"; }

# bad flags: exit 2 naming the option
for args in "--nodes 2 --node-rank 2 --rendezvous 127.0.0.1:1 --workers-per-node 2 --no-auth|--node-rank" \
  "--nodes 2 --node-rank 1 --workers-per-node 2 --no-auth|--rendezvous" \
  "--nodes 2 --rendezvous 127.0.0.1:1 --workers-per-node 2|--auth-token-file" \
  "--node-rank 1|--node-rank"; do
  rc=0
  # shellcheck disable=SC2086
  "$local_bin" ${args%%|*} >/dev/null 2>"$work/bad.err" || rc=$?
  [ "$rc" = 2 ] && grep -q -- "option ${args##*|}" "$work/bad.err" ||
    fail "ps-local ${args%%|*}: exit $rc, $(cat "$work/bad.err")"
done

for sync in allreduce ps; do
  [ "$mode" = loopback ] && [ "$sync" = ps ] && continue # netns runs both
  shards=() shards1=()
  [ "$sync" = ps ] && shards=(--shards-per-node 1) shards1=(--shards 2)
  "$local_bin" --workers 4 "${shards1[@]}" --sync-mode "$sync" "${train[@]}" >"$work/one.out" \
    2>"$work/one.err" || fail "one node, $sync"
  port=$((port + 1))
  if [ "$mode" = loopback ]; then # a stranger's garbage first: refused, the job goes on
    node 0 --sync-mode "$sync" "${train[@]}"
    for _ in $(seq 50); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
    python3 - "$port" <<'EOF'
import socket, sys, struct
for junk in (b"\xff\xff\xff\xffjunk", struct.pack(">I", 11) + b"HELLO x y z", b"GET / HTTP/1.0\r\n\r\n"):
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    s.sendall(junk)
    s.close()
EOF
    node 1 --sync-mode "$sync" "${train[@]}"
  else
    node 0 --sync-mode "$sync" "${train[@]}"
    node 1 --sync-mode "$sync" "${train[@]}"
  fi
  wait "${pids[-2]}" || fail "2 nodes, $sync: node 0"
  wait "${pids[-1]}" || fail "2 nodes, $sync: node 1"
  a1=$(acc "$work/one.out") a2=$(acc "$work/n0.out")
  [ -n "$a1" ] && [ "$a1" = "$a2" ] || fail "$sync: one node accuracy=$a1, two nodes accuracy=$a2"
  echo "ok: $sync: 2 nodes x 2 workers accuracy=$a2 = 1 node x 4 workers"
  [ "$mode" = loopback ] && { grep -q "rendezvous refused.*over the size limit" "$work/n0.err" &&
    grep -q "rendezvous refused.*wrong proof" "$work/n0.err" || fail "no refusals logged"; }
done

# a worker killed on node 1 stops node 0, naming node 1
port=$((port + 1))
node 0 --sync-mode allreduce --epochs 50 --seed 7
node 1 --sync-mode allreduce --epochs 50 --seed 7
for _ in $(seq 200); do grep -q '"training"' "$work/n0.err" 2>/dev/null && break; sleep 0.1; done
victim=$(pgrep -f -- "ps-worker .*--rank 3 " | head -n 1)
[ -n "$victim" ] || fail "no ps-worker rank 3 running"
t0=$(date +%s)
kill -9 "$victim"
rc=0
timeout 20 tail --pid="${pids[-2]}" -f /dev/null || fail "node 0 still running 20 s after rank 3 was killed"
wait "${pids[-2]}" || rc=$?
[ "$rc" != 0 ] || fail "node 0 exited 0 after node 1's worker was killed"
grep -q "node 1 ($h1) failed: ps-worker rank 3 failed" "$work/n0.err" || fail "node 0 does not name node 1 and its worker"
echo "ok: node 1's worker killed: node 0 exited $rc in $(($(date +%s) - t0)) s: $(grep -o "node 1 ($h1) failed.*" "$work/n0.err" | head -n 1)"
wait "${pids[-1]}" || true

# node 1's ps-local stopped (SIGSTOP: no FIN, no heartbeat): node 0 names it
port=$((port + 1))
node 0 --sync-mode allreduce --epochs 50 --seed 7
node 1 --sync-mode allreduce --epochs 50 --seed 7
for _ in $(seq 200); do grep -q '"training"' "$work/n0.err" 2>/dev/null && break; sleep 0.1; done
victim=$(pgrep -f -- "ps-local --nodes 2 --node-rank 1 --rendezvous $h0:$port" | tail -n 1)
[ -n "$victim" ] || fail "no ps-local node 1"
t0=$(date +%s)
kill -STOP "$victim"
timeout 20 tail --pid="${pids[-2]}" -f /dev/null || fail "node 0 still running 20 s after node 1 stopped"
rc=0
wait "${pids[-2]}" || rc=$?
kill -9 "$victim"
[ "$rc" != 0 ] && grep -q "node 1 ($h1) failed: lost" "$work/n0.err" || fail "node 1 stopped: exit $rc"
echo "ok: node 1 stopped: node 0 exited $rc in $(($(date +%s) - t0)) s: $(grep -o "node 1 ($h1) failed: lost.*" "$work/n0.err" | tail -n 1)"
wait "${pids[-1]}" || true

# node 0 alone: the rendezvous times out naming node 1
port=$((port + 1))
node 0 --sync-mode allreduce --rendezvous-timeout 2 "${train[@]}"
timeout 20 tail --pid="${pids[-1]}" -f /dev/null || fail "node 0 alone still running after 20 s"
rc=0
wait "${pids[-1]}" || rc=$?
[ "$rc" != 0 ] && grep -q "node(s) 1 never came" "$work/n0.err" || fail "timeout: exit $rc"
echo "ok: rendezvous timeout: $(grep -o "rendezvous timed out after.*came" "$work/n0.err" | tail -n 1)"
