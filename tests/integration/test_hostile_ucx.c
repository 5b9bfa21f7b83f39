/* test_hostile_ucx: test_hostile's attack, on the --listen port of --transport ucx shards
 * (issue 30).
 *
 * A UCX shard's port is UCX's TCP connection manager: no ps frame reaches the shard before
 * UCX's own handshake, so the hostile clients are peers that do not speak UCX. Two shards
 * (S=2, --transport ucx) and two ps-worker processes (W=2, BSP, SGD, PS_TRANSPORT=ucx, UCX_TLS=tcp
 * unless set) train STEPS steps twice with the same seed: once clean, once while one
 * `ps-hostile --transport ucx` per shard opens connections for ATTACK_SECONDS that send random
 * bytes (16 B to 4 KiB; then left open, half-closed or closed at once) or a ps HELLO (a TCP
 * worker pointed at a UCX port), and holds slowloris (a byte a second) and idle connections.
 * Then:
 *   - neither shard crashed: both serve until the training ends and exit 0;
 *   - ps-hostile saw every connection dropped without a byte in reply: none accepted, stuck,
 *     unexpected or closed wrongly, every held one dropped (the guard's 10 s for a silent
 *     peer; ps-hostile waits DRAIN_S for it);
 *   - each shard counted its refusals in ps_server_rejected_frames_total: at least one, at
 *     most the connections ps-hostile made (UCX closes some itself: a peer that closes before
 *     UCX's buffer is full), logged once ("refused a peer": once per address a minute);
 *   - each shard's fds are back to their number before the attack within SETTLE_S, and its
 *     RSS within RSS_SLACK_KB of it, while the job still trains; its peak RSS (VmHWM) stays
 *     under RSS_CAP_MB;
 *   - the attacked run's final parameters (rank 0's --dump-params) are byte-identical to the
 *     clean run's and its test accuracy is the same (BSP with W=2 is deterministic).
 * The figures are read while the job holds its connections, however fast the machine: the
 * test is the job's third rank (the holder, below). It pushes zero gradients at every step,
 * so BSP keeps it in step with the two workers, and after the last step it leaves only once
 * the checks are done; till then the workers wait in their final barrier and the shards
 * serve. So no step count has to outlast the attack. Skipped (77) where UCX is not built. */
#include <dirent.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "clock.h"
#include "harness.h"
#include "ps.h"
#include "scrape.h"

#define S 2
#define W 2        /* ps-worker processes; the holder is rank W of W + 1 */
#define STEPS 1000 /* of batch 4 (5,000 an epoch with 3 ranks): the attack may outlast them */
#define BATCH "--batch-size=4"
#define MODEL "mlp:784-256-10" /* the holder declares its tensors: fc0 784x256, fc1 256x10 */
#define CHUNK 262144           /* bytes per chunk on every rank, so the placement is theirs */
#define ATTACK_SECONDS "--seconds=3"
/* ps-hostile waits up to this for its held connections to be dropped (the
 * event), 10 times the guard's 10 s for a silent peer (common/ucx_guard.c
 * IDLE_MS); one still open then is "stuck" */
#define DRAIN_S "100"
#define SETTLE_S 20
#define RSS_SLACK_KB 4096
#define RSS_CAP_MB 200
#define RSS_CAP_ASAN_MB 1024
#define LINE_BYTES 4096

struct run {
  double seconds;
  uint64_t conns, drops, refused;
  int steps_attacked; /* steps done when the checks ended (of STEPS) */
  long fds0[S], fds1[S], rss0_kb[S], rss1_kb[S], peak_kb[S];
  char summary[LINE_BYTES];
};

static double field(const char *line, const char *name) {
  char key[96];
  snprintf(key, sizeof(key), " %s=", name);
  const char *p = strstr(line, key);
  REQUIRE(p, "no %s in \"%s\"", name, line);
  return strtod(p + strlen(key), NULL);
}

static void read_line(const char *path, const char *needle, char out[LINE_BYTES]) {
  FILE *f = fopen(path, "r");
  char line[LINE_BYTES];
  out[0] = 0;
  while (f && fgets(line, sizeof(line), f))
    if (strstr(line, needle)) memcpy(out, line, strlen(line) + 1);
  if (f) fclose(f);
}

