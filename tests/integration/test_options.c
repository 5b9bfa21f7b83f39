/* test_options: every enumerated option of ps-server, ps-worker and ps-local
 * is checked through its option table by the parser of the module that owns
 * the value, so each program refuses a bad value before it starts anything:
 * exit 2 and one line "<program>: option --<name>: "<value>": <reason>
 * (<source>)". The reason is the owner's, so a value that two programs take
 * (--consistency, --optimizer, --sync-mode, --log-level) is refused with the
 * same words by both. Each bad value is tried as a flag and through its PS_*
 * variable; good values are shown to pass the table by a run that fails
 * later, at an option checked after it (--shard, --rank, --bin-dir). */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "harness.h"

#define CONSISTENCY_REASON "expected bsp, asp or ssp:K (K a number of clocks, 0..1000000)"
#define OPTIMIZER_REASON "expected sgd, momentum, adam, adamw or sum"
#define SYNC_MODE_REASON "expected ps or allreduce"
#define LOG_LEVEL_REASON "expected debug, info, warn, error or off"
#define BLAS_KERNEL_REASON                                                                        \
  "expected auto, keep or an OpenBLAS x86_64 kernel: Prescott, Atom, Core2, Penryn, Dunnington, " \
  "Nehalem, Opteron, Opteron_SSE3, Barcelona, Nano, Bobcat, Sandybridge, Bulldozer, Piledriver, " \
  "Steamroller, Excavator, Haswell, Zen, SkylakeX, Cooperlake"

struct bad_value {
  const char *bin; /* path under the build dir */
  const char *option, *value, *reason;
};

static const struct bad_value bad_values[] = {
    {"ps-server/ps-server", "consistency", "ssp:x", CONSISTENCY_REASON},
    {"ps-server/ps-server", "consistency", "ssp:1000001", CONSISTENCY_REASON},
    {"ps-server/ps-server", "optimizer", "adagrad", OPTIMIZER_REASON},
    {"ps-server/ps-server", "on-worker-timeout", "maybe", "expected auto, fail or continue"},
    {"ps-server/ps-server", "staleness-method", "dana", "expected lookahead or divide"},
    {"ps-server/ps-server", "log-level", "loud", LOG_LEVEL_REASON},
    {"ps-worker/ps-worker", "sync-mode", "ring", SYNC_MODE_REASON},
    {"ps-worker/ps-worker", "allreduce-backend", "mpi", "expected tcp or nccl"},
    {"ps-worker/ps-worker", "allreduce-algorithm", "tree", "expected auto, ring or node-first"},
    {"ps-worker/ps-worker", "device", "tpu", "expected auto, cpu or cuda"},
    {"ps-worker/ps-worker", "log-level", "", LOG_LEVEL_REASON},
    {"ps-worker/ps-worker", "blas-kernel", "Katmai", BLAS_KERNEL_REASON},
    {"tools/ps-local", "consistency", "ssp:", CONSISTENCY_REASON},
    {"tools/ps-local", "optimizer", "adagrad", OPTIMIZER_REASON},
    {"tools/ps-local", "optimizer", "sum",
     "sum leaves the optimizer to the workers, and ps-worker runs none"},
    {"tools/ps-local", "sync-mode", "ring", SYNC_MODE_REASON},
    {"tools/ps-local", "lr-schedule", "linear", "expected cosine or constant"},
    {"tools/ps-local", "log-level", "loud", LOG_LEVEL_REASON},
    {"tools/ps-local", "blas-kernel", "fastest", BLAS_KERNEL_REASON},
    {"tools/ps-local", "staleness-method", "dana", "expected lookahead or divide"},
};

enum { MAX_ARGS = 8 };

/* Runs bin with args (NULL-terminated, at most MAX_ARGS) and the environment
 * variable env (NAME=value, or NULL); returns the exit status, stderr in
 * err_path. */
static int run(const char *bin, const char *const args[MAX_ARGS + 1], const char *env,
               const char *err_path) {
  const char *argv[MAX_ARGS + 2];
  char path[512];
  int n = 0;
  argv[n++] = harness_bin(bin, path, sizeof(path));
  for (int i = 0; i < MAX_ARGS && args[i]; i++) argv[n++] = args[i];
  argv[n] = NULL;
  char name[64] = "";
  if (env) {
    const char *eq = strchr(env, '=');
    snprintf(name, sizeof(name), "%.*s", (int)(eq - env), env);
    setenv(name, eq + 1, 1);
  }
  pid_t pid = harness_spawn(argv, NULL, err_path);
  if (env) unsetenv(name);
  int st = harness_wait(pid, 10000);
  REQUIRE(st >= 0 && WIFEXITED(st), "%s did not exit by itself (status %d)", bin, st);
  return WEXITSTATUS(st);
}

