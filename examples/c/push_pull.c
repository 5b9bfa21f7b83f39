/* push_pull: a complete libps program, built the way a user builds one,
 * against the installed library:
 *
 *   cc push_pull.c $(pkg-config --cflags --libs libps) -o push_pull
 *   ./push_pull HOST:PORT[,HOST:PORT...] [--token FILE] [--lr LR]
 *               [--rank R --world-size W] [--shutdown]
 *
 * It is one worker (rank 0 of 1 unless told otherwise) of a job whose shards
 * were started with --num-workers W, e.g.
 *
 *   ps-server --listen 127.0.0.1:7070 --shard 0 --num-workers 1 --http '' &
 *   ./push_pull 127.0.0.1:7070
 *
 * What it does is the whole life of a ps_client: connect to every shard,
 * declare the model (one tensor "w" of N floats, cut into chunks that spread
 * over the shards), initialise it (rank 0 does that for the job), wait until
 * it is initialised (every rank: the shards refuse a push before that),
 * push the gradient of step 0, pull version 1, and check that the shards
 * applied the update their optimizer promises: w - lr * g with --optimizer
 * sgd, the mean gradient g with --optimizer sum (the worker then runs its
 * own optimizer); every rank pushes the same g, so the mean is g. It exits 0
 * when the values are right and 1 with a message saying what went wrong
 * otherwise (2 for bad usage). Start the ranks in any order; with --shutdown
 * (give it to every rank) rank 0 stops the shards once every rank is done.
 *
 * Without arguments the shard list comes from PS_SERVERS, the token file
 * from PS_AUTH_TOKEN_FILE, rank and world size from PS_RANK and
 * PS_WORLD_SIZE, the names ps-worker and tools/ps-local use; the learning
 * rate from PS_LR (the shards' own --lr, 0.1 by default). A token file is
 * what the shards got as --auth-token-file: without the right one they
 * refuse the connection. */
#define _POSIX_C_SOURCE 200809L /* strdup, strtok: the rest is C99 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ps.h>

#define N 1000     /* floats in the tensor: 4000 bytes */
#define CHUNK 1024 /* bytes per chunk: 4 chunks, spread over the shards */
#define MAX_SHARDS 64
#define TOLERANCE 1e-6        /* relative: the shard may round w - lr * g differently */
#define INIT_TIMEOUT_MS 30000 /* how long a rank waits for rank 0's ps_init */

static int usage(const char *prog, const char *why) {
  fprintf(stderr, "%s: %s\n", prog, why);
  fprintf(stderr,
          "usage: %s HOST:PORT[,HOST:PORT...] [--token FILE] [--lr LR]\n"
          "          [--rank R --world-size W] [--shutdown]\n"
          "       (or PS_SERVERS, PS_AUTH_TOKEN_FILE, PS_LR, PS_RANK and PS_WORLD_SIZE in\n"
          "       the environment)\n",
          prog);
  return 2;
}

/* Splits "a:1,b:2" in place into servers[]; returns how many, or -1. */
static int split_servers(char *list, const char **servers) {
  int n = 0;
  for (char *s = strtok(list, ","); s; s = strtok(NULL, ",")) {
    if (n == MAX_SHARDS) return -1;
    servers[n++] = s;
  }
  return n;
}

/* Why a call on c failed: the client's last message, else the status's. */
static void fail(const char *prog, const char *what, ps_client *c, ps_status st) {
  char msg[512];
  ps_errmsg(c, msg, sizeof(msg));
  fprintf(stderr, "%s: %s: %s\n", prog, what, msg[0] ? msg : ps_strerror(st));
}

/* text as an int in [lo, hi] into *out; returns 0, or -1. */
static int parse_int(const char *text, int lo, int hi, int *out) {
  char *end = NULL;
  errno = 0;
  long v = strtol(text, &end, 10);
  if (errno || end == text || *end || v < lo || v > hi) return -1;
  *out = (int)v;
  return 0;
}

static double rel_error(float got, float want) {
  double d = (double)got - (double)want, scale = want < 0 ? -(double)want : (double)want;
  if (d < 0) d = -d;
  return d / (scale > 1 ? scale : 1);
}

