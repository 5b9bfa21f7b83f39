#!/usr/bin/env bash
# The node-first all-reduce between simulated hosts (tools/faults/netns-hosts: two
# network namespaces on a bridge, each NIC shaped to 400 Mbit/s by tbf), 4
# real ranks of tools/allreduce-bench, 2 per host, each told its host with
# --node-name:
#  - every all-reduce (sum and mean, counts not divisible by W) checked
#    against the exact result by each rank, with the flat ring and with
#    node-first, ranks placed in host order (0 1 | 2 3) and alternating
#    (0 2 | 1 3);
#  - the bytes the NICs sent: node-first must put at most 3/4 of the ring's
#    across in host order (it should be 2/3: one buffer each way instead of
#    1.5) and at most 2/5 alternating (1/3: 1 instead of 3);
#  - a rank killed in the middle of node-first all-reduces makes rank 0 fail
#    within 15 s naming it.
# Exit 77 where namespaces, bridges or tbf cannot be made (needs root).
#   test_node_first_netns.sh BUILD_DIR
set -euo pipefail
build="${1:?usage: test_node_first_netns.sh BUILD_DIR}"
here="$(cd "$(dirname "$0")" && pwd)"
hosts="$here/../../tools/faults/netns-hosts"
bench="$build/tools/allreduce-bench"
name="psnf$$"
work=$(mktemp -d)
cleanup() { "$hosts" down "$name"; rm -rf "$work"; }
trap cleanup EXIT
rc=0
"$hosts" up "$name" --hosts 2 --rate 400mbit || rc=$?
[ "$rc" = 0 ] || { [ "$rc" = 77 ] && exit 77; echo "FAIL: netns-hosts up: $rc"; exit 1; }

fail() { echo "FAIL: $*"; exit 1; }

# run LAYOUT ALGO OP SIZES [args]: the 4 ranks, to the end; rank 0's table in
# $work/out0, what crossed between the hosts in $work/bytes
run() {
  local layout="$1" algo="$2" op="$3" sizes="$4" b0
  shift 4
  b0=$("$hosts" bytes "$name")
  "$hosts" ranks "$name" "$layout" "$work" "$bench" --allreduce-algorithm "$algo" --op "$op" \
    --sizes "$sizes" --warmup 1 --connect-timeout-ms 20000 --peer-timeout-ms 5000 "$@" ||
    fail "$layout $algo $op: $(cat "$work"/err*)"
  echo $(($("$hosts" bytes "$name") - b0)) >"$work/bytes"
}

for layout in order alternate; do
  for algo in ring node-first; do
    for op in sum avg; do
      run "$layout" "$algo" "$op" 4100,262148,4194308 --iters 2
      grep -q "^# algorithm: $algo" "$work/out0" || fail "rank 0 did not run $algo: $(head -5 "$work/out0")"
      lines=$(grep -vc '^#' "$work/out0" || true)
      [ "$lines" = 3 ] || fail "$layout $algo $op: $lines result lines: $(cat "$work/out0")"
      bad=$(awk '!/^#/ {w += $8} END {print w + 0}' "$work/out0")
      [ "$bad" = 0 ] || fail "$layout $algo $op: $bad wrong elements: $(cat "$work/out0")"
      eval "bytes_${layout}_${algo//-/_}_$op=$(cat "$work/bytes")"
      echo "$layout $algo $op: every element right, $(cat "$work/bytes") bytes between hosts"
    done
  done
done
for layout in order alternate; do
  for op in sum avg; do
    ring=$(eval echo "\$bytes_${layout}_ring_$op") nf=$(eval echo "\$bytes_${layout}_node_first_$op")
    limit=$([ $layout = order ] && echo 75 || echo 40)
    [ $((nf * 100)) -le $((ring * limit)) ] ||
      fail "$layout $op: node-first sent $nf bytes between hosts, the ring $ring (limit $limit%)"
    echo "$layout $op: node-first sent $((nf * 100 / ring))% of the ring's bytes between hosts"
  done
done

# A rank killed in the middle: rank 0 fails naming it, in bounded time.
"$hosts" ranks "$name" order "$work" "$bench" --allreduce-algorithm node-first --sizes 16M \
  --iters 1000 --warmup 1 --peer-timeout-ms 5000 &
runner=$!
sleep 2
read -ra pids <"$work/pids"
kill -9 "${pids[3]}"
# the event: the runner ends (the others failed); waited for 60 s, over 10
# times what it takes, and killed if still running
for _ in $(seq 600); do
  kill -0 "$runner" 2>/dev/null || break
  sleep 0.1
done
if kill -0 "$runner" 2>/dev/null; then
  kill "$runner"
  fail "the others did not fail within 60 s of rank 3's kill"
fi
rc=0
wait "$runner" || rc=$?
[ "$rc" != 0 ] || fail "the ranks exited 0 after rank 3 was killed"
grep -q "rank 3" "$work/err0" || fail "rank 0 does not name rank 3: $(cat "$work/err0")"
echo "rank 3 killed: rank 0: $(grep -m1 "rank 3" "$work/err0")"
echo "PASS"
