/* store: keys, versions and the BSP engine of one shard (see store.h). */
#include "store.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor_math.h"

static struct vbuf *vbuf_new(uint64_t count) {
  struct vbuf *b = malloc(sizeof(*b) + count * sizeof(float));
  if (!b) return NULL;
  b->refs = 1;
  b->count = count;
  return b;
}

struct vbuf *vbuf_ref(struct vbuf *b) {
  b->refs++;
  return b;
}

void vbuf_unref(struct vbuf *b) {
  if (b && --b->refs == 0) free(b);
}

int store_init(struct store *s, const struct store_opts *opts, store_serve_fn serve, void *arg) {
  memset(s, 0, sizeof(*s));
  s->opts = *opts;
  s->serve = serve;
  s->serve_arg = arg;
  return 0;
}

static void layout_free(struct store_layout *l) {
  if (l->names)
    for (uint32_t i = 0; i < l->num_tensors; i++) free(l->names[i]);
  free(l->names);
  free(l->counts);
  memset(l, 0, sizeof(*l));
}

void store_deinit(struct store *s) {
  if (!s) return;
  for (size_t i = 0; i < s->num_keys; i++) {
    struct store_key *k = &s->keys[i];
    vbuf_unref(k->params);
    free(k->sum);
    free(k->opt_state);
    free(k->next_step);
    for (struct store_waiter *w = k->waiters, *n; w; w = n) {
      n = w->next;
      free(w);
    }
  }
  free(s->keys);
  placement_free(&s->placement);
  layout_free(&s->layout);
  s->keys = NULL;
  s->num_keys = 0;
}

static int layout_equal(const struct store_layout *a, const struct store_layout *b) {
  if (a->num_tensors != b->num_tensors || a->chunk_bytes != b->chunk_bytes ||
      a->num_shards != b->num_shards)
    return 0;
  for (uint32_t i = 0; i < a->num_tensors; i++)
    if (a->counts[i] != b->counts[i] || strcmp(a->names[i], b->names[i]) != 0) return 0;
  return 1;
}

static int describe_mismatch(const struct store_layout *held, const struct store_layout *got,
                             char *msg, size_t msglen) {
  if (held->num_shards != got->num_shards)
    snprintf(msg, msglen, "layout mismatch: the job has %" PRIu32 " shards, worker says %" PRIu32,
             held->num_shards, got->num_shards);
  else if (held->chunk_bytes != got->chunk_bytes)
    snprintf(msg, msglen, "layout mismatch: chunk_bytes %" PRIu64 " held, %" PRIu64 " sent",
             held->chunk_bytes, got->chunk_bytes);
  else if (held->num_tensors != got->num_tensors)
    snprintf(msg, msglen, "layout mismatch: shard holds %" PRIu32 " tensors, worker sent %" PRIu32,
             held->num_tensors, got->num_tensors);
  else {
    for (uint32_t i = 0; i < held->num_tensors; i++) {
      if (strcmp(held->names[i], got->names[i]) != 0 || held->counts[i] != got->counts[i]) {
        snprintf(msg, msglen,
                 "layout mismatch at tensor %" PRIu32 ": shard holds %s[%" PRIu64
                 "], worker sent %s[%" PRIu64 "]",
                 i, held->names[i], held->counts[i], got->names[i], got->counts[i]);
        break;
      }
    }
  }
  return -EEXIST;
}

static int layout_copy(struct store_layout *dst, const struct store_layout *src) {
  memset(dst, 0, sizeof(*dst));
  dst->names = calloc(src->num_tensors, sizeof(char *));
  dst->counts = calloc(src->num_tensors, sizeof(uint64_t));
  if (!dst->names || !dst->counts) goto fail;
  dst->num_tensors = src->num_tensors;
  for (uint32_t i = 0; i < src->num_tensors; i++) {
    dst->names[i] = strdup(src->names[i]);
    if (!dst->names[i]) goto fail;
    dst->counts[i] = src->counts[i];
  }
  dst->chunk_bytes = src->chunk_bytes;
  dst->num_shards = src->num_shards;
  dst->hash = src->hash;
  return 0;
fail:
  layout_free(dst);
  return -ENOMEM;
}

