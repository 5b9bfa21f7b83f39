// pods: runs a rendered kustomize overlay the way a kubelet would, each
// replica of each StatefulSet and each index of each Indexed Job as a process
// in its own network namespace, and checks that the job trains to completion.
//
//   node pods.mjs --overlay DIR --usr-local DIR --work DIR --prefix P [--timeout-s N]
//                 [--min-accuracy A] [--objects FILE] [--namespace NS]
//                 [--expect-failure TEXT] [--image-dir D]...
//
// --usr-local: the image's /usr/local, what `meson install --destdir` of the
// build put there (run-pods.sh makes it; deploy/Containerfile copies the same
// tree). --image-dir D (repeatable): a host directory under /usr/local the
// image's base provides (CUDA, for a build that links it), with its mount
// point already in --usr-local. --objects: what already exists in the namespace besides the overlay
// (the Secret ps-auth the user creates, as `kubectl create ...
// --dry-run=client -o yaml` writes it). --expect-failure: the run must fail,
// with a message that contains TEXT (a missing or empty Secret); then it
// passes.
//
// It must run as root inside the "cluster" network namespace that
// run-pods.sh made (bridge br0, 10.244.0.1/24, no route anywhere else).
// Everything a pod runs comes from the rendered manifests, never from a
// second copy: command, args, env (value, configMapKeyRef, secretKeyRef,
// fieldRef including the apps.kubernetes.io/pod-index label and the Job's
// completion index, $(VAR) expansion), volumes (configMap, secret, emptyDir,
// the StatefulSet's volumeClaimTemplates), securityContext (uid, gid,
// fsGroup, readOnlyRootFilesystem, no new privileges, capabilities), probes,
// terminationGracePeriodSeconds, Services (DNS names), NetworkPolicies,
// Prometheus annotations and a Job's podFailurePolicy. What the controllers
// and a kubelet give a pod is emulated:
//  - pods: <set>-N for a StatefulSet; <job>-N-<suffix> with hostname <job>-N
//    for an Indexed Job (the index as label, annotation and
//    JOB_COMPLETION_INDEX);
//  - network: a netns with eth0 on the cluster bridge and no route out;
//  - nodes: spec.nodeName is node-0, or for a StatefulSet with Kueue slices
//    (components/grid) node-k for slice k, as Kueue's TAS places them;
//  - DNS: /etc/hosts with the pod's own entry and, for every headless
//    Service, every name the cluster DNS would answer for its pods
//    (hostname.subdomain, as the FQDN and the forms the search path
//    completes), plus a kubelet-style resolv.conf (its nameserver is
//    unreachable: nothing leaves the netns);
//  - a private mount, UTS (hostname) and PID namespace (the command is PID 1,
//    as in a container), with a root filesystem made of the host's /usr and
//    /etc (overlays: the "image" is this Debian 12 machine) with
//    --usr-local over /usr/local and an ld.so.cache made in it, read-only
//    when readOnlyRootFilesystem says so; the source tree is not in it;
//  - volumes bind-mounted at their mountPaths with kubelet's ownership
//    (fsGroup) and modes;
//  - NetworkPolicy ingress rules as iptables rules in each pod's netns
//    (when iptables exists; checked by connecting from a non-matching pod);
//  - startup, readiness and liveness probes at the manifests' periods and
//    thresholds; a liveness or startup failure, or any container exit of a
//    StatefulSet's pod before deletion (the set would restart it), fails the
//    test;
//  - a Job's pod that exits 0 has succeeded; one that exits otherwise fails
//    the test, with what the podFailurePolicy would do (FailJob, or a retry
//    counted against backoffLimit: retries are not emulated);
//  - the kubelet's refusals: a required Secret or ConfigMap (volume or env)
//    that is not in the namespace, or lacks a key the pod names, keeps the
//    pod from starting, with the kubelet's event text (FailedMount:
//    `MountVolume.SetUp failed for volume "auth" : secret "ps-auth" not
//    found`, or CreateContainerConfigError); a real kubelet retries until
//    it appears, here that fails the run at once.
// Not emulated: cgroup limits, seccomp, image pulls, real DNS.
//
// The job must finish: every worker reports ps_worker_training_done 1 (a
// StatefulSet's ps-worker) or has exited 0 (a Job's script), every shard
// reports ps_server_training_done 1, worker 0 prints its `summary
// accuracy=...` line, every pod with a readiness probe was Ready while
// training, and the shards saw every worker's last step. Then every pod
// still running is deleted (SIGTERM) and must exit 0 within its grace
// period. Exit 0 = pass, 1 = fail.
import { spawn, spawnSync } from "node:child_process";
import fs from "node:fs";
import http from "node:http";
import net from "node:net";
import os from "node:os";
import path from "node:path";
import { createRequire } from "node:module";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const validateDir = path.resolve(here, "../../deploy/k8s/validate");
const YAML = createRequire(path.join(validateDir, "package.json"))("yaml");

// ---- arguments and helpers -----------------------------------------------------

const opts = { timeoutS: 120, minAccuracy: 0.75, namespace: "ps-job", objects: [],
               imageDirs: [] };
for (let i = 2; i < process.argv.length; i += 2) {
  const k = process.argv[i], v = process.argv[i + 1];
  if (k === "--overlay") opts.overlay = v;
  else if (k === "--work") opts.work = v;
  else if (k === "--prefix") opts.prefix = v;
  else if (k === "--timeout-s") opts.timeoutS = Number(v);
  else if (k === "--min-accuracy") opts.minAccuracy = Number(v);
  else if (k === "--owned-keys") opts.ownedKeys = v === "1";
  else if (k === "--objects") opts.objects.push(v);
  else if (k === "--namespace") opts.namespace = v;
  else if (k === "--expect-failure") opts.expectFailure = v;
  else if (k === "--usr-local") opts.usrLocal = v;
  else if (k === "--image-dir") opts.imageDirs.push(v);
  else {
    console.error(`pods: unknown argument ${k}`);
    process.exit(2);
  }
}
for (const k of ["overlay", "work", "prefix", "usr-local"])
  if (!opts[k.replace(/-(.)/g, (_, a) => a.toUpperCase())]) {
    console.error(`pods: --${k} is required`);
    process.exit(2);
  }

const t0 = Date.now();
const log = (msg) => console.log(`[${((Date.now() - t0) / 1000).toFixed(1).padStart(5)}s] ${msg}`);
class Fail extends Error {}
// What the kubelet reports when it cannot start a pod (an event; the pod
// stays waiting with this reason).
class KubeletError extends Error {
  constructor(reason, message) {
    super(message);
    this.reason = reason;
  }
}
const fail = (msg) => {
  throw new Fail(msg);
};
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function run(cmd, args, what) {
  const r = spawnSync(cmd, args, { encoding: "utf8" });
  if (r.status !== 0)
    fail(`${what || cmd}: ${cmd} ${args.join(" ")} exited ${r.status}: ${r.stderr || r.error}`);
  return r.stdout;
}

