// validate: checks rendered Kubernetes manifests offline.
//
//   node validate.mjs [--policy] FILE...    (FILE "-" = stdin; multi-document YAML)
//
// 1. Schema: every object is validated by the kubernetes-models validator of
//    its apiVersion/kind (the upstream OpenAPI schema compiled with ajv). An
//    object of a kind it has no schema for is an error.
// 2. Unknown fields: the OpenAPI schemas do not forbid extra properties, and
//    the API server would silently drop a misspelt field (in client-side
//    apply) - the mistake this check exists for. So the object is validated
//    through a Proxy that records every property the validator reads: the
//    validator reads each property its schema declares, and every key of a
//    map (labels, ConfigMap data). Any key in the object that the validator
//    never read is a field the schema does not have.
// 3. --policy: what ps's deployment promises (docs/KUBERNETES.md), checked on
//    every StatefulSet, Job, Service, NetworkPolicy and Secret, so a later
//    edit cannot quietly drop one (non-root, read-only root, capabilities
//    dropped (IPC_LOCK alone added, only to RDMA pods), probes,
//    requests and limits, headless Services publishing not-ready addresses,
//    Parallel pods, a PodDisruptionBudget for every set of pods, the auth
//    Secret required and never rendered; for a Job of workers: Indexed, the
//    rank from the completion index (procs-per-pod ranks per pod through
//    python3 -m ps.pod, the ring ports admitted), a Service for its subdomain, exit codes
//    1-127 fail it and 129 is retried, ...; the 3D grid's keys valid and
//    read by every worker, num-workers a multiple of tensor-parallel x
//    pipeline-stages, and a 3D job's workers one Kueue gang with slices of
//    tensor-parallel pods per node; the job's size: num-workers and
//    num-shards, the pod counts and each process's setting agree; one image
//    with a tag or digest for every pod; a StatefulSet's binaries stay up
//    when done, a Job's exit, and shards end with a Job of workers; the
//    shards and the workers each one Kueue gang in the queue kueue-queue).
//
// Exit 0 if every object passes, 1 otherwise (each problem printed with the
// object and the field path), 2 on bad usage.
import { readFileSync } from "node:fs";
import YAML from "yaml";

function modulePath(apiVersion, kind) {
  if (typeof apiVersion !== "string" || typeof kind !== "string" || !/^[A-Za-z0-9]+$/.test(kind))
    return null;
  return `kubernetes-models/${apiVersion}/${kind}`;
}

// Wraps value so that reads of its own properties (recursively) are recorded
// in `reads`: path -> Set of keys read.
function recorder(value, path, reads) {
  if (value === null || typeof value !== "object") return value;
  if (!reads.has(path)) reads.set(path, new Set());
  const read = reads.get(path);
  const children = new Map();
  return new Proxy(value, {
    get(target, key, receiver) {
      const v = Reflect.get(target, key, receiver);
      if (typeof key !== "string" || !Object.prototype.hasOwnProperty.call(target, key)) return v;
      read.add(key);
      if (v === null || typeof v !== "object") return v;
      if (!children.has(key)) children.set(key, recorder(v, `${path}/${key}`, reads));
      return children.get(key);
    },
  });
}

// Keys present in value that the validator never read.
function unknownFields(value, path, reads, out) {
  if (value === null || typeof value !== "object") return;
  if (Array.isArray(value)) {
    value.forEach((v, i) => unknownFields(v, `${path}/${i}`, reads, out));
    return;
  }
  const read = reads.get(path) || new Set();
  for (const key of Object.keys(value)) {
    if (!read.has(key)) out.push(`${path}/${key}`);
    else unknownFields(value[key], `${path}/${key}`, reads, out);
  }
}

async function checkSchema(obj) {
  const problems = [];
  const mod = modulePath(obj.apiVersion, obj.kind);
  if (!mod) return [`apiVersion/kind missing or malformed`];
  let Model;
  try {
    Model = (await import(mod))[obj.kind];
  } catch {
    Model = undefined;
  }
  if (typeof Model !== "function" || typeof Model.prototype.validate !== "function")
    return [`no schema for ${obj.apiVersion} ${obj.kind}`];
  const reads = new Map();
  try {
    Model.prototype.validate.call(recorder(obj, "", reads));
  } catch (e) {
    const errs = e && Array.isArray(e.errors) ? e.errors : null;
    if (!errs) return [`schema: ${e && e.message ? e.message : e}`];
    for (const er of errs) {
      const where = er.instancePath || "/";
      const detail = er.params ? JSON.stringify(er.params) : "";
      problems.push(`schema: ${where}: ${er.message || er.keyword} ${detail}`.trim());
    }
  }
  const unknown = [];
  unknownFields(obj, "", reads, unknown);
  for (const p of unknown) problems.push(`unknown field ${p}`);
  return problems;
}

// ---- policy ------------------------------------------------------------------

