/* ps-local: one command trains on a laptop. It starts S ps-server shards and
 * W ps-worker processes on 127.0.0.1, waits for them, and ends with the test
 * accuracy on its last stdout line. With `-- CMD ARGS...` it runs the user's
 * command as each of the W workers instead (command mode, below), as
 * horovodrun and torchrun do.
 *
 * Start-up. Options come from the config table (flags, PS_* environment,
 * --config file). The binaries are found next to this one: in a meson build
 * tree as <build>/ps-server/ps-server and <build>/ps-worker/ps-worker, when
 * installed as ps-server and ps-worker in the same directory (--bin-dir
 * overrides). Shards listen on port 0 and write their bound address to a
 * port file in a private directory (mkdtemp, or --keep-logs DIR); once every
 * shard has written one, the workers start with the list of addresses.
 *
 * Output. Rank 0's stderr is ours, so its progress bar reaches the terminal;
 * its stdout comes through a pipe: the line starting with "summary " is kept
 * and every other line echoed. Every other child writes stdout and stderr to
 * <dir>/shard-<i>.log or <dir>/worker-<r>.log, and the tail of that log is
 * printed if the child fails. The last stdout line is our own summary, with
 * rank 0's figures (samples_per_s: training throughput, the per-epoch
 * evaluation left out, as tools/ps-torch-ref times it) and the launcher's
 * wall time (start-up and evaluation included).
 *
 * Lifecycle. One thread; SIGINT, SIGTERM, SIGHUP and SIGCHLD are blocked and
 * read from a signalfd in the same poll as rank 0's stdout, so no signal is
 * lost between a check and a wait, and signals are handled before child
 * exits in each round (a Ctrl-C that also hit the children is a Ctrl-C, not
 * their failure). Phases:
 *   START -> TRAIN    every port file exists (15 s at most)
 *   TRAIN -> DRAIN    every worker exited 0; rank 0 told the shards to stop,
 *                     so they should exit by themselves: after 10 s they get
 *                     SIGTERM, 5 s later SIGKILL (a warning, not a failure)
 *   any   -> STOP     a child failed (exit != 0 or a signal we did not send)
 *                     or we got a signal: SIGTERM to every child, SIGKILL
 *                     3 s later; a second signal sends SIGKILL at once.
 * Children stay in our process group (Ctrl-C and Ctrl-Z reach them) and set
 * PR_SET_PDEATHSIG=SIGKILL, so even a SIGKILL of ps-local leaves no orphan.
 * Starting, reaping and signalling them, the signalfd, the port files and
 * the temp dir are procs.c's, shared with ps-bench; the phases are ours.
 *
 * Authentication. Unless --no-auth, every child gets --auth-token-file:
 * the user's (--auth-token-file) or a fresh 32-byte token written with mode
 * 0600 into the private directory and removed at the end, so even a
 * laptop run does not accept gradients from other users of the machine.
 *
 * Environment of the children: OPENBLAS_NUM_THREADS=1 and OMP_NUM_THREADS=1
 * (DESIGN.md §9: one BLAS thread per process on a shared box). The PS_*
 * variables of our own options and PS_CONFIG are removed, since their values
 * reach the children as flags; other PS_* variables (e.g. PS_CONSISTENCY,
 * PS_MAX_FRAME_BYTES) pass through, which is how a user tunes the children.
 *
 * Command mode. Everything after the first "--" is the command, an argv
 * (no shell; a name without '/' is looked up in PATH); the options before it
 * are parsed as always. Worker r runs it with its settings in the
 * environment (worker_env): PS_SYNC_MODE, PS_RANK, PS_WORLD_SIZE, RANK,
 * WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, PS_SERVERS and PS_NUM_SHARDS (ps
 * mode), PS_PEERS and PS_PEER_LISTEN_FD (both modes: the ring's sockets are
 * bound as in allreduce mode, and the Python package broadcasts over it in
 * ps mode too), PS_AUTH_TOKEN_FILE, PS_JOB_ID, the thread counts, PYTHONPATH
 * with <build>/python first when we run from a build tree, and MASTER_ADDR /
 * MASTER_PORT (a port held by us until the workers start) for scripts that
 * also use torch.distributed. Stale topology variables of the user's shell
 * (PS_SERVER_TEMPLATE, PS_PEER_TEMPLATE, ...) are removed, so they cannot
 * compete with ours. The shards run --optimizer sum unless --optimizer names
 * a shard-side one (the user's optimizer then steps on the workers, BytePS
 * style); with a shard-side optimizer --lr-schedule is constant, since the
 * run's length in steps is the script's (cosine is refused; PS_LR_DECAY_STEPS
 * still reaches the shards). A flag that would have no effect is refused
 * rather than ignored (command_scopes): the built-in trainer's (--epochs,
 * --model, ...), the shards' in allreduce mode, the optimizer's under sum.
 * Rank 0's stdout and stderr are ours, whole (no summary line is looked
 * for); the other ranks log as ps-worker does. Supervision, Ctrl-C and exit
 * codes are the same, except that shards still running 2 s after the last
 * worker exited 0 get SIGTERM, then SIGKILL, without a warning: a script
 * need not have called ps.shutdown(). A command that cannot be executed
 * fails like a child that exited 127, with the exec error named.
 *
 * Exit: 0 trained and summarised (command mode: every worker exited 0); 1 a
 * child failed (or could not be started), no summary, or a start-up error;
 * 2 bad usage; 128+N stopped by signal N. A failing worker's own status is
 * in the message, not in ours, as torchrun does. */