const shq = (s) => `'${String(s).replace(/'/g, `'\\''`)}'`;

// The image: this machine's /usr and /etc, with /usr/local replaced by what
// `meson install` of the build put there (--usr-local: deploy/Containerfile
// copies exactly that tree), and an ld.so.cache made in it (its RUN ldconfig).
const inImage = (f) =>
  fs.existsSync(f.startsWith("/usr/local/") ? path.join(opts.usrLocal, f.slice(11)) : f);

// ---- the manifests -------------------------------------------------------------

const rendered = run("kubectl", ["kustomize", opts.overlay], "render");
const parse = (text) => YAML.parseAllDocuments(text).map((d) => d.toJS()).filter(Boolean);
const objects = parse(rendered);
// and what the user created in the namespace (objects of other namespaces
// are not visible to these pods)
for (const f of opts.objects)
  for (const o of parse(fs.readFileSync(f, "utf8")))
    if (!o.metadata.namespace || o.metadata.namespace === opts.namespace) objects.push(o);
const ofKind = (k) => objects.filter((o) => o.kind === k);
const byName = (k, n) => ofKind(k).find((o) => o.metadata.name === n);
const sets = ofKind("StatefulSet");
const jobs = ofKind("Job");
if (sets.length + jobs.length === 0) fail("the overlay renders no StatefulSet or Job");

const matches = (selector, labels) =>
  Object.entries((selector || {}).matchLabels || {}).every(([k, v]) => labels[k] === v) &&
  ((selector || {}).matchExpressions || []).every((e) => {
    const has = Object.prototype.hasOwnProperty.call(labels, e.key);
    if (e.operator === "In") return has && e.values.includes(labels[e.key]);
    if (e.operator === "NotIn") return !has || !e.values.includes(labels[e.key]);
    if (e.operator === "Exists") return has;
    if (e.operator === "DoesNotExist") return !has;
    fail(`selector operator ${e.operator} is not emulated`);
  });

// ---- pods ----------------------------------------------------------------------

// What the controllers make of the rendered workloads. A StatefulSet's pod
// N is <set>-N with hostname <set>-N under the subdomain serviceName, and
// the apps.kubernetes.io/pod-index label. An Indexed Job's pod for index N
// is <job>-N-<suffix>, with hostname <job>-N, the template's subdomain, the
// completion index as a label and an annotation, and JOB_COMPLETION_INDEX in
// every container's environment (appended, as the Job controller does).
// The node a pod runs on (spec.nodeName): node-0 for all, except what
// Kueue's topology-aware scheduling does with a StatefulSet whose template
// asks for slices at kubernetes.io/hostname (components/grid): it ranks the
// pods by apps.kubernetes.io/pod-index and gives each node whole slices of
// consecutive ranks; here slice k (ordinals kS .. kS+S-1) is alone on
// node-k, one valid placement.
function nodeOf(owner, i) {
  const ann = (owner.spec.template.metadata || {}).annotations || {};
  const size = Number(ann["kueue.x-k8s.io/podset-slice-size"]);
  if (owner.kind !== "StatefulSet" || !(size > 0) ||
      ann["kueue.x-k8s.io/podset-slice-required-topology"] !== "kubernetes.io/hostname")
    return "node-0";
  return `node-${Math.floor(i / size)}`;
}
const pods = [];
function addPod(owner, i, { name, hostname, subdomain, labels, annotations, claims, env }) {
  const k = pods.length;
  const t = owner.spec.template;
  const spec = structuredClone(t.spec);
  for (const c of spec.containers || []) c.env = [...(c.env || []), ...env];
  pods.push({
    k,
    owner,
    kind: owner.kind,
    app: owner.metadata.name, // ps-server or ps-worker
    index: i,
    node: nodeOf(owner, i),
    name,
    hostname,
    subdomain,
    claims,
    spec,
    labels: { ...t.metadata.labels, ...labels },
    annotations: { ...(t.metadata.annotations || {}), ...annotations },
    ip: `10.244.0.${10 + k}`,
    netns: `${opts.prefix}-p${k}`,
    veth: `${opts.prefix}v${k}`,
    dir: path.join(opts.work, "pods", name),
    state: "pending",
    everReady: false,
    ready: false,
  });
}
for (const s of sets) {
  for (let i = 0; i < (s.spec.replicas ?? 1); i++) {
    const name = `${s.metadata.name}-${i}`;
    addPod(s, i, {
      name, hostname: name, subdomain: s.spec.serviceName,
      labels: { "apps.kubernetes.io/pod-index": String(i), "statefulset.kubernetes.io/pod-name": name },
      annotations: {}, claims: s.spec.volumeClaimTemplates || [], env: [],
    });
  }
}
for (const j of jobs) {
  const n = j.spec.completions ?? 1;
  if (j.spec.completionMode !== "Indexed" || (j.spec.parallelism ?? 1) !== n)
    fail(`Job ${j.metadata.name}: only Indexed Jobs with parallelism = completions are emulated`);
  if (j.spec.template.spec.restartPolicy !== "Never")
    fail(`Job ${j.metadata.name}: restartPolicy ${j.spec.template.spec.restartPolicy} is not emulated`);
  for (let i = 0; i < n; i++) {
    const hostname = `${j.metadata.name}-${i}`;
    const index = { "batch.kubernetes.io/job-completion-index": String(i) };
    addPod(j, i, {
      name: `${hostname}-${Math.random().toString(36).slice(2, 7).padEnd(5, "x")}`,
      hostname, subdomain: j.spec.template.spec.subdomain,
      labels: { ...index, "batch.kubernetes.io/job-name": j.metadata.name, "job-name": j.metadata.name },
      annotations: index, claims: [], env: [{ name: "JOB_COMPLETION_INDEX", value: String(i) }],
    });
  }
}
if (pods.length > 200) fail("too many pods for one /24");
log(`overlay ${opts.overlay}: ${pods.map((p) => p.name).join(", ")}`);

// Every DNS name the cluster would answer for pod p (headless Services).
function dnsNames(p) {
  const ns = opts.namespace;
  const names = [];
  for (const svc of ofKind("Service")) {
    if (svc.spec.clusterIP !== "None" || svc.metadata.name !== p.subdomain) continue;
    if (!matches({ matchLabels: svc.spec.selector }, p.labels)) continue;
    const base = `${p.hostname}.${svc.metadata.name}`;
    names.push(`${base}.${ns}.svc.cluster.local`, `${base}.${ns}.svc`, `${base}.${ns}`, base);
  }
  return names;
}

function hostsFile(p) {
  const lines = [
    "# Kubernetes-managed hosts file (emulated by tests/k8s/pods.mjs).",
    "127.0.0.1\tlocalhost",
    "::1\tlocalhost ip6-localhost ip6-loopback",
    "fe00::0\tip6-localnet",
    "fe00::1\tip6-allnodes",
    "fe00::2\tip6-allrouters",
  ];
  const own = p.subdomain ? `${p.hostname}.${p.subdomain}.${opts.namespace}.svc.cluster.local` : "";
  lines.push(`${p.ip}\t${own} ${p.hostname}`.replace("\t ", "\t"));
  lines.push("# cluster DNS, as /etc/hosts entries:");
  for (const q of pods) {
    const names = dnsNames(q);
    if (names.length) lines.push(`${q.ip}\t${names.join(" ")}`);
  }
  return lines.join("\n") + "\n";
}

const resolvConf = () =>
  `search ${opts.namespace}.svc.cluster.local svc.cluster.local cluster.local\n` +
  "nameserver 10.96.0.10\noptions ndots:5\n";

// ---- environment ---------------------------------------------------------------

// The API server's answer for a missing object, as the kubelet quotes it.
const notFound = (kind, name) => `${kind.toLowerCase()} "${name}" not found`;

function keyValue(kind, obj, key) {
  if (kind === "ConfigMap") return (obj.data || {})[key];
  if (obj.stringData && key in obj.stringData) return obj.stringData[key];
  if (obj.data && key in obj.data) return Buffer.from(obj.data[key], "base64").toString();
  return undefined;
}

// An env valueFrom reference (kubelet makeEnvironmentVariables).
function configValue(kind, ref) {
  const obj = byName(kind, ref.name);
  if (!obj) {
    if (ref.optional) return undefined;
    throw new KubeletError("CreateContainerConfigError", notFound(kind, ref.name));
  }
  const v = keyValue(kind, obj, ref.key);
  if (v === undefined && !ref.optional)
    throw new KubeletError("CreateContainerConfigError",
                           `couldn't find key ${ref.key} in ${kind} ${opts.namespace}/${ref.name}`);
  return v;
}

