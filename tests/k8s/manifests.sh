#!/usr/bin/env bash
# manifests: checks of deploy/k8s that need no cluster.
#   manifests.sh render   every overlay renders with kubectl kustomize; ps has
#                         shards and allreduce none; the ConfigMap is generated
#                         (hash-suffixed name, so a change rolls the pods);
#                         no Secret is rendered (the user creates ps-auth
#                         with the command README and the guide give);
#                         replicas follow num-shards / num-workers;
#                         every overlay but ps-rdma pushes over tcp and adds
#                         no capability; ps-rdma (components/rdma, also on
#                         torch) has transport ucx, UCX_TLS, IPC_LOCK, the
#                         RDMA device in requests and limits and a Memory
#                         /dev/shm in every pod that pushes or pulls
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
overlays=(ps allreduce gpu torch ps-rdma 3d torch-3d torch-procs)
# components/rdma's device plugin resource (deploy/k8s/components/rdma/pods.yaml)
rdma_res=rdma/rdma_shared_device_a

# One object of a render (kubectl kustomize separates them with ---).
object() { # RENDER KIND NAME
  awk -v kind="kind: $2" -v name="  name: $3" '
    /^---$/ { if (k && n) printf "%s", doc; doc = ""; k = n = 0; next }
    { doc = doc $0 "\n"; if ($0 == kind) k = 1; if ($0 == name) n = 1 }
    END { if (k && n) printf "%s", doc }' <<<"$1"
}
# A key of the render's ps-config (quotes dropped).
cfg() { sed -n "s/^  $2: \"\\{0,1\\}\\([^\"]*\\)\"\\{0,1\\}\$/\\1/p" <<<"$1" | head -1; }
# What components/grid promises (docs/KUBERNETES.md, "3D jobs"), in a
# render: the workers' replicas are T * P * D with T, P from the ConfigMap
# and D the data-parallel replicas wanted, every worker reads the four grid
# keys, the set is one Kueue gang (queue-name label from kueue-queue) and
# its pods are cut into slices of T consecutive ordinals, each on one node.
# With KIND Job (overlays/torch-3d, components/grid-job) the same of the
# Indexed Job: its parallelism and completions are the replicas.
grid_checks() { # LABEL RENDER D [KIND]
  local label="$1" out="$2" d="$3" kind="${4:-StatefulSet}" w t p r k e obj
  t="$(cfg "$out" tensor-parallel)" p="$(cfg "$out" pipeline-stages)" w="$(cfg "$out" num-workers)"
  obj="$(object "$out" "$kind" ps-worker)"
  if [ "$kind" = Job ]; then
    r="$(sed -n 's/^  parallelism: //p' <<<"$obj")"
    [ "$(sed -n 's/^  completions: //p' <<<"$obj")" = "$r" ] || bad "$label: the Job's completions are not its parallelism"
  else
    r="$(sed -n 's/^  replicas: //p' <<<"$obj")"
  fi
  [ -n "$t" ] && [ -n "$p" ] && [ -n "$w" ] || { bad "$label: ps-config lacks tensor-parallel, pipeline-stages or num-workers"; return; }
  [ "$r" = "$w" ] && [ "$r" = $((t * p * d)) ] ||
    bad "$label: the workers' replicas are '$r', want num-workers ($w) = T*P*D = $t*$p*$d"
  for k in tensor-parallel pipeline-stages micro-batches pipeline-schedule; do
    [ -n "$(cfg "$out" "$k")" ] || bad "$label: ps-config has no key $k"
    e="PS_$(tr a-z- A-Z_ <<<"$k")"
    # (no `grep | grep -q`: with pipefail it fails when grep -q stops early)
    grep -q "^ *key: $k\$" <<<"$(grep -A4 "^ *- name: $e\$" <<<"$obj")" ||
      bad "$label: the workers do not read $e from the key $k"
  done
  grep -q "^    kueue.x-k8s.io/queue-name: $(cfg "$out" kueue-queue)\$" <<<"$obj" ||
    bad "$label: the workers' $kind has no kueue.x-k8s.io/queue-name label from the key kueue-queue"
  grep -q '^ *kueue.x-k8s.io/podset-slice-required-topology: kubernetes.io/hostname$' <<<"$obj" ||
    bad "$label: the workers' pods have no slice-required-topology kubernetes.io/hostname"
  grep -q "^ *kueue.x-k8s.io/podset-slice-size: \"$t\"\$" <<<"$obj" ||
    bad "$label: the slice size is not tensor-parallel ($t): $(grep 'podset-slice-size' <<<"$obj" || echo none)"
  [ "$kind" = Job ] || grep -q '^  podManagementPolicy: Parallel$' <<<"$obj" ||
    bad "$label: the workers are not Parallel (Kueue gates every pod until the gang is placed)"
}
# What components/rdma promises, in a render: transport ucx, and in the pod
# of each KIND/NAME given: the transport from ps-config, UCX_TLS, IPC_LOCK
# added with ALL still dropped (non-root, read-only root), the RDMA device in
# requests and limits, /dev/shm a Memory emptyDir.
rdma_checks() { # LABEL RENDER KIND/NAME...
  local label="$1" out="$2" w obj
  shift 2
  grep -q '^  transport: ucx$' <<<"$out" || bad "$label: ps-config's transport is not ucx"
  grep -q '^  ucx-tls: .*rc' <<<"$out" || bad "$label: ps-config's ucx-tls names no rc"
  for w in "$@"; do
    obj="$(object "$out" "${w%/*}" "${w#*/}")"
    [ -n "$obj" ] || { bad "$label: no $w"; continue; }
    grep -q '^ *key: transport$' <<<"$obj" || bad "$label: $w does not read the key transport"
    grep -q '^ *- name: UCX_TLS$' <<<"$obj" || bad "$label: $w: UCX_TLS is not set"
    grep -q '^ *- IPC_LOCK$' <<<"$obj" || bad "$label: $w: IPC_LOCK is not added"
    grep -q '^ *- ALL$' <<<"$obj" || bad "$label: $w: capabilities ALL are not dropped"
    grep -q '^ *runAsNonRoot: true$' <<<"$obj" || bad "$label: $w: not runAsNonRoot"
    grep -q '^ *readOnlyRootFilesystem: true$' <<<"$obj" || bad "$label: $w: root filesystem not read-only"
    [ "$(grep -c "^ *$rdma_res: \"1\"$" <<<"$obj")" = 2 ] ||
      bad "$label: $w: $rdma_res: \"1\" is not in both requests and limits"
    grep -q '^ *- mountPath: /dev/shm$' <<<"$obj" || bad "$label: $w: no /dev/shm mount"
    grep -q '^ *medium: Memory$' <<<"$obj" || bad "$label: $w: /dev/shm is not a Memory emptyDir"
  done
}

