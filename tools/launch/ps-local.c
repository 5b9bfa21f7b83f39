/* ps-local: one command trains on a laptop. It starts S ps-server shards and
 * W ps-worker processes on 127.0.0.1, waits for them, and ends with the test
 * accuracy on its last stdout line. With `-- CMD ARGS...` it runs the user's
 * command as each of the W workers instead (command mode, below), as
 * horovodrun and torchrun do. This file parses and plans; local_run.c
 * starts, supervises and reports (its opening comment has the lifecycle:
 * port files, output, phases, signals, the token).
 *
 * Start-up. Options come from the config table (flags, PS_* environment,
 * --config file). The binaries are found next to this one: in a meson build
 * tree as <build>/ps-server/ps-server and <build>/ps-worker/ps-worker, when
 * installed as ps-server and ps-worker in the same directory (--bin-dir
 * overrides).
 *
 * Environment of the children: OPENBLAS_NUM_THREADS=1 and OMP_NUM_THREADS=1
 * (docs/ARCHITECTURE.md, Pitfalls: one BLAS thread per process on a shared box). The PS_*
 * variables of our own options and PS_CONFIG are removed, since their values
 * reach the children as flags; other PS_* variables (e.g. PS_CONSISTENCY,
 * PS_MAX_FRAME_BYTES) pass through, which is how a user tunes the children.
 *
 * Command mode. Everything after the first "--" is the command, an argv
 * (no shell; a name without '/' is looked up in PATH); the options before it
 * are parsed as always. Worker r runs it with its settings in the
 * environment (local_run.c's worker_env): PS_SYNC_MODE, PS_RANK,
 * PS_WORLD_SIZE, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, PS_SERVERS
 * and PS_NUM_SHARDS (ps mode), PS_PEERS and PS_PEER_LISTEN_FD (both modes:
 * the ring's sockets are bound as in allreduce mode, and the Python package
 * broadcasts over it in ps mode too), PS_AUTH_TOKEN_FILE, PS_JOB_ID, the
 * thread counts, PYTHONPATH with <build>/python first when we run from a
 * build tree, and MASTER_ADDR / MASTER_PORT for scripts that also use
 * torch.distributed. Stale topology variables of the user's shell
 * (PS_SERVER_TEMPLATE, PS_PEER_TEMPLATE, ...) are removed, so they cannot
 * compete with ours. The shards run --optimizer sum unless --optimizer names
 * a shard-side one (the user's optimizer then steps on the workers, BytePS
 * style); with a shard-side optimizer --lr-schedule is constant, since the
 * run's length in steps is the script's (cosine is refused; PS_LR_DECAY_STEPS
 * still reaches the shards). A flag that would have no effect is refused
 * rather than ignored (command_scopes): the built-in trainer's (--epochs,
 * --model, ...), ps-worker's --blas-kernel, the shards' in allreduce mode,
 * the optimizer's under sum.
 * Rank 0's stdout and stderr are ours, whole (no summary line is looked
 * for); the other ranks log as ps-worker does. Supervision, Ctrl-C and exit
 * codes are the same, except that shards still running 2 s after the last
 * worker exited 0 are stopped without a warning, and a worker still running
 * 30 s (not 10) after the shards exited by themselves is killed (a script
 * may save or evaluate after ps.shutdown()). A command that cannot be
 * executed fails like a child that exited 127, with the exec error named.
 *
 * Lost workers. --worker-timeout and --on-worker-timeout go to the shards
 * as given (ps mode only; unset, the shards' defaults apply). Whatever the
 * shards do, the launcher never waits on a rank that can no longer finish
 * once another exited 0: one stopped (SIGSTOP) for 5 s, or one still
 * running after every shard exited by itself, is killed (local_run.c).
 *
 * Exit: 0 trained and summarised (command mode: every worker exited 0); 1 a
 * child failed (or could not be started), no summary, or a start-up error;
 * 2 bad usage; 129 a lost rank, retryable (docs/KUBERNETES.md, Exit codes): the first child
 * to fail exited 129 (a worker that lost a peer or a shard, a shard that
 * lost a worker), or a worker that could no longer finish was killed;
 * 128+N stopped by signal N. A failing worker's own status is in the
 * message, as torchrun does; ours only says permanent (1) or retryable
 * (129). */
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "clock.h"
#include "config.h"
#include "local_run.h"
#include "log.h"
#include "net.h"
#include "ucx_link.h"
#include "optimizer.h"
#include "ps.h"
#include "server.h"
#include "server_options.h"
#include "store.h"
#include "worker_options.h"

enum { PATH_BYTES = LOCAL_PATH_BYTES };

