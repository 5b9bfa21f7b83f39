/* store: a shard's keys and the BSP sync engine.
 *
 * The store knows nothing about sockets. It holds the layout (the first one a
 * worker declares), the keys this shard owns under the deterministic
 * placement, and per key: the parameters, the version, the gradient sum of the
 * current step and, per worker rank, the last step it pushed. Parameters live
 * in a reference-counted buffer (struct vbuf) so a pull reply can be written
 * to the socket straight from it; an update that finds the buffer still
 * referenced by a write in flight writes a fresh one instead (copy on write).
 *
 * BSP: a key at version v accepts each rank's step-v gradient once; when all
 * num_workers have pushed, it averages them, applies the optimizer and
 * becomes v+1.
 * A push for a step below v, or one the rank already made, is a resend after
 * reconnect: acknowledged as a duplicate and not applied. Pulls that ask for a
 * version not reached yet wait in the key's queue; the store hands them back
 * to the caller through the serve callback when the version arrives. */
#ifndef PS_STORE_H
#define PS_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "optimizer.h"
#include "placement.h"

struct vbuf {
  uint32_t refs;
  uint64_t count;
  float data[];
};
struct vbuf *vbuf_ref(struct vbuf *b);
void vbuf_unref(struct vbuf *b);

struct store_layout {
  uint32_t num_tensors;
  char **names;
  uint64_t *counts;
  uint64_t chunk_bytes;
  uint32_t num_shards;
  uint64_t hash;
};

/* A pull that waits for a version; owned by the store while queued. */
struct store_waiter {
  struct store_waiter *next;
  void *conn; /* opaque to the store */
  uint64_t request_id;
  uint64_t min_version;
};

struct store_key {
  uint64_t key;
  uint64_t count;
  struct vbuf *params; /* NULL until initialised */
  float *sum;          /* gradient sum of the current step */
  float *opt_state;    /* optimizer state, allocated on the first update */
  uint32_t pushed;     /* pushes in sum */
  uint64_t version;
  uint64_t *next_step; /* per rank: last step pushed + 1 (0 = none yet) */
  struct store_waiter *waiters;
};

struct store_stats {
  uint64_t pushes, pulls, updates, duplicates, bytes_in, bytes_out;
};

struct store_opts {
  uint32_t shard;
  uint32_t num_shards;
  uint32_t num_workers;
  struct opt_params opt;
};

/* Called for each waiter whose version has arrived; the callee owns w after. */
typedef void (*store_serve_fn)(struct store_key *k, struct store_waiter *w, void *arg);

struct store {
  struct store_opts opts;
  bool has_layout;
  struct store_layout layout;
  struct placement placement;
  struct store_key *keys; /* this shard's keys, sorted by key */
  size_t num_keys;
  uint64_t param_bytes;
  struct store_stats stats;
  store_serve_fn serve;
  void *serve_arg;
};

enum store_push_result { STORE_APPLIED = 0, STORE_DUPLICATE = 1 };

int store_init(struct store *s, const struct store_opts *opts, store_serve_fn serve, void *arg);
void store_deinit(struct store *s);

/* Takes the layout (copied). The first call defines it; later calls must be
 * equal. Returns 0, -EINVAL (bad layout; msg says why) or -EEXIST (mismatch). */
int store_set_layout(struct store *s, const struct store_layout *l, char *msg, size_t msglen);

struct store_key *store_find(struct store *s, uint64_t key);

/* Initial values of k (count floats). Returns 1 if k was already initialised
 * (values ignored: a rejoining rank 0 must not overwrite trained values). */
int store_init_key(struct store *s, struct store_key *k, const float *values);

/* A push of rank's step-`step` gradient. Returns STORE_APPLIED,
 * STORE_DUPLICATE, or -EINVAL with msg set (uninitialised key, bad rank,
 * step ahead of the key's version). */
int store_push(struct store *s, struct store_key *k, uint32_t rank, uint64_t step,
               const float *grad, char *msg, size_t msglen);

/* True if a pull for min_version can be answered now. */
static inline bool store_ready(const struct store_key *k, uint64_t min_version) {
  return k->params && k->version >= min_version;
}

/* Queues a waiting pull (takes ownership of w). */
void store_wait(struct store *s, struct store_key *k, struct store_waiter *w);

/* Removes and frees every waiter of conn (the connection closed). */
void store_drop_waiters(struct store *s, const void *conn);

#endif
