/* store: keys, versions and the sync engine of one shard (see store.h for
 * the semantics of each consistency model). Everything here runs on the
 * shard's one loop thread. Per-rank loops (quorum, slowest clock) are O(W)
 * and run once per push or pull at most; with no gone rank the BSP quorum
 * is a counter. */
#include "store.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
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

int store_consistency_parse(const char *s, enum store_consistency *mode, uint32_t *staleness) {
  *staleness = 0;
  if (strcmp(s, "bsp") == 0) {
    *mode = STORE_BSP;
    return 0;
  }
  if (strcmp(s, "asp") == 0) {
    *mode = STORE_ASP;
    return 0;
  }
  if (strncmp(s, "ssp:", 4) != 0 || s[4] < '0' || s[4] > '9') return -EINVAL;
  char *end;
  errno = 0;
  unsigned long long k = strtoull(s + 4, &end, 10);
  if (errno || *end || k > 1000000) return -EINVAL;
  *mode = STORE_SSP;
  *staleness = (uint32_t)k;
  return 0;
}

int store_consistency_check(const char *value, char *err, size_t errlen) {
  enum store_consistency mode;
  uint32_t staleness;
  if (store_consistency_parse(value, &mode, &staleness) == 0) return 0;
  snprintf(err, errlen, "expected bsp, asp or ssp:K (K a number of clocks, 0..1000000)");
  return -EINVAL;
}

static const char *const method_names[] = {
    [STALENESS_LOOKAHEAD] = "lookahead", [STALENESS_DIVIDE] = "divide"};
#define NUM_METHODS (sizeof(method_names) / sizeof(method_names[0]))

int store_staleness_method_parse(const char *s, enum store_staleness_method *out) {
  int i = config_choice(s, method_names, NUM_METHODS, NULL, 0);
  if (i < 0) return i;
  *out = (enum store_staleness_method)i;
  return 0;
}

int store_staleness_method_check(const char *value, char *err, size_t errlen) {
  return config_choice(value, method_names, NUM_METHODS, err, errlen) < 0 ? -EINVAL : 0;
}

static bool lookahead_applies(const struct store_opts *o) {
  return o->consistency != STORE_BSP && o->staleness_aware && o->method == STALENESS_LOOKAHEAD &&
         o->opt.kind == OPT_MOMENTUM && !o->opt.nesterov && o->opt.momentum > 0;
}

const char *store_staleness_name(const struct store_opts *o) {
  if (o->consistency == STORE_BSP || !o->staleness_aware) return "off";
  return lookahead_applies(o) ? "lookahead" : "divide";
}

const char *store_consistency_name(enum store_consistency mode, uint32_t staleness, char *buf,
                                   size_t len) {
  if (mode == STORE_SSP)
    snprintf(buf, len, "ssp:%" PRIu32, staleness);
  else
    snprintf(buf, len, "%s", mode == STORE_ASP ? "asp" : "bsp");
  return buf;
}

int store_init(struct store *s, const struct store_opts *opts, store_serve_fn serve, void *arg) {
  memset(s, 0, sizeof(*s));
  s->opts = *opts;
  s->serve = serve;
  s->serve_arg = arg;
  s->gone = calloc(opts->num_workers ? opts->num_workers : 1, sizeof(bool));
  s->seen_clock = calloc(opts->num_workers ? opts->num_workers : 1, sizeof(uint64_t));
  s->left = calloc(opts->num_workers ? opts->num_workers : 1, sizeof(uint8_t));
  return s->gone && s->seen_clock && s->left ? 0 : -ENOMEM;
}

void store_layout_free(struct store_layout *l) {
  for (uint32_t i = 0; i < l->num_tensors; i++) {
    if (l->names) free(l->names[i]);
    if (l->owners) free(l->owners[i]);
  }
  free(l->names);
  free(l->counts);
  free(l->num_owners);
  free(l->owners);
  memset(l, 0, sizeof(*l));
}