// The pods of a StatefulSet (ps-server, ps-worker: long-running binaries
// with an HTTP port for probes and metrics) or of an Indexed Job (a user's
// script: runs to its end, serves no HTTP, its rank is the completion index).
// The extended resources (a device plugin's: a domain-qualified name
// outside kubernetes.io) that a container requests and limits alike.
const deviceResources = (r) => {
  const req = (r || {}).requests || {}, lim = (r || {}).limits || {};
  return Object.keys(lim).filter((k) => k.includes("/") && !/(^|\.)kubernetes\.io\//.test(k) &&
                                        String(req[k]) === String(lim[k]));
};
const JOB_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']";
// The job's settings: the generated ConfigMap ps-config (its name carries a
// hash), as a map of its keys; {} when the render has none.
const isPsConfig = (n) => /^ps-config(-[a-z0-9]+)?$/.test(n || "");
const psConfig = (all) =>
  ((all || []).find((o) => o.kind === "ConfigMap" && isPsConfig((o.metadata || {}).name)) || {}).data || {};
function podPolicy(name, pod, problems, owner, all) {
  const need = (cond, what) => {
    if (!cond) problems.push(`policy: ${what}`);
  };
  const config = psConfig(all);
  // a binary (ps-server, ps-worker) serves HTTP, probes and metrics, also as
  // a Job's pod (overlays/torch's shards); a user's script does not
  const serves = owner !== "Job" || name === "ps-server";
  const sc = pod.securityContext || {};
  need(sc.runAsNonRoot === true, "pod securityContext.runAsNonRoot must be true");
  need(Number.isInteger(sc.runAsUser) && sc.runAsUser > 0, "pod runAsUser must be a non-zero uid");
  need(sc.seccompProfile && sc.seccompProfile.type === "RuntimeDefault",
       "pod seccompProfile must be RuntimeDefault");
  need(pod.automountServiceAccountToken === false, "automountServiceAccountToken must be false");
  need(Number.isInteger(pod.terminationGracePeriodSeconds),
       "terminationGracePeriodSeconds must be set");
  need(Array.isArray(pod.topologySpreadConstraints) && pod.topologySpreadConstraints.length > 0,
       "topologySpreadConstraints must be set");
  for (const c of pod.containers || []) {
    const csc = c.securityContext || {};
    const cn = `container ${c.name}`;
    need(csc.allowPrivilegeEscalation === false, `${cn}: allowPrivilegeEscalation must be false`);
    need(csc.readOnlyRootFilesystem === true, `${cn}: readOnlyRootFilesystem must be true`);
    need(csc.privileged !== true, `${cn}: must not be privileged`);
    const caps = csc.capabilities || {};
    const added = Array.isArray(caps.add) ? caps.add : [];
    need(Array.isArray(caps.drop) && caps.drop.includes("ALL"), `${cn}: capabilities must drop ALL`);
    const probes = ["startupProbe", "readinessProbe", "livenessProbe"];
    if (!serves) {
      // nothing in a script's pod answers HTTP; an exec probe may watch it
      for (const p of probes)
        need(!c[p] || !(c[p].httpGet || c[p].tcpSocket || c[p].grpc),
             `${cn}: ${p} of a Job's script can only be exec (it serves nothing)`);
    } else {
      for (const p of probes) need(c[p] && c[p].httpGet, `${cn}: ${p} must be an httpGet probe`);
    }
    if (c.readinessProbe && c.readinessProbe.httpGet)
      need(c.readinessProbe.httpGet.path === "/readyz", `${cn}: readinessProbe must GET /readyz`);
    if (c.livenessProbe && c.livenessProbe.httpGet)
      need(c.livenessProbe.httpGet.path === "/healthz", `${cn}: livenessProbe must GET /healthz`);
    const r = c.resources || {};
    for (const k of ["cpu", "memory"]) {
      need(r.requests && r.requests[k] !== undefined, `${cn}: resources.requests.${k} must be set`);
      need(r.limits && r.limits[k] !== undefined, `${cn}: resources.limits.${k} must be set`);
    }
    const env = c.env || [];
    const fromField = (n, fieldPath) => {
      const e = env.find((x) => x.name === n);
      return e && e.valueFrom && e.valueFrom.fieldRef && e.valueFrom.fieldRef.fieldPath === fieldPath;
    };
    if (owner === "Job" && serves)
      need(fromField("PS_POD_INDEX", JOB_INDEX),
           `${cn}: PS_POD_INDEX (--shard=auto) must come from the ` +
           "batch.kubernetes.io/job-completion-index annotation");
    else if (owner === "Job")
      need(fromField("PS_RANK", JOB_INDEX) || (fromField("PS_POD_INDEX", JOB_INDEX) && runsPsPod(c)),
           `${cn}: the rank must come from the batch.kubernetes.io/job-completion-index ` +
           "annotation: as PS_POD_INDEX, with python3 -m ps.pod as the entrypoint (it gives each " +
           "rank of the pod its PS_RANK), or as PS_RANK");
    else
      need(fromField("PS_POD_INDEX", "metadata.labels['apps.kubernetes.io/pod-index']"),
           `${cn}: PS_POD_INDEX must come from the apps.kubernetes.io/pod-index label`);
    // the transport of every process comes from the one key: a worker on tcp
    // cannot reach a shard on ucx
    const fromConfig = (n, key) => {
      const e = env.find((x) => x.name === n);
      const ref = e && e.valueFrom && e.valueFrom.configMapKeyRef;
      return Boolean(ref && isPsConfig(ref.name) && ref.key === key);
    };
    need(fromConfig("PS_TRANSPORT", "transport"),
         `${cn}: PS_TRANSPORT must come from the ps-config key transport`);
    const ucx = fromConfig("PS_TRANSPORT", "transport") && config.transport === "ucx";
    // Capabilities: none is added, with one exception. A pod of
    // components/rdma registers its buffers with the RDMA device, and
    // ibv_reg_mr pins the pages: they count against RLIMIT_MEMLOCK unless
    // the process has CAP_IPC_LOCK. So IPC_LOCK, and it alone, may be added
    // to a container that does RDMA: transport ucx (from ps-config) and a
    // device plugin's resource in its requests and limits. Nothing else,
    // ever: not SYS_PTRACE for UCX's cma (UCX_TLS leaves cma out), not
    // NET_RAW or SYS_ADMIN. The rest of the posture above still holds.
    if (added.length) {
      need(added.length === 1 && added[0] === "IPC_LOCK",
           `${cn}: capabilities may add IPC_LOCK (RDMA memory registration) and nothing else, ` +
           `not ${JSON.stringify(added)}`);
      need(ucx && deviceResources(c.resources).length > 0,
           `${cn}: IPC_LOCK only with transport ucx (PS_TRANSPORT from ps-config) and an RDMA ` +
           "device (a device plugin's resource, the same in requests and limits)");
    }
    if (ucx) {
      // cma (process_vm_readv) needs ptrace permission between the
      // processes, which a container lacks (ucx issue #3046): UCX_TLS must
      // name its transports, and neither cma nor an alias that includes it
      const e = env.find((x) => x.name === "UCX_TLS");
      const ref = e && e.valueFrom && e.valueFrom.configMapKeyRef;
      const tls = e && (ref && isPsConfig(ref.name) ? config[ref.key] : e.value);
      const names = typeof tls === "string" ? tls.split(",").map((t) => t.trim()) : [];
      need(names.length > 0 && !tls.startsWith("^") &&
               !names.some((t) => ["all", "sm", "shm", "cma"].includes(t.replace(/^\\/, ""))),
           `${cn}: with transport ucx, UCX_TLS must list its transports without cma ` +
           `(nor all, sm or shm, which include it; not a ^ list): ${JSON.stringify(tls)}`);
    }
    const text = JSON.stringify([c.command, c.args, env]);
    need(!text.includes("cluster.local"), `${cn}: must not hard-code the cluster domain`);
  }
  const mounts = (pod.containers || []).flatMap((c) => c.volumeMounts || []);
  const secretVols = (pod.volumes || []).filter((v) => v.secret).map((v) => v.name);
  need(secretVols.length > 0 &&
           secretVols.every((n) => mounts.filter((m) => m.name === n).every((m) => m.readOnly)),
       "the auth Secret must be mounted, read-only");
  // the Secret the user creates: a pod without it (or without its key) must
  // not start, and the kubelet then says which one is missing
  const auth = (pod.volumes || []).find((v) => v.secret && v.secret.secretName === "ps-auth");
  need(auth && auth.secret.optional !== true &&
           (auth.secret.items || []).some((i) => i.key === "token" && i.path === "token"),
       "the auth volume must be the Secret ps-auth, not optional, with items [{key: token, path: token}]");
  const ann = ((pod.__meta || {}).annotations) || {};
  if (serves)
    need(ann["prometheus.io/scrape"] === "true" && ann["prometheus.io/port"],
         `${name}: prometheus.io/scrape and prometheus.io/port annotations must be set`);
}