static long status_kb(pid_t pid, const char *key) {
  char path[64], line[256];
  snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "r");
  long kb = -1;
  size_t n = strlen(key);
  while (f && fgets(line, sizeof(line), f))
    if (strncmp(line, key, n) == 0 && line[n] == ':') kb = atol(line + n + 1);
  if (f) fclose(f);
  return kb;
}

static long count_fds(pid_t pid) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
  DIR *d = opendir(path);
  long n = 0;
  if (!d) return -1;
  for (struct dirent *e; (e = readdir(d));)
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

static bool running(pid_t pid) {
  int st;
  return waitpid(pid, &st, WNOHANG) == 0;
}

/* The attacker of shard i is done: what it saw, what the shard counted. */
static void check_attack(int i, const char *hline, const char *metrics, struct run *r) {
  REQUIRE(field(hline, "accepted") == 0 && field(hline, "stuck") == 0 &&
              field(hline, "unexpected") == 0 && field(hline, "closed") == 0,
          "shard %d did not drop every connection cleanly: %s", i, hline);
  REQUIRE(field(hline, "setup_failures") <= field(hline, "connections") / 50 + 1,
          "ps-hostile could not connect: %s", hline);
  REQUIRE(field(hline, "frames") >= 10, "too few probes to mean anything: %s", hline);
  static const char *const held[] = {"slowloris", "idle"};
  for (int h = 0; h < 2; h++) {
    char d[64];
    snprintf(d, sizeof(d), "%s_dropped", held[h]);
    REQUIRE(field(hline, held[h]) >= 1 && field(hline, d) == field(hline, held[h]),
            "shard %d: not every %s connection was dropped: %s", i, held[h], hline);
  }
  double conns = field(hline, "connections");
  double refused = scrape_value(metrics, "ps_server_rejected_frames_total");
  REQUIRE(refused >= 1 && refused <= conns,
          "shard %d counted %.0f refusals for %.0f hostile connections", i, refused, conns);
  r->conns += (uint64_t)conns;
  r->drops += (uint64_t)field(hline, "silent_closes");
  r->refused += (uint64_t)refused;
}

/* Waits up to SETTLE_S for shard pid's fds to be back at r->fds0[i]. */
static void wait_settled(int i, pid_t pid, struct run *r) {
  double deadline = clock_now_s() + SETTLE_S;
  while ((r->fds1[i] = count_fds(pid)) > r->fds0[i] && clock_now_s() < deadline)
    clock_sleep_ms(100);
  r->rss1_kb[i] = status_kb(pid, "VmRSS");
  r->peak_kb[i] = status_kb(pid, "VmHWM");
  REQUIRE(r->fds1[i] <= r->fds0[i], "shard %d: %ld fds %d s after the attack, %ld before it", i,
          r->fds1[i], SETTLE_S, r->fds0[i]);
}

/* The test's own rank of the job: zero gradients at each of STEPS steps, then it holds
 * the job (connections, shards) until released, and leaves as a worker does. */
struct holder {
  pthread_t thread;
  const char *servers[S];
  const char *token_file;
  atomic_bool release;
  atomic_int steps; /* done so far */
  ps_status status;
  char err[512];
};

