/* rendezvous: how the ps-local processes of a job across hosts (--nodes N)
 * agree on its table and fail together (rendezvous.c has the wire).
 *
 * Node 0 serves the rendezvous on --rendezvous HOST:PORT in a thread of its
 * own (rdzv_serve); every node, node 0 included, is a client of it
 * (rdzv_connect). A node registers the addresses of its shards and of its
 * workers' ring sockets (rdzv_register); once all N did, each gets the
 * whole table, node-major (rdzv_table). Then the connections stay open:
 * each side sends a heartbeat every RDZV_BEAT_MS, a node whose child failed
 * says so (rdzv_fail) and the service tells every other node, and a node
 * that goes silent for RDZV_LOST_MS (or closes without rdzv_done) is
 * reported to the others as failed. */
#ifndef PS_LOCAL_RENDEZVOUS_H
#define PS_LOCAL_RENDEZVOUS_H

#include <stdbool.h>
#include <stddef.h>

struct auth_token;

enum {
  RDZV_BEAT_MS = 1000,      /* heartbeat period, both ways */
  RDZV_LOST_MS = 5000,      /* silence that makes a peer lost */
  RDZV_MSG_MAX = 1 << 20,   /* the table, at most */
  RDZV_HELLO_MAX = 1 << 16, /* a node's registration, at most */
};

struct rdzv_server;
struct rdzv_client;

/* Node 0: binds addr ("HOST:PORT") and serves N nodes from a thread.
 * timeout_ms bounds the wait for all of them. tok NULL = no auth. Returns
 * 0, or -1 with err set. */
int rdzv_serve(struct rdzv_server **out, const char *addr, int nodes, int timeout_ms,
               const struct auth_token *tok, char *err, size_t errlen);
/* Waits up to wait_ms for every node to be done or failed, then stops the
 * thread and frees it. */
void rdzv_server_stop(struct rdzv_server *s, int wait_ms);

/* Every node: connects to the rendezvous (retrying until timeout_ms) and
 * reads its nonce. host gets this node's address as the rendezvous sees it
 * (where its shards and ring listen). Returns 0, or -1 with err set. */
int rdzv_connect(struct rdzv_client **out, const char *addr, int node, int nodes, int timeout_ms,
                 const struct auth_token *tok, char *host, size_t hostlen, char *err,
                 size_t errlen);
/* Sends this node's shards and ring addresses (comma-separated, "" = none). */
int rdzv_register(struct rdzv_client *c, const char *shards, const char *peers, char *err,
                  size_t errlen);
/* The fd to poll for input. */
int rdzv_fd(const struct rdzv_client *c);
/* Reads what arrived and sends a heartbeat when due; never blocks. Returns
 * 0 (nothing decisive), 1 once the table arrived (rdzv_table), or -1: the
 * job failed elsewhere, why in err ("node I (host) failed: what"). */
int rdzv_poll(struct rdzv_client *c, char *err, size_t errlen);
/* The table once rdzv_poll returned 1: every node's shards and ring
 * addresses, node 0 first (owned by c). */
void rdzv_table(const struct rdzv_client *c, const char **servers, const char **peers);
/* Tells the others that this node failed (what), or finished. */
void rdzv_fail(struct rdzv_client *c, const char *what);
void rdzv_done(struct rdzv_client *c);
void rdzv_close(struct rdzv_client *c);

#endif