#include <ctype.h>
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
#include <unistd.h>
#include <zlib.h>

#include "clock.h"
#include "config.h"
#include "container_of.h"
#include "log.h"
#include "net.h"
#include "optimizer.h"
#include "procs.h"
#include "ps.h"
#include "store.h"

enum {
  PATH_BYTES = 4096,
  DIR_BYTES = 1024,         /* our directory; room is left for the file names below it */
  START_TIMEOUT_MS = 15000, /* every shard must write its port file by then */
  SHARD_GRACE_MS = 10000,   /* shards exit by themselves after the workers */
  COMMAND_GRACE_MS = 2000,  /* the same after a command, which may not have stopped them */
  SHARD_TERM_MS = 5000,     /* then SIGTERM, then SIGKILL after this */
  STOP_KILL_MS = 3000,      /* after a failure or signal: SIGTERM, then SIGKILL */
  LOG_TAIL_LINES = 20,
  MAX_PROCS = 1024,
};

struct local_config {
  int64_t shards;
  int64_t workers;
  int64_t epochs;
  char model[256];
  int64_t batch_size;
  double lr;
  double momentum;
  int64_t seed;
  char data[PATH_BYTES];
  char sync_mode[16];
  char bin_dir[PATH_BYTES];
  char log_level[16];
  int64_t max_steps;
  char keep_logs[PATH_BYTES];
  char lr_schedule[16];
  char consistency[32];
  char optimizer[16];
  double weight_decay;
  char auth_token_file[PATH_BYTES];
  bool no_auth;
};

/* The enumerated options are checked by the parsers of the programs that
 * take them (the shards' store_consistency_check and opt_check, libps's
 * ps_sync_mode_parse), with their words, so a typo fails before any process
 * starts and reads as it would from ps-server or ps-worker. */
static int check_sync_mode(const char *v, char *err, size_t n) {
  ps_sync_mode mode;
  return ps_sync_mode_parse(v, &mode, err, n) == PS_OK ? 0 : -EINVAL;
}