/* PS_ and the option's name in upper case, '-' as '_' (config.h). */
static void env_name(const char *option, char *out, size_t len) {
  size_t i = (size_t)snprintf(out, len, "PS_");
  for (const char *p = option; *p && i + 1 < len; p++)
    out[i++] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
  out[i] = 0;
}

static void test_bad(const struct bad_value *b, int seq) {
  const char *prog = strrchr(b->bin, '/') + 1;
  char err[512], flag[64], envvar[64], env[160], line[512];
  snprintf(flag, sizeof(flag), "--%s=%s", b->option, b->value);
  env_name(b->option, envvar, sizeof(envvar));
  snprintf(env, sizeof(env), "%s=%s", envvar, b->value);
  for (int source = 0; source < 2; source++) {
    snprintf(err, sizeof(err), "%s/bad-%d-%d.err", harness_dir(), seq, source);
    const char *flag_args[MAX_ARGS + 1] = {flag}, *no_args[MAX_ARGS + 1] = {NULL};
    int code = run(b->bin, source == 0 ? flag_args : no_args, source == 0 ? NULL : env, err);
    snprintf(line, sizeof(line), "%s: option --%s: \"%s\": %s (%s%s)", prog, b->option, b->value,
             b->reason, source == 0 ? "flag" : "env ", source == 0 ? "" : envvar);
    REQUIRE(code == 2, "%s %s: exit %d, want 2", prog, source == 0 ? flag : env, code);
    REQUIRE(harness_grep(err, line) == 1, "%s %s: stderr lacks \"%s\"", prog,
            source == 0 ? flag : env, line);
  }
}

/* Every value of opt (a NULL-terminated list) passes bin's table: the run
 * fails later, at the option `later` names, and nothing names opt. */
static void test_good(const char *bin, const char *opt, const char *const *values,
                      const char *const *later, const char *later_says) {
  for (int v = 0; values[v]; v++) {
    char err[512], flag[96], needle[96];
    snprintf(err, sizeof(err), "%s/good-%s-%d.err", harness_dir(), opt, v);
    snprintf(flag, sizeof(flag), "--%s=%s", opt, values[v]);
    const char *args[MAX_ARGS + 1] = {flag};
    for (int i = 0; i + 1 < MAX_ARGS && later[i]; i++) args[i + 1] = later[i];
    int code = run(bin, args, NULL, err);
    snprintf(needle, sizeof(needle), "option --%s:", opt);
    REQUIRE(code != 0 && harness_grep(err, later_says) >= 1 && harness_grep(err, needle) == 0,
            "%s %s: exit %d, and stderr does not fail at \"%s\" alone", bin, flag, code,
            later_says);
  }
}

/* Issue 30: bad settings that are not enumerated values, each refused with
 * exit 2 and a line naming the option or variable: addresses to listen on
 * (they exited 1 from deep inside the server), a zero connect timeout (it
 * waited 30 s), indices with a space or a sign (taken as numbers), a NUL
 * byte in a config file (it ended the line silently) and the knobs outside
 * the tables (PS_HEARTBEAT_MS said "cannot reach the shards"). */
struct bad_setting {
  const char *bin;
  const char *args[MAX_ARGS + 1];
  const char *env; /* NAME=value or NULL */
  const char *says;
};

/* Where an unfixed server would start: a free port, no HTTP (it then runs
 * until the 10 s wait of run() gives up, and the case fails). */
#define LOCAL "--listen=127.0.0.1:0", "--http="