/* The enumerated options are checked by the parsers of the programs that
 * take them (their entries are forwarded with their checks: the shards'
 * store_consistency_check, libps's ps_sync_mode_parse, ...), with their
 * words, so a typo fails before any process starts and reads as it would
 * from ps-server or ps-worker.
 *
 * ps-worker runs no optimizer of its own in PS mode, so the shards' `sum`
 * (average only) would train nothing. A command runs its own, so in command
 * mode the table takes opt_check instead (main). */
static int check_optimizer(const char *v, char *err, size_t n) {
  enum opt_kind kind;
  if (opt_check(v, err, n) < 0) return -EINVAL;
  opt_parse(v, &kind);
  if (kind != OPT_SUM) return 0;
  snprintf(err, n, "sum leaves the optimizer to the workers, and ps-worker runs none");
  return -EINVAL;
}

/* --lr-schedule, ps-local's own: how --lr-decay-steps is set for the
 * children. */
enum schedule { SCHEDULE_COSINE = 0, SCHEDULE_CONSTANT = 1 };
static const char *const schedule_names[] = {
    [SCHEDULE_COSINE] = "cosine", [SCHEDULE_CONSTANT] = "constant"};
#define NUM_SCHEDULES (sizeof(schedule_names) / sizeof(schedule_names[0]))

static int check_schedule(const char *v, char *err, size_t n) {
  return config_choice(v, schedule_names, NUM_SCHEDULES, err, n) < 0 ? -EINVAL : 0;
}

/* --worker-timeout: a number of seconds as ps-server's own option takes it
 * (a double in [0, 1e7]); kept as text, so that only a value the user gave
 * is passed on and the shards' default applies otherwise. */
static int check_worker_timeout(const char *v, char *err, size_t n) {
  char *end = NULL;
  double x = v[0] && !isspace((unsigned char)v[0]) ? strtod(v, &end) : NAN;
  if (!end || *end || !isfinite(x)) {
    snprintf(err, n, "not a finite number of seconds");
    return -EINVAL;
  }
  const struct config_option *o = config_find(&server_spec, "worker-timeout");
  if (x < o->min || x > o->max) {
    snprintf(err, n, "out of range [%g, %g] (seconds)", o->min, o->max);
    return -EINVAL;
  }
  return 0;
}

static int check_nonempty(const char *v, char *err, size_t n) {
  if (v[0]) return 0;
  snprintf(err, n, "must not be empty");
  return -EINVAL;
}

/* The table: ps-local's own options, and the binaries' entries forwarded
 * (worker_options.c, server_options.c: the same names, types, bounds,
 * checks and help). An override says what differs for a launcher, where
 * it is made. */