/* ps-worker runs no optimizer of its own in PS mode, so the shards' `sum`
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

static int check_nonempty(const char *v, char *err, size_t n) {
  if (v[0]) return 0;
  snprintf(err, n, "must not be empty");
  return -EINVAL;
}

#define OPT(...) CONFIG_OPTION(struct local_config, __VA_ARGS__)

static const struct config_option local_options[] = {
    OPT("shards", CONFIG_INT, shards, "2", 1, 256, NULL, "number of ps-server shards to start"),
    OPT("workers", CONFIG_INT, workers, "2", 1, 256, NULL,
        "number of ps-worker processes to start"),
    OPT("epochs", CONFIG_INT, epochs, "3", 1, 100000, NULL, "passes over the training set"),
    OPT("model", CONFIG_STRING, model, "mlp:784-256-10", 0, 0, check_nonempty,
        "model to train (mlp:IN-HIDDEN...-OUT)"),
    OPT("batch-size", CONFIG_INT, batch_size, "256", 1, 65536, NULL,
        "examples per step on each worker"),
    OPT("lr", CONFIG_DOUBLE, lr, "0.2", 0, 1e6, NULL, "learning rate (applied on the shards)"),
    OPT("lr-schedule", CONFIG_STRING, lr_schedule, NULL, 0, 0, check_schedule,
        "cosine (anneal the learning rate to 0 over the whole run) or constant (default: cosine, "
        "constant with a command)"),
    OPT("momentum", CONFIG_DOUBLE, momentum, "0.9", 0, 1, NULL,
        "momentum in [0, 1); 0 = plain SGD on the shards"),
    OPT("optimizer", CONFIG_STRING, optimizer, NULL, 0, 0, check_optimizer,
        "sgd, momentum, adam or adamw, run on the shards (default: momentum if --momentum > 0, "
        "else sgd); Adam wants a small --lr such as 0.001; with a command also sum, its default "
        "(the shards average, the command's optimizer steps)"),
    OPT("weight-decay", CONFIG_DOUBLE, weight_decay, "0", 0, 1, NULL,
        "weight decay on the shards (L2; decoupled for adamw)"),
    OPT("consistency", CONFIG_STRING, consistency, "bsp", 0, 0, store_consistency_check,
        "the shards' sync model: bsp, asp (each push applied on arrival) or ssp:K (no worker "
        "reads more than K steps ahead of the slowest); the workers are the same in all three"),
    OPT("seed", CONFIG_INT, seed, "1", 0, 4294967295.0, NULL,
        "seed of the initial weights and the data order"),
    OPT("data", CONFIG_STRING, data, "/usr/share/datasets/fashion-mnist", 0, 0, check_nonempty,
        "directory with the Fashion-MNIST IDX files"),
    OPT("sync-mode", CONFIG_STRING, sync_mode, "ps", 0, 0, check_sync_mode,
        "ps (parameter server) or allreduce (ring of the workers, no shards)"),
    OPT("bin-dir", CONFIG_STRING, bin_dir, NULL, 0, 0, NULL,
        "directory of ps-server and ps-worker (default: next to ps-local, or its build tree)"),
    OPT("log-level", CONFIG_STRING, log_level, NULL, 0, 0, log_level_check,
        "log level of the children and ps-local (default: warn for shards, info for workers)"),
    OPT("max-steps", CONFIG_INT, max_steps, "0", 0, 9.0e15, NULL,
        "stop each worker after this many steps (0 = no limit)"),
    OPT("keep-logs", CONFIG_STRING, keep_logs, NULL, 0, 0, NULL,
        "keep the children's logs in this directory (created if missing) instead of a temp dir"),
    OPT("auth-token-file", CONFIG_STRING, auth_token_file, NULL, 0, 0, NULL,
        "the job's token for every child (default: a fresh random one in the private directory)"),
    OPT("no-auth", CONFIG_BOOL, no_auth, "false", 0, 0, NULL,
        "run without authentication (the children warn that anyone can connect)"),
};

static const struct config_spec local_spec = {
    "ps-local",
    "trains on 127.0.0.1: starts --shards ps-server and --workers ps-worker processes, waits for "
    "them and prints the test accuracy",
    local_options, sizeof(local_options) / sizeof(local_options[0])};
#define NUM_LOCAL_OPTIONS (sizeof(local_options) / sizeof(local_options[0]))

/* Command mode: what an option means to a command, and so which flags are
 * refused there (check_command_flags); an option not listed applies as
 * always (--shards, --workers, --sync-mode, --log-level, ...). */