static void test_bad_settings(void) {
  char cfg[512], cfg_arg[600];
  snprintf(cfg, sizeof(cfg), "%s/nul.conf", harness_dir());
  FILE *f = fopen(cfg, "w");
  REQUIRE(f && fwrite("world-size = 1\0 0\n", 1, 19, f) == 19 && fclose(f) == 0, "%s", cfg);
  snprintf(cfg_arg, sizeof(cfg_arg), "--config=%s", cfg);
  const struct bad_setting cases[] = {
      {"ps-server/ps-server",
       {"--shard", "0", "--listen", "nonsense"},
       NULL,
       "option --listen: \"nonsense\""},
      {"ps-server/ps-server",
       {"--shard", "0", "--listen", "127.0.0.1:99999"},
       NULL,
       "option --listen:"},
      {"ps-server/ps-server", {"--shard", "0"}, "PS_LISTEN=:x", "(env PS_LISTEN)"},
      {"ps-server/ps-server",
       {"--shard", "0", "--http", "nonsense"},
       NULL,
       "option --http: \"nonsense\""},
      {"ps-server/ps-server",
       {"--num-shards", "2", "--shard", " 0", LOCAL},
       NULL,
       "option --shard:"},
      {"ps-server/ps-server",
       {"--num-shards", "2", "--shard", "+1", LOCAL},
       NULL,
       "option --shard:"},
      {"ps-server/ps-server",
       {"--num-shards", "2", "--shard", "auto", LOCAL},
       "PS_POD_INDEX= 1",
       "option --shard:"},
      {"ps-server/ps-server",
       {"--shard", "0", "--num-workers", "2x"},
       NULL,
       "option --num-workers:"},
      {"ps-server/ps-server", {"--shard", "0", "--lr", "+0.5"}, NULL, "option --lr:"},
      {"ps-server/ps-server", {"--shard", "0", LOCAL, cfg_arg}, NULL, "NUL byte"},
      {"ps-server/ps-server",
       {"--shard", "0", LOCAL},
       "PS_DISABLE_IO_URING=maybe",
       "PS_DISABLE_IO_URING="},
      {"ps-worker/ps-worker",
       {"--servers", "127.0.0.1:1", "--connect-timeout-ms", "0"},
       NULL,
       "option --connect-timeout-ms:"},
      {"ps-worker/ps-worker",
       {"--servers", "127.0.0.1:1", "--http", "nonsense"},
       NULL,
       "option --http: \"nonsense\""},
      {"ps-worker/ps-worker",
       {"--sync-mode", "allreduce", "--peer-listen", "nonsense"},
       NULL,
       "option --peer-listen:"},
      {"ps-worker/ps-worker",
       {"--servers", "127.0.0.1:1", "--world-size", "2", "--rank", " 1"},
       NULL,
       "option --rank:"},
      {"ps-worker/ps-worker", {"--servers", "127.0.0.1:1", cfg_arg}, NULL, "NUL byte"},
      {"ps-worker/ps-worker",
       {"--servers", "127.0.0.1:1", "--max-steps", "1"},
       "PS_HEARTBEAT_MS= 500",
       "PS_HEARTBEAT_MS="},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    const struct bad_setting *b = &cases[i];
    char err[512];
    snprintf(err, sizeof(err), "%s/setting-%zu.err", harness_dir(), i);
    int code = run(b->bin, b->args, b->env, err);
    REQUIRE(code == 2 && harness_grep(err, b->says) >= 1,
            "case %zu (%s %s %s): exit %d, want 2 with \"%s\" on stderr", i, b->bin,
            b->args[0] ? b->args[0] : "", b->env ? b->env : "", code, b->says);
  }
  printf("%zu bad settings refused with exit 2, each named\n", sizeof(cases) / sizeof(cases[0]));
}

int main(void) {
  test_bad_settings();
  for (size_t i = 0; i < sizeof(bad_values) / sizeof(bad_values[0]); i++)
    test_bad(&bad_values[i], (int)i);
  printf("%zu bad values refused by their owners' checks, as flags and as PS_* variables\n",
         sizeof(bad_values) / sizeof(bad_values[0]));

  const char *const server_later[] = {"--num-shards", "2", "--shard", "7", NULL};
  const char *const worker_later[] = {"--world-size", "2", "--rank", "7", NULL};
  const char *const local_later[] = {"--bin-dir", "/nonexistent", NULL};
  test_good("ps-server/ps-server", "consistency",
            (const char *[]){"bsp", "asp", "ssp:0", "ssp:1000000", NULL}, server_later,
            "option --shard");
  test_good("ps-server/ps-server", "optimizer",
            (const char *[]){"sgd", "momentum", "adam", "adamw", "sum", NULL}, server_later,
            "option --shard");
  test_good("ps-server/ps-server", "staleness-method",
            (const char *[]){"lookahead", "divide", NULL}, server_later, "option --shard");
  test_good("ps-server/ps-server", "on-worker-timeout",
            (const char *[]){"auto", "fail", "continue", NULL}, server_later, "option --shard");
  test_good("ps-worker/ps-worker", "sync-mode", (const char *[]){"ps", "allreduce", NULL},
            worker_later, "option --rank");
  test_good("ps-worker/ps-worker", "allreduce-backend", (const char *[]){"tcp", "nccl", NULL},
            worker_later, "option --rank");
  test_good("ps-worker/ps-worker", "device", (const char *[]){"auto", "cpu", "cuda", NULL},
            worker_later, "option --rank");
  test_good("ps-worker/ps-worker", "log-level",
            (const char *[]){"debug", "info", "warn", "error", "off", NULL}, worker_later,
            "option --rank");
  test_good("ps-worker/ps-worker", "blas-kernel", (const char *[]){"auto", "keep", NULL},
            worker_later, "option --rank");
  test_good("tools/ps-local", "blas-kernel", (const char *[]){"auto", "keep", NULL}, local_later,
            "/nonexistent");
  test_good("tools/ps-local", "consistency", (const char *[]){"bsp", "asp", "ssp:3", NULL},
            local_later, "/nonexistent");
  test_good("tools/ps-local", "lr-schedule", (const char *[]){"cosine", "constant", NULL},
            local_later, "/nonexistent");
  test_good("tools/ps-local", "staleness-method", (const char *[]){"lookahead", "divide", NULL},
            local_later, "/nonexistent");
  printf("every value of the enumerated options passes the tables\n");
  return 0;
}