#define CONFIG_STRUCT struct local_config
#define W (&worker_spec)
#define S (&server_spec)
static const struct config_forward local_forward[] = {
    CONFIG_OWN(CONFIG_OPT("shards", CONFIG_INT, shards, "2", 1, 256,
                          "number of ps-server shards to start")),
    CONFIG_OWN(CONFIG_OPT("workers", CONFIG_INT, workers, "2", 1, 256,
                          "number of workers to start (ps-worker processes, or the command after "
                          "--)")),
    CONFIG_FWD(W, "epochs", epochs),
    /* Refused before anything starts rather than by every worker. */
    CONFIG_FWD_SET(W, "model", model, CONFIG_SET_CHECK, .check = check_nonempty),
    /* Two workers on a laptop: twice ps-worker's batch each. */
    CONFIG_FWD_SET(W, "batch-size", batch_size, CONFIG_SET_DEF, .def = "256"),
    CONFIG_FWD_SET(S, "lr", lr, CONFIG_SET_DEF, .def = "0.2"),
    CONFIG_OWN(CONFIG_CHOICE("lr-schedule", lr_schedule, NULL, check_schedule,
                             "cosine (anneal the learning rate to 0 over the whole run) or "
                             "constant (default: cosine, constant with a command)")),
    /* Also picks the default --optimizer (local_optimizer). */
    CONFIG_FWD_SET(S, "momentum", momentum, CONFIG_SET_HELP,
                   .help = "momentum in [0, 1); 0 = plain SGD on the shards"),
    /* No default: it follows --momentum, or is sum with a command (main). */
    CONFIG_FWD_SET(S, "optimizer", optimizer, CONFIG_SET_DEF | CONFIG_SET_CHECK | CONFIG_SET_HELP,
                   .def = NULL, .check = check_optimizer,
                   .help = "sgd, momentum, adam or adamw, run on the shards (default: momentum if "
                           "--momentum > 0, else sgd); Adam wants a small --lr such as 0.001; "
                           "with a command also sum, its default (the shards average, the "
                           "command's optimizer steps)"),
    CONFIG_FWD(S, "weight-decay", weight_decay),
    CONFIG_FWD(S, "consistency", consistency),
    CONFIG_FWD(S, "staleness-method", staleness_method),
    CONFIG_FWD(W, "shard-optimizer-state", shard_optimizer_state),
    /* ps-local's range has been 32 bits; kept. */
    CONFIG_FWD_SET(W, "seed", seed, CONFIG_SET_RANGE, .min = 0, .max = 4294967295.0),
    CONFIG_FWD_SET(W, "data", data, CONFIG_SET_CHECK, .check = check_nonempty),
    CONFIG_FWD(W, "sync-mode", sync_mode),
    CONFIG_OWN(CONFIG_OPT("bin-dir", CONFIG_STRING, bin_dir, NULL, 0, 0,
                          "directory of ps-server and ps-worker (default: next to ps-local, or "
                          "its build tree)")),
    /* No default: each kind of child keeps its own unless one is given. */
    CONFIG_FWD_SET(W, "log-level", log_level, CONFIG_SET_DEF | CONFIG_SET_HELP, .def = NULL,
                   .help = "log level of the children and ps-local (default: warn for shards, "
                           "info for workers)"),
    /* ps-local's range; kept. */
    CONFIG_FWD_SET(W, "max-steps", max_steps, CONFIG_SET_RANGE, .min = 0, .max = 9.0e15),
    CONFIG_OWN(CONFIG_OPT("keep-logs", CONFIG_STRING, keep_logs, NULL, 0, 0,
                          "keep the children's logs in this directory (created if missing) "
                          "instead of a temp dir")),
    CONFIG_OWN(CONFIG_OPT("auth-token-file", CONFIG_STRING, auth_token_file, NULL, 0, 0,
                          "the job's token for every child (default: a fresh random one in the "
                          "private directory)")),
    CONFIG_OWN(CONFIG_OPT("no-auth", CONFIG_BOOL, no_auth, "false", 0, 0,
                          "run without authentication (the children warn that anyone can "
                          "connect)")),
    CONFIG_FWD(W, "transport", transport),
    /* Text, not ps-server's double: only a value given reaches the shards. */
    CONFIG_OWN(CONFIG_CHOICE("worker-timeout", worker_timeout, NULL, check_worker_timeout,
                             "ps mode: seconds a worker may stay away before the shards apply "
                             "--on-worker-timeout (ps-server --worker-timeout; 0 = wait for it "
                             "forever; default: the shards' own, 60)")),
    CONFIG_FWD_SET(S, "on-worker-timeout", on_worker_timeout, CONFIG_SET_DEF, .def = NULL),
    CONFIG_FWD(W, "blas-kernel", blas_kernel),
    CONFIG_FWD(W, "tensor-parallel", tensor_parallel),
    CONFIG_FWD(W, "pipeline-stages", pipeline_stages),
    CONFIG_FWD(W, "micro-batches", micro_batches),
    CONFIG_FWD(W, "pipeline-schedule", pipeline_schedule),
    CONFIG_FWD(W, "pipeline-chunks", pipeline_chunks),
    CONFIG_OWN(CONFIG_OPT("nodes", CONFIG_INT, nodes, "1", 1, 4096,
                          "hosts the job spans, one ps-local on each (across hosts, below)")),
    CONFIG_OWN(CONFIG_OPT("node-rank", CONFIG_INT, node_rank, "0", 0, 4095,
                          "this host's index in [0, --nodes); node 0 serves the rendezvous")),
    CONFIG_OWN(CONFIG_OPT("rendezvous", CONFIG_STRING, rendezvous, NULL, 0, 0,
                          "HOST:PORT of node 0's rendezvous (node 0 binds it, every node "
                          "connects to it); needed with --nodes > 1")),
    CONFIG_OWN(CONFIG_OPT("rendezvous-timeout", CONFIG_DOUBLE, rendezvous_timeout, "60", 1, 86400,
                          "seconds to wait for every node to register")),
    CONFIG_OWN(CONFIG_OPT("workers-per-node", CONFIG_INT, workers_per_node, "0", 0, 256,
                          "workers on this host (with --nodes; replaces --workers)")),
    CONFIG_OWN(CONFIG_OPT("shards-per-node", CONFIG_INT, shards_per_node, "0", 0, 256,
                          "shards on this host (with --nodes, ps mode; replaces --shards)")),
};
#undef W
#undef S
#define NUM_LOCAL_OPTIONS (sizeof(local_forward) / sizeof(local_forward[0]))
static struct config_option local_options[NUM_LOCAL_OPTIONS];

static const struct config_spec local_spec = {
    "ps-local",
    "trains on 127.0.0.1: starts --shards ps-server and --workers ps-worker processes, waits for "
    "them and prints the test accuracy; with -- CMD ARGS..., runs CMD as every worker (below)",
    local_options, NUM_LOCAL_OPTIONS, NULL};