static void keys_free(struct store *s) {
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
  free(s->owner_masks);
  s->owner_masks = NULL;
  placement_free(&s->placement);
  store_layout_free(&s->layout);
  s->keys = NULL;
  s->num_keys = 0;
  s->param_bytes = 0;
}

void store_deinit(struct store *s) {
  if (!s) return;
  keys_free(s);
  free(s->gone);
  s->gone = NULL;
  free(s->seen_clock);
  s->seen_clock = NULL;
  free(s->left);
  s->left = NULL;
}

/* Whether tensor i of l names owners (else every rank owns it). */
static bool has_owners(const struct store_layout *l, uint32_t i) {
  return l->num_owners && l->num_owners[i] > 0;
}

/* Whether rank r owns tensor i of l. */
static bool owned_by(const struct store_layout *l, uint32_t i, uint32_t r) {
  if (!has_owners(l, i)) return true;
  for (uint32_t j = 0; j < l->num_owners[i]; j++)
    if (l->owners[i][j] == r) return true;
  return false;
}

/* Whether tensor i has the same owners in a and b, over ranks [0, w):
 * naming every rank is the same as naming none. */
static bool owners_equal(const struct store_layout *a, const struct store_layout *b, uint32_t i,
                         uint32_t w) {
  if (!has_owners(a, i) && !has_owners(b, i)) return true;
  for (uint32_t r = 0; r < w; r++)
    if (owned_by(a, i, r) != owned_by(b, i, r)) return false;
  return true;
}

/* Writes tensor i's owners as "{0,1}" or "every rank" into buf. */
static const char *owners_text(const struct store_layout *l, uint32_t i, char *buf, size_t len) {
  if (!has_owners(l, i)) {
    snprintf(buf, len, "every rank");
    return buf;
  }
  size_t n = (size_t)snprintf(buf, len, "ranks {");
  for (uint32_t j = 0; j < l->num_owners[i] && n < len; j++)
    n += (size_t)snprintf(buf + n, len - n, "%s%" PRIu32, j ? "," : "", l->owners[i][j]);
  if (n < len) snprintf(buf + n, len - n, "}");
  return buf;
}

static int layout_equal(const struct store_layout *a, const struct store_layout *b, uint32_t w) {
  if (a->num_tensors != b->num_tensors || a->chunk_bytes != b->chunk_bytes ||
      a->num_shards != b->num_shards)
    return 0;
  for (uint32_t i = 0; i < a->num_tensors; i++)
    if (a->counts[i] != b->counts[i] || strcmp(a->names[i], b->names[i]) != 0 ||
        !owners_equal(a, b, i, w))
      return 0;
  return 1;
}

static int describe_mismatch(const struct store_layout *held, const struct store_layout *got,
                             uint32_t w, char *msg, size_t msglen) {
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
      if (!owners_equal(held, got, i, w)) {
        char a[160], b[160];
        snprintf(
            msg, msglen,
            "layout mismatch at tensor %" PRIu32
            " (%s): the shard holds it owned by %s, the worker declared it owned by %s (every rank "
            "must declare the same owners: ps_declare_owned)",
            i, held->names[i], owners_text(held, i, a, sizeof(a)),
            owners_text(got, i, b, sizeof(b)));
        break;
      }
    }
  }
  return -EEXIST;
}

int store_layout_copy(struct store_layout *dst, const struct store_layout *src) {
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
  if (src->num_owners) {
    dst->num_owners = calloc(src->num_tensors, sizeof(uint32_t));
    dst->owners = calloc(src->num_tensors, sizeof(uint32_t *));
    if (!dst->num_owners || !dst->owners) goto fail;
    for (uint32_t i = 0; i < src->num_tensors; i++) {
      uint32_t n = src->num_owners[i];
      if (n == 0) continue;
      if (!(dst->owners[i] = malloc(n * sizeof(uint32_t)))) goto fail;
      memcpy(dst->owners[i], src->owners[i], n * sizeof(uint32_t));
      dst->num_owners[i] = n;
    }
  }
  dst->chunk_bytes = src->chunk_bytes;
  dst->num_shards = src->num_shards;
  dst->hash = src->hash;
  return 0;
fail:
  store_layout_free(dst);
  return -ENOMEM;
}