// A Job of ranks: all at once, each its index, findable by DNS for the ring,
// restarted by exit code as ps-worker's codes mean (129 and signals retried,
// 1-127 permanent), and not evicted while it trains.
function jobPolicy(obj, all, need) {
  const spec = obj.spec || {};
  const tpl = spec.template || {};
  const pod = tpl.spec || {};
  const labels = (tpl.metadata || {}).labels || {};
  need(spec.completionMode === "Indexed", "a Job of workers must be completionMode: Indexed");
  need(Number.isInteger(spec.parallelism) && spec.parallelism === spec.completions,
       "parallelism must equal completions (every rank runs at once)");
  need(pod.restartPolicy === "Never", "restartPolicy must be Never (podFailurePolicy decides)");
  need(Number.isInteger(spec.backoffLimit) && spec.backoffLimit >= 1,
       "backoffLimit must be set (retries of exit 129)");
  const svc = all.find((o) => o.kind === "Service" && o.metadata.name === pod.subdomain);
  need(svc && Object.entries(svc.spec.selector || {}).every(([k, v]) => labels[k] === v),
       `subdomain ${pod.subdomain} must name a headless Service that selects these pods`);
  // the first rule that fails the Job must be exactly 1-127 for the container
  const rules = (spec.podFailurePolicy || {}).rules || [];
  const c = (pod.containers || [])[0] || {};
  const permanent = Array.from({ length: 127 }, (_, i) => i + 1);
  const exits = rules.filter((r) => r.onExitCodes);
  const fails = exits.find((r) => r.action === "FailJob");
  need(fails && fails.onExitCodes.operator === "In" &&
           (!fails.onExitCodes.containerName || fails.onExitCodes.containerName === c.name) &&
           JSON.stringify(fails.onExitCodes.values) === JSON.stringify(permanent) &&
           exits.indexOf(fails) === 0,
       "podFailurePolicy must fail the Job on exit codes 1-127 (In, all of them) and on no other " +
       "(129 and signals are retried)");
  need(rules.some((r) => r.action === "Ignore" &&
                         (r.onPodConditions || []).some((pc) => pc.type === "DisruptionTarget")),
       "podFailurePolicy must Ignore DisruptionTarget (an evicted or preempted pod is no failure)");
  const pdb = all.find((o) => o.kind === "PodDisruptionBudget" &&
                              matchesLabels(o.spec.selector, labels));
  need(pdb && Number.isInteger(pdb.spec.minAvailable) && pdb.spec.minAvailable === spec.parallelism,
       "a PodDisruptionBudget with minAvailable = parallelism (a number: Jobs have no scale for " +
       "maxUnavailable) must select these pods");
}