/* Command mode: what an option means to a command, and so which flags are
 * refused there (check_command_flags); an option not listed applies as
 * always (--shards, --workers, --sync-mode, --log-level, ...). */
enum scope {
  SCOPE_TRAINER,   /* the built-in trainer's: a command takes its arguments after -- */
  SCOPE_SHARDS,    /* the shards': none in allreduce mode */
  SCOPE_OPTIMIZER, /* the shards' optimizer's: none in allreduce mode or under sum */
  SCOPE_WORKER,    /* ps-worker's own, which a command does not run */
};
static const struct {
  const char *name;
  enum scope scope;
} command_scopes[] = {
    {"epochs", SCOPE_TRAINER},
    {"model", SCOPE_TRAINER},
    {"batch-size", SCOPE_TRAINER},
    {"seed", SCOPE_TRAINER},
    {"data", SCOPE_TRAINER},
    {"max-steps", SCOPE_TRAINER},
    {"optimizer", SCOPE_SHARDS},
    {"consistency", SCOPE_SHARDS},
    {"staleness-method", SCOPE_SHARDS},
    {"shard-optimizer-state", SCOPE_WORKER},
    {"lr", SCOPE_OPTIMIZER},
    {"momentum", SCOPE_OPTIMIZER},
    {"weight-decay", SCOPE_OPTIMIZER},
    {"lr-schedule", SCOPE_OPTIMIZER},
    {"blas-kernel", SCOPE_WORKER},
    {"tensor-parallel", SCOPE_TRAINER},
    {"pipeline-stages", SCOPE_TRAINER},
    {"micro-batches", SCOPE_TRAINER},
    {"pipeline-schedule", SCOPE_TRAINER},
    {"pipeline-chunks", SCOPE_TRAINER},
};

/* Lines --help adds to the option table's. */
static const char command_help[] =
    "\nCommand mode: ps-local [options] -- COMMAND [ARGS...]\n"
    "  runs COMMAND (an argv, no shell; without a '/' it is looked up in PATH) as each of the\n"
    "  --workers workers, after starting the shards (ps mode), as horovodrun and torchrun do.\n"
    "  Worker r of W gets in its environment:\n"
    "    PS_SYNC_MODE=ps|allreduce  PS_RANK=r  PS_WORLD_SIZE=W  RANK=r  WORLD_SIZE=W\n"
    "    LOCAL_RANK=r  LOCAL_WORLD_SIZE=W\n"
    "    PS_SERVERS=127.0.0.1:P,...  PS_NUM_SHARDS=S        (ps mode: the shards, shard 0 first)\n"
    "    PS_TRANSPORT=tcp|ucx                                (ps mode: --transport)\n"
    "    PS_PEERS=127.0.0.1:P,...  PS_PEER_LISTEN_FD=N      (both modes: the workers' ring, rank "
    "0\n"
    "                            first; N is an inherited socket already listening on rank r's)\n"
    "    PS_AUTH_TOKEN_FILE=PATH (unless --no-auth)  PS_JOB_ID (ours if set, else ps-local-PID)\n"
    "    PS_LOG_LEVEL (with --log-level)  OPENBLAS_NUM_THREADS=1  OMP_NUM_THREADS=1\n"
    "    PYTHONPATH=<build>/python:...              (when ps-local runs from a build tree)\n"
    "    MASTER_ADDR=127.0.0.1  MASTER_PORT=<a free port>   (for torch.distributed, if used too)\n"
    "  The shards run --optimizer sum by default: they average and the command's optimizer\n"
    "  steps (BytePS style); --optimizer sgd|momentum|adam|adamw runs it on the shards with\n"
    "  --lr, --momentum, --weight-decay and a constant --lr-schedule (cosine needs the run's\n"
    "  length in steps, which is the command's: it is refused; PS_LR_DECAY_STEPS=N reaches the\n"
    "  shards). Flags that would do nothing are refused: --epochs, --model, --batch-size,\n"
    "  --seed, --data and --max-steps (the built-in trainer's; give the command its own\n"
    "  arguments), --blas-kernel (ps-worker's; OPENBLAS_CORETYPE=NAME reaches the command), the\n"
    "  optimizer's under sum, and the shards' with --sync-mode allreduce.\n"
    "  Rank 0's stdout and stderr are ps-local's; rank r > 0 writes to <dir>/worker-<r>.log,\n"
    "  whose tail is shown if it fails. When a worker fails (or its command cannot be run)\n"
    "  every other child is stopped. Shards still running 2 s after the last worker exited 0\n"
    "  are stopped (a command need not have called ps.shutdown()).\n"
    "\nLost workers (with or without a command): once a worker exited 0, ps-local waits on no\n"
    "  worker that can no longer finish: one stopped (SIGSTOP, state T) for 5 s, or (ps mode)\n"
    "  one still running 10 s after every shard exited by itself (rank 0 ended the training;\n"
    "  30 s with a command, which may save or evaluate after ps.shutdown()) is named and\n"
    "  killed, and the job stopped (exit 129). --worker-timeout and --on-worker-timeout reach\n"
    "  the shards only when given.\n"
    "\nAcross hosts: ps-local --nodes N --node-rank I --rendezvous HOST:PORT\n"
    "  --workers-per-node K [--shards-per-node S] --auth-token-file F [-- CMD ...], on every host\n"
    "  (torchrun's model). Node 0 serves the rendezvous at HOST:PORT; each node starts its own\n"
    "  shards and workers on the address it reaches HOST from. Ranks are node-major (node I has\n"
    "  ranks I*K .. I*K+K-1); the shards and the ring are the table every node gets once all N\n"
    "  registered (--rendezvous-timeout, naming the nodes that never came). A failing child on\n"
    "  any node stops every node with \"node I (host) failed: what\"; a vanished node is noticed\n"
    "  within 5 s (heartbeats). The summary is node 0's. The token proves each node to the\n"
    "  rendezvous and the table to each node.\n"
    "\nExit: 0 trained (a command: every worker exited 0); 1 a child failed (its status is in\n"
    "  the message), no summary, or a start-up error; 2 bad usage; 129 a lost rank, worth a\n"
    "  retry: the first child to fail exited 129 (a worker that lost a peer or a shard, a shard\n"
    "  that lost a worker) or a worker that could no longer finish was killed; 128+N stopped\n"
    "  by signal N (Ctrl-C: 130).\n";