function fieldValue(p, fieldPath) {
  const m = /^metadata\.(labels|annotations)\['(.+)'\]$/.exec(fieldPath);
  if (m) return (m[1] === "labels" ? p.labels : p.annotations)[m[2]] ?? "";
  const simple = {
    "metadata.name": p.name,
    "metadata.namespace": opts.namespace,
    "metadata.uid": `uid-${p.name}`,
    "spec.nodeName": p.node,
    "spec.serviceAccountName": p.spec.serviceAccountName || "default",
    "status.podIP": p.ip,
    "status.podIPs": p.ip,
    "status.hostIP": "10.244.0.1",
  };
  if (fieldPath in simple) return simple[fieldPath];
  fail(`fieldRef ${fieldPath} is not emulated`);
}

const expand = (s, env) =>
  String(s).replace(/\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g, (all, name) =>
    all === "$$" ? "$" : name in env ? env[name] : all);

function containerEnv(p, c) {
  const env = {
    PATH: "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    HOSTNAME: p.hostname,
    HOME: "/",
  };
  for (const from of c.envFrom || []) {
    const kind = from.configMapRef ? "ConfigMap" : from.secretRef ? "Secret" : null;
    if (!kind) fail("envFrom source is not emulated");
    const ref = from.configMapRef || from.secretRef;
    const obj = byName(kind, ref.name);
    if (!obj) {
      if (ref.optional) continue;
      throw new KubeletError("CreateContainerConfigError", notFound(kind, ref.name));
    }
    const keys = Object.keys(obj.data || {}).concat(Object.keys(obj.stringData || {}));
    for (const key of keys)
      env[(from.prefix || "") + key] = configValue(kind, { name: ref.name, key });
  }
  for (const e of c.env || []) {
    let v;
    if (e.valueFrom) {
      const f = e.valueFrom;
      if (f.configMapKeyRef) v = configValue("ConfigMap", f.configMapKeyRef);
      else if (f.secretKeyRef) v = configValue("Secret", f.secretKeyRef);
      else if (f.fieldRef) v = fieldValue(p, f.fieldRef.fieldPath);
      else fail(`env ${e.name}: valueFrom ${Object.keys(f)} is not emulated`);
    } else {
      v = expand(e.value ?? "", env);
    }
    if (v !== undefined) env[e.name] = v;
  }
  return env;
}

// ---- volumes -------------------------------------------------------------------

function volumeSources(p) {
  const vols = new Map();
  for (const v of p.spec.volumes || []) vols.set(v.name, v);
  for (const t of p.claims) vols.set(t.metadata.name, { name: t.metadata.name, pvc: t });
  return vols;
}

// Materialises volume v of pod p on the host; returns {dir, tmpfs}.
function prepareVolume(p, v, fsGroup) {
  const dir = path.join(p.dir, "vol", v.name);
  fs.mkdirSync(dir, { recursive: true });
  const own = (f, mode) => {
    fs.chownSync(f, 0, fsGroup ?? 0);
    fs.chmodSync(f, mode);
  };
  if (v.configMap || v.secret) {
    // kubelet's configmap/secret volume plugins: a missing object or key is
    // a FailedMount unless the volume is optional
    const kind = v.configMap ? "ConfigMap" : "Secret";
    const ref = v.configMap || v.secret;
    const name = ref.name || ref.secretName;
    const mountFailed = (why) => {
      throw new KubeletError("FailedMount", `MountVolume.SetUp failed for volume "${v.name}" : ${why}`);
    };
    const obj = byName(kind, name) || (ref.optional ? { data: {} } : mountFailed(notFound(kind, name)));
    const mode = ref.defaultMode ?? 0o644;
    const keys = ref.items ? ref.items.map((i) => [i.key, i.path, i.mode])
                           : Object.keys({ ...obj.data, ...obj.stringData }).map((k) => [k, k]);
    for (const [key, rel, m] of keys) {
      const value = keyValue(kind, obj, key);
      if (value === undefined) {
        if (ref.optional) continue;
        mountFailed(kind === "ConfigMap" ? `configmap references non-existent config key: ${key}`
                                         : `references non-existent secret key: ${key}`);
      }
      const f = path.join(dir, rel);
      fs.mkdirSync(path.dirname(f), { recursive: true });
      fs.writeFileSync(f, value);
      own(f, m ?? mode);
    }
    own(dir, fsGroup !== undefined ? 0o2755 : 0o755);
    return { dir };
  }
  if (v.emptyDir) {
    own(dir, 0o777);
    return { dir, tmpfs: v.emptyDir.medium === "Memory", size: v.emptyDir.sizeLimit };
  }
  if (v.pvc) {
    // a fresh volume from the provisioner, group-owned by fsGroup (kubelet)
    own(dir, fsGroup !== undefined ? 0o2775 : 0o755);
    return { dir };
  }
  fail(`volume ${v.name}: source ${Object.keys(v).filter((k) => k !== "name")} is not emulated`);
}

function toBytes(q) {
  if (!q) return undefined;
  const m = /^(\d+)(Ki|Mi|Gi|k|M|G)?$/.exec(String(q));
  if (!m) return undefined;
  const mult = { Ki: 1024, Mi: 1 << 20, Gi: 1 << 30, k: 1e3, M: 1e6, G: 1e9 }[m[2]] || 1;
  return Number(m[1]) * mult;
}

// ---- the container -------------------------------------------------------------

