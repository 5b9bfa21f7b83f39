/* test_worker_http: two real ps-worker processes train one epoch through two
 * shards with --http and --exit-when-done=false, and their endpoints are
 * checked at each stage the kubelet would probe:
 *  - shard 1 is stopped (SIGSTOP) while the workers start: they reach its
 *    port but get no hello back, so /readyz is 503 "starting", /healthz 200;
 *  - mid-training shard 0 is stopped: the workers stall with every
 *    connection up, so /readyz is 200 with "2 of 2 shards", and /metrics
 *    shows steps, pushes, pulls, bytes and the step-time histogram;
 *  - after training /readyz is 503 "done", ps_worker_training_done is 1, the
 *    step count is the epoch's 234 steps, the client's counters survive the
 *    client, and the process lingers until SIGTERM, then exits 0.
 * A malformed --http exits 2 naming the option. Skips (77) without the
 * Fashion-MNIST files. */
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "harness.h"
#include "scrape.h"

#define W 2

static char text[1 << 18];

static double metric(const char *addr, const char *series) {
  int st = scrape_get(addr, "/metrics", text, sizeof(text));
  REQUIRE(st == 200, "GET %s/metrics: %d", addr, st);
  return scrape_value(text, series);
}

int main(void) {
  harness_require_dataset();
  struct test_server s[2];
  for (int i = 0; i < 2; i++) harness_start_server(&s[i], i, 2, W, 0.1, NULL);
  kill(s[1].pid, SIGSTOP);
  char servers[200], bin[512], logs[W][512], addr[W][64], body[1024], ranks[W][8];
  snprintf(servers, sizeof(servers), "%s,%s", s[0].addr, s[1].addr);
  harness_bin("ps-worker/ps-worker", bin, sizeof(bin));
  pid_t pid[W];
  for (int r = 0; r < W; r++) {
    snprintf(ranks[r], sizeof(ranks[r]), "%d", r);
    snprintf(logs[r], sizeof(logs[r]), "%s/worker-%d.log", harness_dir(), r);
    const char *argv[] = {bin,      "--servers",    servers,       "--rank",
                          ranks[r], "--world-size", "2",           "--epochs",
                          "1",      "--http",       "127.0.0.1:0", "--exit-when-done=false",
                          NULL};
    pid[r] = harness_spawn(argv, NULL, logs[r]);
  }
  for (int r = 0; r < W; r++)
    REQUIRE(scrape_http_addr(logs[r], addr[r], sizeof(addr[r]), 10000) == 0, "no address in %s",
            logs[r]);

  /* starting: one shard does not answer its hello */
  clock_sleep_ms(300);
  for (int r = 0; r < W; r++) {
    int st = scrape_get(addr[r], "/readyz", body, sizeof(body));
    REQUIRE(st == 503 && strstr(body, "starting"), "rank %d readyz while starting: %d %s", r, st,
            body);
    REQUIRE(scrape_get(addr[r], "/healthz", body, sizeof(body)) == 200, "healthz while starting");
  }
  REQUIRE(metric(addr[0], "ps_worker_ready") == 0, "ready gauge while starting");
  REQUIRE(metric(addr[0], "ps_worker_rank") == 0 && metric(addr[1], "ps_worker_rank") == 1, "rank");
  REQUIRE(metric(addr[0], "ps_worker_sync_mode{mode=\"ps\"}") == 1, "sync mode");
  const char *tr = getenv("PS_TRANSPORT");
  char series[64];
  snprintf(series, sizeof(series), "ps_worker_transport{transport=\"%s\"}", tr && *tr ? tr : "tcp");
  REQUIRE(metric(addr[0], series) == 1, "%s", series);

  /* training, then stalled on a stopped shard with every connection up */
  kill(s[1].pid, SIGCONT);
  double steps = 0;
  for (int i = 0; i < 2000 && steps < 20; i++) {
    steps = metric(addr[0], "ps_worker_steps_total");
    if (steps < 20) clock_sleep_ms(2);
  }
  REQUIRE(steps >= 20, "training did not start (%g steps)", steps);
  kill(s[0].pid, SIGSTOP);
  clock_sleep_ms(200);
  for (int r = 0; r < W; r++) {
    int st = scrape_get(addr[r], "/readyz", body, sizeof(body));
    REQUIRE(st == 200 && strstr(body, "2 of 2 shards"), "rank %d readyz training: %d %s", r, st,
            body);
    REQUIRE(metric(addr[r], "ps_worker_connected_shards") == 2, "connected shards");
    REQUIRE(metric(addr[r], "ps_worker_shards") == 2, "shards");
    REQUIRE(metric(addr[r], "ps_worker_pushes_total") > 0, "pushes");
    REQUIRE(metric(addr[r], "ps_worker_pulls_total") > 0, "pulls");
    REQUIRE(metric(addr[r], "ps_worker_sent_bytes_total") > 1e5, "bytes sent");
    REQUIRE(metric(addr[r], "ps_worker_received_bytes_total") > 1e5, "bytes received");
    REQUIRE(metric(addr[r], "ps_worker_gradient_bytes_total") > 1e5, "gradient bytes");
    REQUIRE(metric(addr[r], "ps_worker_ready") == 1, "ready gauge");
  }
  steps = metric(addr[0], "ps_worker_steps_total");
  REQUIRE(metric(addr[0], "ps_worker_step_seconds_count") == steps, "histogram count");
  REQUIRE(metric(addr[0], "ps_worker_samples_total") == steps * 128, "samples");
  REQUIRE(metric(addr[0], "ps_worker_step") >= steps, "clock");
  clock_sleep_ms(100);
  REQUIRE(metric(addr[0], "ps_worker_steps_total") <= steps + 1, "steps moved while stalled");
  kill(s[0].pid, SIGCONT);

  /* done: lingering with final numbers until SIGTERM */
  for (int r = 0; r < W; r++) {
    int st = -1;
    for (int i = 0; i < 3000; i++) {
      st = scrape_get(addr[r], "/readyz", body, sizeof(body));
      if (st == 503 && strncmp(body, "done", 4) == 0) break;
      clock_sleep_ms(10);
    }
    REQUIRE(st == 503 && strncmp(body, "done", 4) == 0, "rank %d readyz after: %d %s", r, st, body);
    REQUIRE(metric(addr[r], "ps_worker_training_done") == 1, "done gauge");
    REQUIRE(metric(addr[r], "ps_worker_steps_total") == 234, "steps %g",
            metric(addr[r], "ps_worker_steps_total"));
    REQUIRE(metric(addr[r], "ps_worker_pushes_total") > 0, "pushes after the client is gone");
    REQUIRE(metric(addr[r], "ps_worker_connected_shards") == 0, "connections after");
  }
  for (int i = 0; i < 2; i++) {
    int st = harness_wait(s[i].pid, 10000);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "shard %d: status %d", i, st);
  }
  clock_sleep_ms(200);
  for (int r = 0; r < W; r++) {
    int st;
    REQUIRE(waitpid(pid[r], &st, WNOHANG) == 0, "rank %d exited instead of lingering", r);
    st = harness_stop(pid[r], SIGTERM, 10000);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "rank %d after SIGTERM: status %d", r,
            st);
  }

  char log[600];
  snprintf(log, sizeof(log), "%s/bad-http.log", harness_dir());
  const char *bad[] = {bin, "--servers", "127.0.0.1:1", "--http", "nonsense", NULL};
  int st = harness_wait(harness_spawn(bad, NULL, log), 10000);
  REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 2, "bad --http: status %d", st);
  REQUIRE(harness_grep(log, "--http") == 1, "message does not name --http");
  printf("ok\n");
  return 0;
}
