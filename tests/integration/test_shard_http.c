/* test_shard_http: a real ps-server's /metrics, /healthz and /readyz while
 * two workers (libps clients in this process) train three BSP steps: the
 * counters match what was sent (pushes, pulls, updates, bytes, and
 * ps_stats over the wire), every key's version and every worker's clock
 * reach 3, a garbage client shows up as one bad_frame error and one rejected
 * frame. Then worker 0 ends the training: with --exit-when-done=false the
 * shard stops serving workers but keeps answering (/readyz 503 "done",
 * ps_server_training_done 1, no connections) until SIGTERM, which ends it
 * with 0. Also: an --http port already in use exits 1 and a malformed one 2,
 * each naming --http. Checkpoints (--checkpoint-every 1): enabled, none before
 * training, then written, with their clock and age (steps since) exported. */
#include <arpa/inet.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "harness.h"
#include "net.h"
#include "ps.h"
#include "scrape.h"
#include "ucx_link.h"

#define W 2
#define K 3
#define NT 2
static const char *const names[NT] = {"w", "b"};
static const uint64_t counts[NT] = {300, 7}; /* one key each */

static double metric(const char *addr, const char *series) {
  static char text[1 << 18];
  int st = scrape_get(addr, "/metrics", text, sizeof(text));
  REQUIRE(st == 200, "GET /metrics: %d", st);
  return scrape_value(text, series);
}

/* Over UCX (PS_TRANSPORT=ucx): the junk as one active message; the shard
 * refuses it and closes. */
static bool ucx_gone;
static void gone(struct ulink_ep *ep, const char *why, void *arg) {
  (void)ep, (void)why, (void)arg;
  ucx_gone = true;
}
static struct ulink *gu;
static void drop(struct ulink_rx *rx, void *arg) {
  (void)arg;
  ulink_rx_free(gu, rx);
}
static void nothing(void *arg, int status) {
  (void)arg, (void)status;
}

static void garbage_client_ucx(const char *server_addr, const char *junk, size_t n) {
  struct ulink *u = NULL;
  struct ulink_ep *ep = NULL;
  struct net_addr a;
  char err[256];
  struct ulink_cbs cbs = {.on_rx = drop, .on_error = gone};
  REQUIRE(net_parse_addr(server_addr, &a, 0, err, sizeof(err)) == 0, "addr");
  REQUIRE(ulink_new(false, &cbs, &u, err, sizeof(err)) == 0, "ucx: %s", err);
  gu = u;
  REQUIRE(ulink_connect(u, a.host, a.port, &ep, err, sizeof(err)) == 0, "ucx: %s", err);
  REQUIRE(ulink_send(ep, junk, n, NULL, 0, nothing, NULL) == 0, "ucx send");
  uint64_t until = clock_now_ns() + 5000000000u;
  while (!ucx_gone && clock_now_ns() < until) ulink_progress(u);
  REQUIRE(ucx_gone, "the shard kept a UCX garbage client open");
  ulink_ep_close(ep, false);
  ulink_free(u);
}

static void garbage_client(const char *server_addr) {
  static const char junk[32] = "this is not a PS01 frame at all";
  const char *tr = getenv("PS_TRANSPORT");
  if (tr && strcmp(tr, "ucx") == 0) {
    garbage_client_ucx(server_addr, junk, sizeof(junk));
    return;
  }
  const char *colon = strrchr(server_addr, ':');
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(colon + 1))};
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0, "connect");
  REQUIRE(send(fd, junk, sizeof(junk), MSG_NOSIGNAL) == (ssize_t)sizeof(junk), "send");
  char buf[256];
  while (recv(fd, buf, sizeof(buf), 0) > 0) {
  }
  close(fd);
}

static void refused_starts(void) {
  char bin[512], log[600], addr[64];
  harness_bin("ps-server/ps-server", bin, sizeof(bin));
  /* a port in use: start one shard, then a second on the first one's HTTP port */
  struct test_server a;
  harness_start_server(&a, 0, 1, 1, 0.1, NULL);
  REQUIRE(scrape_http_addr(a.log, addr, sizeof(addr), 5000) == 0, "no http address in %s", a.log);
  snprintf(log, sizeof(log), "%s/inuse.log", harness_dir());
  const char *argv1[] = {bin, "--listen", "127.0.0.1:0", "--shard", "0", "--http", addr, NULL};
  int st = harness_wait(harness_spawn(argv1, NULL, log), 10000);
  REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 1, "port in use: status %d", st);
  REQUIRE(harness_grep(log, "--http") == 1, "message does not name --http");
  snprintf(log, sizeof(log), "%s/bad.log", harness_dir());
  const char *argv2[] = {bin, "--listen", "127.0.0.1:0", "--shard",
                         "0", "--http",   "nonsense",    NULL};
  st = harness_wait(harness_spawn(argv2, NULL, log), 10000);
  REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 2, "bad address: status %d", st);
  REQUIRE(harness_grep(log, "--http") == 1, "message does not name --http");
  st = harness_stop(a.pid, SIGTERM, 10000);
  REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "first shard: status %d", st);
}