/* The owners of every tensor are ranks of the job, each named once. */
static int check_owners(const struct store *s, const struct store_layout *l, char *msg,
                        size_t msglen) {
  uint32_t w = s->opts.num_workers;
  for (uint32_t i = 0; l->num_owners && i < l->num_tensors; i++) {
    for (uint32_t j = 0; j < l->num_owners[i]; j++) {
      uint32_t r = l->owners[i][j];
      if (r >= w) {
        snprintf(msg, msglen,
                 "tensor %" PRIu32 " (%s): owner rank %" PRIu32 " is outside [0, %" PRIu32
                 ") (--num-workers)",
                 i, l->names[i], r, w);
        return -EINVAL;
      }
      for (uint32_t q = 0; q < j; q++) {
        if (l->owners[i][q] == r) {
          snprintf(msg, msglen, "tensor %" PRIu32 " (%s): owner rank %" PRIu32 " is named twice", i,
                   l->names[i], r);
          return -EINVAL;
        }
      }
    }
  }
  return 0;
}

/* s->owner_masks from s->layout, when some tensor names owners. */
static int build_owner_masks(struct store *s) {
  const struct store_layout *l = &s->layout;
  uint32_t w = s->opts.num_workers;
  bool any = false;
  for (uint32_t i = 0; i < l->num_tensors; i++) any = any || has_owners(l, i);
  if (!any) return 0;
  s->owner_masks = calloc((size_t)l->num_tensors * w, 1);
  if (!s->owner_masks) return -ENOMEM;
  for (uint32_t i = 0; i < l->num_tensors; i++)
    for (uint32_t r = 0; r < w; r++) s->owner_masks[(size_t)i * w + r] = owned_by(l, i, r);
  return 0;
}

const char *store_key_tensor(const struct store *s, const struct store_key *k) {
  uint64_t t = k->key >> 32;
  return t < s->layout.num_tensors ? s->layout.names[t] : "?";
}