static bool is_executable_file(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 && S_ISREG(st.st_mode) && access(path, X_OK) == 0;
}

static int join_path(char *buf, size_t len, const char *dir, const char *rel) {
  int n = snprintf(buf, len, "%s/%s", dir, rel);
  return n < 0 || (size_t)n >= len ? -ENAMETOOLONG : 0;
}

/* Finds ps-server and ps-worker. In base (--bin-dir, or the directory of
 * /proc/self/exe) either both sit side by side (installed), or base is a
 * build tree's tools/ and they are in ../ps-server/ and ../ps-worker/; a
 * --bin-dir may also name the build root itself. The layout found also
 * says whether we run from a build tree (build_root, for a command's
 * PYTHONPATH). A command needs no ps-worker, nor ps-server in allreduce
 * mode: only what runs must exist. */
static int resolve_bins(struct local_plan *L) {
  char base[PATH_BYTES], tree[PATH_BYTES], path[PATH_BYTES];
  const char *from = "--bin-dir";
  if (L->cfg->bin_dir[0]) {
    snprintf(base, sizeof(base), "%s", L->cfg->bin_dir);
  } else {
    ssize_t n = readlink("/proc/self/exe", base, sizeof(base) - 1);
    if (n <= 0) {
      fprintf(stderr, "ps-local: cannot read /proc/self/exe: %s; set --bin-dir\n", strerror(errno));
      return -1;
    }
    base[n] = '\0';
    char *slash = strrchr(base, '/');
    if (slash) *slash = '\0';
    from = "the directory of ps-local";
  }
  /* Layouts to try, most specific first. */
  const char *layouts[][2] = {
      {"ps-server", "ps-worker"},                           /* installed, or --bin-dir */
      {"../ps-server/ps-server", "../ps-worker/ps-worker"}, /* tools/ of a build tree */
      {"ps-server/ps-server", "ps-worker/ps-worker"},       /* --bin-dir = build root */
  };
  size_t first = 0;
  if (!L->cfg->bin_dir[0] && join_path(tree, sizeof(tree), base, layouts[1][0]) == 0 &&
      is_executable_file(tree))
    first = 1; /* a build tree: prefer it even if stale copies sit beside ps-local */
  size_t pick = first;
  for (size_t i = 0; i < 3; i++) {
    size_t l = (first + i) % 3;
    if (join_path(path, sizeof(path), base, layouts[l][0]) == 0 && is_executable_file(path)) {
      pick = l;
      break;
    }
  }
  if (pick > 0 && join_path(tree, sizeof(tree), base, pick == 1 ? ".." : ".") == 0 &&
      !realpath(tree, L->build_root))
    snprintf(L->build_root, sizeof(L->build_root), "%s", tree);
  const char *names[2] = {"ps-server", "ps-worker"};
  char *outs[2] = {L->server_bin, L->worker_bin};
  bool need[2] = {!L->cmd || !L->allreduce, !L->cmd};
  for (int b = 0; b < 2; b++) {
    if (!need[b]) continue;
    if (join_path(path, sizeof(path), base, layouts[pick][b]) < 0) {
      fprintf(stderr, "ps-local: path of %s is too long\n", names[b]);
      return -1;
    }
    if (!is_executable_file(path)) {
      fprintf(stderr, "ps-local: %s not found: %s is not an executable file (looked in %s%s)\n",
              names[b], path, from, L->cfg->bin_dir[0] ? "" : "; set --bin-dir");
      return -1;
    }
    if (!realpath(path, outs[b])) snprintf(outs[b], PATH_BYTES, "%s", path);
  }
  return 0;
}
/* --optimizer, or its default from --momentum. */
static const char *local_optimizer(const struct local_config *cfg) {
  if (cfg->optimizer[0]) return cfg->optimizer;
  return cfg->momentum > 0 ? "momentum" : "sgd";
}
/* Removes the PS_* variables of our own options (and PS_CONFIG) from the
 * environment the children inherit: their values reach them as flags. */