int main(int argc, char **argv) {
  const char *prog = argv[0];
  const char *list = getenv("PS_SERVERS"), *token_file = getenv("PS_AUTH_TOKEN_FILE");
  const char *lr_text = getenv("PS_LR");
  const char *rank_text = getenv("PS_RANK"), *world_text = getenv("PS_WORLD_SIZE");
  int shutdown = 0, rank = 0, world_size = 1;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--token") == 0 && i + 1 < argc)
      token_file = argv[++i];
    else if (strcmp(argv[i], "--lr") == 0 && i + 1 < argc)
      lr_text = argv[++i];
    else if (strcmp(argv[i], "--rank") == 0 && i + 1 < argc)
      rank_text = argv[++i];
    else if (strcmp(argv[i], "--world-size") == 0 && i + 1 < argc)
      world_text = argv[++i];
    else if (strcmp(argv[i], "--shutdown") == 0)
      shutdown = 1;
    else if (argv[i][0] != '-')
      list = argv[i];
    else
      return usage(prog, "unknown or incomplete option");
  }
  if (!list || !list[0]) return usage(prog, "no shards given");
  char *end = NULL;
  errno = 0;
  double lr = lr_text && lr_text[0] ? strtod(lr_text, &end) : 0.1;
  if (lr_text && lr_text[0] && (errno || *end || lr < 0))
    return usage(prog, "the learning rate is not a number >= 0");
  if (world_text && world_text[0] && parse_int(world_text, 1, 1 << 20, &world_size) < 0)
    return usage(prog, "the world size is not a whole number >= 1");
  if (rank_text && rank_text[0] && parse_int(rank_text, 0, world_size - 1, &rank) < 0)
    return usage(prog, "the rank is not a whole number in [0, world size)");

  char *copy = strdup(list);
  const char *servers[MAX_SHARDS];
  int num_servers = copy ? split_servers(copy, servers) : -1;
  if (num_servers < 1) {
    free(copy);
    return usage(prog, "the shard list is empty or longer than 64");
  }

  int ret = 1;
  char err[512];
  ps_status st;
  ps_token *token = NULL;
  ps_client *c = NULL;
  if (token_file && token_file[0] && ps_token_load(token_file, &token, err, sizeof(err)) != PS_OK) {
    fprintf(stderr, "%s: %s\n", prog, err);
    goto out;
  }

  /* 1. connect: one connection per shard, authenticated with the token */
  struct ps_client_opts opts = {.servers = servers,
                                .num_servers = num_servers,
                                .rank = rank,
                                .world_size = world_size,
                                .job_id = "push_pull example",
                                .chunk_bytes = CHUNK,
                                .connect_timeout_ms = 10000,
                                .auth_token = token};
  if ((st = ps_client_new(&opts, &c, err, sizeof(err))) != PS_OK) {
    fprintf(stderr, "%s: cannot connect to the shards %s: %s\n", prog, list, err);
    goto out;
  }

  /* 2. declare the model (every rank the same), and rank 0 gives it its
   * initial values; every rank computes them (the same seed, here a
   * formula) only to check the update at the end */
  const char *names[1] = {"w"};
  const uint64_t counts[1] = {N};
  static float w0[N], grad[N], w1[N];
  for (int i = 0; i < N; i++) {
    w0[i] = (float)i / N;
    grad[i] = 1.0f + (float)(i % 7);
  }
  if ((st = ps_declare(c, 1, names, counts)) != PS_OK ||
      (rank == 0 && (st = ps_init(c, 0, w0)) != PS_OK)) {
    fail(prog, "declare/init", c, st);
    goto out;
  }
  /* 3. wait until w has its values on the shards: a rank that pushed before
   * rank 0's ps_init arrived would be refused ("before it was initialised") */
  if ((st = ps_wait_initialised(c, INIT_TIMEOUT_MS)) != PS_OK) {
    fail(prog, "waiting for rank 0 to initialise w", c, st);
    goto out;
  }

  /* 4. push the gradient of step 0, then pull version 1: the shards answer
   * once every worker's step-0 gradient is in and the update is applied */
  uint64_t version = 0;
  if ((st = ps_push(c, 0, 0, grad)) != PS_OK || (st = ps_pull(c, 0, 1, w1, &version)) != PS_OK) {
    fail(prog, "push/pull", c, st);
    goto out;
  }

  /* 5. what the shards run, and how the tensor was spread over them */
  struct ps_shard_stats stats;
  uint64_t bytes[MAX_SHARDS];
  if ((st = ps_stats(c, 0, &stats)) != PS_OK || (st = ps_shard_bytes(c, bytes)) != PS_OK) {
    fail(prog, "stats", c, st);
    goto out;
  }
  printf("rank %d of %d, %d shard(s), optimizer %s, consistency %s, authentication %s\n", rank,
         world_size, num_servers, stats.optimizer, stats.consistency, token ? "on" : "off");
  for (int s = 0; s < num_servers; s++)
    printf("  shard %d (%s) holds %llu bytes of w\n", s, servers[s], (unsigned long long)bytes[s]);

  /* 6. check the update */
  int sgd = strcmp(stats.optimizer, "sgd") == 0, sum = strcmp(stats.optimizer, "sum") == 0;
  if (!sgd && !sum) {
    fprintf(stderr, "%s: this example checks --optimizer sgd or sum; the shards run %s\n", prog,
            stats.optimizer);
    goto out;
  }
  int wrong = 0;
  for (int i = 0; i < N; i++) {
    float want = sum ? grad[i] : (float)(w0[i] - lr * grad[i]);
    if (rel_error(w1[i], want) > TOLERANCE && wrong++ < 5)
      fprintf(stderr, "%s: w[%d] = %.7g after the update, expected %.7g\n", prog, i, (double)w1[i],
              (double)want);
  }
  printf("pulled version %llu: w[0] = %.6g, w[1] = %.6g, ..., w[%d] = %.6g\n",
         (unsigned long long)version, (double)w1[0], (double)w1[1], N - 1, (double)w1[N - 1]);
  if (wrong) {
    fprintf(stderr, "%s: %d of %d values are not %s (lr %g: the shards' --lr?)\n", prog, wrong, N,
            sum ? "the pushed gradient" : "w - lr * g", lr);
    goto out;
  }
  printf("ok: all %d values are %s\n", N, sum ? "the mean gradient" : "w - lr * g");

  /* 7. rank 0 stops the shards, once every rank got here (the barrier) */
  if (shutdown && world_size > 1 && (st = ps_barrier(c)) != PS_OK) {
    fail(prog, "barrier before the shutdown", c, st);
    goto out;
  }
  if (shutdown && rank == 0 && (st = ps_shutdown_servers(c)) != PS_OK) {
    fail(prog, "shutdown", c, st);
    goto out;
  }
  ret = 0;
out:
  ps_client_free(c);
  ps_token_free(token); /* after the client, which borrows it */
  free(copy);
  return ret;
}