# What the torch Job's pods get (docs/KUBERNETES.md, "Your own PyTorch
# script"): /dev/shm as a Memory emptyDir, a volume for checkpoints at
# PS_CHECKPOINT_DIR, and the script (its path the 5th element of the
# command) run by python3 -m ps.pod (which starts procs-per-pod ranks, the
# pod's index in PS_POD_INDEX) with the words of the ps-config key
# script-args.
torch_job_checks() { # LABEL JOB SCRIPT
  local label="$1" job="$2" script="$3"
  grep -q '^ *- mountPath: /dev/shm$' <<<"$job" || bad "$label: the Job's pods have no /dev/shm"
  grep -B3 '^ *name: dshm$' <<<"$job" | grep -q '^ *medium: Memory$' ||
    bad "$label: the Job's /dev/shm is not a Memory emptyDir"
  grep -A1 '^ *- name: PS_CHECKPOINT_DIR$' <<<"$job" | grep -q 'value: /var/lib/ps/checkpoints$' &&
    grep -q '^ *- mountPath: /var/lib/ps/checkpoints$' <<<"$job" ||
    bad "$label: no checkpoint volume at PS_CHECKPOINT_DIR=/var/lib/ps/checkpoints"
  grep -A4 '^ *- name: TORCH_SCRIPT_ARGS$' <<<"$job" | grep -q '^ *key: script-args$' ||
    bad "$label: TORCH_SCRIPT_ARGS does not come from the key script-args"
  [ "$(grep -A6 '^ *command:$' <<<"$job" | sed -n 's/^ *- //p' | tr '\n' '|')" = \
    "/usr/bin/sh|-c|set -f; exec \"\$0\" -m ps.pod -- \"\$0\" \"\$@\" \$TORCH_SCRIPT_ARGS|/usr/bin/python3|$script|" ] ||
    bad "$label: the command does not exec python3 -m ps.pod -- /usr/bin/python3 $script with \$TORCH_SCRIPT_ARGS"
  grep -A3 '^ *- name: PS_POD_INDEX$' <<<"$job" | grep -q "job-completion-index" ||
    bad "$label: PS_POD_INDEX (ps.pod's pod index) is not the completion index"
  grep -A4 '^ *- name: PS_PROCS_PER_POD$' <<<"$job" | grep -q '^ *key: procs-per-pod$' ||
    bad "$label: PS_PROCS_PER_POD does not come from the key procs-per-pod"
}