static void scrub_env(void) {
  unsetenv("PS_CONFIG");
  for (size_t i = 0; i < local_spec.num_options; i++) {
    char name[96] = "PS_";
    size_t n = 3;
    for (const char *p = local_spec.options[i].name; *p && n + 1 < sizeof(name); p++)
      name[n++] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
    name[n] = '\0';
    unsetenv(name);
  }
  setenv("OPENBLAS_NUM_THREADS", "1", 1);
  setenv("OMP_NUM_THREADS", "1", 1);
}
/* Training samples in the data set, from the header of its label file (raw or
 * gzip): the cosine schedule must know how many steps the run has. */
static int count_train_samples(const char *dir, uint32_t *n) {
  char path[PATH_BYTES + 64];
  const char *suffix[] = {"", ".gz"};
  for (int i = 0; i < 2; i++) {
    snprintf(path, sizeof(path), "%s/train-labels-idx1-ubyte%s", dir, suffix[i]);
    if (access(path, R_OK) != 0) continue;
    gzFile f = gzopen(path, "rb");
    unsigned char h[8];
    int got = f ? gzread(f, h, sizeof(h)) : -1;
    if (f) gzclose(f);
    if (got != (int)sizeof(h) || h[0] || h[1] || h[2] != 8 || h[3] != 1) {
      fprintf(stderr, "ps-local: %s is not an IDX label file\n", path);
      return -EINVAL;
    }
    *n = (uint32_t)h[4] << 24 | (uint32_t)h[5] << 16 | (uint32_t)h[6] << 8 | h[7];
    return 0;
  }
  fprintf(stderr,
          "ps-local: option --data: no train-labels-idx1-ubyte[.gz] in %s "
          "(apt-get install dataset-fashion-mnist)\n",
          dir);
  return -ENOENT;
}

/* Whether argv[1..argc) holds --name as a flag ("--name" or "--name=v"):
 * a value never starts with "--" (config.c takes that as a missing value). */
static bool flag_given(int argc, char **argv, const char *name) {
  size_t n = strlen(name);
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strncmp(a, "--", 2) == 0 && strncmp(a + 2, name, n) == 0 &&
        (a[2 + n] == '\0' || a[2 + n] == '='))
      return true;
  }
  return false;
}

/* The shards' handling of a lost worker is theirs alone, with or without a
 * command: --sync-mode allreduce starts none (and a lost ring peer fails
 * the job by itself). Returns 0, or -EINVAL after saying why. */
static int check_ps_only_flags(int argc, char **argv, bool allreduce) {
  static const char *const names[] = {"worker-timeout", "on-worker-timeout"};
  for (size_t i = 0; allreduce && i < sizeof(names) / sizeof(names[0]); i++) {
    if (!flag_given(argc, argv, names[i])) continue;
    fprintf(stderr,
            "ps-local: option --%s: is the shards', and --sync-mode allreduce starts none: a "
            "lost ring peer fails the job by itself (flag)\n",
            names[i]);
    return -EINVAL;
  }
  return 0;
}

/* Command mode: refuses the flags that would do nothing (command_scopes)
 * and the settings the shards cannot run. Returns 0, or -EINVAL after
 * saying why. */