static void *hold(void *arg) {
  struct holder *h = arg;
  static const char *const names[] = {"fc0.weight", "fc0.bias", "fc1.weight", "fc1.bias"};
  static const uint64_t counts[] = {784 * 256, 256, 256 * 10, 10};
  enum { NT = 4 };
  ps_token *token = NULL;
  ps_client *c = NULL;
  float *zero = calloc(counts[0], sizeof(float)), *buf[NT];
  for (int t = 0; t < NT; t++) buf[t] = malloc(counts[t] * sizeof(float));
  ps_status st = ps_token_load(h->token_file, &token, h->err, sizeof(h->err));
  struct ps_client_opts o = {.servers = h->servers,
                             .num_servers = S,
                             .rank = W,
                             .world_size = W + 1,
                             .chunk_bytes = CHUNK,
                             .auth_token = token,
                             .transport = "ucx"};
  if (st == PS_OK) st = ps_client_new(&o, &c, h->err, sizeof(h->err));
  if (st == PS_OK) st = ps_declare(c, NT, names, counts);
  for (int t = 0; t < NT && st == PS_OK; t++) st = ps_pull(c, t, 0, buf[t], NULL); /* rank 0 init */
  for (int k = 0; k < STEPS && st == PS_OK; k++) { /* as a worker: every key in flight */
    ps_request *req[2 * NT] = {0};
    for (int t = 0; t < NT && st == PS_OK; t++)
      st = ps_push_async(c, t, (uint64_t)k, zero, NULL, NULL, &req[t]);
    for (int i = 0; i < NT; i++) { /* then the pulls, as sync_ps does */
      ps_status w = req[i] ? ps_wait(req[i], NULL) : PS_OK;
      req[i] = NULL;
      if (st == PS_OK) st = w;
    }
    for (int t = 0; t < NT && st == PS_OK; t++)
      st = ps_pull_async(c, t, (uint64_t)k + 1, buf[t], NULL, NULL, &req[NT + t]);
    for (int i = 0; i < 2 * NT; i++) {
      ps_status w = req[i] ? ps_wait(req[i], NULL) : PS_OK;
      if (st == PS_OK) st = w;
    }
    atomic_store(&h->steps, k + 1);
  }
  while (st == PS_OK && !atomic_load(&h->release)) clock_sleep_ms(20);
  if (st == PS_OK) st = ps_leave(c, PS_LEAVE_FINISHED);
  if (st == PS_OK) st = ps_barrier(c);
  if (st != PS_OK && c && !h->err[0]) ps_errmsg(c, h->err, sizeof(h->err));
  h->status = st;
  ps_client_free(c);
  ps_token_free(token);
  free(zero);
  for (int t = 0; t < NT; t++) free(buf[t]);
  return NULL;
}