enum scope {
  SCOPE_TRAINER,   /* the built-in trainer's: a command takes its arguments after -- */
  SCOPE_SHARDS,    /* the shards': none in allreduce mode */
  SCOPE_OPTIMIZER, /* the shards' optimizer's: none in allreduce mode or under sum */
};
static const struct {
  const char *name;
  enum scope scope;
} command_scopes[] = {
    {"epochs", SCOPE_TRAINER},         {"model", SCOPE_TRAINER},
    {"batch-size", SCOPE_TRAINER},     {"seed", SCOPE_TRAINER},
    {"data", SCOPE_TRAINER},           {"max-steps", SCOPE_TRAINER},
    {"optimizer", SCOPE_SHARDS},       {"consistency", SCOPE_SHARDS},
    {"lr", SCOPE_OPTIMIZER},           {"momentum", SCOPE_OPTIMIZER},
    {"weight-decay", SCOPE_OPTIMIZER}, {"lr-schedule", SCOPE_OPTIMIZER},
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
    "  arguments), the optimizer's under sum, and the shards' with --sync-mode allreduce.\n"
    "  Rank 0's stdout and stderr are ps-local's; rank r > 0 writes to <dir>/worker-<r>.log,\n"
    "  whose tail is shown if it fails. When a worker fails (or its command cannot be run)\n"
    "  every other child is stopped. Shards still running 2 s after the last worker exited 0\n"
    "  are stopped (a command need not have called ps.shutdown()).\n"
    "  Exit: 0 every worker exited 0; 1 a child failed (its status is in the message) or a\n"
    "  start-up error; 2 bad usage; 128+N stopped by signal N (Ctrl-C: 130).\n";

enum child_kind { CHILD_SHARD, CHILD_WORKER };

struct child {
  struct procs_child proc; /* pid, name, running, signalled, wait status */
  enum child_kind kind;
  int index;            /* shard id or worker rank */
  bool failed;          /* exited non-zero or by a signal on its own */
  char why[160];        /* a failure that is not an exit status (start-up) */
  bool not_run;         /* why: its exec failed, so it wrote nothing */
  char log[PATH_BYTES]; /* empty for rank 0 (its stderr is ours) */
};

enum phase { PHASE_START, PHASE_TRAIN, PHASE_DRAIN, PHASE_STOP };

struct launcher {
  const struct local_config *cfg;
  char server_bin[PATH_BYTES];
  char worker_bin[PATH_BYTES];
  char dir[DIR_BYTES];
  bool keep_dir;
  const char *shard_level, *worker_level;
  uint64_t decay_steps;   /* --lr-decay-steps for the shards; 0 = constant */
  bool allreduce;         /* --sync-mode allreduce: no shards, workers form a ring */
  const char *const *cmd; /* command mode: the argv after "--"; NULL = ps-worker */
  const char *optimizer;  /* the shards' --optimizer */
  const char *schedule;   /* --lr-schedule, its default resolved */
  int shard_grace_ms;     /* DRAIN: how long shards may take to exit by themselves */
  int *ring_fd;           /* allreduce, command: rank r's listening socket, handed over at exec */
  char *peers;            /* allreduce, command: the ring's addresses, rank 0 first */
  int master_fd;          /* command: holds MASTER_PORT until the workers start; -1 = none */
  int master_port;
  char build_root[PATH_BYTES]; /* the meson build tree we run from; "" = installed */
  char job_id[128];            /* command: PS_JOB_ID */
  char token[PATH_BYTES];      /* --auth-token-file for the children; "" = none */
  bool token_made;             /* we wrote it (and remove it) */

  struct child *kids; /* shards 0..S-1, then workers 0..W-1 */
  int num_kids;
  struct procs procs;

  enum phase phase;
  uint64_t deadline_ms; /* next escalation in DRAIN or STOP; 0 = none */
  int escalation;       /* DRAIN: 0 waiting, 1 SIGTERM sent, 2 SIGKILL sent; STOP: 0/2 */
  int stop_signal;      /* the signal that stopped us, 0 = none */
  struct child *first_failure;

  int out_fd; /* rank 0's stdout, -1 once closed */
  char out_buf[8192];
  size_t out_len;
  char summary[1024];
};

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
 * says whether we run from a build tree (L->build_root, for a command's
 * PYTHONPATH). A command needs no ps-worker, nor ps-server in allreduce
 * mode: only what runs must exist. */
static int resolve_bins(struct launcher *L) {
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

/* The shortest decimal form of x that reads back as x ("0.1", not
 * "0.10000000000000001"), so command lines show what the user typed. */
static void format_double(double x, char *buf, size_t len) {
  for (int prec = 1; prec <= 17; prec++) {
    snprintf(buf, len, "%.*g", prec, x);
    if (strtod(buf, NULL) == x) return;
  }
}

/* --optimizer, or its default from --momentum. */
static const char *local_optimizer(const struct local_config *cfg) {
  if (cfg->optimizer[0]) return cfg->optimizer;
  return cfg->momentum > 0 ? "momentum" : "sgd";
}

static int start_shard(struct launcher *L, struct child *k) {
  const struct local_config *cfg = L->cfg;
  char port[PATH_BYTES], a_shard[24], a_ns[24], a_nw[24], a_lr[40], a_mom[40];
  port_path(L, k->index, port, sizeof(port));
  unlink(port); /* a stale one in a --keep-logs dir would read as ready */
  snprintf(a_shard, sizeof(a_shard), "%d", k->index);
  snprintf(a_ns, sizeof(a_ns), "%lld", (long long)cfg->shards);
  snprintf(a_nw, sizeof(a_nw), "%lld", (long long)cfg->workers);
  format_double(cfg->lr, a_lr, sizeof(a_lr));
  format_double(cfg->momentum, a_mom, sizeof(a_mom));
  const char *argv[32] = {L->server_bin, "--listen", "127.0.0.1:0",  "--port-file", port,
                          "--shard",     a_shard,    "--num-shards", a_ns,          "--num-workers",
                          a_nw,          "--http",   "127.0.0.1:0"};
  int n = 13;
  argv[n++] = "--consistency";
  argv[n++] = cfg->consistency;
  argv[n++] = "--optimizer";
  argv[n++] = L->optimizer;
  argv[n++] = "--lr";
  argv[n++] = a_lr;
  if (strcmp(L->optimizer, "momentum") == 0) {
    argv[n++] = "--momentum";
    argv[n++] = a_mom;
  }
  char a_wd[40];
  if (cfg->weight_decay > 0) {
    format_double(cfg->weight_decay, a_wd, sizeof(a_wd));
    argv[n++] = "--weight-decay";
    argv[n++] = a_wd;
  }
  char a_decay[24];
  if (L->decay_steps) {
    snprintf(a_decay, sizeof(a_decay), "%llu", (unsigned long long)L->decay_steps);
    argv[n++] = "--lr-decay-steps";
    argv[n++] = a_decay;
  }
  argv[n++] = "--log-level";
  argv[n++] = L->shard_level;
  if (L->token[0]) {
    argv[n++] = "--auth-token-file";
    argv[n++] = L->token;
  }
  argv[n] = NULL;
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
  if (k->index == 0 && L->cmd) return spawn(L, k, argv, -1, -1, keep, env);
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

/* Worker k as ps-worker, its settings as flags. */
static int start_builtin_worker(struct launcher *L, struct child *k, const char *servers) {
  const struct local_config *cfg = L->cfg;
  char a_rank[24], a_ws[24], a_ep[24], a_bs[24], a_seed[24], a_max[24];
  snprintf(a_rank, sizeof(a_rank), "%d", k->index);
  snprintf(a_ws, sizeof(a_ws), "%lld", (long long)cfg->workers);
  snprintf(a_ep, sizeof(a_ep), "%lld", (long long)cfg->epochs);
  snprintf(a_bs, sizeof(a_bs), "%lld", (long long)cfg->batch_size);
  snprintf(a_seed, sizeof(a_seed), "%lld", (long long)cfg->seed);
  snprintf(a_max, sizeof(a_max), "%lld", (long long)cfg->max_steps);
  const char *argv[40] = {
      L->worker_bin, "--sync-mode",  "ps",           "--servers", servers,    "--rank",
      a_rank,        "--world-size", a_ws,           "--model",   cfg->model, "--epochs",
      a_ep,          "--batch-size", a_bs,           "--seed",    a_seed,     "--data",
      cfg->data,     "--log-level",  L->worker_level};
  int n = 21;
  if (cfg->max_steps > 0) {
    argv[n++] = "--max-steps";
    argv[n++] = a_max;
  }
  char a_fd[24], a_lr[40], a_mom[40], a_decay[24];
  if (L->allreduce) { /* the optimizer runs on the workers: they get what the shards would */
    argv[2] = "allreduce";
    argv[3] = "--peers";
    argv[4] = L->peers;
    snprintf(a_fd, sizeof(a_fd), "%d", L->ring_fd[k->index]);
    format_double(cfg->lr, a_lr, sizeof(a_lr));
    format_double(strcmp(L->optimizer, "momentum") == 0 ? cfg->momentum : 0, a_mom, sizeof(a_mom));
    snprintf(a_decay, sizeof(a_decay), "%llu", (unsigned long long)L->decay_steps);
    const char *more[] = {"--peer-listen-fd", a_fd,   "--lr", a_lr, "--momentum", a_mom,
                          "--lr-decay-steps", a_decay};
    for (size_t i = 0; i < sizeof(more) / sizeof(more[0]); i++) argv[n++] = more[i];
  }
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
};

/* Command mode: worker k's environment (file comment), into e. */
static int worker_env(const struct launcher *L, const struct child *k, const char *servers,
                      struct procs_env *e) {
  const struct local_config *cfg = L->cfg;
  int r = k->index;
  if (procs_env_init(e) < 0) return -ENOMEM;
  for (size_t i = 0; i < sizeof(worker_env_names) / sizeof(worker_env_names[0]); i++)
    procs_env_unset(e, worker_env_names[i]);
  procs_env_set(e, "PS_SYNC_MODE", "%s", L->allreduce ? "allreduce" : "ps");
  procs_env_set(e, "PS_RANK", "%d", r);
  procs_env_set(e, "PS_WORLD_SIZE", "%lld", (long long)cfg->workers);
  procs_env_set(e, "RANK", "%d", r);
  procs_env_set(e, "WORLD_SIZE", "%lld", (long long)cfg->workers);
  procs_env_set(e, "LOCAL_RANK", "%d", r);
  procs_env_set(e, "LOCAL_WORLD_SIZE", "%lld", (long long)cfg->workers);
  if (!L->allreduce) {
    procs_env_set(e, "PS_SERVERS", "%s", servers);
    procs_env_set(e, "PS_NUM_SHARDS", "%lld", (long long)cfg->shards);
  }
  procs_env_set(e, "PS_PEERS", "%s", L->peers);
  procs_env_set(e, "PS_PEER_LISTEN_FD", "%d", L->ring_fd[r]);
  if (L->token[0]) procs_env_set(e, "PS_AUTH_TOKEN_FILE", "%s", L->token);
  procs_env_set(e, "PS_JOB_ID", "%s", L->job_id);
  if (cfg->log_level[0]) procs_env_set(e, "PS_LOG_LEVEL", "%s", cfg->log_level);
  procs_env_set(e, "MASTER_ADDR", "127.0.0.1");
  procs_env_set(e, "MASTER_PORT", "%d", L->master_port);
  if (L->build_root[0]) {
    const char *old = getenv("PYTHONPATH");
    procs_env_set(e, "PYTHONPATH", "%s/python%s%s", L->build_root, old && old[0] ? ":" : "",
                  old && old[0] ? old : "");
  }
  return procs_env_vars(e) ? 0 : -ENOMEM;
}

/* Worker k as the user's command, its settings in the environment. */
static int start_command_worker(struct launcher *L, struct child *k, const char *servers) {
  struct procs_env env;
  int r = worker_env(L, k, servers, &env);
  if (r == 0)
    r = launch_worker(L, k, L->cmd, procs_env_vars(&env));
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
    struct net_addr a = {.host = "127.0.0.1", .port = 0};
    char err[256];
    L->ring_fd[r] = net_listen(&a, 16, err, sizeof(err));
    if (L->ring_fd[r] < 0) {
      fprintf(stderr, "ps-local: ring port of worker %d: %s\n", r, err);
      return -1;
    }
    used += (size_t)snprintf(L->peers + used, (size_t)W * 24 - used, "%s127.0.0.1:%d", r ? "," : "",
                             net_bound_port(L->ring_fd[r]));
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

static void signal_children(struct launcher *L, int sig, bool shards_only) {
  for (int i = 0; i < L->num_kids; i++)
    if (!shards_only || L->kids[i].kind == CHILD_SHARD) procs_kill(&L->kids[i].proc, sig);
}

/* Enters STOP: every child gets SIGTERM now and SIGKILL after STOP_KILL_MS. */
static void begin_stop(struct launcher *L) {
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
    begin_stop(L);
  }
}

static void reap(struct launcher *L) {
  struct procs_child *c;
  while ((c = procs_reap(&L->procs))) {
    struct child *k = container_of(c, struct child, proc);
    if (procs_exited_ok(c) || c->signalled) continue;
    k->failed = true;
    if (!L->first_failure) L->first_failure = k;
    begin_stop(L);
  }
}

static int running_count(const struct launcher *L, bool workers_only) {
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
  bool quiet = L->phase == PHASE_DRAIN && L->cmd;
  if (L->phase == PHASE_DRAIN && L->escalation == 0) {
    if (!quiet)
      fprintf(stderr,
              "ps-local: warning: %d shard(s) still running %d s after the workers "
              "finished; sending SIGTERM\n",
              running_count(L, false), L->shard_grace_ms / 1000);
    signal_children(L, SIGTERM, true);
    L->escalation = 1;
    L->deadline_ms = clock_now_ms() + SHARD_TERM_MS;
  } else {
    if (!quiet)
      fprintf(
          stderr, "ps-local: warning: %d child(ren) ignored SIGTERM for %d s; sending SIGKILL\n",
          running_count(L, false), (L->phase == PHASE_DRAIN ? SHARD_TERM_MS : STOP_KILL_MS) / 1000);
    signal_children(L, SIGKILL, false);
    L->escalation = 2;
    L->deadline_ms = 0;
  }
}

/* One round: waits up to timeout_ms for a signal or output, then handles
 * signals, output, exits and deadlines, in that order. */
static void pump(struct launcher *L, int timeout_ms) {
  if (L->deadline_ms) {
    uint64_t now = clock_now_ms();
    int left = L->deadline_ms > now ? (int)(L->deadline_ms - now) : 0;
    if (timeout_ms < 0 || left < timeout_ms) timeout_ms = left;
  }
  struct pollfd pf[2] = {{procs_signal_fd(&L->procs), POLLIN, 0}, {L->out_fd, POLLIN, 0}};
  int r = poll(pf, L->out_fd >= 0 ? 2 : 1, timeout_ms);
  if (r < 0 && errno != EINTR) {
    fprintf(stderr, "ps-local: poll: %s\n", strerror(errno));
    clock_sleep_ms(10);
  }
  handle_signals(L);
  read_output(L);
  reap(L);
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
      begin_stop(L);
      break;
    }
    pump(L, 0);
    /* A shard that exits 0 before the workers even started is a failure too. */
    for (int i = 0; i < S && L->phase != PHASE_STOP; i++) {
      struct child *k = &L->kids[i];
      if (!k->proc.running && !k->proc.signalled && !k->failed) {
        k->failed = true;
        snprintf(k->why, sizeof(k->why), "exited with status 0 during start-up");
        if (!L->first_failure) L->first_failure = k;
        begin_stop(L);
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
  fprintf(stderr, "ps-local: %lld shard(s) + %lld worker(s) on 127.0.0.1, sync %s",
          L->allreduce ? 0LL : (long long)c->shards, (long long)c->workers,
          L->allreduce ? "allreduce" : "ps");
  if (L->allreduce)
    fprintf(stderr, ", the command's optimizer");
  else if (strcmp(L->optimizer, "sum") == 0)
    fprintf(stderr, ", shards sum (the command's optimizer steps), consistency %s", c->consistency);
  else
    fprintf(stderr, ", optimizer %s on the shards (lr %g, momentum %g, constant), consistency %s",
            L->optimizer, c->lr, c->momentum, c->consistency);
  fprintf(stderr, "; each worker runs:");
  size_t shown = 0;
  for (int i = 0; L->cmd[i]; i++) {
    if (shown > 400) {
      fprintf(stderr, " ...");
      break;
    }
    fprintf(stderr, " %s", L->cmd[i]);
    shown += strlen(L->cmd[i]) + 1;
  }
  fputc('\n', stderr);
}

static void print_banner(const struct launcher *L) {
  const struct local_config *c = L->cfg;
  if (L->cmd) {
    print_command_banner(L);
  } else {
    fprintf(stderr,
            "ps-local: %lld shard(s) + %lld worker(s) on 127.0.0.1, sync %s, model %s, %lld "
            "epoch(s), batch %lld/worker, lr %g (%s), optimizer %s (momentum %g), consistency %s, "
            "seed %lld\n",
            L->allreduce ? 0LL : (long long)c->shards, (long long)c->workers,
            L->allreduce ? "allreduce" : "ps", c->model, (long long)c->epochs,
            (long long)c->batch_size, c->lr, L->schedule, L->optimizer, c->momentum, c->consistency,
            (long long)c->seed);
  }
  if (c->max_steps > 0)
    fprintf(stderr, "ps-local: at most %lld steps per worker\n", (long long)c->max_steps);
  if (L->keep_dir) fprintf(stderr, "ps-local: logs in %s\n", L->dir);
  log_debug("binaries", "ps_server=%s ps_worker=%s dir=%s", L->server_bin, L->worker_bin, L->dir);
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
    return 1;
  }
  if (L->cmd) return 0; /* its output was the user's to read */
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
  double wall = (double)(clock_now_ms() - t0) / 1000.0;
  printf("summary accuracy=%s epochs=%s wall_s=%.2f samples_per_s=%s\n", acc, epochs, wall, sps);
  fflush(stdout);
  return 0;
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

static int run(struct launcher *L, uint64_t t0) {
  const struct local_config *cfg = L->cfg;
  int S = L->allreduce ? 0 : (int)cfg->shards, W = (int)cfg->workers;
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
                     : L->cmd               ? "worker rank"
                                            : "ps-worker rank",
                     k->index);
    if (k->kind == CHILD_SHARD)
      snprintf(k->log, sizeof(k->log), "%s/shard-%d.log", L->dir, k->index);
    else if (k->index > 0)
      snprintf(k->log, sizeof(k->log), "%s/worker-%d.log", L->dir, k->index);
  }

  /* Our ports first: a shard's port 0 cannot take them then. */
  if ((L->allreduce || L->cmd) && bind_ring(L) < 0) return 1;
  if (L->cmd && reserve_master_port(L) < 0) return 1;
  for (int i = 0; i < S && L->phase == PHASE_START; i++) {
    if (start_shard(L, &L->kids[i]) < 0) {
      if (!L->kids[i].why[0])
        snprintf(L->kids[i].why, sizeof(L->kids[i].why), "could not be started");
      if (!L->first_failure) L->first_failure = &L->kids[i];
      begin_stop(L);
    }
    handle_signals(L);
  }
  if (L->phase == PHASE_START && (L->allreduce || wait_for_shards(L, &servers) == 0)) {
    L->phase = PHASE_TRAIN;
    close_master(L); /* rank 0's torch.distributed store may bind it now */
    for (int r = 0; r < W && L->phase == PHASE_TRAIN; r++) {
      struct child *k = &L->kids[S + r];
      int started =
          L->cmd ? start_command_worker(L, k, servers) : start_builtin_worker(L, k, servers);
      if (started < 0) {
        if (!k->why[0]) snprintf(k->why, sizeof(k->why), "could not be started");
        if (!L->first_failure) L->first_failure = k;
        begin_stop(L);
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

  while (running_count(L, false) > 0 || L->out_fd >= 0) {
    if (L->phase == PHASE_TRAIN && running_count(L, true) == 0) {
      L->phase = PHASE_DRAIN;
      L->deadline_ms = clock_now_ms() + (uint64_t)L->shard_grace_ms;
      log_debug("workers done", "shards_running=%d", running_count(L, false));
    }
    if (running_count(L, false) == 0) {
      /* Everyone is gone; whoever still holds rank 0's stdout is not ours. */
      read_output(L);
      if (L->out_fd >= 0) {
        close(L->out_fd);
        L->out_fd = -1;
      }
      break;
    }
    pump(L, -1);
  }
  return finish(L, t0);
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

int main(int argc, char **argv) {
  uint64_t t0 = clock_now_ms();
  /* The first "--" ends our options; what follows is the command. */
  int opt_argc = argc;
  for (int i = 1; i < argc && opt_argc == argc; i++)
    if (strcmp(argv[i], "--") == 0) opt_argc = i;
  bool command = opt_argc < argc;
  struct config_option options[NUM_LOCAL_OPTIONS];
  memcpy(options, local_options, sizeof(options));
  for (size_t i = 0; command && i < NUM_LOCAL_OPTIONS; i++)
    if (strcmp(options[i].name, "optimizer") == 0) options[i].check = opt_check; /* sum too */
  struct config_spec spec = local_spec;
  spec.options = options;

  struct local_config cfg;
  memset(&cfg, 0, sizeof(cfg));
  int r = config_parse(&spec, &cfg, opt_argc, argv, NULL, stderr);
  if (r == CONFIG_HELP) fputs(command_help, stdout);
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
  if (!command && allreduce &&
      ((kind != OPT_SGD && kind != OPT_MOMENTUM) || cfg.weight_decay > 0)) {
    fprintf(stderr,
            "ps-local: option --sync-mode allreduce: the workers run SGD (with momentum); "
            "--optimizer adam/adamw and --weight-decay need --sync-mode ps\n");
    return 2;
  }
  enum schedule sched = command ? SCHEDULE_CONSTANT : SCHEDULE_COSINE;
  if (cfg.lr_schedule[0])
    sched = (enum schedule)config_choice(cfg.lr_schedule, schedule_names, NUM_SCHEDULES, NULL, 0);
  if (command && check_command_options(&cfg, opt_argc, argv, allreduce, kind == OPT_SUM, sched) < 0)
    return 2;
  enum log_level level = LOG_INFO;
  if (cfg.log_level[0]) log_level_parse(cfg.log_level, &level);
  log_setup("ps-local", level);

  struct launcher L;
  memset(&L, 0, sizeof(L));
  L.cfg = &cfg;
  L.allreduce = allreduce;
  L.cmd = command ? (const char *const *)argv + opt_argc + 1 : NULL;
  L.optimizer = command && !cfg.optimizer[0] ? "sum" : local_optimizer(&cfg);
  L.schedule = schedule_names[sched];
  L.shard_grace_ms = command ? COMMAND_GRACE_MS : SHARD_GRACE_MS;
  L.master_fd = -1;
  if (sched == SCHEDULE_COSINE) { /* built-in only: check_command_options refused it */
    uint32_t n;
    if (count_train_samples(cfg.data, &n) < 0) return 1;
    uint64_t per_epoch = n / ((uint64_t)cfg.batch_size * (uint64_t)cfg.workers);
    L.decay_steps = per_epoch * (uint64_t)cfg.epochs;
    if (cfg.max_steps > 0 && (uint64_t)cfg.max_steps < L.decay_steps)
      L.decay_steps = (uint64_t)cfg.max_steps;
  }
  const char *job = getenv("PS_JOB_ID");
  if (job && job[0])
    snprintf(L.job_id, sizeof(L.job_id), "%s", job);
  else
    snprintf(L.job_id, sizeof(L.job_id), "ps-local-%d", (int)getpid());
  L.out_fd = -1;
  L.shard_level = cfg.log_level[0] ? cfg.log_level : "warn";
  L.worker_level = cfg.log_level[0] ? cfg.log_level : "info";
  if (resolve_bins(&L) < 0) return 1;
  scrub_env();

  if (procs_init(&L.procs, "ps-local") < 0) return 1;
  signal(SIGPIPE, SIG_IGN);

  int code = 1;
  if (make_dir(&L) == 0 && make_token(&L) == 0) {
    print_banner(&L);
    code = run(&L, t0);
  }
  close_master(&L);
  remove_dir(&L);
  free(L.kids);
  for (int i = 0; L.ring_fd && i < cfg.workers; i++)
    if (L.ring_fd[i] >= 0) close(L.ring_fd[i]);
  free(L.ring_fd);
  free(L.peers);
  procs_deinit(&L.procs);
  return code;
}