static int check_command_options(const struct local_config *cfg, int argc, char **argv,
                                 bool allreduce, bool sum, enum schedule sched) {
  for (size_t i = 0; i < sizeof(command_scopes) / sizeof(command_scopes[0]); i++) {
    const char *name = command_scopes[i].name, *why = NULL;
    enum scope scope = command_scopes[i].scope;
    if (!flag_given(argc, argv, name)) continue;
    if (scope == SCOPE_TRAINER)
      why = "belongs to the built-in trainer; a command takes its own arguments after --";
    else if (scope == SCOPE_WORKER && strcmp(name, "blas-kernel") == 0)
      why =
          "is ps-worker's, and a command runs instead of it: the command's BLAS picks its own "
          "kernel (OPENBLAS_CORETYPE=NAME in the environment reaches it)";
    else if (scope == SCOPE_WORKER)
      why =
          "is ps-worker's, and a command runs instead of it: pass shard_optimizer_state=True to "
          "ps.torch.DistributedOptimizer";
    else if (allreduce)
      why =
          "is the shards', and --sync-mode allreduce starts none: the command's optimizer "
          "steps on the workers";
    else if (scope == SCOPE_OPTIMIZER && sum)
      why =
          "is the shards' optimizer's, and under --optimizer sum (the default with a command) "
          "they only average: set it in the command's optimizer, or give --optimizer sgd, "
          "momentum, adam or adamw to run one on the shards";
    if (!why) continue;
    fprintf(stderr, "ps-local: option --%s: %s (flag)\n", name, why);
    return -EINVAL;
  }
  if (allreduce) return 0;
  enum store_consistency mode;
  uint32_t staleness;
  store_consistency_parse(cfg->consistency, &mode, &staleness);
  if (sum && mode != STORE_BSP) {
    fprintf(stderr,
            "ps-local: option --consistency: \"%s\": the shards' --optimizer sum (the default "
            "with a command) needs bsp (the workers apply each step's mean gradient in step "
            "order); give --optimizer sgd, momentum, adam or adamw for asp or ssp\n",
            cfg->consistency);
    return -EINVAL;
  }
  if (!sum && sched == SCHEDULE_COSINE) {
    fprintf(stderr,
            "ps-local: option --lr-schedule: cosine needs the run's length in steps, which is "
            "the command's: use constant (the default with a command), or set "
            "PS_LR_DECAY_STEPS=N for the shards\n");
    return -EINVAL;
  }
  return 0;
}

/* Across hosts: --nodes N with its companions, or none of them. The per-node
 * counts replace --workers and --shards. Returns 0, or -EINVAL after saying
 * why. */
static int check_nodes(struct local_config *cfg, int argc, char **argv) {
  const char *bad = NULL, *why = NULL;
  char buf[160];
  if (cfg->nodes == 1) {
    static const char *const only[] = {"node-rank", "rendezvous", "workers-per-node",
                                       "shards-per-node", "rendezvous-timeout"};
    for (size_t i = 0; i < sizeof(only) / sizeof(only[0]) && !bad; i++)
      if (flag_given(argc, argv, only[i])) bad = only[i], why = "needs --nodes > 1";
  } else if (cfg->node_rank >= cfg->nodes) {
    snprintf(buf, sizeof(buf), "%lld is not in [0, --nodes %lld)", (long long)cfg->node_rank,
             (long long)cfg->nodes);
    bad = "node-rank", why = buf;
  } else if (!cfg->rendezvous[0]) {
    bad = "rendezvous", why = "is needed with --nodes > 1: node 0's HOST:PORT";
  } else if (!cfg->workers_per_node) {
    bad = "workers-per-node", why = "is needed with --nodes > 1";
  } else if (flag_given(argc, argv, "workers") || flag_given(argc, argv, "shards")) {
    bad = flag_given(argc, argv, "workers") ? "workers" : "shards";
    why = "is for one node: give --workers-per-node / --shards-per-node with --nodes";
  } else if (!cfg->no_auth && !cfg->auth_token_file[0]) {
    bad = "auth-token-file",
    why = "is needed with --nodes > 1 (every node must hold the same token; or --no-auth)";
  }
  if (bad) {
    fprintf(stderr, "ps-local: option --%s: %s\n", bad, why);
    return -EINVAL;
  }
  if (cfg->nodes > 1) {
    struct net_addr a;
    char err[256];
    if (net_parse_addr(cfg->rendezvous, &a, 0, err, sizeof(err)) < 0) {
      fprintf(stderr, "ps-local: option --rendezvous: %s\n", err);
      return -EINVAL;
    }
    cfg->workers = cfg->workers_per_node;
    if (cfg->shards_per_node) cfg->shards = cfg->shards_per_node;
  }
  return 0;
}