int store_set_layout(struct store *s, const struct store_layout *l, char *msg, size_t msglen) {
  if (l->num_tensors == 0) {
    snprintf(msg, msglen, "layout has no tensors");
    return -EINVAL;
  }
  for (uint32_t i = 0; i < l->num_tensors; i++) {
    if (l->counts[i] == 0) {
      snprintf(msg, msglen, "tensor %" PRIu32 " (%s) has no elements", i, l->names[i]);
      return -EINVAL;
    }
  }
  if (l->chunk_bytes < 4) {
    snprintf(msg, msglen, "chunk_bytes %" PRIu64 " is below 4", l->chunk_bytes);
    return -EINVAL;
  }
  uint64_t hash = placement_layout_hash((const char *const *)l->names, l->counts, l->num_tensors,
                                        l->chunk_bytes, l->num_shards);
  if (hash != l->hash) {
    snprintf(msg, msglen, "layout hash %016" PRIx64 " does not match its contents (%016" PRIx64 ")",
             l->hash, hash);
    return -EINVAL;
  }
  if (s->has_layout) {
    if (layout_equal(&s->layout, l)) return 0;
    return describe_mismatch(&s->layout, l, msg, msglen);
  }
  if (l->num_shards != s->opts.num_shards) {
    snprintf(msg, msglen,
             "layout mismatch: worker places keys on %" PRIu32
             " shards, this shard was started with --num-shards %" PRIu32,
             l->num_shards, s->opts.num_shards);
    return -EEXIST;
  }

  int ret = layout_copy(&s->layout, l);
  if (ret < 0) goto fail;
  ret = placement_build(l->counts, l->num_tensors, l->chunk_bytes, l->num_shards, &s->placement);
  if (ret < 0) {
    snprintf(msg, msglen, "cannot place this layout (%s)", strerror(-ret));
    goto fail;
  }
  size_t n = 0;
  for (size_t i = 0; i < s->placement.num_chunks; i++)
    n += s->placement.chunks[i].shard == s->opts.shard;
  ret = -ENOMEM;
  s->keys = calloc(n ? n : 1, sizeof(*s->keys));
  if (!s->keys) goto fail;
  for (size_t i = 0; i < s->placement.num_chunks; i++) {
    const struct placement_chunk *c = &s->placement.chunks[i];
    if (c->shard != s->opts.shard) continue;
    struct store_key *k = &s->keys[s->num_keys++];
    k->key = c->key;
    k->count = c->count;
    k->sum = calloc(c->count, sizeof(float));
    k->next_step = calloc(s->opts.num_workers, sizeof(uint64_t));
    if (!k->sum || !k->next_step) goto fail;
    s->param_bytes += c->count * sizeof(float);
  }
  s->has_layout = true;
  return 0;
fail:
  if (ret == -ENOMEM) snprintf(msg, msglen, "out of memory for the layout");
  store_deinit(s);
  return ret;
}

struct store_key *store_find(struct store *s, uint64_t key) {
  size_t lo = 0, hi = s->num_keys;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (s->keys[mid].key == key) return &s->keys[mid];
    if (s->keys[mid].key < key)
      lo = mid + 1;
    else
      hi = mid;
  }
  return NULL;
}

/* Hands every waiter whose version is now reached to the serve callback. */
static void serve_waiters(struct store *s, struct store_key *k) {
  struct store_waiter **pp = &k->waiters;
  while (*pp) {
    struct store_waiter *w = *pp;
    if (store_ready(k, w->min_version)) {
      *pp = w->next;
      w->next = NULL;
      s->serve(k, w, s->serve_arg);
    } else {
      pp = &w->next;
    }
  }
}

int store_init_key(struct store *s, struct store_key *k, const float *values) {
  if (k->params) return 1;
  k->params = vbuf_new(k->count);
  if (!k->params) return -ENOMEM;
  memcpy(k->params->data, values, k->count * sizeof(float));
  serve_waiters(s, k);
  return 0;
}

/* Averages the step's gradients and applies the optimizer, copying the
 * parameters first if a reply being written still reads them. */
static int apply_update(struct store *s, struct store_key *k) {
  size_t state = opt_state_floats(s->opts.opt.kind);
  if (state && !k->opt_state) {
    k->opt_state = calloc(state * k->count, sizeof(float));
    if (!k->opt_state) return -ENOMEM;
  }
  if (k->params->refs > 1) {
    struct vbuf *fresh = vbuf_new(k->count);
    if (!fresh) return -ENOMEM;
    memcpy(fresh->data, k->params->data, k->count * sizeof(float));
    vbuf_unref(k->params);
    k->params = fresh;
  }
  if (k->pushed > 1) tm_scale(k->sum, 1.0f / (float)k->pushed, k->count);
  opt_apply(&s->opts.opt, opt_lr_at(&s->opts.opt, k->version), k->params->data, k->sum,
            k->opt_state, k->count);
  k->pushed = 0;
  k->version++;
  s->stats.updates++;
  return 0;
}

int store_push(struct store *s, struct store_key *k, uint32_t rank, uint64_t step,
               const float *grad, char *msg, size_t msglen) {
  if (rank >= s->opts.num_workers) {
    snprintf(msg, msglen, "rank %" PRIu32 " is outside [0, %" PRIu32 ")", rank,
             s->opts.num_workers);
    return -EINVAL;
  }
  if (!k->params) {
    snprintf(msg, msglen, "push to key %016" PRIx64 " before it was initialised", k->key);
    return -EINVAL;
  }
  if (step < k->version || k->next_step[rank] > step) {
    s->stats.duplicates++;
    return STORE_DUPLICATE;
  }
  if (step > k->version) {
    snprintf(msg, msglen,
             "push for step %" PRIu64 " of key %016" PRIx64 " at version %" PRIu64
             " (bsp: a worker pushes only the step it pulled)",
             step, k->key, k->version);
    return -EINVAL;
  }
  if (k->pushed == 0)
    memcpy(k->sum, grad, k->count * sizeof(float));
  else
    tm_add(k->sum, grad, k->count);
  k->pushed++;
  k->next_step[rank] = step + 1;
  s->stats.pushes++;
  if (k->pushed == s->opts.num_workers) {
    int r = apply_update(s, k);
    if (r < 0) {
      snprintf(msg, msglen, "out of memory applying the update");
      return r;
    }
    serve_waiters(s, k);
  }
  return STORE_APPLIED;
}

void store_wait(struct store *s, struct store_key *k, struct store_waiter *w) {
  (void)s;
  w->next = k->waiters;
  k->waiters = w;
}

void store_drop_waiters(struct store *s, const void *conn) {
  for (size_t i = 0; i < s->num_keys; i++) {
    struct store_waiter **pp = &s->keys[i].waiters;
    while (*pp) {
      struct store_waiter *w = *pp;
      if (w->conn == conn) {
        *pp = w->next;
        free(w);
      } else {
        pp = &w->next;
      }
    }
  }
}