function setupScript(p, c) {
  const psc = p.spec.securityContext || {};
  const csc = c.securityContext || {};
  const uid = csc.runAsUser ?? psc.runAsUser ?? 0;
  const gid = csc.runAsGroup ?? psc.runAsGroup ?? 0;
  const fsGroup = psc.fsGroup;
  if ((csc.runAsNonRoot ?? psc.runAsNonRoot) && uid === 0)
    fail(`${p.name}: runAsNonRoot but the uid is 0 (the kubelet would refuse to start it)`);
  const readOnlyRoot = csc.readOnlyRootFilesystem === true;
  const noNewPrivs = csc.allowPrivilegeEscalation === false;
  const drop = ((csc.capabilities || {}).drop || []).includes("ALL");
  if (csc.privileged) fail(`${p.name}: privileged containers are not emulated`);

  const R = path.join(p.dir, "root");
  const L = path.join(p.dir, "layers");
  for (const d of ["etc/upper", "etc/work", "usr/upper", "usr/work", "root"])
    fs.mkdirSync(path.join(d === "root" ? R : L, d === "root" ? "" : d), { recursive: true });
  // the kubelet sets up every volume of the pod, then the container's
  // environment (either can refuse: KubeletError)
  const vols = volumeSources(p);
  const prepared = new Map();
  for (const [name, v] of vols) prepared.set(name, prepareVolume(p, v, fsGroup));
  // the image's binaries and the kubelet's files
  const command = c.command || fail(`${p.name}: no command (image entrypoints are not emulated)`);
  const env = containerEnv(p, c);
  const argv = [...command, ...(c.args || [])].map((a) => expand(a, env));
  // `sh -c '... exec "$0" "$@" ...' PROGRAM ARGS...` (the torch Job: the
  // words of a ConfigMap key appended) ends as PROGRAM, PID 1 in its turn
  const execs = /\/sh$/.test(argv[0]) && argv[1] === "-c" && /\bexec "\$0"/.test(argv[2] || "")
                  ? argv[3] : argv[0];
  for (const prog of new Set([argv[0], execs]))
    if (!prog || !prog.startsWith("/usr/") || !inImage(prog))
      fail(`${p.name}: ${prog} is not in the image (its /usr/local is ${opts.usrLocal})`);
  fs.writeFileSync(path.join(L, "etc/upper/hosts"), hostsFile(p));
  fs.writeFileSync(path.join(L, "etc/upper/hostname"), p.hostname + "\n");
  fs.writeFileSync(path.join(L, "etc/upper/resolv.conf"), resolvConf());

  const sh = ["#!/bin/sh", "# pod " + p.name + ", container " + c.name, "set -eu"];
  const m = (...a) => sh.push(a.join(" "));
  m("hostname", shq(p.hostname));
  m("mount -t tmpfs -o mode=755,size=8m pod-root", shq(R));
  for (const d of ["usr", "etc", "proc", "sys", "dev", "tmp", "var", "run"])
    m("mkdir -p", shq(path.join(R, d)));
  m("chmod 1777", shq(path.join(R, "tmp")));
  for (const [l, t] of [["bin", "usr/bin"], ["lib", "usr/lib"], ["lib64", "usr/lib64"], ["sbin", "usr/sbin"]])
    m("ln -s", t, shq(path.join(R, l)));
  m(`mount -t overlay pod-usr -o lowerdir=/usr,upperdir=${shq(L + "/usr/upper")},workdir=${shq(L + "/usr/work")}`,
    shq(R + "/usr"));
  m("mount --bind", shq(opts.usrLocal), shq(R + "/usr/local"));
  m("mount -o remount,bind,ro", shq(R + "/usr/local"));
  for (const d of opts.imageDirs) {
    m("mount --bind", shq(d), shq(R + d));
    m("mount -o remount,bind,ro", shq(R + d));
  }
  m(`mount -t overlay pod-etc -o lowerdir=/etc,upperdir=${shq(L + "/etc/upper")},workdir=${shq(L + "/etc/work")}`,
    shq(R + "/etc"));
  m("chroot", shq(R), "/usr/sbin/ldconfig");
  m("mount -t proc proc", shq(R + "/proc"));
  m("mount --rbind /sys", shq(R + "/sys"));
  m("mount -o remount,bind,ro", shq(R + "/sys"));
  m("mount -t tmpfs -o mode=755,size=1m pod-dev", shq(R + "/dev"));
  for (const d of ["null", "zero", "full", "random", "urandom", "tty"]) {
    m("touch", shq(`${R}/dev/${d}`));
    m("mount --bind", `/dev/${d}`, shq(`${R}/dev/${d}`));
  }
  m("mkdir -p", shq(R + "/dev/shm"));
  m("mount -t tmpfs -o mode=1777,size=64m shm", shq(R + "/dev/shm"));
  // volumes at their mount paths
  for (const vm of c.volumeMounts || []) {
    const src = prepared.get(vm.name) || fail(`${p.name}: volumeMount ${vm.name} has no volume`);
    const target = path.join(R, vm.mountPath);
    if (vm.subPath) fail("subPath mounts are not emulated");
    m("mkdir -p", shq(target));
    if (src.tmpfs) {
      const size = toBytes(src.size);
      m(`mount -t tmpfs -o mode=1777${size ? ",size=" + size : ""} pod-${vm.name}`, shq(target));
    } else {
      m("mount --bind", shq(src.dir), shq(target));
    }
    if (vm.readOnly) m("mount -o remount,bind,ro", shq(target));
  }
  if (readOnlyRoot) {
    m("mount -o remount,ro", shq(R + "/usr"));
    m("mount -o remount,ro", shq(R + "/etc"));
    m("mount -o remount,ro", shq(R));
  }
  const groups = [...new Set([gid, ...(fsGroup !== undefined ? [fsGroup] : []),
                               ...(psc.supplementalGroups || [])])];
  const priv = ["/usr/bin/setpriv", `--reuid=${uid}`, `--regid=${gid}`, `--groups=${groups.join(",")}`];
  if (noNewPrivs) priv.push("--no-new-privs");
  if (drop) priv.push("--inh-caps=-all", "--bounding-set=-all");
  const envArgs = Object.entries(env).map(([k, v]) => shq(`${k}=${v}`));
  sh.push(`cd ${shq(R)}`);
  sh.push(["exec chroot", shq(R), ...priv, "--", "/usr/bin/env -i", ...envArgs,
           ...argv.map(shq)].join(" "));
  const file = path.join(p.dir, `start-${c.name}.sh`);
  fs.writeFileSync(file, sh.join("\n") + "\n", { mode: 0o700 });
  return { file, env, argv, execs };
}

// ---- network -------------------------------------------------------------------

function setupNetwork(p) {
  run("ip", ["netns", "add", p.netns], "netns");
  run("ip", ["link", "add", p.veth, "type", "veth", "peer", "name", "eth0", "netns", p.netns]);
  run("ip", ["link", "set", p.veth, "master", "br0", "up"]);
  run("ip", ["-n", p.netns, "addr", "add", `${p.ip}/24`, "dev", "eth0"]);
  run("ip", ["-n", p.netns, "link", "set", "eth0", "up"]);
  run("ip", ["-n", p.netns, "link", "set", "lo", "up"]);
}

function portNumber(c, port) {
  if (typeof port === "number") return port;
  const cp = (c.ports || []).find((x) => x.name === port);
  return cp ? cp.containerPort : fail(`named port ${port} is not declared`);
}