int main(void) {
  char ckdir[600];
  snprintf(ckdir, sizeof(ckdir), "%s/ckpt", harness_dir());
  const char *const extra[] = {
      "--exit-when-done=false", "--checkpoint-dir", ckdir, "--checkpoint-every", "1", NULL};
  struct test_server s;
  harness_start_server(&s, 0, 1, W, 0.1, extra);
  char addr[64], body[4096];
  REQUIRE(scrape_http_addr(s.log, addr, sizeof(addr), 5000) == 0, "no http address in %s", s.log);
  REQUIRE(scrape_get(addr, "/readyz", body, sizeof(body)) == 200, "readyz: %s", body);
  REQUIRE(strncmp(body, "ready", 5) == 0, "readyz body: %s", body);
  REQUIRE(scrape_get(addr, "/healthz", body, sizeof(body)) == 200, "healthz: %s", body);
  REQUIRE(scrape_get(addr, "/nope", body, sizeof(body)) == 404, "unknown path");
  REQUIRE(metric(addr, "ps_server_ready") == 1, "ready gauge");
  const char *tr = getenv("PS_TRANSPORT");
  bool on_ucx = tr && strcmp(tr, "ucx") == 0;
  REQUIRE(metric(addr, "ps_server_transport{transport=\"ucx\"}") == on_ucx &&
              metric(addr, "ps_server_transport{transport=\"tcp\"}") == !on_ucx,
          "the transport gauge says %s", on_ucx ? "tcp" : "ucx");
  REQUIRE(metric(addr, "ps_server_connected_workers") == 0, "connections before");
  REQUIRE(metric(addr, "ps_server_checkpoints_enabled") == 1, "checkpoints enabled");
  REQUIRE(metric(addr, "ps_server_checkpoint_clock") == -1, "no checkpoint yet");

  ps_client *c[W];
  const char *servers[1] = {s.addr};
  for (int r = 0; r < W; r++) {
    struct ps_client_opts o = {.servers = servers,
                               .num_servers = 1,
                               .rank = r,
                               .world_size = W,
                               .job_id = "test_shard_http"};
    char err[256];
    REQUIRE(ps_client_new(&o, &c[r], err, sizeof(err)) == PS_OK, "rank %d: %s", r, err);
    REQUIRE(ps_declare(c[r], NT, names, counts) == PS_OK, "declare");
  }
  REQUIRE(metric(addr, "ps_server_connected_workers") == W, "connections during");
  float *p[NT];
  for (int t = 0; t < NT; t++) {
    p[t] = calloc(counts[t], sizeof(float));
    REQUIRE(ps_init(c[0], t, p[t]) == PS_OK, "init");
  }
  for (uint64_t step = 0; step < K; step++) {
    for (int r = 0; r < W; r++)
      for (int t = 0; t < NT; t++) REQUIRE(ps_pull(c[r], t, step, p[t], NULL) == PS_OK, "pull");
    ps_request *req[W][NT];
    for (int r = 0; r < W; r++)
      for (int t = 0; t < NT; t++)
        REQUIRE(ps_push_async(c[r], t, step, p[t], NULL, NULL, &req[r][t]) == PS_OK, "push");
    for (int r = 0; r < W; r++)
      for (int t = 0; t < NT; t++) REQUIRE(ps_wait(req[r][t], NULL) == PS_OK, "push wait");
  }
  struct ps_shard_stats ss;
  REQUIRE(ps_stats(c[0], 0, &ss) == PS_OK, "stats");
  REQUIRE(metric(addr, "ps_server_pushes_total") == (double)(K * W * NT), "pushes %g",
          metric(addr, "ps_server_pushes_total"));
  REQUIRE(metric(addr, "ps_server_pushes_total") == (double)ss.pushes, "pushes vs stats");
  REQUIRE(metric(addr, "ps_server_pulls_total") == (double)(K * W * NT), "pulls %g",
          metric(addr, "ps_server_pulls_total"));
  REQUIRE(metric(addr, "ps_server_updates_total") == (double)(K * NT), "updates");
  double in = metric(addr, "ps_server_received_bytes_total");
  REQUIRE(in >= (double)(K * W * (counts[0] + counts[1]) * 4), "bytes in %g", in);
  REQUIRE(
      metric(addr, "ps_server_sent_bytes_total") >= (double)(K * W * (counts[0] + counts[1]) * 4),
      "bytes out");
  REQUIRE(metric(addr, "ps_server_keys") == NT, "keys");
  REQUIRE(metric(addr, "ps_server_min_version") == K, "min version");
  REQUIRE(metric(addr, "ps_server_worker_clock{rank=\"0\"}") == K, "clock 0");
  REQUIRE(metric(addr, "ps_server_worker_clock{rank=\"1\"}") == K, "clock 1");
  {
    static char text[1 << 18];
    scrape_get(addr, "/metrics", text, sizeof(text));
    int versions = 0;
    for (const char *q = text; (q = strstr(q, "ps_server_key_version{key=\"")); q++) {
      const char *v = strchr(q, ' ');
      REQUIRE(v && atof(v + 1) == K, "key version line: %.60s", q);
      versions++;
    }
    REQUIRE(versions == NT, "%d key series", versions);
  }

  /* a checkpoint every version: the newest one is at most K, and its age is
   * the steps applied since */
  double written = 0;
  for (int i = 0; i < 300 && written < 1; i++) {
    written = metric(addr, "ps_server_checkpoints_total{result=\"written\"}");
    if (written < 1) clock_sleep_ms(10);
  }
  REQUIRE(written >= 1, "no checkpoint written");
  double ck = metric(addr, "ps_server_checkpoint_clock");
  REQUIRE(ck >= 0 && ck <= K, "checkpoint clock %g", ck); /* 0: the initial values */
  REQUIRE(metric(addr, "ps_server_checkpoint_age_steps") == K - ck, "checkpoint age %g",
          metric(addr, "ps_server_checkpoint_age_steps"));
  REQUIRE(metric(addr, "ps_server_checkpoint_bytes") > 0, "checkpoint bytes");
  /* and in seconds: it grows while nothing newer is written (the event:
   * a quarter of a second more, seen within 30 s) */
  double age1 = metric(addr, "ps_server_checkpoint_age_seconds"), age2 = age1;
  for (int i = 0; i < 3000 && age2 - age1 < 0.25; i++) {
    clock_sleep_ms(10);
    age2 = metric(addr, "ps_server_checkpoint_age_seconds");
  }
  REQUIRE(age1 >= 0 && age1 < 60 && age2 - age1 >= 0.25,
          "checkpoint age %g s, and %g s at most while nothing was written", age1, age2);

  garbage_client(s.addr);
  REQUIRE(metric(addr, "ps_server_errors_total{kind=\"bad_frame\"}") == 1, "bad_frame count");
  REQUIRE(metric(addr, "ps_server_rejected_frames_total") == 1, "rejected frames");

  /* the end of training: the shard lingers, answering, until SIGTERM */
  REQUIRE(ps_shutdown_servers(c[0]) == PS_OK, "shutdown");
  for (int r = 0; r < W; r++) ps_client_free(c[r]);
  for (int t = 0; t < NT; t++) free(p[t]);
  int st = -1;
  for (int i = 0; i < 500; i++) {
    st = scrape_get(addr, "/readyz", body, sizeof(body));
    if (st == 503 && strncmp(body, "done", 4) == 0) break;
    clock_sleep_ms(10);
  }
  REQUIRE(st == 503 && strncmp(body, "done", 4) == 0, "readyz after shutdown: %d %s", st, body);
  REQUIRE(metric(addr, "ps_server_training_done") == 1, "done gauge");
  /* The workers' connections close asynchronously (over UCX the shard
   * learns it when its endpoint reports the peer gone): wait for the count
   * to reach 0, up to 30 s. */
  double conns = metric(addr, "ps_server_connected_workers");
  for (int i = 0; i < 3000 && conns != 0; i++) {
    clock_sleep_ms(10);
    conns = metric(addr, "ps_server_connected_workers");
  }
  REQUIRE(conns == 0, "connections after: %g, 30 s after the workers closed", conns);
  REQUIRE(metric(addr, "ps_server_pushes_total") == (double)(K * W * NT), "final pushes");
  REQUIRE(scrape_get(addr, "/healthz", body, sizeof(body)) == 200, "healthz after");
  clock_sleep_ms(300);
  REQUIRE(waitpid(s.pid, &st, WNOHANG) == 0, "the shard exited instead of lingering");
  st = harness_stop(s.pid, SIGTERM, 10000);
  REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "SIGTERM while lingering: status %d",
          st);
  REQUIRE(scrape_get(addr, "/healthz", body, sizeof(body)) == -1, "still answering after exit");

  refused_starts();
  printf("ok\n");
  return 0;
}