const matchesLabels = (selector, labels) =>
  Object.entries((selector || {}).matchLabels || {}).every(([k, v]) => labels[k] === v) &&
  !((selector || {}).matchExpressions || []).length;

// The 3D grid (docs/KUBERNETES.md, "3D jobs"): the ConfigMap keys the
// workers read as --tensor-parallel, --pipeline-stages, --micro-batches and
// --pipeline-schedule, and what a StatefulSet of workers needs when T * P > 1:
// replicas (= num-workers, components/sizes) a multiple of T * P, one Kueue
// gang (the queue-name label) and each tensor-parallel group (T consecutive
// ordinals) on one node (TAS slices of T pods at kubernetes.io/hostname).
const GRID_KEYS = { "tensor-parallel": "PS_TENSOR_PARALLEL", "pipeline-stages": "PS_PIPELINE_STAGES",
                    "micro-batches": "PS_MICRO_BATCHES", "pipeline-schedule": "PS_PIPELINE_SCHEDULE" };
const SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1"];
const KUEUE_QUEUE = "kueue.x-k8s.io/queue-name";
const SLICE_TOPOLOGY = "kueue.x-k8s.io/podset-slice-required-topology";
const SLICE_SIZE = "kueue.x-k8s.io/podset-slice-size";
const count = (v) => (typeof v === "string" && /^[1-9][0-9]{0,5}$/.test(v) ? Number(v) : NaN);
function gridConfigPolicy(data, need) {
  for (const k of ["tensor-parallel", "pipeline-stages", "micro-batches"])
    need(count(data[k]) > 0, `ConfigMap ps-config must hold ${k} = a positive integer, not ` +
                             `${JSON.stringify(data[k])}`);
  need(SCHEDULES.includes(data["pipeline-schedule"]),
       `ConfigMap ps-config must hold pipeline-schedule = ${SCHEDULES.join(", ")}, not ` +
       `${JSON.stringify(data["pipeline-schedule"])}`);
  const tp = count(data["tensor-parallel"]) * count(data["pipeline-stages"]);
  const w = count(data["num-workers"]);
  if (tp > 0 && w > 0)
    need(w % tp === 0, `num-workers ${w} must be tensor-parallel x pipeline-stages x D: it is not ` +
                       `a multiple of ${data["tensor-parallel"]} x ${data["pipeline-stages"]} = ${tp}`);
}
function gridWorkerPolicy(obj, pod, config, need) {
  const c = ((pod.containers || []).find((x) => x.name === "ps-worker")) || {};
  for (const [key, name] of Object.entries(GRID_KEYS)) {
    const e = (c.env || []).find((x) => x.name === name);
    const ref = e && e.valueFrom && e.valueFrom.configMapKeyRef;
    need(ref && isPsConfig(ref.name) && ref.key === key,
         `container ps-worker: ${name} must come from the ps-config key ${key}`);
  }
  const t = count(config["tensor-parallel"]), p = count(config["pipeline-stages"]);
  const ann = ((pod.__meta || {}).annotations) || {};
  // K ranks per pod (ps.pod): a tensor-parallel group spans T / gcd(T, K)
  // pods (1 when K is a multiple of T), the slice Kueue keeps on one node
  const k = obj.kind === "Job" ? procsPerPod(pod, config) : 1;
  const slice = k > 0 && t > 0 ? t / gcd(t, k) : t;
  const per = k === 1 ? `tensor-parallel (${config["tensor-parallel"]})`
                      : `tensor-parallel / gcd(tensor-parallel, procs-per-pod) = ${slice} pods`;
  // a slice that is not one tensor-parallel group splits groups over nodes
  if (ann[SLICE_SIZE] !== undefined || ann[SLICE_TOPOLOGY] !== undefined)
    need(ann[SLICE_SIZE] === String(slice) && ann[SLICE_TOPOLOGY] === "kubernetes.io/hostname",
         `${SLICE_SIZE} must be ${per}, not ` +
         `${JSON.stringify(ann[SLICE_SIZE])}, with ${SLICE_TOPOLOGY} kubernetes.io/hostname ` +
         `(one tensor-parallel group per node), not ${JSON.stringify(ann[SLICE_TOPOLOGY])}`);
  if (!(t * p > 1)) return;
  // a StatefulSet's replicas, an Indexed Job's parallelism (= completions)
  const job = obj.kind === "Job";
  const field = job ? "parallelism" : "replicas";
  const grid = job ? "components/grid-job" : "components/grid";
  const replicas = (obj.spec || {})[field];
  need(replicas * k === count(config["num-workers"]) && (replicas * k) % (t * p) === 0,
       `a 3D job's workers: ${field} ${replicas}` + (k === 1 ? "" : ` x procs-per-pod ${k}`) +
       ` must be num-workers (${config["num-workers"]}), ` +
       `a multiple of tensor-parallel x pipeline-stages = ${t * p} (components/sizes)`);
  need(Boolean(((obj.metadata || {}).labels || {})[KUEUE_QUEUE]),
       `a 3D job's workers must be one gang: the label ${KUEUE_QUEUE} (${grid})`);
  need(ann[SLICE_SIZE] !== undefined,
       `a 3D job's workers must keep each tensor-parallel group on one node: annotations ` +
       `${SLICE_TOPOLOGY} and ${SLICE_SIZE} on the pod template (${grid})`);
}