// NetworkPolicy ingress as iptables rules in the pod's netns. Returns false if
// iptables is not available (then not enforced, and said so).
const haveIptables = spawnSync("iptables", ["--version"]).status === 0;
function applyNetworkPolicies(p) {
  const policies = ofKind("NetworkPolicy").filter(
      (np) => matches(np.spec.podSelector, p.labels) &&
              (np.spec.policyTypes || ["Ingress"]).includes("Ingress"));
  if (!policies.length || !haveIptables) return;
  const ipt = (...a) => run("ip", ["netns", "exec", p.netns, "iptables", ...a], "iptables");
  ipt("-A", "INPUT", "-i", "lo", "-j", "ACCEPT");
  ipt("-A", "INPUT", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT");
  const c = p.spec.containers[0];
  for (const np of policies) {
    for (const rule of np.spec.ingress || []) {
      let sources = [null]; // null = any source
      if (rule.from && rule.from.length) {
        sources = [];
        for (const f of rule.from) {
          if (f.ipBlock || f.namespaceSelector) fail("ipBlock/namespaceSelector are not emulated");
          for (const q of pods) if (matches(f.podSelector, q.labels)) sources.push(q.ip);
        }
      }
      const ports = rule.ports && rule.ports.length ? rule.ports : [null];
      for (const src of sources)
        for (const port of ports) {
          const a = ["-A", "INPUT"];
          if (src) a.push("-s", `${src}/32`);
          // endPort: a range (the torch Job's ring ports, one per rank of the pod)
          if (port) a.push("-p", (port.protocol || "TCP").toLowerCase(), "--dport",
                           String(portNumber(c, port.port)) +
                           (port.endPort !== undefined ? `:${port.endPort}` : ""));
          ipt(...a, "-j", "ACCEPT");
        }
    }
  }
  ipt("-A", "INPUT", "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset");
  ipt("-A", "INPUT", "-j", "DROP");
  p.policed = true;
}

// ---- processes -----------------------------------------------------------------

function startPod(p) {
  if (p.spec.containers.length !== 1) fail(`${p.name}: only one container per pod is emulated`);
  if (p.spec.initContainers && p.spec.initContainers.length) fail("initContainers are not emulated");
  const c = p.spec.containers[0];
  p.container = c;
  let script;
  try {
    script = setupScript(p, c);
  } catch (e) {
    if (!(e instanceof KubeletError)) throw e;
    // the pod is scheduled but its container is never created
    p.state = "waiting";
    p.waiting = { reason: e.reason === "FailedMount" ? "ContainerCreating" : e.reason, event: e };
    log(`${p.name}: ${p.waiting.reason}; event ${e.reason}: ${e.message}`);
    return;
  }
  const { file, argv, execs } = script;
  p.argv = argv;
  p.execs = execs;
  p.stdout = path.join(p.dir, "stdout.log");
  p.stderr = path.join(p.dir, "stderr.log");
  const out = fs.openSync(p.stdout, "w"), err = fs.openSync(p.stderr, "w");
  p.proc = spawn("ip", ["netns", "exec", p.netns, "unshare", "--mount", "--uts", "--pid", "--fork",
                        "--propagation", "private", "/bin/sh", file],
                 { stdio: ["ignore", out, err] });
  fs.closeSync(out);
  fs.closeSync(err);
  p.state = "running";
  p.started = Date.now();
  p.exit = new Promise((resolve) => p.proc.on("exit", (code, sig) => {
    p.state = "exited";
    p.exitCode = code;
    p.exitSignal = sig;
    resolve();
  }));
  log(`${p.name}: started ${argv.join(" ")}`);
}

// The host pid of the container's PID 1 (the command), found through the
// pod's network namespace.
function containerPid(p) {
  const r = spawnSync("ip", ["netns", "pids", p.netns], { encoding: "utf8" });
  for (const pid of (r.stdout || "").split(/\s+/).filter(Boolean)) {
    try {
      const st = fs.readFileSync(`/proc/${pid}/status`, "utf8");
      const ns = /^NSpid:\s+(.*)$/m.exec(st);
      if (ns && ns[1].trim().split(/\s+/).pop() === "1") return Number(pid);
    } catch {}
  }
  return 0;
}

function tail(file, n = 25) {
  try {
    return fs.readFileSync(file, "utf8").trimEnd().split("\n").slice(-n).join("\n");
  } catch {
    return "(no output)";
  }
}

// ---- HTTP: probes and scrapes from the cluster namespace -----------------------

function httpGet(ip, port, urlPath, timeoutMs) {
  return new Promise((resolve) => {
    const req = http.get({ host: ip, port, path: urlPath, timeout: timeoutMs, agent: false },
                         (res) => {
                           let body = "";
                           res.setEncoding("utf8");
                           res.on("data", (d) => (body += d));
                           res.on("end", () => resolve({ status: res.statusCode, body }));
                         });
    req.on("timeout", () => req.destroy(new Error("timeout")));
    req.on("error", (e) => resolve({ status: 0, body: String(e.message) }));
  });
}

const sample = (text, series) => {
  for (const line of text.split("\n")) if (line.startsWith(series + " ")) return Number(line.slice(series.length + 1));
  return NaN;
};

// How long a Job's shard may outlive the workers' Job.
const SHARDS_END_S = 30;
// A shard's metrics: scraped now, or a Job's that exited: the last scrape.
const shardMetrics = async (p) => (p.kind === "Job" ? p.lastMetrics || "" : await scrape(p));
// The value of --flag=V in a container's command and args.
const flagOf = (c, flag) =>
  [...(c.command || []), ...(c.args || [])].filter((a) => String(a).startsWith(flag + "="))
      .map((a) => String(a).slice(flag.length + 1)).pop();

async function scrape(p) {
  const port = Number(p.annotations["prometheus.io/port"]);
  const pth = p.annotations["prometheus.io/path"] || "/metrics";
  if (p.annotations["prometheus.io/scrape"] !== "true" || !port) fail(`${p.name}: not scrapeable`);
  const r = await httpGet(p.ip, port, pth, 3000);
  return r.status === 200 ? r.body : "";
}

// A kubelet's prober for one probe of one pod; onFailure when the threshold
// is crossed, onSuccess on each success.
function prober(p, kind, probe, { onSuccess, onFailure, enabled }) {
  const c = p.container;
  const period = (probe.periodSeconds ?? 10) * 1000;
  const timeout = (probe.timeoutSeconds ?? 1) * 1000;
  const threshold = probe.failureThreshold ?? 3;
  const successThreshold = probe.successThreshold ?? 1;
  if (!probe.httpGet) fail(`${p.name}: ${kind} probe is not httpGet`);
  const port = portNumber(c, probe.httpGet.port);
  let failures = 0, successes = 0, stopped = false;
  const loop = async () => {
    await sleep((probe.initialDelaySeconds ?? 0) * 1000);
    while (!stopped && p.state === "running") {
      if (enabled()) {
        const r = await httpGet(p.ip, port, probe.httpGet.path, timeout);
        if (stopped || p.state !== "running") break;
        if (r.status >= 200 && r.status < 400) {
          failures = 0;
          if (++successes >= successThreshold) onSuccess(r);
        } else {
          successes = 0;
          if (++failures >= threshold) onFailure(r, failures);
        }
      }
      await sleep(period);
    }
  };
  loop();
  return () => (stopped = true);
}

// ---- the run -------------------------------------------------------------------

const problems = [];
const stops = [];

async function main() {
  for (const p of pods) {
    fs.mkdirSync(p.dir, { recursive: true });
    setupNetwork(p);
  }
  for (const p of pods) applyNetworkPolicies(p);
  if (!haveIptables) log("iptables not installed: NetworkPolicies are not enforced in this run");
  for (const p of pods) startPod(p); // podManagementPolicy Parallel: all at once
  // A kubelet keeps retrying a pod it cannot start, and the pod waits for what
  // it lacks (a Secret the user has yet to create); nothing will create it here.
  const stuck = pods.filter((p) => p.state === "waiting");
  if (stuck.length)
    fail(stuck.map((p) => `${p.name} does not start: it stays ${p.waiting.reason}, the kubelet ` +
                          `reporting (event ${p.waiting.event.reason}): ${p.waiting.event.message}`)
             .join("\n"));

  for (const p of pods) {
    const c = p.container;
    p.startedOk = !c.startupProbe;
    if (c.startupProbe)
      stops.push(prober(p, "startup", c.startupProbe, {
        enabled: () => !p.startedOk,
        onSuccess: () => {
          if (!p.startedOk) log(`${p.name}: startup probe passed`);
          p.startedOk = true;
        },
        onFailure: (r, n) => problems.push(
            `${p.name}: startup probe failed ${n} times (last: ${r.status} ` +
            `${r.body.trim()}); the kubelet would restart it`),
      }));
    if (c.readinessProbe)
      stops.push(prober(p, "readiness", c.readinessProbe, {
        enabled: () => p.startedOk,
        onSuccess: () => (p.ready = true),
        onFailure: () => (p.ready = false),
      }));
    if (c.livenessProbe)
      stops.push(prober(p, "liveness", c.livenessProbe, {
        enabled: () => p.startedOk,
        onSuccess: () => {},
        onFailure: (r, n) => problems.push(
            `${p.name}: liveness probe failed ${n} times (last: ${r.status} ` +
            `${r.body.trim()}); the kubelet would restart it`),
      }));
  }

  // Watch until the job is done: readiness at a finer grain than the
  // kubelet's period (so a short training run is still seen Ready), metrics
  // through the Prometheus annotations, and any container exit.
  const deadline = t0 + opts.timeoutS * 1000;
  let jobDone = 0;
  const workers = pods.filter((p) => p.app === "ps-worker");
  const servers = pods.filter((p) => p.app === "ps-server");
  if (!workers.length) fail("no ps-worker pods");
  for (;;) {
    if (problems.length) fail(problems.join("\n"));
    for (const p of pods) {
      if (p.state !== "exited" || p.succeeded) continue;
      if (p.kind === "Job" && p.exitCode === 0) {
        p.succeeded = true;
        log(`${p.name}: Succeeded (exit 0 after ${((Date.now() - p.started) / 1000).toFixed(1)} s)`);
        continue;
      }
      fail(`${p.name} exited (code ${p.exitCode}, signal ${p.exitSignal}) before it was deleted; ` +
           (p.kind === "Job" ? jobVerdict(p) : "a StatefulSet would restart it.") +
           `\n--- ${p.name} stderr ---\n${tail(p.stderr)}`);
    }
    if (Date.now() > deadline) fail(`the job did not finish within ${opts.timeoutS} s`);
    for (const p of pods) {
      const rp = p.container.readinessProbe;
      if (!rp || p.state !== "running") continue;
      const r = await httpGet(p.ip, portNumber(p.container, rp.httpGet.port), rp.httpGet.path, 1000);
      if (r.status === 200 && !p.everReady) {
        p.everReady = true;
        log(`${p.name}: ready (${r.body.trim()})`);
      }
    }
    for (const p of pods) if (!p.fsChecked && p.startedOk && p.state === "running") checkFilesystem(p);
    let done = true;
    for (const p of workers)
      done = done && (p.kind === "Job" ? p.succeeded === true
                                       : sample(await scrape(p), "ps_worker_training_done") === 1);
    // The workers' Job is Complete: the shards must end with it (rank 0's
    // ps.shutdown() stopped them) and their controller must not start them
    // again, within SHARDS_END_S (a shard waits for its workers to hang up).
    if (done && workers.every((p) => p.kind === "Job")) {
      jobDone = jobDone || Date.now();
      for (const p of servers) {
        if (p.kind !== "Job")
          fail(`the workers' Job is Complete, but ${p.name} of the ${p.kind} ${p.app} still runs ` +
               "and would be started again if it exited: shards next to a Job of workers must " +
               "end with it (a Job of shards, overlays/torch/server-job.yaml)");
        if (p.state === "running" && Date.now() - jobDone > SHARDS_END_S * 1000)
          fail(`the workers' Job is Complete, but ${p.name} still runs ${SHARDS_END_S} s later`);
      }
    }
    for (const p of servers) {
      // a Job's shard exits when rank 0 ends the training: its metrics are
      // the last ones scraped while it ran
      if (p.kind === "Job") {
        if (p.state === "running") {
          const text = await scrape(p);
          if (text) p.lastMetrics = text;
        }
        done = done && p.succeeded === true;
      } else {
        done = done && sample(await scrape(p), "ps_server_training_done") === 1;
      }
    }
    if (done) break;
    await sleep(200);
  }
  log("training done on every pod");

  // what the job reports (rank 0: a ps-worker or the script)
  const rank0 = workers.find((p) => p.index === 0);
  const out0 = fs.readFileSync(rank0.stdout, "utf8");
  const summary = /summary accuracy=([0-9.]+).*$/m.exec(out0);
  if (!summary) fail(`${rank0.name} printed no summary line\n--- stdout ---\n${tail(rank0.stdout)}`);
  const acc = Number(summary[1]);
  log(`${rank0.name}: ${summary[0]}`);
  // a script's ranks: every one took part (ps.pod starts procs-per-pod of
  // them in each pod), as many as the world size the pods were given
  const ranks = / workers=(\d+)/.exec(summary[0]);
  const world = containerEnv(rank0, rank0.container).PS_WORLD_SIZE;
  if (rank0.kind === "Job" && ranks && ranks[1] !== world)
    fail(`${rank0.name}: the script trained with ${ranks[1]} ranks, PS_WORLD_SIZE is ${world}`);
  if (!(acc >= opts.minAccuracy)) fail(`accuracy ${acc} < ${opts.minAccuracy}`);
  for (const p of pods)
    if (p.container.readinessProbe && !p.everReady) fail(`${p.name} was never Ready`);
  // Every shard holds part of the model (ps-worker and ps.torch both size
  // their chunks so that a small model still spreads over every shard).
  for (const s of servers)
    if (!(sample(await shardMetrics(s), "ps_server_keys") > 0)) fail(`${s.name} holds no keys`);
  // A Job's shards are gone: rank 0 stopped them (their log says so), and
  // the final checkpoint each wrote on the way out holds its clock (the
  // version every key reached: in BSP, every rank's last step).
  for (const s of servers.filter((q) => q.kind === "Job")) {
    const out = fs.readFileSync(s.stderr, "utf8") + fs.readFileSync(s.stdout, "utf8");
    if (!out.includes("shutdown requested by worker 0"))
      fail(`${s.name} exited 0, but not because rank 0 ended the training\n${tail(s.stderr)}`);
    const dir = flagOf(s.container, "--checkpoint-dir");
    const vm = (s.container.volumeMounts || []).find((m) => m.mountPath === dir);
    if (!vm) fail(`${s.name}: no volume at --checkpoint-dir ${dir}`);
    const files = fs.readdirSync(path.join(s.dir, "vol", vm.name));
    const versions = files.map((f) => /^shard-\d{4}-v(\d{20})/.exec(f)).filter(Boolean).map((m) => Number(m[1]));
    if (!versions.length) fail(`${s.name}: no checkpoint on its volume ${vm.name}: ${files.join(", ")}`);
    s.finalClock = Math.max(...versions);
    log(`${s.name}: Succeeded: stopped by rank 0 (ps.shutdown), final checkpoint at step ` +
         `${s.finalClock} on its volume ${vm.name} (${files.join(", ")})`);
  }
  for (const p of workers) {
    // a script has no metrics: its summary says how many steps every rank took
    const scriptSteps = / steps=(\d+)/.exec(summary[0]);
    if (p.kind === "Job" && !scriptSteps) fail(`${rank0.name}: the summary line has no steps=N`);
    const steps = p.kind === "Job" ? Number(scriptSteps[1])
                                   : sample(await scrape(p), "ps_worker_steps_total");
    if (!(steps > 0)) fail(`${p.name}: ${steps} steps`);
    // With a 3D layout a worker owns keys on some shards only (ps_declare_owned): its clock
    // there is 0, and it must be its steps on every shard holding one of its keys (at least one).
    let owning = 0;
    for (const s of servers) {
      const clock = s.kind === "Job" ? s.finalClock
                                     : sample(await scrape(s), `ps_server_worker_clock{rank="${p.index}"}`);
      if (clock === steps) owning++;
      else if (!(clock === 0 && opts.ownedKeys))
        fail(`${s.name}: worker ${p.index}'s clock ${clock} != its ${steps} steps`);
    }
    if (servers.length && owning === 0) fail(`worker ${p.index}: no shard has its ${steps} steps`);
  }
  for (const p of servers) {
    const text = await shardMetrics(p);
    if (!(sample(text, "ps_server_updates_total") > 0)) fail(`${p.name}: no updates`);
    if (sample(text, "ps_server_checkpoints_enabled") === 1) {
      const written = sample(text, 'ps_server_checkpoints_total{result="written"}');
      if (!(written > 0)) fail(`${p.name}: checkpoints enabled but none written`);
      p.checkpoints = true;
      log(`${p.name}: ${written} checkpoints written, age ` +
          `${sample(text, "ps_server_checkpoint_age_steps")} steps`);
    }
  }
  // finished pods are not Ready (so a PodDisruptionBudget lets them go)
  for (const p of pods) {
    const rp = p.container.readinessProbe;
    if (!rp || p.succeeded) continue;
    const r = await httpGet(p.ip, portNumber(p.container, rp.httpGet.port), rp.httpGet.path, 1000);
    if (r.status !== 503 || !r.body.startsWith("done")) fail(`${p.name}: /readyz after training: ${r.status} ${r.body}`);
  }

  if (haveIptables) await checkPolicies();

  // delete every pod still running: SIGTERM to PID 1, SIGKILL after the
  // grace period (a Job's pods that succeeded are gone already)
  for (const s of stops) s();
  await Promise.all(pods.filter((p) => !p.succeeded).map(async (p) => {
    const grace = (p.spec.terminationGracePeriodSeconds ?? 30) * 1000;
    const pid = containerPid(p);
    if (!pid) fail(`${p.name}: no container process`);
    process.kill(pid, "SIGTERM");
    const t = Date.now();
    const timer = sleep(grace).then(() => "timeout");
    if ((await Promise.race([p.exit.then(() => "exit"), timer])) === "timeout") {
      const again = containerPid(p);
      if (again) process.kill(again, "SIGKILL");
      await p.exit;
      fail(`${p.name} ignored SIGTERM for its ${grace / 1000} s grace period`);
    }
    if (p.exitCode !== 0)
      fail(`${p.name}: exit code ${p.exitCode} (signal ${p.exitSignal}) after SIGTERM\n${tail(p.stderr)}`);
    log(`${p.name}: deleted, exit 0 after ${Date.now() - t} ms`);
  }));
  // what a shard checkpointed is on its own volume (the PVC of its ordinal)
  for (const p of servers.filter((q) => q.checkpoints)) {
    for (const t of p.claims) {
      const dir = path.join(p.dir, "vol", t.metadata.name);
      const files = fs.existsSync(dir) ? fs.readdirSync(dir) : [];
      if (!files.length) fail(`${p.name}: nothing on its volume ${t.metadata.name}`);
      log(`${p.name}: volume ${t.metadata.name} holds ${files.join(", ")}`);
    }
  }
  // all-reduce workers checkpoint into theirs (a restarted ring resumes there)
  for (const p of workers.filter((q) => q.claims.length)) {
    for (const t of p.claims) {
      const dir = path.join(p.dir, "vol", t.metadata.name);
      const files = (fs.existsSync(dir) ? fs.readdirSync(dir) : []).filter((f) =>
        /^worker-\d{4}-step-\d{16}\.ckpt$/.test(f));
      if (!files.length) fail(`${p.name}: no worker checkpoint on its volume ${t.metadata.name}`);
      log(`${p.name}: volume ${t.metadata.name} holds ${files.join(", ")}`);
    }
  }
}

// What a Job's controller does with a failed pod: the first podFailurePolicy
// rule whose exit codes match (In / NotIn, for the named container or any),
// else Count (a retry, up to backoffLimit). A signal N is exit 128+N.
function jobVerdict(p) {
  const job = p.owner.spec;
  const code = p.exitCode ?? 128 + (os.constants.signals[p.exitSignal] || 0);
  const rule = ((job.podFailurePolicy || {}).rules || []).find((r) => {
    const e = r.onExitCodes;
    if (!e || (e.containerName && e.containerName !== p.container.name)) return false;
    return e.operator === "In" ? e.values.includes(code) : !e.values.includes(code);
  });
  const action = rule ? rule.action : "Count";
  const what = {
    FailJob: "the Job's podFailurePolicy fails the Job (FailJob): a permanent error",
    Ignore: "the Job's podFailurePolicy ignores it (Ignore) and makes a new pod",
    Count: `the Job makes a new pod for index ${p.index}, counted against backoffLimit ` +
           `${job.backoffLimit ?? 6} (Count: retryable)`,
  }[action] || `podFailurePolicy action ${action}`;
  return `exit ${code}: ${what}` +
         (action === "FailJob" ? "." : "; retries are not emulated: a test run must train without one.");
}

// NetworkPolicy, checked on the rules' own counters so it does not depend on
// whether the application listens at that moment: a connection from the
// cluster namespace (standing in for any pod the policy does not select) to a
// pod's data port must hit the final REJECT rule, its http port must stay
// open to scrapers and probes, and the job's own traffic (shards' data port
// in ps mode, the ring port in allreduce mode) must have come in through an
// ACCEPT rule for a selected pod.
function connect(ip, port) {
  return new Promise((resolve) => {
    const s = net.connect({ host: ip, port, timeout: 2000 });
    s.on("connect", () => {
      s.destroy();
      resolve(true);
    });
    s.on("timeout", () => {
      s.destroy();
      resolve(false);
    });
    s.on("error", () => resolve(false));
  });
}

function ruleCounters(p) {
  const out = run("ip", ["netns", "exec", p.netns, "iptables", "-L", "INPUT", "-n", "-v", "-x"]);
  return out.split("\n").slice(2).filter(Boolean).map((l) => {
    const f = l.trim().split(/\s+/);
    return { pkts: Number(f[0]), target: f[2], prot: f[3], source: f[7], rest: f.slice(9).join(" ") };
  });
}

async function checkPolicies() {
  const policed = pods.filter((p) => p.policed);
  if (!policed.length) return;
  for (const p of policed) {
    for (const cp of p.container.ports || []) {
      if (cp.name === "http") {
        // (a Job's pod that is done listens no more)
        if (!p.succeeded && !(await connect(p.ip, cp.containerPort)))
          fail(`${p.name}: port http is closed to scrapers`);
        continue;
      }
      const reject = () => ruleCounters(p).find(
          (r) => r.target === "REJECT" && (r.prot === "tcp" || r.prot === "6")).pkts;
      const before = reject();
      if (await connect(p.ip, cp.containerPort))
        fail(`${p.name}: port ${cp.name} (${cp.containerPort}) is reachable from outside the job`);
      if (!(reject() > before))
        fail(`${p.name}: a connection to ${cp.name} from outside the job was not refused by the policy`);
      const admits = (rest) => {
        const m = /dpts?:(\d+)(?::(\d+))?/.exec(rest);
        return m && Number(m[1]) <= cp.containerPort && cp.containerPort <= Number(m[2] ?? m[1]);
      };
      const accepted = ruleCounters(p)
          .filter((r) => r.target === "ACCEPT" && admits(r.rest) && r.source !== "0.0.0.0/0")
          .reduce((n, r) => n + r.pkts, 0);
      // the ring carries all-reduce mode, and a script's broadcasts in ps
      // mode too (ps-worker does not use it in ps mode)
      const used = (p.app === "ps-server" && cp.name === "ps") ||
                   (p.app === "ps-worker" && cp.name === "ring" &&
                    (!shardPods().length || p.kind === "Job"));
      if (used && !accepted) fail(`${p.name}: no job traffic came in on ${cp.name} through the policy`);
      log(`${p.name}: NetworkPolicy: ${cp.name} refused from outside the job` +
          (used ? `, ${accepted} packets from selected pods accepted` : "") +
          ((p.container.ports || []).some((q) => q.name === "http") ? "; http open" : ""));
    }
  }
}
const shardPods = () => pods.filter((p) => p.app === "ps-server");

// Inside a running container, as its user: every read-only volume is there
// and cannot be written, the root filesystem cannot be written when
// readOnlyRootFilesystem says so, and writable volumes can be.
function checkFilesystem(p) {
  // a container that is exiting is reported as such by the caller's next
  // round; one whose PID 1 is still the setup script (mounting) is checked
  // once it runs the command
  const pid = containerPid(p);
  if (!pid) return;
  let cmd = "";
  try {
    cmd = fs.readFileSync(`/proc/${pid}/cmdline`, "utf8").split("\0")[0];
  } catch {}
  if (cmd !== p.execs) return;
  const c = p.container;
  const psc = p.spec.securityContext || {};
  const csc = c.securityContext || {};
  const uid = csc.runAsUser ?? psc.runAsUser ?? 0, gid = csc.runAsGroup ?? psc.runAsGroup ?? 0;
  const groups = [gid, ...(psc.fsGroup !== undefined ? [psc.fsGroup] : [])].join(",");
  const tests = [];
  for (const vm of c.volumeMounts || []) {
    if (vm.readOnly) {
      tests.push(`test -n "$(ls -A ${shq(vm.mountPath)})" || { echo "${vm.mountPath} is empty"; exit 1; }`);
      tests.push(`for f in ${shq(vm.mountPath)}/*; do test -r "$f" || { echo "cannot read $f"; exit 1; }; done`);
      tests.push(`! (echo x > ${shq(vm.mountPath + "/.probe")}) 2>/dev/null || { echo "${vm.mountPath} is writable"; exit 1; }`);
    } else if (vm.mountPath !== "/dev/shm") {
      tests.push(`echo x > ${shq(vm.mountPath + "/.probe")} && rm ${shq(vm.mountPath + "/.probe")} || { echo "${vm.mountPath} is not writable"; exit 1; }`);
    }
  }
  if (csc.readOnlyRootFilesystem)
    tests.push(`! (echo x > /.probe) 2>/dev/null || { echo "the root filesystem is writable"; exit 1; }`);
  tests.push(`test "$(id -u)" = ${uid} || { echo "uid is $(id -u), not ${uid}"; exit 1; }`);
  const r = spawnSync("nsenter", ["--target", String(pid), "--mount", "--root", "--wd=/", "--",
                                  "/usr/bin/setpriv", `--reuid=${uid}`, `--regid=${gid}`,
                                  `--groups=${groups}`, "/bin/sh", "-c", tests.join("\n")],
                      { encoding: "utf8" });
  if (r.status !== 0 && containerPid(p) !== pid) return;
  if (r.status !== 0) fail(`${p.name}: filesystem check: ${(r.stdout + r.stderr).trim()}`);
  p.fsChecked = true;
  log(`${p.name}: runs as uid ${uid}; volumes at their mountPaths (read-only ones unwritable)` +
      (csc.readOnlyRootFilesystem ? "; root filesystem read-only" : ""));
}

main().then(
  () => {
    if (opts.expectFailure !== undefined) {
      console.error(`FAIL: the job ran, but it should have failed with "${opts.expectFailure}"`);
      process.exit(1);
    }
    log("PASS");
    process.exit(0);
  },
  async (e) => {
    const expected = opts.expectFailure !== undefined && e instanceof Fail &&
                     e.message.includes(opts.expectFailure);
    if (expected) log(`failed as it should:\n${e.message}`);
    else console.error(`FAIL: ${e instanceof Fail ? e.message : e.stack || e}`);
    for (const p of expected ? [] : pods) {
      if (!p.stderr) continue;
      console.error(`--- ${p.name} (${p.state}) stderr, last lines ---\n${tail(p.stderr, 15)}`);
    }
    for (const s of stops) s();
    for (const p of pods) {
      const pid = p.state === "running" ? containerPid(p) : 0;
      if (pid) process.kill(pid, "SIGKILL");
    }
    process.exit(expected ? 0 : 1);
  });
