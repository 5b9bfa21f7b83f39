#!/usr/bin/env bash
# manifests: checks of deploy/k8s that need no cluster.
#   manifests.sh render   every overlay renders with kubectl kustomize; ps has
#                         shards and allreduce none; the ConfigMap is generated
#                         (hash-suffixed name, so a change rolls the pods);
#                         no Secret is rendered (the user creates ps-auth
#                         with the command README and the guide give);
#                         replicas follow num-shards / num-workers
#   manifests.sh schema   every rendered object passes deploy/k8s/validate
#                         (schema, unknown fields, deployment policy)
#   manifests.sh broken   each deliberately broken manifest in
#                         deploy/k8s/validate/testdata is rejected, with the
#                         message its "# expect:" line names
# Exit 77 (skip) without kubectl, or without node and the npm packages
# (npm ci in deploy/k8s/validate) for schema and broken.
set -euo pipefail
mode="$1"
root="$(cd "$(dirname "$0")/../.." && pwd)"
k8s="$root/deploy/k8s"
val="$k8s/validate"
skip() { echo "SKIP: $*"; exit 77; }
fails=0
bad() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }
command -v kubectl >/dev/null || skip "kubectl is not installed"
if [ "$mode" != render ]; then
  command -v node >/dev/null || skip "node is not installed"
  [ -d "$val/node_modules/kubernetes-models" ] || skip "run npm ci in deploy/k8s/validate"
fi
overlays=(ps allreduce gpu torch)

case "$mode" in
render)
  for o in "${overlays[@]}"; do
    out="$(kubectl kustomize "$k8s/overlays/$o")" || { bad "overlay $o does not render"; continue; }
    kinds="$(sed -n 's/^kind: //p' <<<"$out" | sort | tr '\n' ' ')"
    echo "$o: $kinds"
    grep -q '^  name: ps-config-[a-z0-9]\{10\}$' <<<"$out" || bad "$o: ps-config is not a generated (hashed) ConfigMap"
    # the token is never in the repository: the user creates the Secret
    ! grep -q '^kind: Secret$' <<<"$out" || bad "$o: renders a Secret (its data comes from the repository)"
    grep -q '^          secretName: ps-auth$' <<<"$out" || bad "$o: the pods do not mount the Secret ps-auth"
    grep -q '^  name: ps-worker$' <<<"$out" || bad "$o: no ps-worker"
    n="$(grep -c '^  name: ps-server$' <<<"$out" || true)"
    case "$o" in
      ps) [ "$n" -ge 4 ] || bad "ps: the shards' objects are missing"
          grep -q '^  sync-mode: ps$' <<<"$out" || bad "ps: sync-mode is not ps" ;;
      torch)
        [ "$n" -ge 4 ] || bad "torch: the shards' objects are missing"
        grep -q '^  sync-mode: ps$' <<<"$out" || bad "torch: sync-mode is not ps"
        grep -q '^  optimizer: sum$' <<<"$out" || bad "torch: the shards do not sum (optimizer is not sum)"
        grep -q '^  completionMode: Indexed$' <<<"$out" || bad "torch: the workers are not an Indexed Job"
        grep -q '^kind: StatefulSet$' <<<"$(awk '/^kind:/{k=$0} /^  name: ps-worker$/{print k}' <<<"$out")" &&
          bad "torch: the base's worker StatefulSet is still rendered"
        grep -q '^  name: ps-torch-script-[a-z0-9]\{10\}$' <<<"$out" ||
          bad "torch: the script is not a generated (hashed) ConfigMap"
        grep -q '"/usr/bin/python3"\|- /usr/bin/python3$' <<<"$out" || bad "torch: the workers do not run /usr/bin/python3" ;;
      *) [ "$n" = 0 ] || bad "$o: shards are rendered in all-reduce mode"
         grep -q '^  sync-mode: allreduce$' <<<"$out" || bad "$o: sync-mode is not allreduce" ;;
    esac
  done
  # the one command that makes the Secret, the same in README and the guide
  # (run-pods.sh runs the guide's, as a user would)
  want="$(grep -m1 '^kubectl create secret generic ps-auth ' "$root/docs/KUBERNETES.md" || true)"
  if [ -z "$want" ]; then
    bad "docs/KUBERNETES.md has no 'kubectl create secret generic ps-auth ...' line"
  else
    grep -qF -- "$want" "$root/README.md" || bad "README.md does not give the command of docs/KUBERNETES.md: $want"
    grep -q 'token=.*\(/dev/urandom\|openssl rand\)' <<<"$want" || bad "the documented token is not random: $want"
  fi
  # resizing is one key each
  tmp="$(mktemp -d "${PS_BUILD_DIR:-/tmp}/k8s-resize-XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  rel="$(realpath --relative-to="$tmp" "$k8s")"
  cat >"$tmp/kustomization.yaml" <<EOT
resources: [$rel/overlays/ps]
components: [$rel/components/sizes]
configMapGenerator:
  - name: ps-config
    behavior: merge
    literals: [num-shards=3, num-workers=5]
EOT
  out="$(kubectl kustomize "$tmp")"
  replicas="$(sed -n 's/^  replicas: //p' <<<"$out" | tr '\n' ' ')"
  [ "$replicas" = "3 5 " ] || bad "resizing: replicas are '$replicas', want '3 5 '"
  # the same in the torch overlay: the shards, and the worker Job's size
  # and budget
  sed -i "s|overlays/ps]|overlays/torch]|" "$tmp/kustomization.yaml"
  out="$(kubectl kustomize "$tmp")"
  sizes="$(sed -n 's/^  \(replicas\|parallelism\|completions\|minAvailable\): //p' <<<"$out" | sort | tr '\n' ' ')"
  [ "$sizes" = "3 5 5 5 " ] || bad "resizing torch: replicas, parallelism, completions, minAvailable are '$sizes', want '3 5 5 5 '"
  ;;
schema)
  for o in "${overlays[@]}"; do
    echo "== $o"
    kubectl kustomize "$k8s/overlays/$o" | node "$val/validate.mjs" --policy - || bad "overlay $o"
  done
  ;;
broken)
  for f in "$val"/testdata/broken-*; do
    name="$(basename "$f")"
    if [ -d "$f" ]; then
      expect="$(sed -n 's/^# expect: //p' "$f/kustomization.yaml")"
      out="$(kubectl kustomize "$f" | node "$val/validate.mjs" --policy - 2>&1)" && rc=0 || rc=$?
    else
      expect="$(sed -n 's/^# expect: //p' "$f")"
      flag=""
      grep -q '^# policy$' "$f" && flag=--policy
      out="$(node "$val/validate.mjs" $flag "$f" 2>&1)" && rc=0 || rc=$?
    fi
    [ -n "$expect" ] || { bad "$name has no '# expect:' line"; continue; }
    if [ "$rc" != 1 ]; then
      bad "$name: accepted (exit $rc)"
    elif ! grep -qF -- "$expect" <<<"$out"; then
      bad "$name: rejected, but not for '$expect':"$'\n'"$out"
    else
      echo "$name: rejected: $expect"
    fi
  done
  ;;
*)
  echo "usage: manifests.sh render|schema|broken" >&2
  exit 2
  ;;
esac
[ "$fails" = 0 ]
