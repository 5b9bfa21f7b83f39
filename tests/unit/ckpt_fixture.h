/* A store to checkpoint, shared by test_ckpt (unit) and test_ckpt_crash
 * (faults): shard 0 of 1, two workers, BSP with momentum (so there is
 * optimizer state), three tensors cut into several keys; store_fixture_run
 * plays BSP steps with deterministic gradients, store_fixture_equal compares
 * two stores bit for bit (parameters, versions, optimizer state, clocks).
 * Header-only: static functions. */
#ifndef PS_TEST_CKPT_FIXTURE_H
#define PS_TEST_CKPT_FIXTURE_H

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "placement.h"
#include "store.h"

#define FIX_WORKERS 2u

static void fixture_serve(struct store_key *k, struct store_waiter *w, void *arg) {
  (void)k;
  (void)arg;
  free(w);
}

/* Returns 0, or -1 (and prints why). asp with method: the store keeps
 * store_state_floats of state (the look-ahead: a velocity per worker). */
static int store_fixture_init_mode(struct store *s, bool with_layout, enum store_consistency mode,
                                   enum store_staleness_method method) {
  struct store_opts o = {.shard = 0,
                         .num_shards = 1,
                         .num_workers = FIX_WORKERS,
                         .consistency = mode,
                         .staleness_aware = true,
                         .method = method,
                         .opt = {.kind = OPT_MOMENTUM, .lr = 0.05, .momentum = 0.9}};
  if (store_init(s, &o, fixture_serve, NULL) < 0) return -1;
  if (!with_layout) return 0;
  char *names[] = {"fc1.weight", "fc1.bias", "fc2.weight"};
  uint64_t counts[] = {3000, 10, 1500};
  struct store_layout l = {
      .num_tensors = 3, .names = names, .counts = counts, .chunk_bytes = 4096, .num_shards = 1};
  l.hash = placement_layout_hash((const char *const *)names, counts, 3, l.chunk_bytes, 1);
  char msg[256] = "";
  if (store_set_layout(s, &l, msg, sizeof(msg)) < 0) {
    fprintf(stderr, "layout: %s\n", msg);
    return -1;
  }
  for (size_t i = 0; i < s->num_keys; i++) {
    struct store_key *k = &s->keys[i];
    float *v = malloc(k->count * sizeof(float));
    for (uint64_t j = 0; j < k->count; j++) v[j] = (float)((k->key * 31 + j) % 97) / 97.0f;
    store_init_key(s, k, v);
    free(v);
  }
  return 0;
}

static int store_fixture_init(struct store *s, bool with_layout) {
  return store_fixture_init_mode(s, with_layout, STORE_BSP, STALENESS_LOOKAHEAD);
}

/* Plays BSP steps (asp: rounds of pushes) [from, to) on every key; with partial, rank 0 also pushes
 * step `to` (an unfinished step). Returns 0 or -1. */
static int store_fixture_run(struct store *s, uint64_t from, uint64_t to, bool partial) {
  char msg[256];
  for (size_t i = 0; i < s->num_keys; i++) {
    struct store_key *k = &s->keys[i];
    float *g = malloc(k->count * sizeof(float));
    for (uint64_t step = from; step < to + (partial ? 1 : 0); step++) {
      for (uint32_t r = 0; r < FIX_WORKERS; r++) {
        if (step == to && r > 0) break;
        for (uint64_t j = 0; j < k->count; j++)
          g[j] = (float)(((j + 1) * (step + 3) * (r + 1)) % 13) / 13.0f - 0.5f;
        if (store_push(s, k, r, step, STORE_NO_BASE, g, msg, sizeof(msg)) < 0) {
          fprintf(stderr, "push: %s\n", msg);
          free(g);
          return -1;
        }
      }
    }
    free(g);
  }
  return 0;
}

/* 1 if equal; else 0 and prints the first difference. */
static int store_fixture_equal(const struct store *a, const struct store *b) {
  if (a->num_keys != b->num_keys) {
    fprintf(stderr, "keys: %zu vs %zu\n", a->num_keys, b->num_keys);
    return 0;
  }
  for (size_t i = 0; i < a->num_keys; i++) {
    const struct store_key *x = &a->keys[i], *y = &b->keys[i];
    if (x->key != y->key || x->version != y->version || !x->params != !y->params) {
      fprintf(stderr, "key %zu: version %llu vs %llu\n", i, (unsigned long long)x->version,
              (unsigned long long)y->version);
      return 0;
    }
    if (x->params && memcmp(x->params->data, y->params->data, x->count * 4) != 0) {
      fprintf(stderr, "key %zu: parameters differ\n", i);
      return 0;
    }
    size_t state = store_state_floats(a);
    if (!x->opt_state != !y->opt_state || state != store_state_floats(b) ||
        (x->opt_state && memcmp(x->opt_state, y->opt_state, state * x->count * 4) != 0)) {
      fprintf(stderr, "key %zu: optimizer state differs\n", i);
      return 0;
    }
    if (memcmp(x->next_step, y->next_step, FIX_WORKERS * 8) != 0) {
      fprintf(stderr, "key %zu: clocks differ\n", i);
      return 0;
    }
  }
  return 1;
}

#endif