int main(int argc, char **argv) {
  uint64_t t0 = clock_now_ms();
  /* The first "--" ends our options; what follows is the command. */
  int opt_argc = argc;
  for (int i = 1; i < argc && opt_argc == argc; i++)
    if (strcmp(argv[i], "--") == 0) opt_argc = i;
  bool command = opt_argc < argc;
  if (config_forward(local_forward, NUM_LOCAL_OPTIONS, local_options, stderr) < 0) return 2;
  struct config_option options[NUM_LOCAL_OPTIONS];
  memcpy(options, local_options, sizeof(options));
  for (size_t i = 0; command && i < NUM_LOCAL_OPTIONS; i++)
    if (strcmp(options[i].name, "optimizer") == 0) options[i].check = opt_check; /* sum too */
  struct config_spec spec = local_spec;
  spec.options = options;
  spec.help_tail = command_help; /* --help only: --help=json stays one JSON document */

  struct local_config cfg;
  memset(&cfg, 0, sizeof(cfg));
  int r = config_parse(&spec, &cfg, opt_argc, argv, NULL, stderr);
  if (r == CONFIG_HELP || r == CONFIG_VERSION) return 0;
  if (r < 0) return 2;
  if (command && (opt_argc + 1 == argc || !argv[opt_argc + 1][0])) {
    fprintf(stderr,
            "ps-local: %s after --: give the command every worker runs, e.g. -- "
            "/usr/bin/python3 train.py ARGS\n",
            opt_argc + 1 == argc ? "nothing" : "an empty command name");
    return 2;
  }
  if (cfg.momentum >= 1) {
    fprintf(stderr, "ps-local: option --momentum: %g is out of range [0, 1)\n", cfg.momentum);
    return 2;
  }
  /* The enumerated values passed their checks in the table. */
  ps_sync_mode mode;
  enum opt_kind kind = command ? OPT_SUM : OPT_SGD; /* built-in: or momentum, from --momentum */
  ps_sync_mode_parse(cfg.sync_mode, &mode, NULL, 0);
  if (cfg.optimizer[0]) opt_parse(cfg.optimizer, &kind);
  bool allreduce = mode == PS_SYNC_ALLREDUCE;
  if (check_ps_only_flags(opt_argc, argv, allreduce) < 0) return 2;
  if (!command && allreduce &&
      ((kind != OPT_SGD && kind != OPT_MOMENTUM) || cfg.weight_decay > 0)) {
    fprintf(stderr,
            "ps-local: option --sync-mode allreduce: the workers run SGD (with momentum); "
            "--optimizer adam/adamw and --weight-decay need --sync-mode ps\n");
    return 2;
  }
  if (!command && !allreduce && cfg.shard_optimizer_state) {
    fprintf(stderr,
            "ps-local: option --shard-optimizer-state: --sync-mode allreduce only (in ps mode "
            "the shards hold the optimizer state)\n");
    return 2;
  }
  if (!command && cfg.workers % (cfg.tensor_parallel * cfg.pipeline_stages) != 0) {
    fprintf(stderr,
            "ps-local: options --tensor-parallel %lld and --pipeline-stages %lld: --workers %lld "
            "is not a multiple of %lld ranks per pipeline replica\n",
            (long long)cfg.tensor_parallel, (long long)cfg.pipeline_stages, (long long)cfg.workers,
            (long long)(cfg.tensor_parallel * cfg.pipeline_stages));
    return 2;
  }
  enum schedule sched = command ? SCHEDULE_CONSTANT : SCHEDULE_COSINE;
  if (cfg.lr_schedule[0])
    sched = (enum schedule)config_choice(cfg.lr_schedule, schedule_names, NUM_SCHEDULES, NULL, 0);
  if (command && check_command_options(&cfg, opt_argc, argv, allreduce, kind == OPT_SUM, sched) < 0)
    return 2;
  if (check_nodes(&cfg, opt_argc, argv) < 0) return 2;
  enum log_level level = LOG_INFO;
  if (cfg.log_level[0]) log_level_parse(cfg.log_level, &level);
  log_setup("ps-local", level);

  struct local_plan plan;
  memset(&plan, 0, sizeof(plan));
  plan.cfg = &cfg;
  plan.allreduce = allreduce;
  plan.cmd = command ? (const char *const *)argv + opt_argc + 1 : NULL;
  plan.optimizer = command && !cfg.optimizer[0] ? "sum" : local_optimizer(&cfg);
  plan.schedule = schedule_names[sched];
  if (!command && sched == SCHEDULE_COSINE) { /* a command's length is its own */
    uint32_t n;
    if (count_train_samples(cfg.data, &n) < 0) return 1;
    /* the global batch: --batch-size per data-parallel replica, and a
     * replica is --tensor-parallel x --pipeline-stages workers */
    uint64_t replicas =
        (uint64_t)(cfg.workers * cfg.nodes / (cfg.tensor_parallel * cfg.pipeline_stages));
    uint64_t per_epoch = n / ((uint64_t)cfg.batch_size * replicas);
    plan.decay_steps = per_epoch * (uint64_t)cfg.epochs;
    if (cfg.max_steps > 0 && (uint64_t)cfg.max_steps < plan.decay_steps)
      plan.decay_steps = (uint64_t)cfg.max_steps;
  }
  const char *job = getenv("PS_JOB_ID");
  if (job && job[0])
    snprintf(plan.job_id, sizeof(plan.job_id), "%s", job);
  else
    snprintf(plan.job_id, sizeof(plan.job_id), "ps-local-%d", (int)getpid());
  if (resolve_bins(&plan) < 0) return 1;
  scrub_env();
  return local_run(&plan, t0);
}
