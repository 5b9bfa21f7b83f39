/* A lost ring peer stops every other rank in bounded time, with a message
 * naming the lost rank and the retryable exit code 129 (never a hang).
 *
 * Three rings of W=3 ps-worker processes train with --peer-timeout-ms 1500;
 * once every rank is training, one rank is
 *  - killed with SIGKILL (rank 1, a middle rank): its sockets close, its
 *    neighbours see it at once and rank 0 tells the third;
 *  - killed with SIGKILL (rank 0, the hub of the control connections);
 *  - stopped with SIGSTOP (rank 2): nothing closes, so only the missing
 *    heartbeats reveal it, after the peer timeout.
 * The survivors must exit 129 within the bound and their logs must say
 * "lost rank N". */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "harness.h"
#include "ring_workers.h"

static void scenario(const char *name, int victim, int sig, double bound_s) {
  const char *args[] = {"--epochs", "20",          "--batch-size", "32", "--peer-timeout-ms",
                        "1500",     "--log-every", "20",           NULL};
  struct ring_workers rw;
  ring_workers_start(&rw, 3, args, NULL);
  /* Every rank is past the rendezvous and rank 0 reports progress. */
  double t0 = clock_now_s();
  for (;;) {
    int ready = harness_grep(rw.log[0], "msg=\"progress\"") > 0;
    for (int r = 0; r < 3; r++) ready = ready && harness_grep(rw.log[r], "msg=\"training\"") > 0;
    if (ready) break;
    for (int r = 0; r < 3; r++) {
      int st;
      REQUIRE(waitpid(rw.pid[r], &st, WNOHANG) == 0, "%s: rank %d exited before the fault", name,
              r);
    }
    REQUIRE(clock_now_s() - t0 < 30, "%s: training did not start within 30 s", name);
    clock_sleep_ms(20);
  }
  clock_sleep_ms(200);
  kill(rw.pid[victim], sig);
  double t_fault = clock_now_s();
  char needle[32];
  snprintf(needle, sizeof(needle), "lost rank %d", victim);
  for (int r = 0; r < 3; r++) {
    if (r == victim) continue;
    double left = bound_s - (clock_now_s() - t_fault);
    int st = harness_wait(rw.pid[r], left > 0 ? (int)(left * 1000) : 1);
    double took = clock_now_s() - t_fault;
    REQUIRE(st >= 0, "%s: rank %d still running %.1f s after the fault (bound %.1f s)", name, r,
            took, bound_s);
    REQUIRE(WIFEXITED(st) && WEXITSTATUS(st) == 129,
            "%s: rank %d should exit 129 (retryable), got status 0x%x", name, r, st);
    REQUIRE(harness_grep(rw.log[r], needle) > 0, "%s: rank %d's log does not say \"%s\"", name, r,
            needle);
    printf("%-16s rank %d exited 129 after %.2f s, naming rank %d\n", name, r, took, victim);
  }
  if (sig == SIGSTOP) { /* found by the heartbeat timeout given, not the 10 s default */
    int said = 0;
    for (int r = 0; r < 3; r++)
      said += r != victim && harness_grep(rw.log[r], "silent for 1500 ms") > 0;
    REQUIRE(said > 0, "%s: no rank says rank %d was silent for --peer-timeout-ms 1500", name,
            victim);
  }
  if (sig == SIGSTOP) kill(rw.pid[victim], SIGKILL);
  harness_wait(rw.pid[victim], 5000);
}

int main(void) {
  harness_require_dataset();
  /* Bounds of 10 times what they take unloaded, for a loaded machine: the
   * event is the exit 129 naming the lost rank. A close is seen at once; a
   * stop after 1.5 s of silence, then heartbeat checks every 375 ms: about
   * 2 s. */
  scenario("SIGKILL rank 1", 1, SIGKILL, 20.0);
  scenario("SIGKILL rank 0", 0, SIGKILL, 20.0);
  scenario("SIGSTOP rank 2", 2, SIGSTOP, 20.0);
  return 0;
}