# The torch overlays' shards end with the workers' Job (docs/KUBERNETES.md,
# "When the script is done"): an Indexed Job ps-server, not the base's
# StatefulSet (which restarts a shard that exits 0), whose ps-server exits
# when rank 0's ps.shutdown() says so, its shard id the completion index,
# with its Service, budget, policy and a checkpoint volume; nothing in the
# render is a StatefulSet.
shard_job_checks() { # LABEL RENDER
  local label="$1" out="$2" job
  job="$(object "$out" Job ps-server)"
  [ -n "$job" ] || { bad "$label: the shards are not a Job ps-server"; return; }
  ! grep -q '^kind: StatefulSet$' <<<"$out" || bad "$label: renders a StatefulSet (it would outlive the Job)"
  grep -q '^  completionMode: Indexed$' <<<"$job" || bad "$label: the shards' Job is not Indexed"
  grep -q '^      restartPolicy: Never$' <<<"$job" || bad "$label: the shards' pods are not restartPolicy: Never"
  grep -q '^      subdomain: ps-server$' <<<"$job" || bad "$label: the shards' pods are not under the subdomain ps-server"
  grep -q -- '- --exit-when-done=true$' <<<"$job" || bad "$label: the shards do not exit when done"
  grep -A3 '^ *- name: PS_POD_INDEX$' <<<"$job" | grep -q "job-completion-index" ||
    bad "$label: the shard id is not the completion index"
  grep -q '^ *- mountPath: /var/lib/ps$' <<<"$job" || bad "$label: the shards have no checkpoint volume"
  for k in Service NetworkPolicy; do
    [ -n "$(object "$out" $k ps-server)" ] || bad "$label: no $k ps-server"
  done
  [ -n "$(object "$out" PodDisruptionBudget ps-server-job)" ] || bad "$label: no budget for the shards' Job"
}

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
    # every StatefulSet and Job is one Kueue gang in the queue kueue-queue
    # (components/gang)
    q="$(cfg "$out" kueue-queue)"
    for w in $(awk '/^kind: (StatefulSet|Job)$/ { k = $2 } /^  name: / && k { print k "/" $2; k = "" }' <<<"$out"); do
      grep -q "^    kueue.x-k8s.io/queue-name: $q\$" <<<"$(object "$out" "${w%/*}" "${w#*/}")" ||
        bad "$o: $w has no kueue.x-k8s.io/queue-name label '$q' from the key kueue-queue (components/gang)"
    done
    imgs="$(sed -n 's/^ *image: //p' <<<"$out" | sort -u | tr '\n' ' ')"
    [ "$imgs" = "ps:0.1.0 " ] || bad "$o: the pods' images are '$imgs', want one, 'ps:0.1.0 ' (components/image)"
    if [ "$o" != ps-rdma ]; then
      grep -q '^  transport: tcp$' <<<"$out" || bad "$o: transport is not tcp"
      ! grep -q '^ *add:$' <<<"$out" || bad "$o: a container adds a capability"
    fi
    if [ "$o" != 3d ] && [ "$o" != torch-3d ]; then
      g="$(for k in tensor-parallel pipeline-stages micro-batches pipeline-schedule; do cfg "$out" $k; done | tr '\n' ' ')"
      [ "$g" = "1 1 1 1f1b " ] || bad "$o: the grid keys are '$g', want the defaults '1 1 1 1f1b '"
      ! grep -q 'kueue.x-k8s.io/podset' <<<"$out" || bad "$o: has Kueue topology fields without components/grid"
    fi
    n="$(grep -c '^  name: ps-server$' <<<"$out" || true)"
    case "$o" in
      ps|ps-rdma)
        [ "$n" -ge 4 ] || bad "$o: the shards' objects are missing"
        grep -q '^  sync-mode: ps$' <<<"$out" || bad "$o: sync-mode is not ps"
        [ "$o" = ps ] || rdma_checks "$o" "$out" StatefulSet/ps-server StatefulSet/ps-worker ;;
      3d)
        [ "$n" -ge 4 ] || bad "3d: the shards' objects are missing"
        grep -q '^  sync-mode: ps$' <<<"$out" || bad "3d: sync-mode is not ps"
        [ "$(cfg "$out" tensor-parallel)/$(cfg "$out" pipeline-stages)" = 2/2 ] ||
          bad "3d: T/P are $(cfg "$out" tensor-parallel)/$(cfg "$out" pipeline-stages), want 2/2"
        grid_checks 3d "$out" 2 ;;
      torch)
        shard_job_checks torch "$out"
        grep -q '^  sync-mode: ps$' <<<"$out" || bad "torch: sync-mode is not ps"
        grep -q '^  optimizer: sum$' <<<"$out" || bad "torch: the shards do not sum (optimizer is not sum)"
        grep -q '^  completionMode: Indexed$' <<<"$out" || bad "torch: the workers are not an Indexed Job"
        grep -q '^kind: StatefulSet$' <<<"$(awk '/^kind:/{k=$0} /^  name: ps-worker$/{print k}' <<<"$out")" &&
          bad "torch: the base's worker StatefulSet is still rendered"
        grep -q '^  name: ps-torch-script-[a-z0-9]\{10\}$' <<<"$out" ||
          bad "torch: the script is not a generated (hashed) ConfigMap"
        grep -q '"/usr/bin/python3"\|- /usr/bin/python3$' <<<"$out" || bad "torch: the workers do not run /usr/bin/python3"
        # a script that trains in 3D reads the grid (1, 1, 1, 1f1b here)
        job="$(object "$out" Job ps-worker)"
        torch_job_checks torch "$job" /etc/ps/script/train.py
        for k in tensor-parallel pipeline-stages micro-batches pipeline-schedule; do
          e="PS_$(tr a-z- A-Z_ <<<"$k")"
          grep -q "^ *key: $k\$" <<<"$(grep -A4 "^ *- name: $e\$" <<<"$job")" ||
            bad "torch: the workers do not read $e from the key $k"
        done ;;
      torch-3d)
        shard_job_checks torch-3d "$out"
        grep -q '^  sync-mode: ps$' <<<"$out" || bad "torch-3d: sync-mode is not ps"
        grep -q '^  optimizer: sum$' <<<"$out" || bad "torch-3d: the shards do not sum (optimizer is not sum)"
        grep -q '^  completionMode: Indexed$' <<<"$out" || bad "torch-3d: the workers are not an Indexed Job"
        [ "$(cfg "$out" tensor-parallel)/$(cfg "$out" pipeline-stages)" = 2/2 ] ||
          bad "torch-3d: T/P are $(cfg "$out" tensor-parallel)/$(cfg "$out" pipeline-stages), want 2/2"
        grep -q '^        - /usr/local/share/doc/ps/examples/torch/train_gpt.py$' <<<"$out" ||
          bad "torch-3d: the workers do not run the installed train_gpt.py"
        ! grep -q 'ps-torch-script' <<<"$out" || bad "torch-3d: the unused script ConfigMap is rendered"
        torch_job_checks torch-3d "$(object "$out" Job ps-worker)" /usr/local/share/doc/ps/examples/torch/train_gpt.py
        grid_checks torch-3d "$out" 2 Job ;;
      torch-procs)
        # 4 ranks, 2 per pod: 2 pods, each rank's ring port admitted
        shard_job_checks torch-procs "$out"
        job="$(object "$out" Job ps-worker)"
        torch_job_checks torch-procs "$job" /etc/ps/script/train.py
        c="$(cfg "$out" num-workers)/$(cfg "$out" worker-pods)/$(cfg "$out" procs-per-pod)"
        [ "$c" = 4/2/2 ] || bad "torch-procs: num-workers/worker-pods/procs-per-pod are $c, want 4/2/2"
        sizes="$(sed -n 's/^  \(parallelism\|completions\): //p' <<<"$job" | tr '\n' ' ')"
        sizes+="$(sed -n 's/^  minAvailable: //p' <<<"$(object "$out" PodDisruptionBudget ps-worker-job)")"
        [ "$sizes" = "2 2 2" ] || bad "torch-procs: the worker Job's completions, parallelism, minAvailable are '$sizes', want '2 2 2' (components/procs-per-pod)"
        grep -A2 '^    - endPort: 7102$' <<<"$(object "$out" NetworkPolicy ps-worker)" | grep -q 'port: 7071$' ||
          bad "torch-procs: the workers' NetworkPolicy does not admit the ring ports 7071-7102" ;;
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
  [ "$sizes" = "3 3 3 5 5 5 " ] || bad "resizing torch: parallelism, completions, minAvailable are '$sizes', want '3 3 3 5 5 5 '"
  # an overlay of ps-rdma resizes the same way and stays on ucx
  sed -i "s|overlays/torch]|overlays/ps-rdma]|" "$tmp/kustomization.yaml"
  out="$(kubectl kustomize "$tmp")"
  replicas="$(sed -n 's/^  replicas: //p' <<<"$out" | tr '\n' ' ')"
  [ "$replicas" = "3 5 " ] || bad "resizing ps-rdma: replicas are '$replicas', want '3 5 '"
  grep -q '^  transport: ucx$' <<<"$out" || bad "resizing ps-rdma: transport is no longer ucx"
  # the image is set once for every pod, the Job's too, as the guide says
  for o in ps torch; do
    cat >"$tmp/kustomization.yaml" <<EOT
