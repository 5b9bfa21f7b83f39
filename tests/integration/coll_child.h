/* coll_child: what the tests of libps's collective group (test_collectives,
 * test_p2p, test_node_first, test_dtypes) do in and around their
 * ring_children_run children: the options every such group opens with,
 * opening it or reporting why not, the checks of a child's script, the
 * report of a failed operation, and the parent's check that a rank that
 * died stopped every other rank, naming it, in bounded time. Links libps
 * (ring_workers.c does not). */
#ifndef PS_TEST_COLL_CHILD_H
#define PS_TEST_COLL_CHILD_H

#include <stddef.h>

#include "collective.h"
#include "ring_workers.h"

/* Rank `rank` of the group on g's ports, job id `job`, with the tests'
 * timeouts (rendezvous 10 s, a silent peer lost after 3 s) and token (NULL
 * = none); the caller sets anything else. */
struct ps_coll_opts coll_child_opts(const struct ring_ports *g, int rank, const char *job,
                                    const ps_token *token);

/* Opens the group of o; NULL after writing "rank R: open: <why>" to fd. */
ps_coll *coll_child_open(const struct ps_coll_opts *o, int fd);

/* The checks of a child's script, where `a` points at a struct with the
 * child's result_fd and rank, `c` is its group and a char msg[] is in
 * scope: COLL_EXPECT is RING_EXPECT on a's fd and rank; COLL_OK(call, what,
 * ...) fails the child unless call returns PS_OK, naming what and the
 * group's error. */
#define COLL_EXPECT(cond, ...) RING_EXPECT(a->result_fd, a->rank, cond, __VA_ARGS__)
#define COLL_OK(call, what, ...)                                              \
  do {                                                                        \
    ps_status st_ = (call);                                                   \
    COLL_EXPECT(st_ == PS_OK, what ": %s: %s", __VA_ARGS__, ps_strerror(st_), \
                ps_coll_errmsg(c, msg, sizeof(msg)));                         \
  } while (0)

/* Writes "<status> <lost rank> <message>" of st and the group to fd, what
 * coll_expect_lost reads. */
void coll_child_report(ps_coll *c, ps_status st, int fd);

/* In the parent, after ring_children_run (out: world rows of out_len):
 * rank `dead` exited 3 (as if killed) and every other rank exited 0 having
 * reported (coll_child_report) PS_ERR_IO, lost rank `dead` and a message
 * naming it; all of it within 15 s of t0 (clock_now_s). what names the
 * case in failures; each rank's report is printed. */
void coll_expect_lost(const char *what, int world, int dead, const char *out, size_t out_len,
                      const int *status, double t0);

#endif