// The job's size, said in three places that must agree: the ConfigMap keys
// num-shards and num-workers (what every process reads as --num-shards,
// --num-workers and --world-size), and the controllers' counts of pods (a
// StatefulSet's replicas, a Job's completions and parallelism). A mismatch
// renders and applies, then every rank waits for peers that never come
// (5 minutes, exit 129, retried): components/sizes copies the keys into the
// counts, and must run on the overlay's final keys.
const SIZE_OF = { "ps-worker": ["num-workers", "workers", ["PS_WORLD_SIZE", "PS_NUM_WORKERS"]],
                  "ps-server": ["num-shards", "shards", ["PS_NUM_SHARDS"]] };
const SIZE_FLAGS = { PS_WORLD_SIZE: "--world-size", PS_NUM_WORKERS: "--num-workers",
                     PS_NUM_SHARDS: "--num-shards" };
// What a container's setting resolves to: a literal, a ps-config key, a flag.
function settingValue(c, name, config) {
  const e = (c.env || []).find((x) => x.name === name);
  const ref = e && e.valueFrom && e.valueFrom.configMapKeyRef;
  let v = e ? (ref && isPsConfig(ref.name) ? config[ref.key] : e.value) : undefined;
  const flag = SIZE_FLAGS[name];
  for (const a of [...(c.command || []), ...(c.args || [])])
    if (typeof a === "string" && a.startsWith(flag + "=")) v = a.slice(flag.length + 1);
  return v;
}
function sizePolicy(obj, pod, config, need) {
  const role = SIZE_OF[obj.metadata.name];
  if (!role) return;
  const [key, who, envs] = role;
  const want = config[key];
  const spec = obj.spec || {};
  // a Job of workers with K ranks per pod (python3 -m ps.pod) has num-workers / K pods
  const k = key === "num-workers" && obj.kind === "Job" ? procsPerPod(pod, config) : 1;
  if (!(k > 0)) {
    need(false, `procs-per-pod must be a positive integer, not ${JSON.stringify(procsSetting(pod, config))}`);
    return;
  }
  const pods = Number(want) / k;
  if (k > 1) {
    need(Number.isInteger(pods),
         `the workers' sizes disagree: num-workers (the ranks) ${want} is not a multiple of ` +
         `procs-per-pod ${k}: num-workers must be worker-pods x procs-per-pod`);
    const c = (pod.containers || []).find((x) => x.name === "ps-worker") || {};
    need(runsPsPod(c), `container ps-worker: procs-per-pod ${k} needs python3 -m ps.pod as the ` +
                       "entrypoint (it starts the pod's ranks): one process would run");
    if (!Number.isInteger(pods)) return;
  }
  const counts = obj.kind === "Job" ? [["completions", spec.completions], ["parallelism", spec.parallelism]]
                                    : [["replicas", spec.replicas ?? 1]];
  const settings = [];
  for (const c of pod.containers || [])
    for (const n of envs) {
      const v = settingValue(c, n, config);
      if (v !== undefined) settings.push([`${c.name}'s ${n}`, v]);
    }
  const badSetting = settings.some(([, v]) => String(v) !== String(want));
  const bad = badSetting || counts.some(([, n]) => String(n) !== String(k > 1 ? pods : want));
  const podCounts = counts.map(([f, n]) => `${f} ${n}`).join(" and ");
  const said = `, ${settings.map(([w, v]) => `${w} ${v}`).join(", ")}`;
  need(!bad, k > 1
    ? `the ${who}' sizes disagree: num-workers (the ranks) is ${want} with procs-per-pod ${k}, ` +
      `so ${pods} pods, but the Job ps-worker's ${podCounts}${badSetting ? said : ""}` +
      ": set worker-pods = num-workers / " +
      "procs-per-pod and list components/procs-per-pod after components/sizes"
    : `the ${who}' sizes disagree: ${key} (ConfigMap ps-config) is ${want}, the ` +
      `${obj.kind} ${obj.metadata.name}'s ${podCounts}${settings.length ? said : ""}: list ` +
      "components/sizes last in the overlay's " +
      `components (also in an overlay of an overlay that changes ${key}): it copies num-shards ` +
      "and num-workers into replicas, completions and parallelism");
}

