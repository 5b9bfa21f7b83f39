/* coll_child: see coll_child.h. */
#include "coll_child.h"

#include <stdio.h>
#include <string.h>

#include "clock.h"
#include "harness.h"

struct ps_coll_opts coll_child_opts(const struct ring_ports *g, int rank, const char *job,
                                    const ps_token *token) {
  return (struct ps_coll_opts){.rank = rank,
                               .world_size = g->world,
                               .peers = g->peers,
                               .job_id = job,
                               .listen_fd = g->lfd[rank],
                               .connect_timeout_ms = 10000,
                               .peer_timeout_ms = 3000,
                               .auth_token = token};
}

ps_coll *coll_child_open(const struct ps_coll_opts *o, int fd) {
  ps_coll *c;
  char err[512];
  ps_status st = ps_coll_open(o, &c, err, sizeof(err));
  if (st == PS_OK) return c;
  dprintf(fd, "rank %d: open: %s: %s\n", o->rank, ps_strerror(st), err);
  return NULL;
}

void coll_child_report(ps_coll *c, ps_status st, int fd) {
  char msg[512];
  dprintf(fd, "%d %d %s", (int)st, ps_coll_lost_rank(c), ps_coll_errmsg(c, msg, sizeof(msg)));
}

void coll_expect_lost(const char *what, int world, int dead, const char *out, size_t out_len,
                      const int *status, double t0) {
  REQUIRE(ring_exited(status[dead], 3), "%s: the dying rank %d ended with status %d", what, dead,
          status[dead]);
  char name[32];
  snprintf(name, sizeof(name), "rank %d", dead);
  for (int r = 0; r < world; r++) {
    if (r == dead) continue;
    const char *o = out + (size_t)r * out_len;
    int st = -1, lost = -9;
    REQUIRE(ring_exited(status[r], 0) && sscanf(o, "%d %d", &st, &lost) == 2,
            "%s: rank %d (status %d): %s", what, r, status[r], o);
    REQUIRE(st == PS_ERR_IO && lost == dead && strstr(o, name),
            "%s: rank %d should fail naming rank %d: %s", what, r, dead, o);
    printf("%s: rank %d died: rank %d: %s\n", what, dead, r, o);
  }
  REQUIRE(clock_now_s() - t0 < 15, "%s: the failure took %.1f s", what, clock_now_s() - t0);
}
