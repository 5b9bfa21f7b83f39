/* ps_coll_abort: a rank fails the collective group on purpose (it found the
 * ranks inconsistent), in W = 2 and 3 real processes on 127.0.0.1.
 *
 * Rank 1 queues an all-reduce its peers never start, which runs in the ring
 * waiting for them; then the aborting rank (rank 0, and in a second run of
 * W = 3 rank 2, whose failure reaches the others through rank 0) calls
 * ps_coll_abort with a reason. On every rank the pending operation (rank
 * 1's) and the next one fail with PS_ERR_STATE, ps_coll_errmsg says "rank
 * R: reason", a second abort changes nothing (the first failure stands),
 * and ps_coll_close returns: the whole run ends within a bound. */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#include "clock.h"
#include "coll_child.h"
#include "collective.h"
#include "harness.h"
#include "ring_workers.h"

#define MAX_W 3
#define REASON "the ranks ran different numbers of steps"

struct scene { /* shared by the children (MAP_SHARED) */
  int aborter;
  atomic_int queued; /* rank 1's all-reduce is queued and running */
};

struct child_arg {
  int rank, result_fd;
};

static int child(void *ctx, struct ring_ports *g, int rank, int fd) {
  struct scene *sc = ctx;
  struct child_arg arg = {rank, fd}, *a = &arg;
  struct ps_coll_opts o = coll_child_opts(g, rank, "coll_abort", NULL);
  ps_coll *c = coll_child_open(&o, fd);
  if (!c) return 1;
  char msg[700];
  static float x[1000];
  ps_coll_request *req = NULL;
  ps_status pending = PS_OK;
  if (rank == 1) {
    COLL_OK(ps_coll_allreduce_async(c, x, 1000, PS_REDOP_SUM, &req), "%s", "queue");
    clock_sleep_ms(100); /* into the ring, where only abort_efd wakes it */
    atomic_store(&sc->queued, 1);
  }
  if (rank == sc->aborter) {
    for (int i = 0; i < 1000 && !atomic_load(&sc->queued); i++) clock_sleep_ms(10);
    COLL_EXPECT(atomic_load(&sc->queued), "rank 1 never queued its all-reduce");
    COLL_OK(ps_coll_abort(c, REASON), "%s", "abort");
  }
  if (req) pending = ps_coll_wait(req);
  ps_status next = ps_coll_allreduce(c, x, 1000, PS_REDOP_SUM);
  ps_coll_errmsg(c, msg, sizeof(msg));
  COLL_OK(ps_coll_abort(c, "a second reason"), "%s", "abort again");
  char again[700];
  ps_coll_errmsg(c, again, sizeof(again));
  COLL_EXPECT(strcmp(msg, again) == 0, "a second abort changed the message: %s", again);
  COLL_EXPECT(
      ps_coll_abort(NULL, REASON) == PS_ERR_INVALID && ps_coll_abort(c, NULL) == PS_ERR_INVALID,
      "NULL arguments accepted");
  dprintf(fd, "%d %d %d %s", (int)pending, (int)next, (int)ps_coll_status(c), msg);
  ps_coll_close(c);
  return 0;
}

static void run(int world, int aborter) {
  struct scene *sc =
      mmap(NULL, sizeof(*sc), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  REQUIRE(sc != MAP_FAILED, "mmap");
  sc->aborter = aborter;
  atomic_init(&sc->queued, 0);
  char out[MAX_W][800], blame[80];
  int status[MAX_W];
  snprintf(blame, sizeof(blame), "rank %d: " REASON, aborter);
  double t0 = clock_now_s();
  ring_children_run(world, child, sc, 30000, out[0], sizeof(out[0]), status);
  double took = clock_now_s() - t0;
  for (int r = 0; r < world; r++) {
    int pending = -1, next = -1, now = -1;
    REQUIRE(ring_exited(status[r], 0) && sscanf(out[r], "%d %d %d", &pending, &next, &now) == 3,
            "W=%d, rank %d aborts: rank %d (status %d): %s", world, aborter, r, status[r], out[r]);
    REQUIRE((r != 1 || pending == PS_ERR_STATE) && next == PS_ERR_STATE && now == PS_ERR_STATE,
            "W=%d, rank %d aborts: rank %d: pending %d, next %d, status %d (want PS_ERR_STATE)",
            world, aborter, r, pending, next, now);
    REQUIRE(strstr(out[r], blame), "W=%d: rank %d's message does not say \"%s\": %s", world, r,
            blame, out[r]);
    printf("W=%d, rank %d aborts: rank %d: %s\n", world, aborter, r, strchr(out[r], ' ') + 1);
  }
  REQUIRE(took < 15, "W=%d: the abort took %.1f s to stop every rank", world, took);
  munmap(sc, sizeof(*sc));
}

int main(void) {
  harness_dir();
  run(2, 0);
  run(3, 0);
  run(3, 2);
  return harness_status();
}