// Processes per pod (components/procs-per-pod, python/ps/pod.py): the pod's
// entrypoint python3 -m ps.pod starts K = PS_PROCS_PER_POD ranks, local rank
// j on the ring port of the pod's template + j, so the Job needs num-workers
// / K pods, and the workers' NetworkPolicy must admit every one of the K
// ports from the other workers (or the ring never forms: 5 minutes, 129).
const runsPsPod = (c) => [...(c.command || []), ...(c.args || [])]
  .some((a) => /(^|\s)-m ps\.pod(\s|$)/.test(String(a)));
const procsSetting = (pod, config) => {
  const c = (pod.containers || []).find((x) => x.name === "ps-worker") || {};
  return settingValue(c, "PS_PROCS_PER_POD", config);
};
const procsPerPod = (pod, config) => {
  const v = procsSetting(pod, config);
  return v === undefined ? 1 : count(String(v));
};
const gcd = (a, b) => (b ? gcd(b, a % b) : a);
function ringPortsPolicy(obj, pod, config, all, need) {
  if (obj.kind !== "Job" || obj.metadata.name !== "ps-worker") return;
  const k = procsPerPod(pod, config);
  const c = (pod.containers || []).find((x) => x.name === "ps-worker") || {};
  const m = /:([0-9]+)$/.exec(String(settingValue(c, "PS_PEER_TEMPLATE", config) ?? ""));
  if (!(k > 1) || !m) return;
  const lo = Number(m[1]), hi = lo + k - 1;
  const labels = ((pod.__meta || {}).labels) || {};
  const portOf = (p) => (typeof p === "number" ? p
    : ((c.ports || []).find((x) => x.name === p) || {}).containerPort);
  const covered = all.filter((o) => o.kind === "NetworkPolicy" && matchesLabels(o.spec.podSelector, labels))
    .some((np) => (np.spec.ingress || []).some((r) =>
      (r.from || []).some((f) => f.podSelector && matchesLabels(f.podSelector, labels)) &&
      (r.ports || []).some((p) => portOf(p.port) <= lo && hi <= (p.endPort ?? portOf(p.port)))));
  need(covered, `procs-per-pod ${k}: the ring ports ${lo}-${hi} (the template's port + each local ` +
                "rank) must be admitted from the workers by their NetworkPolicy (port " +
                `${lo}, endPort >= ${hi}; overlays/torch admits 7071-7102)`);
}

// One image for the whole job: every container of every StatefulSet and Job
// in the render runs the same image, with a tag or digest (a bare name is
// :latest, whatever the node pulled last). components/image names it once.
const podImages = (all) =>
  all.filter((o) => o.kind === "StatefulSet" || o.kind === "Job")
     .flatMap((o) => ((((o.spec || {}).template || {}).spec || {}).containers || [])
                      .map((c) => [`${o.kind} ${o.metadata.name}`, c.image]));
