/* local_run: the supervision of one ps-local run (local_run.h).
 *
 * Start-up. Shards listen on port 0 and write their bound address to a port
 * file in a private directory (mkdtemp, or --keep-logs DIR); once every
 * shard has written one, the workers start with the list of addresses. The
 * ring's sockets (allreduce and command mode) and MASTER_PORT (command
 * mode) are bound before the shards, so no shard's port 0 can take them.
 *
 * Output. Rank 0's stderr is ours, so its progress bar reaches the terminal;
 * its stdout comes through a pipe: the line starting with "summary " is kept
 * and every other line echoed (a command's stdout is ours, whole). Every
 * other child writes stdout and stderr to <dir>/shard-<i>.log or
 * <dir>/worker-<r>.log, and the tail of that log is printed if the child
 * fails. The last stdout line is our own summary, with rank 0's figures
 * (samples_per_s: training throughput, the per-epoch evaluation left out, as
 * tools/bench/ps-torch-ref times it) and the launcher's wall time (start-up and
 * evaluation included); a command gets none.
 *
 * Lifecycle. One thread; SIGINT, SIGTERM, SIGHUP and SIGCHLD are blocked and
 * read from a signalfd in the same poll as rank 0's stdout, so no signal is
 * lost between a check and a wait, and signals are handled before child
 * exits in each round (a Ctrl-C that also hit the children is a Ctrl-C, not
 * their failure). Phases:
 *   START -> TRAIN    every port file exists (15 s at most)
 *   TRAIN -> DRAIN    every worker exited 0; rank 0 told the shards to stop,
 *                     so they should exit by themselves: after 10 s they get
 *                     SIGTERM, 5 s later SIGKILL (a warning, not a failure);
 *                     after a command 2 s and no warning, since a script
 *                     need not have called ps.shutdown()
 *   TRAIN -> STOP     a worker exited 0 and another can no longer finish
 *                     (watch_finished): stopped (state T or t) for 5 s, or
 *                     still running after every shard exited by itself
 *                     (rank 0 ended the training), 10 s later (a command:
 *                     30 s). It is named, killed (SIGKILL reaches a stopped
 *                     process) and the job stopped as after a failure
 *   any   -> STOP     a child failed (exit != 0 or a signal we did not send)
 *                     or we got a signal: SIGTERM and SIGCONT (a stopped
 *                     child acts on the SIGTERM) to every child, SIGKILL 3 s
 *                     later; a second signal sends SIGKILL at once.
 * So once the job is decided nothing is waited on for ever. Exit code: 0;
 * 128+N after our signal N; 129 (retryable) if the first child to fail
 * exited 129 (a worker that lost a peer or shard, a shard that lost a
 * worker: docs/KUBERNETES.md, Exit codes) or a worker was killed as above; 1 for any other
 * failure.
 * Children stay in our process group (Ctrl-C and Ctrl-Z reach them) and set
 * PR_SET_PDEATHSIG=SIGKILL, so even a SIGKILL of ps-local leaves no orphan.
 * Starting, reaping and signalling them, the signalfd, the port files and
 * the temp dir are procs.c's, shared with ps-bench; the phases are ours.
 *
 * Authentication. Unless --no-auth, every child gets --auth-token-file (a
 * command: PS_AUTH_TOKEN_FILE): the user's (--auth-token-file) or a fresh
 * 32-byte token written with mode 0600 into the private directory and
 * removed at the end, so even a laptop run does not accept gradients from
 * other users of the machine.
 *
 * A command's environment is ours (ps-local.c scrubbed it) plus its rank's
 * settings (worker_env), with the variables that could compete with them
 * removed. */
#include "local_run.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "clock.h"
#include "container_of.h"
#include "log.h"
#include "net.h"
#include "local_run_impl.h"
#include "procs.h"
#include "rendezvous.h"
#include "server_argv.h"

static int mkdir_p(const char *path) {
  char buf[PATH_BYTES];
  snprintf(buf, sizeof(buf), "%s", path);
  for (char *p = buf + 1;; p++) {
    if (*p == '/' || *p == '\0') {
      char c = *p;
      *p = '\0';
      if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -errno;
      *p = c;
      if (!c) break;
    }
  }
  struct stat st;
  if (stat(path, &st) != 0) return -errno;
  return S_ISDIR(st.st_mode) ? 0 : -ENOTDIR;
}

static int make_dir(struct launcher *L) {
  const struct local_config *cfg = L->cfg;
  if (cfg->keep_logs[0]) {
    char full[PATH_MAX];
    int r = mkdir_p(cfg->keep_logs);
    if (r < 0) {
      fprintf(stderr, "ps-local: option --keep-logs: cannot create %s: %s\n", cfg->keep_logs,
              strerror(-r));
      return -1;
    }
    if (!realpath(cfg->keep_logs, full)) snprintf(full, sizeof(full), "%s", cfg->keep_logs);
    if (strlen(full) >= sizeof(L->dir)) {
      fprintf(stderr, "ps-local: option --keep-logs: %s is too long (at most %d bytes)\n", full,
              DIR_BYTES - 1);
      return -1;
    }
    memcpy(L->dir, full, strlen(full) + 1);
    L->keep_dir = true;
  } else if (procs_make_tmpdir(&L->procs, L->dir, sizeof(L->dir)) < 0) {
    return -1;
  }
  return 0;
}

static void port_path(const struct launcher *L, int shard, char *buf, size_t len) {
  snprintf(buf, len, "%s/shard-%d.port", L->dir, shard);
}

/* This launch's job id, the same for every shard and a restarted one: a
 * shard's checkpoints say which job wrote them (a reused directory keeps
 * another launch's apart). */