static void run_job(bool attacked, const char *token, const char *dump, struct run *r) {
  const char *server_args[] = {"--transport", "ucx", "--auth-token-file", token, NULL};
  struct test_server srv[S];
  char servers[256] = "", http[S][64];
  for (int i = 0; i < S; i++) {
    harness_start_server(&srv[i], i, S, W + 1, 0.1, server_args);
    REQUIRE(scrape_http_addr(srv[i].log, http[i], sizeof(http[i]), 5000) == 0, "no http address");
    snprintf(servers + strlen(servers), sizeof(servers) - strlen(servers), "%s%s", i ? "," : "",
             srv[i].addr);
  }
  char bin[512], rank[W][8], log[W][512], out0[512];
  harness_bin("ps-worker/ps-worker", bin, sizeof(bin));
  snprintf(out0, sizeof(out0), "%s/%s-worker-0.out", harness_dir(),
           attacked ? "attacked" : "clean");
  pid_t workers[W];
  double t0 = clock_now_s();
  static struct holder h;
  memset(&h, 0, sizeof(h));
  h.token_file = token;
  for (int i = 0; i < S; i++) h.servers[i] = srv[i].addr;
  REQUIRE(pthread_create(&h.thread, NULL, hold, &h) == 0, "%s", "start the holder rank");
  char steps[32], chunk[32];
  snprintf(steps, sizeof(steps), "--max-steps=%d", STEPS);
  snprintf(chunk, sizeof(chunk), "--chunk-bytes=%d", CHUNK);
  for (int w = 0; w < W; w++) {
    snprintf(rank[w], sizeof(rank[w]), "%d", w);
    snprintf(log[w], sizeof(log[w]), "%s/%s-worker-%d.log", harness_dir(),
             attacked ? "attacked" : "clean", w);
    const char *argv[] = {bin,
                          "--servers",
                          servers,
                          "--transport",
                          "ucx",
                          "--rank",
                          rank[w],
                          "--auth-token-file",
                          token,
                          "--dump-params",
                          w == 0 ? dump : "",
                          "--world-size=3",
                          "--epochs=1",
                          "--model=" MODEL,
                          chunk,
                          BATCH,
                          steps,
                          "--seed=11",
                          "--log-every=1000",
                          NULL};
    workers[w] = harness_spawn(argv, w == 0 ? out0 : NULL, log[w]);
  }
  static char text[1 << 18];
  for (int i = 0; i < S; i++) { /* the job is up: its connections and layout are in */
    double deadline = clock_now_s() + 30;
    while (scrape_get(http[i], "/metrics", text, sizeof(text)) != 200 ||
           scrape_value(text, "ps_server_keys") < 1) {
      REQUIRE(clock_now_s() < deadline, "shard %d never got the layout", i);
      clock_sleep_ms(20);
    }
  }
  if (attacked) {
    /* the baseline once the shards' buffers and UCX's pools have grown to
     * what training needs: at the layout they are still growing */
    for (int i = 0; i < S; i++) {
      double deadline = clock_now_s() + 30;
      while (scrape_get(http[i], "/metrics", text, sizeof(text)) != 200 ||
             scrape_value(text, "ps_server_updates_total") < 200) {
        REQUIRE(clock_now_s() < deadline, "shard %d made no 200 updates within 30 s", i);
        clock_sleep_ms(20);
      }
    }
    for (int i = 0; i < S; i++) {
      r->fds0[i] = count_fds(srv[i].pid);
      r->rss0_kb[i] = status_kb(srv[i].pid, "VmRSS");
    }
    char hbin[512], hout[S][512], hlog[S][512], seed[S][16];
    harness_bin("tools/ps-hostile", hbin, sizeof(hbin));
    pid_t hostile[S];
    for (int i = 0; i < S; i++) {
      snprintf(seed[i], sizeof(seed[i]), "%d", 300 + i);
      snprintf(hout[i], sizeof(hout[i]), "%s/hostile-%d.out", harness_dir(), i);
      snprintf(hlog[i], sizeof(hlog[i]), "%s/hostile-%d.log", harness_dir(), i);
      const char *argv[] = {hbin,
                            "--transport",
                            "ucx",
                            "--server",
                            srv[i].addr,
                            "--seed",
                            seed[i],
                            "--world-size=2",
                            "--connections=64",
                            "--threads=4",
                            "--frames=100000",
                            ATTACK_SECONDS,
                            "--drain-seconds=" DRAIN_S,
                            "--slowloris=2",
                            "--idle=2",
                            NULL};
      hostile[i] = harness_spawn(argv, hout[i], hlog[i]);
    }
    for (int i = 0; i < S; i++) {
      int st = harness_wait(hostile[i], 60000);
      REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "ps-hostile %d: status %d", i, st);
    }
    for (int i = 0; i < S; i++) {
      REQUIRE(running(srv[i].pid), "shard %d died during the attack", i);
      REQUIRE(scrape_get(http[i], "/metrics", text, sizeof(text)) == 200, "GET /metrics");
      char hline[LINE_BYTES];
      read_line(hout[i], "hostile frames=", hline);
      REQUIRE(hline[0], "no summary from ps-hostile %d", i);
      check_attack(i, hline, text, r);
      wait_settled(i, srv[i].pid, r);
    }
    for (int w = 0; w < W; w++)
      REQUIRE(running(workers[w]), "worker %d ended while the holder rank held the job", w);
    r->steps_attacked = atomic_load(&h.steps);
  }
  atomic_store(&h.release, true);
  pthread_join(h.thread, NULL);
  REQUIRE(h.status == PS_OK && atomic_load(&h.steps) == STEPS,
          "the holder rank: %s after %d of %d steps: %s", ps_strerror(h.status),
          atomic_load(&h.steps), STEPS, h.err);
  for (int w = 0; w < W; w++) {
    int st = harness_wait(workers[w], 120000);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s worker %d: status %d",
            attacked ? "attacked" : "clean", w, st);
  }
  r->seconds = clock_now_s() - t0;
  read_line(out0, "summary accuracy=", r->summary);
  REQUIRE(r->summary[0], "rank 0 printed no summary (%s)", out0);
  for (int i = 0; i < S; i++) {
    int st = harness_wait(srv[i].pid, 15000);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "shard %d: status %d", i, st);
    char stop[LINE_BYTES];
    read_line(srv[i].log, "msg=\"stopping\"", stop);
    REQUIRE(stop[0], "shard %d logged no stop line", i);
    REQUIRE(field(stop, "refused_connections") == 0 && field(stop, "auth_failures") == 0,
            "shard %d refused a worker: %s", i, stop);
    int logged = harness_grep(srv[i].log, "ucx listener refused a peer");
    if (!attacked)
      REQUIRE(field(stop, "rejected_frames") == 0 && logged == 0, "the clean run had errors: %s",
              stop);
    else
      REQUIRE(logged == 1, "shard %d logged its refusals %d times (once per address a minute)", i,
              logged);
  }
}