int store_check_owner(const struct store *s, const struct store_key *k, uint32_t rank, char *msg,
                      size_t msglen) {
  if (rank >= s->opts.num_workers || store_owns(k, rank)) return 0;
  char who[160];
  snprintf(msg, msglen,
           "rank %" PRIu32 " does not own tensor \"%s\" (key %016" PRIx64
           "): it is owned by %s "
           "(ps_declare_owned); only its owners push and pull it",
           rank, store_key_tensor(s, k), k->key,
           owners_text(&s->layout, (uint32_t)(k->key >> 32), who, sizeof(who)));
  return -EPERM;
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
  if (check_owners(s, l, msg, msglen) < 0) return -EINVAL;
  uint64_t hash = placement_layout_hash((const char *const *)l->names, l->counts, l->num_tensors,
                                        l->chunk_bytes, l->num_shards);
  if (hash != l->hash) {
    snprintf(msg, msglen, "layout hash %016" PRIx64 " does not match its contents (%016" PRIx64 ")",
             l->hash, hash);
    return -EINVAL;
  }
  uint32_t w = s->opts.num_workers;
  if (s->has_layout) {
    if (layout_equal(&s->layout, l, w)) return 0;
    return describe_mismatch(&s->layout, l, w, msg, msglen);
  }
  if (l->num_shards != s->opts.num_shards) {
    snprintf(msg, msglen,
             "layout mismatch: worker places keys on %" PRIu32
             " shards, this shard was started with --num-shards %" PRIu32,
             l->num_shards, s->opts.num_shards);
    return -EEXIST;
  }

  int ret = store_layout_copy(&s->layout, l);
  if (ret < 0) goto fail;
  ret = placement_build(l->counts, l->num_tensors, l->chunk_bytes, l->num_shards, &s->placement);
  if (ret < 0) {
    snprintf(msg, msglen, "cannot place this layout (%s)", strerror(-ret));
    goto fail;
  }
  ret = -ENOMEM;
  if (build_owner_masks(s) < 0) goto fail;
  size_t n = 0;
  for (size_t i = 0; i < s->placement.num_chunks; i++)
    n += s->placement.chunks[i].shard == s->opts.shard;
  s->keys = calloc(n ? n : 1, sizeof(*s->keys));
  if (!s->keys) goto fail;
  for (size_t i = 0; i < s->placement.num_chunks; i++) {
    const struct placement_chunk *c = &s->placement.chunks[i];
    if (c->shard != s->opts.shard) continue;
    struct store_key *k = &s->keys[s->num_keys++];
    k->key = c->key;
    k->count = c->count;
    /* only BSP sums; calloc'd pages cost nothing until the first push */
    if (s->opts.consistency == STORE_BSP && !(k->sum = calloc(c->count, sizeof(float)))) goto fail;
    k->sum_bytes = k->sum ? c->count * sizeof(float) : 0;
    k->next_step = calloc(s->opts.num_workers, sizeof(uint64_t));
    if (!k->next_step) goto fail;
    k->owns = s->owner_masks ? s->owner_masks + (size_t)c->tensor * w : NULL;
    k->num_owners = w;
    if (k->owns) {
      k->num_owners = 0;
      for (uint32_t r = 0; r < w; r++) k->num_owners += k->owns[r];
    }
    s->param_bytes += c->count * sizeof(float);
  }
  s->has_layout = true;
  return 0;
fail:
  if (ret == -ENOMEM) snprintf(msg, msglen, "out of memory for the layout");
  keys_free(s);
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

/* Whether the steps wait for rank r: it is neither gone nor joined. */
static bool counted(const struct store *s, uint32_t r) {
  return !s->gone[r] && s->left[r] != STORE_JOINED;
}

/* Whether k's steps wait for rank r: it owns k and counts. */
static bool counted_on(const struct store *s, const struct store_key *k, uint32_t r) {
  return store_owns(k, r) && counted(s, r);
}

/* r's clock on k as SSP's bound counts it. */
static uint64_t rank_clock(const struct store *s, const struct store_key *k, uint32_t r) {
  uint64_t c = k->next_step[r];
  if (s->accept_gaps && s->seen_clock[r] > c) c = s->seen_clock[r]; /* store.h: Restored */
  return c;
}

/* The slowest counted rank's clock on k (UINT64_MAX if no rank counts). */
static uint64_t slowest_clock(const struct store *s, const struct store_key *k) {
  uint64_t m = UINT64_MAX;
  for (uint32_t r = 0; r < s->opts.num_workers; r++) {
    uint64_t c = rank_clock(s, k, r);
    if (counted_on(s, k, r) && c < m) m = c;
  }
  return m;
}

/* k's owners that are not gone (O(W) only when owners were declared). */
static uint32_t live_owners(const struct store *s, const struct store_key *k) {
  if (!k->owns) return s->opts.num_workers - s->num_gone;
  uint32_t n = 0;
  for (uint32_t r = 0; r < s->opts.num_workers; r++) n += k->owns[r] && !s->gone[r];
  return n;
}

/* SSP: a pull by a worker at clock c waits for slowest >= c - K. */
static bool ssp_ready(uint64_t clock, uint64_t staleness, uint64_t slowest) {
  return clock <= staleness || slowest >= clock - staleness;
}

bool store_ready(const struct store *s, const struct store_key *k, uint64_t min_version) {
  if (!k->params) return false;
  switch (s->opts.consistency) {
    case STORE_BSP:
      return k->version >= min_version;
    case STORE_ASP:
      return true;
    case STORE_SSP:
      return ssp_ready(min_version, s->opts.staleness, slowest_clock(s, k));
  }
  return false;
}

/* Hands every waiter that can now be answered to the serve callback. */
static void serve_waiters(struct store *s, struct store_key *k) {
  if (!k->waiters || !k->params) return;
  uint64_t slowest = s->opts.consistency == STORE_SSP ? slowest_clock(s, k) : 0;
  struct store_waiter **pp = &k->waiters;
  while (*pp) {
    struct store_waiter *w = *pp;
    bool ready;
    if (s->opts.consistency == STORE_SSP)
      ready = ssp_ready(w->min_version, s->opts.staleness, slowest);
    else
      ready = store_ready(s, k, w->min_version);
    if (ready) {
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

bool store_lookahead(const struct store *s) {
  return lookahead_applies(&s->opts);
}

size_t store_state_floats(const struct store *s) {
  return store_lookahead(s) ? (size_t)s->opts.num_workers + 1 : opt_state_floats(s->opts.opt.kind);
}

/* Applies one optimizer update with gradient gscale * (g + g2) (g2 may be
 * NULL), in one pass. If a reply being written still reads the parameters,
 * the new ones go to a fresh buffer (read from the old, not copied first).
 * sched_step is the learning-rate schedule's position. With the look-ahead
 * (ASP/SSP) the update goes through rank's velocity: opt_state holds the W
 * velocities, then their sum. */
static int apply_update(struct store *s, struct store_key *k, uint32_t rank, const float *g,
                        const float *g2, float gscale, uint64_t sched_step) {
  const struct opt_params *o = &s->opts.opt;
  size_t state = store_state_floats(s);
  if (state && !k->opt_state) {
    k->opt_state = calloc(state * k->count, sizeof(float));
    if (!k->opt_state) return -ENOMEM;
  }
  struct vbuf *fresh = NULL;
  if (k->params->refs > 1 && !(fresh = vbuf_new(k->count))) return -ENOMEM;
  float *dst = fresh ? fresh->data : k->params->data;
  uint32_t w = s->opts.num_workers;
  uint32_t round = k->num_owners ? k->num_owners : 1; /* pushes per step of k */
  if (store_lookahead(s)) /* the previous update's rate, at the schedule step it had */
    opt_lookahead(o, k->version ? opt_lr_at(o, (k->version - 1) / round) : 0,
                  opt_lr_at(o, sched_step), gscale, dst, k->params->data, g,
                  k->opt_state + (size_t)rank * k->count, k->opt_state + (size_t)w * k->count,
                  k->count);
  else
    opt_apply_fused(o, opt_lr_at(o, sched_step), k->version + 1, gscale, dst, k->params->data, g,
                    g2, k->opt_state, k->count);
  if (fresh) {
    vbuf_unref(k->params);
    k->params = fresh;
  }
  k->version++;
  s->stats.updates++;
  if (s->on_update) s->on_update(s, k, s->on_update_arg);
  return 0;
}

/* BSP: every counted rank has pushed the current step (and someone has). */
static bool bsp_complete(const struct store *s, const struct store_key *k) {
  if (k->pushed == 0) return false;
  if (s->num_gone == 0 && s->num_joined == 0) return k->pushed == k->num_owners;
  for (uint32_t r = 0; r < s->opts.num_workers; r++)
    if (counted_on(s, k, r) && k->next_step[r] <= k->version) return false;
  return true;
}

/* BSP: averages the step's pushes into the optimizer; the key becomes v+1. */
static int bsp_finish_step(struct store *s, struct store_key *k) {
  int r = apply_update(s, k, 0, k->sum, NULL, 1.0f / (float)k->pushed, k->version);
  k->pushed = 0;
  if (r == 0) serve_waiters(s, k);
  return r;
}

uint64_t store_rank_at(struct store *s, struct store_key *k, uint32_t rank, uint64_t clock) {
  if (!s->accept_gaps || s->opts.consistency == STORE_BSP || rank >= s->opts.num_workers ||
      !k->params)
    return 0;
  uint64_t lost = 0;
  if (clock > k->next_step[rank]) {
    lost = clock - k->next_step[rank];
    k->next_step[rank] = clock;
    k->version += lost;
    s->stats.lost += lost;
  }
  if (clock > s->seen_clock[rank]) {
    s->seen_clock[rank] = clock;
    if (s->opts.consistency == STORE_SSP) /* the bound moved on every key */
      for (size_t i = 0; i < s->num_keys; i++) serve_waiters(s, &s->keys[i]);
  } else if (lost && s->opts.consistency == STORE_SSP) {
    serve_waiters(s, k);
  }
  return lost;
}

/* ASP/SSP: the staleness of a push computed on version base, counted in the
 * stats. A base the key has not reached (a shard restored from an older
 * checkpoint) counts as 0. */
static uint64_t note_staleness(struct store *s, const struct store_key *k, uint64_t base) {
  if (base == STORE_NO_BASE) {
    s->stats.no_base++;
    return 0;
  }
  uint64_t tau = base <= k->version ? k->version - base : 0;
  if (tau < STORE_STALENESS_SLOTS - 1) {
    s->stats.staleness[tau]++;
  } else {
    s->stats.staleness[STORE_STALENESS_SLOTS - 1]++;
    s->stats.staleness_over_sum += tau;
  }
  return tau;
}

/* store_push and store_push_buffer: swap_buf, if given, is the caller's
 * buffer holding grad (see store_push_buffer). */
static int push(struct store *s, struct store_key *k, uint32_t rank, uint64_t step, uint64_t base,
                const float *grad, float **swap_buf, size_t *swap_bytes, char *msg, size_t msglen) {
  if (rank >= s->opts.num_workers) {
    snprintf(msg, msglen, "rank %" PRIu32 " is outside [0, %" PRIu32 ")", rank,
             s->opts.num_workers);
    return -EINVAL;
  }
  if (!k->params) {
    snprintf(msg, msglen, "push to key %016" PRIx64 " before it was initialised", k->key);
    return -EINVAL;
  }
  if (store_check_owner(s, k, rank, msg, msglen) < 0) return -EPERM;
  bool bsp = s->opts.consistency == STORE_BSP;
  if (k->next_step[rank] > step || (bsp && step < k->version)) {
    s->stats.duplicates++;
    return STORE_DUPLICATE;
  }
  if (bsp && step > k->version) {
    snprintf(msg, msglen,
             "push for step %" PRIu64 " of key %016" PRIx64 " at version %" PRIu64
             " (bsp: a worker pushes only the step it pulled)",
             step, k->key, k->version);
    return -EINVAL;
  }
  if (!bsp) store_rank_at(s, k, rank, step); /* after a restore: what it pushed since is lost */
  if (!bsp && step > k->next_step[rank]) {
    snprintf(msg, msglen,
             "push for step %" PRIu64 " of key %016" PRIx64 " but rank %" PRIu32
             " is at clock %" PRIu64 " (asp/ssp: a worker pushes its steps in order)",
             step, k->key, rank, k->next_step[rank]);
    return -EINVAL;
  }
  s->stats.pushes++;
  if (!bsp) {
    /* The clock moves with the update, before the on_update hook runs: a
     * checkpoint taken there holds the update and the clock that says so
     * (else a resend after its restore would be applied a second time). A
     * failed update moves it back: the push stays unapplied, and the shard
     * closes the connection. */
    uint32_t live = live_owners(s, k);
    float scale = 1.0f / (float)(live ? live : 1);
    uint64_t tau = note_staleness(s, k, base);
    bool ahead = store_lookahead(s);
    if (s->opts.staleness_aware && !ahead) scale /= (float)(tau + 1);
    if (ahead && tau + 1 > live) scale *= (float)live / (float)(tau + 1); /* beyond a round */
    k->next_step[rank] = step + 1;
    int r = apply_update(s, k, rank, grad, NULL, scale,
                         k->version / (k->num_owners ? k->num_owners : 1));
    if (r < 0) {
      k->next_step[rank] = step;
      snprintf(msg, msglen, "out of memory applying the update");
      return r;
    }
    if (s->opts.consistency == STORE_SSP) serve_waiters(s, k);
    return STORE_APPLIED;
  }
  k->pushed++;
  k->next_step[rank] = step + 1;
  if (bsp_complete(s, k)) {
    /* The last push of the step is not added to the sum: the update reads
     * sum + grad (or grad alone, the only push) in the same pass. */
    bool only = k->pushed == 1;
    int r = apply_update(s, k, rank, only ? grad : k->sum, only ? NULL : grad,
                         1.0f / (float)k->pushed, k->version);
    k->pushed = 0;
    if (r < 0) {
      snprintf(msg, msglen, "out of memory applying the update");
      return r;
    }
    serve_waiters(s, k);
    return STORE_APPLIED;
  }
  size_t need = k->count * sizeof(float);
  if (k->pushed == 1 && swap_buf && *swap_bytes >= need && *swap_bytes - need <= STORE_SWAP_SLACK) {
    float *old = k->sum;
    size_t old_bytes = k->sum_bytes;
    k->sum = *swap_buf;
    k->sum_bytes = *swap_bytes;
    *swap_buf = old;
    *swap_bytes = old_bytes;
  } else if (k->pushed == 1) {
    memcpy(k->sum, grad, need);
  } else {
    tm_add(k->sum, grad, k->count);
  }
  return STORE_APPLIED;
}

int store_push(struct store *s, struct store_key *k, uint32_t rank, uint64_t step, uint64_t base,
               const float *grad, char *msg, size_t msglen) {
  return push(s, k, rank, step, base, grad, NULL, NULL, msg, msglen);
}

int store_push_buffer(struct store *s, struct store_key *k, uint32_t rank, uint64_t step,
                      uint64_t base, float **buf, size_t *buf_bytes, char *msg, size_t msglen) {
  return push(s, k, rank, step, base, *buf, buf, buf_bytes, msg, msglen);
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

void store_take_waiters(struct store *s, store_serve_fn fn, void *arg) {
  for (size_t i = 0; i < s->num_keys; i++) {
    struct store_key *k = &s->keys[i];
    while (k->waiters) {
      struct store_waiter *w = k->waiters;
      k->waiters = w->next;
      w->next = NULL;
      fn(k, w, arg);
    }
  }
}

/* A rank stopped counting: completes the BSP steps and serves the SSP
 * pulls that only waited for it. Returns 0, or -ENOMEM if an update could
 * not be applied. */
static int complete_without(struct store *s) {
  int ret = 0;
  for (size_t i = 0; i < s->num_keys; i++) {
    struct store_key *k = &s->keys[i];
    if (!k->params) continue;
    if (s->opts.consistency == STORE_BSP) {
      if (bsp_complete(s, k)) {
        int r = bsp_finish_step(s, k);
        if (r < 0) ret = r;
      }
    } else if (s->opts.consistency == STORE_SSP) {
      serve_waiters(s, k);
    }
  }
  return ret;
}

int store_worker_gone(struct store *s, uint32_t rank) {
  if (rank >= s->opts.num_workers || s->gone[rank]) return 0;
  s->gone[rank] = true;
  s->num_gone++;
  return complete_without(s);
}

int store_set_left(struct store *s, uint32_t rank, enum store_left how) {
  if (rank >= s->opts.num_workers || s->left[rank] == how) return 0;
  enum store_left was = (enum store_left)s->left[rank];
  s->left[rank] = (uint8_t)how;
  if (was == STORE_FINISHED) s->num_finished--;
  if (was == STORE_JOINED) s->num_joined--;
  if (how == STORE_FINISHED) s->num_finished++;
  if (how != STORE_JOINED) return 0;
  s->num_joined++;
  return complete_without(s);
}

bool store_waits_for(const struct store *s, const struct store_key *k, uint32_t rank,
                     uint64_t min_version) {
  if (rank >= s->opts.num_workers || !k->params || !counted_on(s, k, rank)) return false;
  switch (s->opts.consistency) {
    case STORE_BSP:
      return min_version > k->version && k->next_step[rank] <= k->version;
    case STORE_SSP:
      return !ssp_ready(min_version, s->opts.staleness, rank_clock(s, k, rank));
    case STORE_ASP:
      break;
  }
  return false;
}

void store_take_waiters_on(struct store *s, struct store_key *k, uint32_t rank, store_serve_fn fn,
                           void *arg) {
  struct store_waiter **pp = &k->waiters;
  while (*pp) {
    struct store_waiter *w = *pp;
    if (store_waits_for(s, k, rank, w->min_version)) {
      *pp = w->next;
      w->next = NULL;
      fn(k, w, arg);
    } else {
      pp = &w->next;
    }
  }
}

/* Moves the clocks of rank, which does not count now (gone or joined), to
 * where the others are: BSP the key's version (the step being gathered, so
 * a step another rank already pushed waits for it too), ASP/SSP the
 * slowest counted rank's clock. */
static void fast_forward(struct store *s, uint32_t rank) {
  for (size_t i = 0; i < s->num_keys; i++) {
    struct store_key *k = &s->keys[i];
    if (!store_owns(k, rank)) continue; /* its clock there never counts */
    uint64_t to = k->version;
    if (s->opts.consistency != STORE_BSP) {
      to = slowest_clock(s, k);
      if (to == UINT64_MAX) to = 0;
    }
    if (k->next_step[rank] < to) k->next_step[rank] = to;
  }
}

void store_worker_back(struct store *s, uint32_t rank) {
  if (rank >= s->opts.num_workers || !s->gone[rank]) return;
  fast_forward(s, rank); /* the slowest of the others: its own clock is still gone */
  s->gone[rank] = false;
  s->num_gone--;
}

void store_rejoin(struct store *s, uint32_t rank) {
  if (rank >= s->opts.num_workers || s->left[rank] != STORE_JOINED) return;
  fast_forward(s, rank);
  store_set_left(s, rank, STORE_IN);
}

bool store_blocked_on(const struct store *s, uint32_t rank) {
  for (size_t i = 0; i < s->num_keys; i++) {
    const struct store_key *k = &s->keys[i];
    if (s->opts.consistency == STORE_BSP) {
      if (k->pushed > 0 && store_waits_for(s, k, rank, k->version + 1)) return true;
    } else if (s->opts.consistency == STORE_SSP) {
      for (const struct store_waiter *w = k->waiters; w; w = w->next)
        if (store_waits_for(s, k, rank, w->min_version)) return true;
    }
  }
  return false;
}

uint64_t store_worker_clock(const struct store *s, uint32_t rank) {
  uint64_t m = UINT64_MAX;
  if (rank >= s->opts.num_workers) return m;
  for (size_t i = 0; i < s->num_keys; i++)
    if (store_owns(&s->keys[i], rank) && s->keys[i].next_step[rank] < m)
      m = s->keys[i].next_step[rank];
  return m;
}

int store_restore_key(struct store *s, struct store_key *k, uint64_t version, const float *params,
                      const float *opt_state, const uint64_t *next_step) {
  size_t state = store_state_floats(s);
  struct vbuf *b = vbuf_new(k->count);
  if (!b) return -ENOMEM;
  if (opt_state && state) {
    float *st = malloc(state * k->count * sizeof(float));
    if (!st) {
      vbuf_unref(b);
      return -ENOMEM;
    }
    memcpy(st, opt_state, state * k->count * sizeof(float));
    free(k->opt_state);
    k->opt_state = st;
  }
  memcpy(b->data, params, k->count * sizeof(float));
  vbuf_unref(k->params);
  k->params = b;
  k->version = version;
  k->pushed = 0;
  memcpy(k->next_step, next_step, s->opts.num_workers * sizeof(uint64_t));
  return 0;
}

bool store_at_step_boundary(const struct store *s) {
  for (size_t i = 0; i < s->num_keys; i++)
    if (s->keys[i].pushed > 0) return false;
  return true;
}