static int make_job_id(struct launcher *L) {
  unsigned char raw[8];
  if (getrandom(raw, sizeof(raw), 0) != (ssize_t)sizeof(raw)) {
    fprintf(stderr, "ps-local: no randomness for the job id: %s\n", strerror(errno));
    return -1;
  }
  int n = snprintf(L->job_id, sizeof(L->job_id), "local-");
  for (size_t i = 0; i < sizeof(raw); i++)
    n += snprintf(L->job_id + n, sizeof(L->job_id) - (size_t)n, "%02x", raw[i]);
  return 0;
}

/* The token for the children: the user's file, or a fresh random one in our
 * private directory (mode 0600), or none with --no-auth. */
static int make_token(struct launcher *L) {
  const struct local_config *cfg = L->cfg;
  if (cfg->no_auth) return 0;
  if (cfg->auth_token_file[0]) {
    if (access(cfg->auth_token_file, R_OK) != 0) {
      fprintf(stderr, "ps-local: option --auth-token-file: cannot read %s: %s\n",
              cfg->auth_token_file, strerror(errno));
      return -1;
    }
    snprintf(L->token, sizeof(L->token), "%s", cfg->auth_token_file);
    return 0;
  }
  unsigned char raw[32];
  char hex[2 * sizeof(raw) + 2];
  if (getrandom(raw, sizeof(raw), 0) != (ssize_t)sizeof(raw)) {
    fprintf(stderr, "ps-local: no randomness for the auth token: %s\n", strerror(errno));
    return -1;
  }
  for (size_t i = 0; i < sizeof(raw); i++) snprintf(hex + 2 * i, 3, "%02x", raw[i]);
  hex[2 * sizeof(raw)] = '\n';
  snprintf(L->token, sizeof(L->token), "%s/auth-token", L->dir);
  int fd = open(L->token, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  bool ok = fd >= 0 && write(fd, hex, 2 * sizeof(raw) + 1) == (ssize_t)(2 * sizeof(raw) + 1);
  if (fd >= 0 && close(fd) != 0) ok = false;
  explicit_bzero(raw, sizeof(raw));
  explicit_bzero(hex, sizeof(hex));
  if (!ok) {
    fprintf(stderr, "ps-local: cannot write %s: %s\n", L->token, strerror(errno));
    L->token[0] = 0;
    return -1;
  }
  L->token_made = true;
  return 0;
}

/* The temp dir goes whole; a kept one loses only our port files (and the
 * token we made). */
static void remove_dir(struct launcher *L) {
  if (!L->dir[0]) return;
  if (L->token_made) unlink(L->token);
  if (L->keep_dir) {
    for (int i = 0; i < L->cfg->shards; i++) {
      char p[PATH_BYTES];
      port_path(L, i, p, sizeof(p));
      unlink(p);
    }
    return;
  }
  procs_remove_dir(&L->procs, L->dir);
}

/* Starts k from argv with stdout to out_fd and stderr to err_fd (-1 =
 * ours), keep_fd inherited (-1 = none) and the environment env (NULL =
 * ours). Returns 0 once it runs, or -1 after saying why; k->proc.running
 * says whether a child exists anyway (an exec that failed: it exits 127,
 * which the caller reports). */
static int spawn(struct launcher *L, struct child *k, const char *const *argv, int out_fd,
                 int err_fd, int keep_fd, char *const *env) {
  struct procs_io io = {out_fd, err_fd, keep_fd, env};
  int r = procs_spawn(&L->procs, &k->proc, argv, &io);
  if (r < 0 && k->proc.running) { /* finish() says it */
    snprintf(k->why, sizeof(k->why), "cannot run %.100s: %s", argv[0], strerror(-r));
    k->not_run = true;
  }
  return r < 0 ? -1 : 0;
}

static int start_shard(struct launcher *L, struct child *k) {
  const struct local_config *cfg = L->cfg;
  char port[PATH_BYTES];
  port_path(L, k->index, port, sizeof(port));
  unlink(port); /* a stale one in a --keep-logs dir would read as ready */
  struct server_argv a;
  char listen[96];
  snprintf(listen, sizeof(listen), "%s:0", L->host);
  server_argv_init(&a, L->plan->server_bin, listen, port, L->shard0 + k->index, L->num_shards,
                   L->world);
  server_argv_add(&a, "--http", "127.0.0.1:0");
  server_argv_add(&a, "--consistency", cfg->consistency);
  server_argv_add(&a, "--staleness-method", cfg->staleness_method);
  server_argv_add(&a, "--optimizer", L->plan->optimizer);
  server_argv_add_double(&a, "--lr", cfg->lr);
  if (strcmp(L->plan->optimizer, "momentum") == 0)
    server_argv_add_double(&a, "--momentum", cfg->momentum);
  if (cfg->weight_decay > 0) server_argv_add_double(&a, "--weight-decay", cfg->weight_decay);
  if (L->plan->decay_steps) server_argv_add_u64(&a, "--lr-decay-steps", L->plan->decay_steps);
  /* as given; unset, the shards' defaults apply */
  if (cfg->worker_timeout[0]) server_argv_add(&a, "--worker-timeout", cfg->worker_timeout);
  if (cfg->on_worker_timeout[0]) server_argv_add(&a, "--on-worker-timeout", cfg->on_worker_timeout);
  server_argv_add(&a, "--log-level", L->shard_level);
  server_argv_add(&a, "--transport", cfg->transport);
  if (L->token[0]) server_argv_add(&a, "--auth-token-file", L->token);
  /* one per launch, the same for a restarted shard */
  server_argv_add(&a, "--job-id", L->job_id);
  const char *const *argv = server_argv_get(&a);
  if (!argv) return -1;
  int fd = procs_open_log(&L->procs, k->log);
  if (fd < 0) return -1;
  int r = spawn(L, k, argv, fd, fd, -1, NULL);
  close(fd);
  return r;
}

/* Runs worker k from argv with env (NULL = ours): rank 0's stderr is ours
 * and its stdout too in command mode, or else a pipe we read
 * (read_output); every other rank writes to its log. */
static int launch_worker(struct launcher *L, struct child *k, const char *const *argv,
                         char *const *env) {
  int keep = L->ring_fd ? L->ring_fd[k->index] : -1;
  if (k->index == 0 && L->plan->cmd) return spawn(L, k, argv, -1, -1, keep, env);
  if (k->index == 0) {
    int p[2];
    if (pipe2(p, O_CLOEXEC) < 0) {
      fprintf(stderr, "ps-local: pipe: %s\n", strerror(errno));
      return -1;
    }
    int r = spawn(L, k, argv, p[1], -1, keep, env);
    close(p[1]);
    if (r < 0 && !k->proc.running) {
      close(p[0]);
      return -1;
    }
    fcntl(p[0], F_SETFL, fcntl(p[0], F_GETFL) | O_NONBLOCK);
    L->out_fd = p[0];
    return r;
  }
  int fd = procs_open_log(&L->procs, k->log);
  if (fd < 0) return -1;
  int r = spawn(L, k, argv, fd, fd, keep, env);
  close(fd);
  return r;
}

/* ps mode needs the workers' pairwise connections too when the model is
 * split over them (--tensor-parallel x --pipeline-stages > 1). */
static bool model_parallel(const struct local_config *cfg) {
  return cfg->tensor_parallel * cfg->pipeline_stages > 1;
}

/* Worker k as ps-worker, its settings as flags. */
static int start_builtin_worker(struct launcher *L, struct child *k, const char *servers) {
  const struct local_config *cfg = L->cfg;
  char a_rank[24], a_ws[24], a_ep[24], a_bs[24], a_seed[24], a_max[24];
  snprintf(a_rank, sizeof(a_rank), "%d", L->rank0 + k->index);
  snprintf(a_ws, sizeof(a_ws), "%d", L->world);
  snprintf(a_ep, sizeof(a_ep), "%lld", (long long)cfg->epochs);
  snprintf(a_bs, sizeof(a_bs), "%lld", (long long)cfg->batch_size);
  snprintf(a_seed, sizeof(a_seed), "%lld", (long long)cfg->seed);
  snprintf(a_max, sizeof(a_max), "%lld", (long long)cfg->max_steps);
  const char *argv[64] = {L->plan->worker_bin,
                          "--sync-mode",
                          "ps",
                          "--servers",
                          servers,
                          "--rank",
                          a_rank,
                          "--world-size",
                          a_ws,
                          "--model",
                          cfg->model,
                          "--epochs",
                          a_ep,
                          "--batch-size",
                          a_bs,
                          "--seed",
                          a_seed,
                          "--data",
                          cfg->data,
                          "--log-level",
                          L->worker_level,
                          "--blas-kernel",
                          cfg->blas_kernel,
                          "--transport",
                          cfg->transport};
  int n = 25;
  if (cfg->max_steps > 0) {
    argv[n++] = "--max-steps";
    argv[n++] = a_max;
  }
  char a_fd[24], a_lr[40], a_mom[40], a_decay[24];
  if (L->plan->allreduce) { /* the optimizer runs on the workers: they get what the shards would */
    argv[2] = "allreduce";
    argv[3] = "--peers";
    argv[4] = L->peers;
    snprintf(a_fd, sizeof(a_fd), "%d", L->ring_fd[k->index]);
    server_argv_format_double(cfg->lr, a_lr, sizeof(a_lr));
    server_argv_format_double(strcmp(L->plan->optimizer, "momentum") == 0 ? cfg->momentum : 0,
                              a_mom, sizeof(a_mom));
    snprintf(a_decay, sizeof(a_decay), "%llu", (unsigned long long)L->plan->decay_steps);
    const char *more[] = {"--peer-listen-fd",
                          a_fd,
                          "--lr",
                          a_lr,
                          "--momentum",
                          a_mom,
                          "--lr-decay-steps",
                          a_decay,
                          "--shard-optimizer-state",
                          cfg->shard_optimizer_state ? "true" : "false"};
    for (size_t i = 0; i < sizeof(more) / sizeof(more[0]); i++) argv[n++] = more[i];
  }
  if (!L->plan->allreduce && model_parallel(cfg)) { /* stages and slices talk directly */
    snprintf(a_fd, sizeof(a_fd), "%d", L->ring_fd[k->index]);
    const char *more[] = {"--peers", L->peers, "--peer-listen-fd", a_fd};
    for (size_t i = 0; i < sizeof(more) / sizeof(more[0]); i++) argv[n++] = more[i];
  }
  char a_tp[24], a_pp[24], a_mb[24], a_ch[24];
  snprintf(a_tp, sizeof(a_tp), "%lld", (long long)cfg->tensor_parallel);
  snprintf(a_pp, sizeof(a_pp), "%lld", (long long)cfg->pipeline_stages);
  snprintf(a_mb, sizeof(a_mb), "%lld", (long long)cfg->micro_batches);
  snprintf(a_ch, sizeof(a_ch), "%lld", (long long)cfg->pipeline_chunks);
  const char *mp[] = {"--tensor-parallel", a_tp, "--pipeline-stages",   a_pp,
                      "--micro-batches",   a_mb, "--pipeline-schedule", cfg->pipeline_schedule,
                      "--pipeline-chunks", a_ch};
  for (size_t i = 0; i < sizeof(mp) / sizeof(mp[0]); i++) argv[n++] = mp[i];
  if (L->token[0]) {
    argv[n++] = "--auth-token-file";
    argv[n++] = L->token;
  }
  argv[n] = NULL;
  return launch_worker(L, k, argv, NULL);
}

/* Names worker_env sets, and stale ones of the user's shell that would
 * compete with them in the command's view (a template beside our list). */
static const char *const worker_env_names[] = {
    "PS_SYNC_MODE",      "PS_RANK",
    "PS_WORLD_SIZE",     "RANK",
    "WORLD_SIZE",        "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",  "PS_SERVERS",
    "PS_NUM_SHARDS",     "PS_SERVER_TEMPLATE",
    "PS_PEERS",          "PS_PEER_TEMPLATE",
    "PS_PEER_LISTEN_FD", "PS_AUTH_TOKEN_FILE",
    "MASTER_ADDR",       "MASTER_PORT",
    "PS_TRANSPORT",
};

/* Command mode: worker k's environment (file comment), into e. */
static int worker_env(const struct launcher *L, const struct child *k, const char *servers,
                      struct procs_env *e) {
  const struct local_config *cfg = L->cfg;
  int r = L->rank0 + k->index;
  if (procs_env_init(e) < 0) return -ENOMEM;
  for (size_t i = 0; i < sizeof(worker_env_names) / sizeof(worker_env_names[0]); i++)
    procs_env_unset(e, worker_env_names[i]);
  procs_env_set(e, "PS_SYNC_MODE", "%s", L->plan->allreduce ? "allreduce" : "ps");
  procs_env_set(e, "PS_RANK", "%d", r);
  procs_env_set(e, "PS_WORLD_SIZE", "%d", L->world);
  procs_env_set(e, "RANK", "%d", r);
  procs_env_set(e, "WORLD_SIZE", "%d", L->world);
  procs_env_set(e, "LOCAL_RANK", "%d", k->index);
  procs_env_set(e, "LOCAL_WORLD_SIZE", "%lld", (long long)cfg->workers);
  if (!L->plan->allreduce) {
    procs_env_set(e, "PS_SERVERS", "%s", servers);
    procs_env_set(e, "PS_NUM_SHARDS", "%d", L->num_shards);
    procs_env_set(e, "PS_TRANSPORT", "%s", cfg->transport);
  }
  procs_env_set(e, "PS_PEERS", "%s", L->peers);
  procs_env_set(e, "PS_PEER_LISTEN_FD", "%d", L->ring_fd[k->index]);
  if (L->token[0]) procs_env_set(e, "PS_AUTH_TOKEN_FILE", "%s", L->token);
  procs_env_set(e, "PS_JOB_ID", "%s", L->plan->job_id);
  if (cfg->log_level[0]) procs_env_set(e, "PS_LOG_LEVEL", "%s", cfg->log_level);
  if (cfg->nodes == 1) { /* across hosts none: each node's port is its own */
    procs_env_set(e, "MASTER_ADDR", "127.0.0.1");
    procs_env_set(e, "MASTER_PORT", "%d", L->master_port);
  }
  if (L->plan->build_root[0]) {
    const char *old = getenv("PYTHONPATH");
    procs_env_set(e, "PYTHONPATH", "%s/python%s%s", L->plan->build_root, old && old[0] ? ":" : "",
                  old && old[0] ? old : "");
  }
  return procs_env_vars(e) ? 0 : -ENOMEM;
}

/* Worker k as the user's command, its settings in the environment. */
static int start_command_worker(struct launcher *L, struct child *k, const char *servers) {
  struct procs_env env;
  int r = worker_env(L, k, servers, &env);
  if (r == 0)
    r = launch_worker(L, k, L->plan->cmd, procs_env_vars(&env));
  else
    fprintf(stderr, "ps-local: no memory for the environment of %s\n", k->proc.name);
  procs_env_deinit(&env);
  return r < 0 ? -1 : 0;
}

/* Allreduce and command mode: binds one listening socket per rank on
 * 127.0.0.1 port 0 (close-on-exec; each worker inherits only its own,
 * --peer-listen-fd or PS_PEER_LISTEN_FD), so no port can be taken between
 * choosing and using it, and builds --peers. */
static int bind_ring(struct launcher *L) {
  int W = (int)L->cfg->workers;
  L->ring_fd = malloc((size_t)W * sizeof(int));
  L->peers = calloc((size_t)W, 24);
  if (!L->ring_fd || !L->peers) {
    fprintf(stderr, "ps-local: no memory for the ring of %d workers\n", W);
    return -1;
  }
  for (int r = 0; r < W; r++) L->ring_fd[r] = -1;
  size_t used = 0;
  for (int r = 0; r < W; r++) {
    struct net_addr a = {.port = 0};
    snprintf(a.host, sizeof(a.host), "%s", L->host);
    char err[256];
    L->ring_fd[r] = net_listen(&a, 16, err, sizeof(err));
    if (L->ring_fd[r] < 0) {
      fprintf(stderr, "ps-local: ring port of worker %d: %s\n", r, err);
      return -1;
    }
    used += (size_t)snprintf(L->peers + used, (size_t)W * 24 - used, "%s%s:%d", r ? "," : "",
                             L->host, net_bound_port(L->ring_fd[r]));
  }
  return 0;
}

/* Command mode: MASTER_PORT, a free port for torch.distributed's store.
 * Our listening socket holds it until the workers start (close_master),
 * so no shard takes it meanwhile. */
static int reserve_master_port(struct launcher *L) {
  struct net_addr a = {.host = "127.0.0.1", .port = 0};
  char err[256];
  L->master_fd = net_listen(&a, 1, err, sizeof(err));
  if (L->master_fd < 0) {
    fprintf(stderr, "ps-local: MASTER_PORT: %s\n", err);
    return -1;
  }
  L->master_port = net_bound_port(L->master_fd);
  return 0;
}

static void close_master(struct launcher *L) {
  if (L->master_fd >= 0) close(L->master_fd);
  L->master_fd = -1;
}

/* Sends sig to every child still running (or to the shards only). SIGTERM
 * comes with SIGCONT: a stopped child would otherwise hold it pending until
 * the SIGKILL. */
static void signal_children(struct launcher *L, int sig, bool shards_only) {
  for (int i = 0; i < L->num_kids; i++) {
    if (shards_only && L->kids[i].kind != CHILD_SHARD) continue;
    procs_kill(&L->kids[i].proc, sig);
    if (sig == SIGTERM) procs_kill(&L->kids[i].proc, SIGCONT);
  }
}

/* Enters STOP: every child gets SIGTERM now and SIGKILL after STOP_KILL_MS. */
void local_begin_stop(struct launcher *L) {
  if (L->phase == PHASE_STOP) return;
  L->phase = PHASE_STOP;
  signal_children(L, SIGTERM, false);
  L->escalation = 0;
  L->deadline_ms = clock_now_ms() + STOP_KILL_MS;
}

/* One line of rank 0's stdout (without its newline; whole = false for the
 * first piece of a line longer than our buffer, which is echoed as is). */
static void handle_line(struct launcher *L, const char *line, size_t len, bool whole) {
  if (whole && len >= 8 && strncmp(line, "summary ", 8) == 0) {
    size_t n = len < sizeof(L->summary) - 1 ? len : sizeof(L->summary) - 1;
    memcpy(L->summary, line, n);
    L->summary[n] = '\0';
    return;
  }
  /* Not our business if stdout is gone (e.g. piped into head). */
  if (fwrite(line, 1, len, stdout) == len && whole) fputc('\n', stdout);
  fflush(stdout);
}

/* Reads what rank 0 wrote to stdout; at EOF the last partial line counts. */
static void read_output(struct launcher *L) {
  while (L->out_fd >= 0) {
    ssize_t n = read(L->out_fd, L->out_buf + L->out_len, sizeof(L->out_buf) - L->out_len);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    if (n <= 0) {
      if (L->out_len) handle_line(L, L->out_buf, L->out_len, true);
      L->out_len = 0;
      close(L->out_fd);
      L->out_fd = -1;
      return;
    }
    L->out_len += (size_t)n;
    size_t start = 0;
    for (size_t i = 0; i < L->out_len; i++) {
      if (L->out_buf[i] != '\n') continue;
      handle_line(L, L->out_buf + start, i - start, true);
      start = i + 1;
    }
    if (start == 0 && L->out_len == sizeof(L->out_buf)) { /* a line longer than the buffer */
      handle_line(L, L->out_buf, L->out_len, false);
      start = L->out_len;
    }
    memmove(L->out_buf, L->out_buf + start, L->out_len - start);
    L->out_len -= start;
  }
}

static void handle_signals(struct launcher *L) {
  int sig;
  while ((sig = procs_next_signal(&L->procs))) { /* SIGCHLD: reap() runs every round anyway */
    if (L->stop_signal) {
      /* A second Ctrl-C: the user does not want to wait. */
      fprintf(stderr, "ps-local: %s again: killing every child now\n", strsignal(sig));
      signal_children(L, SIGKILL, false);
      L->escalation = 2;
      L->deadline_ms = 0;
      continue;
    }
    L->stop_signal = sig;
    fprintf(stderr, "ps-local: %s: stopping every child\n", strsignal(sig));
    local_begin_stop(L);
  }
}

static void reap(struct launcher *L) {
  struct procs_child *c;
  while ((c = procs_reap(&L->procs))) {
    struct child *k = container_of(c, struct child, proc);
    if (procs_exited_ok(c) || c->signalled) continue;
    k->failed = true;
    if (!L->first_failure) L->first_failure = k;
    local_begin_stop(L);
  }
}

int local_running_count(const struct launcher *L, bool workers_only) {
  int n = 0;
  for (int i = 0; i < L->num_kids; i++)
    n += L->kids[i].proc.running && (!workers_only || L->kids[i].kind == CHILD_WORKER);
  return n;
}

/* Applies the DRAIN and STOP time limits. After a command, shards still
 * running are no surprise (it need not have called ps.shutdown()): they are
 * stopped without a warning. */
static void escalate(struct launcher *L) {
  if (!L->deadline_ms || clock_now_ms() < L->deadline_ms) return;
  bool quiet = L->phase == PHASE_DRAIN && L->plan->cmd;
  if (L->phase == PHASE_DRAIN && L->escalation == 0) {
    if (!quiet)
      fprintf(stderr,
              "ps-local: warning: %d shard(s) still running %d s after the workers "
              "finished; sending SIGTERM\n",
              local_running_count(L, false), L->shard_grace_ms / 1000);
    signal_children(L, SIGTERM, true);
    L->escalation = 1;
    L->deadline_ms = clock_now_ms() + SHARD_TERM_MS;
  } else {
    if (!quiet)
      fprintf(stderr,
              "ps-local: warning: %d child(ren) ignored SIGTERM for %d s; sending SIGKILL\n",
              local_running_count(L, false),
              (L->phase == PHASE_DRAIN ? SHARD_TERM_MS : STOP_KILL_MS) / 1000);
    signal_children(L, SIGKILL, false);
    L->escalation = 2;
    L->deadline_ms = 0;
  }
}

/* One round: waits up to timeout_ms for a signal or output, then handles
 * signals, output, exits and deadlines, in that order. */
void local_pump(struct launcher *L, int timeout_ms) {
  if (L->deadline_ms) {
    uint64_t now = clock_now_ms();
    int left = L->deadline_ms > now ? (int)(L->deadline_ms - now) : 0;
    if (timeout_ms < 0 || left < timeout_ms) timeout_ms = left;
  }
  if (L->rdzv && (timeout_ms < 0 || timeout_ms > 250)) timeout_ms = 250; /* heartbeats */
  struct pollfd pf[3] = {{procs_signal_fd(&L->procs), POLLIN, 0},
                         {L->rdzv ? rdzv_fd(L->rdzv) : -1, POLLIN, 0},
                         {L->out_fd, POLLIN, 0}};
  int r = poll(pf, L->out_fd >= 0 ? 3 : 2, timeout_ms);
  if (r < 0 && errno != EINTR) {
    fprintf(stderr, "ps-local: poll: %s\n", strerror(errno));
    clock_sleep_ms(10);
  }
  handle_signals(L);
  read_output(L);
  reap(L);
  nodes_poll(L);
  escalate(L);
}

/* Waits until every shard wrote its port file, then builds the --servers
 * list in *servers (malloc'd, the caller frees it). Whatever the signalfd
 * brings meanwhile (a signal, a shard's exit) is handled as in any round. */
static int wait_for_shards(struct launcher *L, char **servers) {
  int S = (int)L->cfg->shards, ready = 0;
  size_t cap = (size_t)S * 300 + 1, used = 0;
  char *list = calloc(1, cap);
  if (!list) return -1;
  uint64_t deadline = clock_now_ms() + START_TIMEOUT_MS;
  while (ready < S) {
    char path[PATH_BYTES], addr[300];
    port_path(L, ready, path, sizeof(path));
    int r = procs_wait_port(&L->procs, path, addr, sizeof(addr), deadline);
    if (r == 0) {
      used += (size_t)snprintf(list + used, cap - used, "%s%s", ready ? "," : "", addr);
      ready++;
      continue;
    }
    if (r == -ETIMEDOUT) {
      fprintf(stderr, "ps-local: ps-server shard %d did not write %s within %d s\n", ready, path,
              START_TIMEOUT_MS / 1000);
      struct child *k = &L->kids[ready];
      snprintf(k->why, sizeof(k->why), "no port file after %d s", START_TIMEOUT_MS / 1000);
      L->first_failure = k;
      local_begin_stop(L);
      break;
    }
    local_pump(L, 0);
    /* A shard that exits 0 before the workers even started is a failure too. */
    for (int i = 0; i < S && L->phase != PHASE_STOP; i++) {
      struct child *k = &L->kids[i];
      if (!k->proc.running && !k->proc.signalled && !k->failed) {
        k->failed = true;
        snprintf(k->why, sizeof(k->why), "exited with status 0 during start-up");
        if (!L->first_failure) L->first_failure = k;
        local_begin_stop(L);
      }
    }
    if (L->phase == PHASE_STOP) break; /* a shard failed, or a signal */
  }
  if (ready == S) {
    *servers = list;
    return 0;
  }
  free(list);
  return -1;
}

/* The banner of command mode: what the shards run, and the command. */
static void print_command_banner(const struct launcher *L) {
  const struct local_config *c = L->cfg;
  fprintf(stderr, "ps-local: %lld shard(s) + %lld worker(s) on %s, sync %s",
          L->plan->allreduce ? 0LL : (long long)c->shards, (long long)c->workers, L->host,
          L->plan->allreduce ? "allreduce" : "ps");
  if (L->plan->allreduce) {
    fprintf(stderr, ", the workers in a ring");
  } else if (strcmp(L->plan->optimizer, "sum") == 0) {
    fprintf(stderr, ", the shards sum (the command's optimizer steps), consistency %s",
            c->consistency);
  } else {
    fprintf(stderr, ", optimizer %s on the shards (lr %g constant", L->plan->optimizer, c->lr);
    if (strcmp(L->plan->optimizer, "momentum") == 0) fprintf(stderr, ", momentum %g", c->momentum);
    if (c->weight_decay > 0) fprintf(stderr, ", weight decay %g", c->weight_decay);
    fprintf(stderr, "), consistency %s", c->consistency);
  }
  fprintf(stderr, "; each worker runs:");
  size_t shown = 0;
  for (int i = 0; L->plan->cmd[i]; i++) {
    if (shown > 400) {
      fprintf(stderr, " ...");
      break;
    }
    fprintf(stderr, " %s", L->plan->cmd[i]);
    shown += strlen(L->plan->cmd[i]) + 1;
  }
  fputc('\n', stderr);
}

static void print_banner(const struct launcher *L) {
  const struct local_config *c = L->cfg;
  if (L->plan->cmd) {
    print_command_banner(L);
  } else {
    fprintf(stderr,
            "ps-local: %lld shard(s) + %lld worker(s) on %s, sync %s, model %s, %lld "
            "epoch(s), batch %lld/worker, lr %g (%s), optimizer %s (momentum %g), consistency %s, "
            "seed %lld\n",
            L->plan->allreduce ? 0LL : (long long)c->shards, (long long)c->workers, L->host,
            L->plan->allreduce ? "allreduce" : "ps", c->model, (long long)c->epochs,
            (long long)c->batch_size, c->lr, L->plan->schedule, L->plan->optimizer, c->momentum,
            c->consistency, (long long)c->seed);
    if (model_parallel(c) || c->micro_batches > 1)
      fprintf(stderr,
              "ps-local: 3D: tensor-parallel %lld x pipeline-stages %lld x data-parallel %lld, "
              "batch %lld per replica in %lld micro-batch(es), schedule %s\n",
              (long long)c->tensor_parallel, (long long)c->pipeline_stages,
              (long long)(c->workers / (c->tensor_parallel * c->pipeline_stages)),
              (long long)c->batch_size, (long long)c->micro_batches, c->pipeline_schedule);
  }
  if (c->max_steps > 0)
    fprintf(stderr, "ps-local: at most %lld steps per worker\n", (long long)c->max_steps);
  if (L->keep_dir) fprintf(stderr, "ps-local: logs in %s\n", L->dir);
  log_debug("binaries", "ps_server=%s ps_worker=%s dir=%s", L->plan->server_bin,
            L->plan->worker_bin, L->dir);
}

/* Finds key=value in a summary line; copies the value into out. */
static bool summary_field(const char *line, const char *key, char *out, size_t len) {
  size_t klen = strlen(key);
  for (const char *p = line; (p = strstr(p, key)) != NULL; p += klen) {
    if ((p != line && p[-1] != ' ') || p[klen] != '=') continue;
    const char *v = p + klen + 1;
    size_t n = strcspn(v, " \t");
    if (n == 0 || n >= len) return false;
    memcpy(out, v, n);
    out[n] = '\0';
    return true;
  }
  return false;
}

/* Reports how the run ended; returns the exit code. */
static int finish(struct launcher *L, uint64_t t0) {
  if (L->stop_signal) return 128 + L->stop_signal;
  if (L->first_failure) {
    struct child *k = L->first_failure;
    char how[160];
    if (k->why[0])
      snprintf(how, sizeof(how), "%s", k->why);
    else
      procs_describe(k->proc.status, how, sizeof(how));
    fprintf(stderr, "ps-local: %s failed: %s\n", k->proc.name, how);
    if (k->not_run) {
      /* its exec failed: it wrote nothing */
    } else if (k->log[0]) {
      procs_print_log_tail(&L->procs, k->log, L->keep_dir, LOG_TAIL_LINES);
    } else {
      fprintf(stderr, "ps-local: (its stderr is above)\n");
    }
    for (int i = 0; i < L->num_kids; i++) {
      struct child *o = &L->kids[i];
      if (o == k || !o->failed) continue;
      if (o->why[0])
        snprintf(how, sizeof(how), "%s", o->why);
      else
        procs_describe(o->proc.status, how, sizeof(how));
      fprintf(stderr, "ps-local: %s also failed: %s%s%s\n", o->proc.name, how,
              L->keep_dir && o->log[0] ? "; see " : "", L->keep_dir ? o->log : "");
    }
    /* Its own 129 is a lost peer, shard or worker: retryable, so ours too;
     * its 3 is a job whose state is lost: restart all of it, so ours too. */
    int code = !k->why[0] && WIFEXITED(k->proc.status) ? WEXITSTATUS(k->proc.status) : 1;
    return code == EXIT_RETRY || code == EXIT_JOB_LOST ? code : 1;
  }
  if (L->first_lost) { /* watch_finished named it */
    if (L->first_lost->log[0])
      procs_print_log_tail(&L->procs, L->first_lost->log, L->keep_dir, LOG_TAIL_LINES);
    return EXIT_RETRY;
  }
  if (L->plan->cmd) return 0;  /* its output was the user's to read */
  if (L->cfg->node_rank > 0) { /* rank 0, and so the summary, is node 0's */
    fprintf(stderr, "ps-local: node %lld done (the summary is node 0's)\n",
            (long long)L->cfg->node_rank);
    return 0;
  }
  if (!L->summary[0]) {
    fprintf(stderr, "ps-local: ps-worker rank 0 exited without printing its summary line\n");
    return 1;
  }
  char acc[64], epochs[64], sps[64];
  if (!summary_field(L->summary, "accuracy", acc, sizeof(acc)) ||
      !summary_field(L->summary, "epochs", epochs, sizeof(epochs)) ||
      !summary_field(L->summary, "samples_per_s", sps, sizeof(sps))) {
    fprintf(stderr,
            "ps-local: rank 0's summary line lacks accuracy=, epochs= or samples_per_s=: "
            "%s\n",
            L->summary);
    return 1;
  }
  /* workers_lost= (ranks the shards went on without) only if rank 0 says. */
  char lost[64];
  bool has_lost = summary_field(L->summary, "workers_lost", lost, sizeof(lost));
  double wall = (double)(clock_now_ms() - t0) / 1000.0;
  printf("summary accuracy=%s epochs=%s wall_s=%.2f samples_per_s=%s%s%s\n", acc, epochs, wall, sps,
         has_lost ? " workers_lost=" : "", has_lost ? lost : "");
  fflush(stdout);
  return 0;
}

static int run(struct launcher *L, uint64_t t0) {
  const struct local_config *cfg = L->cfg;
  int S = L->plan->allreduce ? 0 : (int)cfg->shards, W = (int)cfg->workers;
  char *servers = NULL;
  L->num_kids = S + W;
  L->kids = calloc((size_t)L->num_kids, sizeof(*L->kids));
  if (!L->kids) return 1;
  for (int i = 0; i < L->num_kids; i++) {
    struct child *k = &L->kids[i];
    k->kind = i < S ? CHILD_SHARD : CHILD_WORKER;
    k->index = i < S ? i : i - S;
    procs_child_init(&k->proc,
                     k->kind == CHILD_SHARD ? "ps-server shard"
                     : L->plan->cmd         ? "worker rank"
                                            : "ps-worker rank",
                     (k->kind == CHILD_SHARD ? L->shard0 : L->rank0) + k->index);
    if (k->kind == CHILD_SHARD)
      snprintf(k->log, sizeof(k->log), "%s/shard-%d.log", L->dir, k->index);
    else if (k->index > 0)
      snprintf(k->log, sizeof(k->log), "%s/worker-%d.log", L->dir, k->index);
  }

  /* Our ports first: a shard's port 0 cannot take them then. */
  if ((L->plan->allreduce || L->plan->cmd || model_parallel(L->cfg)) && bind_ring(L) < 0) return 1;
  if (L->plan->cmd && reserve_master_port(L) < 0) return 1;
  for (int i = 0; i < S && L->phase == PHASE_START; i++) {
    if (start_shard(L, &L->kids[i]) < 0) {
      if (!L->kids[i].why[0])
        snprintf(L->kids[i].why, sizeof(L->kids[i].why), "could not be started");
      if (!L->first_failure) L->first_failure = &L->kids[i];
      local_begin_stop(L);
    }
    handle_signals(L);
  }
  if (L->phase == PHASE_START && (L->plan->allreduce || wait_for_shards(L, &servers) == 0) &&
      nodes_exchange(L, &servers) == 0) {
    L->phase = PHASE_TRAIN;
    close_master(L); /* rank 0's torch.distributed store may bind it now */
    for (int r = 0; r < W && L->phase == PHASE_TRAIN; r++) {
      struct child *k = &L->kids[S + r];
      int started =
          L->plan->cmd ? start_command_worker(L, k, servers) : start_builtin_worker(L, k, servers);
      if (started < 0) {
        if (!k->why[0]) snprintf(k->why, sizeof(k->why), "could not be started");
        if (!L->first_failure) L->first_failure = k;
        local_begin_stop(L);
      }
      handle_signals(L);
    }
  }
  free(servers);
  close_master(L);
  for (int r = 0; L->ring_fd && r < W; r++) { /* the workers have theirs */
    if (L->ring_fd[r] >= 0) close(L->ring_fd[r]);
    L->ring_fd[r] = -1;
  }
  /* handle_signals above may have read the SIGCHLD of a child that exited
   * at once (a command that fails to start): the poll would not see it. */
  reap(L);

  while (local_running_count(L, false) > 0 || L->out_fd >= 0) {
    if (L->phase == PHASE_TRAIN && local_running_count(L, true) == 0) {
      L->phase = PHASE_DRAIN;
      L->deadline_ms = clock_now_ms() + (uint64_t)L->shard_grace_ms;
      log_debug("workers done", "shards_running=%d grace_ms=%d", local_running_count(L, false),
                L->shard_grace_ms);
    }
    if (local_running_count(L, false) == 0) {
      /* Everyone is gone; whoever still holds rank 0's stdout is not ours. */
      read_output(L);
      if (L->out_fd >= 0) {
        close(L->out_fd);
        L->out_fd = -1;
      }
      break;
    }
    /* Once a worker finished, the others are looked at every WATCH_MS. */
    bool watching = L->phase == PHASE_TRAIN && local_finished_worker(L);
    local_pump(L, watching ? WATCH_MS : -1);
    local_watch(L);
  }
  return nodes_finish(L, finish(L, t0));
}

int local_run(const struct local_plan *plan, uint64_t t0) {
  const struct local_config *cfg = plan->cfg;
  struct launcher *L = calloc(1, sizeof(*L));
  if (!L) {
    fprintf(stderr, "ps-local: out of memory\n");
    return 1;
  }
  L->plan = plan;
  L->cfg = cfg;
  L->shard_grace_ms = plan->cmd ? COMMAND_GRACE_MS : SHARD_GRACE_MS;
  L->left_behind_ms = plan->cmd ? COMMAND_LEFT_BEHIND_MS : LEFT_BEHIND_MS;
  L->master_fd = -1;
  L->out_fd = -1;
  L->shard_level = cfg->log_level[0] ? cfg->log_level : "warn";
  L->worker_level = cfg->log_level[0] ? cfg->log_level : "info";
  if (procs_init(&L->procs, "ps-local") < 0) {
    free(L);
    return 1;
  }
  signal(SIGPIPE, SIG_IGN);

  L->world = (int)(cfg->workers * cfg->nodes);
  L->rank0 = (int)(cfg->workers * cfg->node_rank);
  L->num_shards = plan->allreduce ? 0 : (int)(cfg->shards * cfg->nodes);
  L->shard0 = (int)(cfg->shards * cfg->node_rank);
  snprintf(L->host, sizeof(L->host), "127.0.0.1");
  int code = 1;
  if (make_dir(L) == 0 && make_token(L) == 0 && make_job_id(L) == 0 && nodes_start(L) == 0) {
    print_banner(L);
    code = run(L, t0);
  }
  close_master(L);
  nodes_end(L);
  remove_dir(L);
  free(L->kids);
  for (int i = 0; L->ring_fd && i < cfg->workers; i++)
    if (L->ring_fd[i] >= 0) close(L->ring_fd[i]);
  free(L->ring_fd);
  free(L->peers);
  procs_deinit(&L->procs);
  free(L);
  return code;
}