resources: [$rel/overlays/$o]
images: [{name: ps, newName: registry.example.com/ps, newTag: "0.2.0"}]
EOT
    out="$(kubectl kustomize "$tmp")"
    imgs="$(sed -n 's/^ *image: //p' <<<"$out" | sort | uniq -c | awk '{print $1, $2}' | tr '\n' ' ')"
    [ "$imgs" = "2 registry.example.com/ps:0.2.0 " ] ||
      bad "$o with images: the pods run '$imgs', want '2 registry.example.com/ps:0.2.0 '"
  done
  # the guide's patch that backs the torch Job's checkpoints with a claim
  awk '/^\*\*Checkpoints of the script\.\*\*/ { f = 1 } f && /^```$/ { exit } f && c { print }
       f && /^```yaml$/ { c = 1 }' "$root/docs/KUBERNETES.md" |
    sed "s|\.\./\.\./deploy/k8s/|$rel/|" >"$tmp/kustomization.yaml"
  out="$(kubectl kustomize "$tmp")" || bad "the guide's checkpoint claim patch does not render"
  vol="$(sed -n '/^      volumes:$/,$p' <<<"$(object "$out" Job ps-worker)" |
         awk '/^      - / { v = ($0 ~ /name: checkpoints$/) } v')"
  grep -q 'claimName: my-checkpoints$' <<<"$vol" && ! grep -q 'emptyDir' <<<"$vol" ||
    bad "the guide's patch does not back the Job's checkpoints with the claim: $vol"
  # the torch overlays' shards are the base's, as a Job: the pod template of
  # server-job.yaml is a copy of server-statefulset.yaml's (kustomize cannot
  # turn one kind into another), so it must not drift: the same pod but for
  # what a Job's pod needs (restartPolicy, subdomain, the shard id from the
  # completion index, --exit-when-done=true, --first-worker-timeout,
  # --fail-on-signal, the checkpoint volume)
  if ! command -v node >/dev/null || [ ! -d "$val/node_modules/yaml" ]; then
    echo "note: the shards' Job is not compared with the StatefulSet (needs node and npm ci in $val)"
  else
  diff_out="$(kubectl kustomize "$k8s/overlays/ps" >"$tmp/ps.yaml" && kubectl kustomize "$k8s/overlays/torch" >"$tmp/torch.yaml" &&
    node --input-type=module -e '
      import { readFileSync } from "node:fs";
      import { createRequire } from "node:module";
      const YAML = createRequire(process.argv[1] + "/package.json")("yaml");
      const pod = (f, kind) => {
        const o = YAML.parseAllDocuments(readFileSync(f, "utf8")).map((d) => d.toJS())
          .find((x) => x && x.kind === kind && x.metadata.name === "ps-server");
        const t = structuredClone(o.spec.template);
        delete t.spec.restartPolicy; delete t.spec.subdomain;
        t.spec.volumes = t.spec.volumes.filter((v) => v.name !== "checkpoints");
        const c = t.spec.containers[0];
        c.args = c.args.map((a) => a.replace(/^--exit-when-done=.*/, "--exit-when-done"))
          .filter((a) => !a.startsWith("--first-worker-timeout=") && !a.startsWith("--fail-on-signal="));
        for (const e of c.env) if (e.name === "PS_POD_INDEX") e.valueFrom = "index";
        return JSON.stringify(t, null, 1).replace(/ps-config-[a-z0-9]{10}/g, "ps-config");
      };
      const a = pod(process.argv[2], "StatefulSet"), b = pod(process.argv[3], "Job");
      if (a !== b) {
        const al = a.split("\n"), bl = b.split("\n");
        const i = al.findIndex((l, k) => l !== bl[k]);
        console.log(`first difference at line ${i}: StatefulSet: ${al[i]} / Job: ${bl[i]}`);
      }' "$val" "$tmp/ps.yaml" "$tmp/torch.yaml" 2>&1)" || diff_out="node failed: $diff_out"
  [ -z "$diff_out" ] || bad "overlays/torch/server-job.yaml drifted from base/server-statefulset.yaml: $diff_out"
  fi
  # a shard of the Job gives up when no worker comes (a failed workers' Job)
  for o in torch torch-3d; do
    grep -q -- '- --first-worker-timeout=600$' <<<"$(kubectl kustomize "$k8s/overlays/$o")" ||
      bad "overlays/$o: the shards' Job does not pass --first-worker-timeout (a new shard pod would wait for ever)"
    # ... and a shard evicted mid-training exits 143, so the Job runs its index again
    grep -q -- '- --fail-on-signal=true$' <<<"$(kubectl kustomize "$k8s/overlays/$o")" ||
      bad "overlays/$o: the shards' Job does not pass --fail-on-signal (an evicted shard would count as done)"
  done
  # another queue: the key and components/gang again, in an overlay of any
  # overlay; every StatefulSet and Job follows
  for o in allreduce torch; do
    cat >"$tmp/kustomization.yaml" <<EOT
resources: [$rel/overlays/$o]
components: [$rel/components/gang]
configMapGenerator:
  - name: ps-config
    behavior: merge
    literals: [kueue-queue=team-a]
EOT
    out="$(kubectl kustomize "$tmp")"
    n="$(grep -c '^    kueue.x-k8s.io/queue-name: team-a$' <<<"$out" || true)"
    [ "$n" = "$(grep -c '^kind: \(StatefulSet\|Job\)$' <<<"$out")" ] && [ "$n" -ge 1 ] &&
      ! grep -q 'queue-name: ps-queue' <<<"$out" || bad "$o with kueue-queue=team-a: $n sets in team-a"
  done
  # the 3D job resized in an overlay of its own (grid and sizes again): T=4,
  # P=1, D=4 gives 16 workers in slices of 4
  cat >"$tmp/kustomization.yaml" <<EOT
resources: [$rel/overlays/3d]
components: [$rel/components/grid, $rel/components/sizes]
configMapGenerator:
  - name: ps-config
    behavior: merge
    literals: [tensor-parallel=4, pipeline-stages=1, num-workers=16, kueue-queue=team-a]
EOT
  out="$(kubectl kustomize "$tmp")" || bad "resizing 3d does not render"
  grid_checks "resizing 3d" "$out" 4
  # and the PyTorch 3D job (grid-job and sizes again)
  sed -i "s|overlays/3d]|overlays/torch-3d]|; s|components/grid,|components/grid-job,|" "$tmp/kustomization.yaml"
  out="$(kubectl kustomize "$tmp")" || bad "resizing torch-3d does not render"
  grid_checks "resizing torch-3d" "$out" 4 Job
  [ "$(sed -n 's/^  minAvailable: //p' <<<"$(object "$out" PodDisruptionBudget ps-worker-job)")" = 16 ] ||
    bad "resizing torch-3d: the Job's PodDisruptionBudget does not follow num-workers"
  # components/rdma on torch (before sizes): the Job's pods get it too, the
  # sizes still follow the keys, and a UCX key set next to the component
  # wins (the base holds its default, the component does not set it)
  cat >"$tmp/kustomization.yaml" <<EOT
resources: [$rel/overlays/torch]
components: [$rel/components/rdma, $rel/components/sizes]
configMapGenerator:
  - name: ps-config
    behavior: merge
    literals: [num-workers=3, ucx-net-devices=mlx5_0:1]
EOT
  out="$(kubectl kustomize "$tmp")" || bad "torch with components/rdma does not render"
  rdma_checks "torch+rdma" "$out" Job/ps-server Job/ps-worker
  sizes="$(sed -n 's/^  \(replicas\|parallelism\|completions\|minAvailable\): //p' <<<"$out" | sort | tr '\n' ' ')"
  [ "$sizes" = "2 2 2 3 3 3 " ] || bad "torch+rdma: parallelism, completions, minAvailable are '$sizes', want '2 2 2 3 3 3 '"
  grep -q '^  ucx-net-devices: mlx5_0:1$' <<<"$out" || bad "torch+rdma: ucx-net-devices set next to the component is lost"
  # the device plugin's resource renamed as docs/KUBERNETES.md says
  want="$(grep -m1 -o 'rdma~1[a-z_]*_devices_a' "$root/docs/KUBERNETES.md" || true)"
  [ -n "$want" ] || bad "docs/KUBERNETES.md shows no rename of the RDMA resource"
  c0=/spec/template/spec/containers/0/resources
  cat >"$tmp/kustomization.yaml" <<EOT
resources: [$rel/overlays/ps-rdma]
patches:
  - target: {kind: StatefulSet|Job, name: ps-server|ps-worker}
    patch: |-
      - {op: move, from: $c0/requests/${rdma_res/\//~1}, path: $c0/requests/$want}
      - {op: move, from: $c0/limits/${rdma_res/\//~1}, path: $c0/limits/$want}
EOT
  out="$(kubectl kustomize "$tmp")" || bad "the rename of the RDMA resource does not render"
  ! grep -q "$rdma_res" <<<"$out" || bad "renaming the RDMA resource: $rdma_res is still there"
  [ "$(grep -c "^ *${want/~1//}: \"1\"$" <<<"$out")" = 4 ] ||
    bad "renaming the RDMA resource: ${want/~1//} is not in both pods' requests and limits"
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