static size_t read_all(const char *path, char **out) {
  FILE *f = fopen(path, "rb");
  REQUIRE(f, "no parameter dump %s", path);
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  *out = malloc((size_t)n + 1);
  REQUIRE(*out && fread(*out, 1, (size_t)n, f) == (size_t)n, "read %s", path);
  fclose(f);
  return (size_t)n;
}

int main(void) {
#ifdef PS_TEST_NO_UCX
  printf("SKIP: this build has no UCX transport\n");
  return 77;
#endif
  harness_require_dataset();
  setenv("PS_TRANSPORT", "ucx", 1);
  setenv("UCX_TLS", "tcp", 0); /* as workers beside other jobs: the tcp lanes are attacked */
  char token[512], clean[512], attacked[512];
  harness_token_file("token", token, sizeof(token));
  snprintf(clean, sizeof(clean), "%s/clean.bin", harness_dir());
  snprintf(attacked, sizeof(attacked), "%s/attacked.bin", harness_dir());
  static struct run rc, ra;
  run_job(false, token, clean, &rc);
  run_job(true, token, attacked, &ra);

  char *a, *b;
  size_t na = read_all(clean, &a), nb = read_all(attacked, &b);
  REQUIRE(na == nb && na > 0 && memcmp(a, b, na) == 0,
          "the attacked run's parameters differ from the clean run's (%zu vs %zu bytes)", na, nb);
  free(a);
  free(b);
  double acc_c = field(rc.summary, "accuracy"), acc_a = field(ra.summary, "accuracy");
  REQUIRE(acc_c == acc_a, "test accuracy %.4f attacked, %.4f clean", acc_a, acc_c);
  long cap_kb = (long)(HARNESS_UNDER_ASAN ? RSS_CAP_ASAN_MB : RSS_CAP_MB) * 1024;
  for (int i = 0; i < S; i++) {
    /* ASan keeps freed memory in its quarantine (256 MB): RSS grows with
     * every connection there and says nothing of a leak (38 -> 251 MB in
     * CI); LeakSanitizer checks leaks instead, the peak cap still holds */
    REQUIRE(HARNESS_UNDER_ASAN || ra.rss1_kb[i] <= ra.rss0_kb[i] + RSS_SLACK_KB,
            "shard %d's RSS went from %ld kB before the attack to %ld kB after it", i,
            ra.rss0_kb[i], ra.rss1_kb[i]);
    REQUIRE(ra.peak_kb[i] > 0 && ra.peak_kb[i] <= cap_kb, "shard %d peaked at %ld kB (cap %ld)", i,
            ra.peak_kb[i], cap_kb);
  }
  printf(
      "hostile ucx: %llu connections, %llu dropped by the shards while ps-hostile waited, "
      "%llu refusals counted; fds %ld/%ld before, %ld/%ld after; RSS %ld/%ld kB before, "
      "%ld/%ld kB after, peak %ld/%ld kB; accuracy %.4f both, parameters identical "
      "(%.1f s clean, %.1f s attacked; %d of %d steps trained when the checks ended)\n",
      (unsigned long long)ra.conns, (unsigned long long)ra.drops, (unsigned long long)ra.refused,
      ra.fds0[0], ra.fds0[1], ra.fds1[0], ra.fds1[1], ra.rss0_kb[0], ra.rss0_kb[1], ra.rss1_kb[0],
      ra.rss1_kb[1], ra.peak_kb[0], ra.peak_kb[1], acc_a, rc.seconds, ra.seconds, ra.steps_attacked,
      STEPS);
  return 0;
}
