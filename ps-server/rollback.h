/* rollback: the job rollback, as one shard sees it (docs/RELIABILITY.md).
 *
 * A shard restored from a checkpoint (at start, or by a rollback) answers
 * the requests only a job ahead of it can send with ERR_ROLLBACK naming the
 * clock to roll back to. A job rollback has an id, drawn by the shard that
 * finds the job ahead of it and carried by every ERR_ROLLBACK and
 * MSG_ROLLBACK of that rollback. Each shard goes back to the clock once per
 * id: entering it (the finding shard when it first refuses, the others at
 * the first MSG_ROLLBACK with it) it reloads its checkpoint of the clock
 * unless it is exactly there, dropping what the abandoned timeline had
 * added, even half a step; then, until every live rank has sent its
 * MSG_ROLLBACK with that id, it refuses the pushes and pulls of the ranks
 * that have not. So no step passes the clock while a rank still works in
 * the old timeline, a rank's second MSG_ROLLBACK for the same id only
 * counts it in, and ranks rolling back at different moments can no longer
 * undo each other's redone steps (which livelocked: each rollback reloaded
 * a shard that the other ranks had already moved past the clock again).
 *
 * rollback.c owns struct rollback (server.rb) and is the one module that
 * replaces the shard's store (rollback_replace_store: the reload, and the
 * start over of lost.c). */
#ifndef PS_SERVER_ROLLBACK_H
#define PS_SERVER_ROLLBACK_H

#include <stdbool.h>
#include <stdint.h>

#include "wire.h"

struct conn;
struct server;
struct store;
struct store_key;

struct rollback {
  bool restored;           /* the store came from a checkpoint (start or rollback) */
  uint64_t restored_clock; /* ...of this clock */
  /* while open, a rank that has not sent MSG_ROLLBACK(id) here
   * (rolled_back[rank]) gets ERR_ROLLBACK for every push and pull, so no
   * step passes clock before every live rank is back there */
  uint64_t id; /* 0 = none yet */
  uint64_t clock;
  bool open;
  bool *rolled_back; /* per rank */
};

/* For num_workers ranks. Returns 0 or -ENOMEM. deinit accepts a zeroed rb. */
int rollback_init(struct rollback *rb, uint32_t num_workers);
void rollback_deinit(struct rollback *rb);
/* The shard started from its checkpoint of clock. */
void rollback_restored(struct rollback *rb, uint64_t clock);
/* The job starts over from step 0 (lost.c): nothing restored, none open. */
void rollback_forget(struct rollback *rb);
/* Whether the open rollback still waits for rank's MSG_ROLLBACK. */
bool rollback_waits_for(const struct rollback *rb, uint32_t rank);

/* Before a push of k is taken: refuses it (ERR_ROLLBACK, true) from a rank
 * not counted in to the open rollback, or for a step beyond a restored
 * BSP shard's clock (which starts a job rollback). */
bool rollback_refuses_push(struct conn *c, const wire_header *h, struct store_key *k);
/* A pull of k that is not ready: refuses it (true) from a rank not counted
 * in, or when it asks for a version the shard went back from. */
bool rollback_refuses_pull(struct conn *c, const wire_header *h, struct store_key *k);
/* A pull, before anything: refuses it (true) from a rank not counted in. */
bool rollback_refuses(struct conn *c, const wire_header *h);
/* MSG_ROLLBACK's handler. */
void rollback_handle(struct conn *c, const wire_header *h, const void *payload);

/* s->store becomes *fresh (moved from, so the caller drops it) with the
 * old store's counters and gone ranks (not who left the steps: every rank
 * replays them) and the periodic checkpoint hook. The old store is freed:
 * the caller took its waiting pulls first. */
void rollback_replace_store(struct server *s, struct store *fresh);

#endif