function imagePolicy(obj, all, need) {
  const mine = podImages([obj]);
  const every = podImages(all);
  const distinct = [...new Set(every.map(([, i]) => i))];
  for (const [, image] of mine) {
    need(typeof image === "string" && /(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}|@sha256:[0-9a-f]{64})$/.test(image.replace(/^[^/]*\//, "")),
         `image ${JSON.stringify(image)} has no tag or digest (it would be :latest): ` +
         "components/image sets the tag of every pod");
    need(distinct.length === 1,
         `the pods' images disagree: ${every.map(([w, i]) => `${w} runs ${i}`).join(", ")}: every ` +
         "pod of a job runs one image (components/image names it once; set yours with an images " +
         "entry for the name ps)");
  }
}

// When the job ends (docs/KUBERNETES.md, "When the script is done"): a
// binary in a StatefulSet must stay up once done (--exit-when-done=false: the
// set restarts a container that exits, even with 0, and it would train
// again); a binary in a Job must exit when done (its pod Succeeded: the Job
// completes). And a job whose workers are a Job ends with it: rank 0's
// ps.shutdown() stops the shards, which a StatefulSet would start again, to
// wait for workers that are gone.
const flagValue = (c, flag) => {
  let v;
  for (const a of [...(c.command || []), ...(c.args || [])])
    if (typeof a === "string" && (a === flag || a.startsWith(flag + "=")))
      v = a === flag ? "true" : a.slice(flag.length + 1);
  return v;
};
function lifecyclePolicy(obj, pod, all, need) {
  for (const c of pod.containers || []) {
    if (!/\/ps-(server|worker)$/.test((c.command || [])[0] || "")) continue;
    const done = flagValue(c, "--exit-when-done");
    if (obj.kind === "StatefulSet")
      need(done === "false", `container ${c.name}: a StatefulSet's ${c.command[0]} must pass ` +
           "--exit-when-done=false (the set restarts a container that exits, even with 0)");
    else
      need(done !== "false", `container ${c.name}: a Job's ${c.command[0]} must exit when done ` +
           "(not --exit-when-done=false): the pod would run on after training and the Job never " +
           "complete");
  }
  if (obj.kind === "StatefulSet" && obj.metadata.name === "ps-server")
    need(!all.some((o) => o.kind === "Job" && o.metadata.name === "ps-worker"),
         "the workers are a Job, the shards a StatefulSet: rank 0's ps.shutdown() stops the " +
         "shards when the script ends, and the set would start them again, running (and holding " +
         "their nodes) after the Job completes: run them as the Job ps-server (overlays/torch, " +
         "server-job.yaml), which completes with the workers");
  if (obj.kind === "Job" && obj.metadata.name === "ps-server") {
    const c = (pod.containers || [])[0] || {};
    need(flagValue(c, "--fail-on-signal") === "true",
         "the shards' Job must pass --fail-on-signal=true: a shard evicted mid-training exits 0 " +
         "without it, a Job counts that index done and never runs it again, and the workers " +
         "wait for a shard that is gone");
    const dir = flagValue(c, "--checkpoint-dir");
    need(dir && (c.volumeMounts || []).some((m) => m.mountPath === dir),
         "the shards' Job must mount a volume at --checkpoint-dir (a Job has no " +
         "volumeClaimTemplates: an emptyDir placeholder, or a claim of yours)");
  }
}

// Gang admission (components/gang): the shards and the workers are each one
// Kueue workload, admitted whole or not at all, in the LocalQueue the key
// kueue-queue names. A label that is missing or names another queue (an
// overlay that changed the key without listing the component again) would
// leave that set outside the gang, or in a queue nobody meant.
function gangPolicy(obj, config, need) {
  if (!SIZE_OF[obj.metadata.name]) return;
  const label = ((obj.metadata || {}).labels || {})[KUEUE_QUEUE];
  need(label !== undefined && label === config["kueue-queue"],
       `the ${obj.kind} ${obj.metadata.name} must be admitted as one gang: the label ${KUEUE_QUEUE} ` +
       `= the ps-config key kueue-queue (${JSON.stringify(config["kueue-queue"])}), not ` +
       `${JSON.stringify(label)} (components/gang, listed again in an overlay that changes the key)`);
}

function checkPolicy(obj, all) {
  const problems = [];
  const need = (cond, what) => {
    if (!cond) problems.push(`policy: ${what}`);
  };
  const spec = obj.spec || {};
  if (obj.kind === "StatefulSet") {
    need(spec.podManagementPolicy === "Parallel", "podManagementPolicy must be Parallel");
    const svc = all.find((o) => o.kind === "Service" && o.metadata.name === spec.serviceName);
    need(svc, `serviceName ${spec.serviceName} must name a Service in the same render`);
    const pdb = all.find((o) => o.kind === "PodDisruptionBudget" &&
                                 JSON.stringify(o.spec.selector) === JSON.stringify(spec.selector));
    need(pdb, "a PodDisruptionBudget must select these pods");
    const pod = { ...(spec.template || {}).spec, __meta: (spec.template || {}).metadata };
    podPolicy(obj.metadata.name, pod, problems, "StatefulSet", all);
    if (obj.metadata.name === "ps-server")
      need((spec.volumeClaimTemplates || []).length > 0, "shards need a volumeClaimTemplate");
    if (obj.metadata.name === "ps-worker") gridWorkerPolicy(obj, pod, psConfig(all), need);
    sizePolicy(obj, pod, psConfig(all), need);
    imagePolicy(obj, all, need);
    lifecyclePolicy(obj, pod, all, need);
    gangPolicy(obj, psConfig(all), need);
    // all-reduce mode: the workers hold the model, so they checkpoint it
    const cfg = all.find((o) => o.kind === "ConfigMap" && (o.metadata.name || "").startsWith("ps-config"));
    if (obj.metadata.name === "ps-worker" && cfg && cfg.data && cfg.data["sync-mode"] === "allreduce") {
      const c = ((pod.containers || []).find((x) => x.name === "ps-worker")) || {};
      const env = (c.env || []).find((e) => e.name === "PS_CHECKPOINT_DIR");
      const mount = env && (c.volumeMounts || []).find((m) => m.mountPath === env.value);
      const claim = mount && (spec.volumeClaimTemplates || []).find((t) => t.metadata.name === mount.name);
      need(claim, "in all-reduce mode the workers need PS_CHECKPOINT_DIR on a volumeClaimTemplate " +
           "of their own (a restarted ring resumes from it)");
    }
  } else if (obj.kind === "Job") {
    jobPolicy(obj, all, need);
    const pod = { ...(spec.template || {}).spec, __meta: (spec.template || {}).metadata };
    podPolicy(obj.metadata.name, pod, problems, "Job", all);
    if (obj.metadata.name === "ps-worker") gridWorkerPolicy(obj, pod, psConfig(all), need);
    sizePolicy(obj, pod, psConfig(all), need);
    ringPortsPolicy(obj, pod, psConfig(all), all, need);
    imagePolicy(obj, all, need);
    lifecyclePolicy(obj, pod, all, need);
    gangPolicy(obj, psConfig(all), need);
  } else if (obj.kind === "Service") {
    need(spec.clusterIP === "None", "Services must be headless (clusterIP: None)");
    need(spec.publishNotReadyAddresses === true, "Services must set publishNotReadyAddresses");
  } else if (obj.kind === "NetworkPolicy") {
    need((spec.policyTypes || []).includes("Ingress"), "NetworkPolicy must restrict Ingress");
  } else if (obj.kind === "Secret") {
    // a Secret in the render comes from the repository, and so does its value
    need(false, `Secret ${obj.metadata.name} is rendered from the repository (anyone who reads ` +
                "it knows the token): create it in the cluster instead (docs/KUBERNETES.md)");
  } else if (obj.kind === "ConfigMap" && obj.metadata.name.startsWith("ps-config")) {
    need(obj.data && ["ps", "allreduce"].includes(obj.data["sync-mode"]),
         "ConfigMap ps-config must hold sync-mode = ps or allreduce");
    need(obj.data && ["tcp", "ucx"].includes(obj.data.transport),
         "ConfigMap ps-config must hold transport = tcp or ucx");
    // ucx carries push and pull; the ring of all-reduce is TCP whatever the
    // key says, so an RDMA device per worker would buy nothing
    need(!(obj.data && obj.data.transport === "ucx" && obj.data["sync-mode"] !== "ps"),
         "transport ucx carries push and pull, which only sync-mode ps has (the all-reduce ring " +
         "is TCP): components/rdma is for overlays with shards (ps, torch)");
    gridConfigPolicy(obj.data || {}, need);
  }
  return problems;
}

async function main() {
  const args = process.argv.slice(2);
  const policy = args[0] === "--policy";
  const files = policy ? args.slice(1) : args;
  if (files.length === 0) {
    console.error("usage: node validate.mjs [--policy] FILE... (- = stdin)");
    process.exit(2);
  }
  let failed = 0, count = 0;
  for (const file of files) {
    const text = readFileSync(file === "-" ? 0 : file, "utf8");
    const docs = YAML.parseAllDocuments(text);
    const objs = [];
    for (const d of docs) {
      if (d.errors.length) {
        console.error(`${file}: YAML: ${d.errors[0].message}`);
        failed++;
        continue;
      }
      const o = d.toJS();
      if (o !== null && o !== undefined) objs.push(o);
    }
    for (const o of objs) {
      count++;
      const name = `${file}: ${o.kind || "?"} ${(o.metadata && o.metadata.name) || "?"}`;
      const problems = await checkSchema(o);
      if (policy && problems.length === 0) problems.push(...checkPolicy(o, objs));
      for (const p of problems) console.error(`${name}: ${p}`);
      if (problems.length) failed++;
    }
  }
  if (count === 0) {
    console.error("no objects found");
    process.exit(1);
  }
  console.log(`${count} objects, ${failed} rejected`);
  process.exit(failed ? 1 : 0);
}

main().catch((e) => {
  console.error(e && e.stack ? e.stack : e);
  process.exit(1);
});
