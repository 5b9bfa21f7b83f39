/* placement: see placement.h for the rules; this file only implements them. */
#include "placement.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static int cmp_by_size_desc(const void *a, const void *b) {
  const struct placement_chunk *x = *(const struct placement_chunk *const *)a;
  const struct placement_chunk *y = *(const struct placement_chunk *const *)b;
  if (x->count != y->count) return x->count > y->count ? -1 : 1;
  return x->key < y->key ? -1 : (x->key > y->key);
}

int placement_build(const uint64_t *counts, uint32_t num_tensors, uint64_t chunk_bytes,
                    uint32_t num_shards, struct placement *out) {
  memset(out, 0, sizeof(*out));
  if (num_shards == 0 || num_tensors == 0) return -EINVAL;
  uint64_t chunk_elems = chunk_bytes / 4;
  if (chunk_elems == 0) chunk_elems = 1;

  size_t total = 0;
  for (uint32_t t = 0; t < num_tensors; t++) {
    if (counts[t] == 0) return -EINVAL;
    uint64_t n = (counts[t] + chunk_elems - 1) / chunk_elems;
    if (n > UINT32_MAX || total + n < total) return -EINVAL;
    total += (size_t)n;
  }
  int ret = -ENOMEM;
  struct placement_chunk **order = NULL;
  out->chunks = calloc(total, sizeof(*out->chunks));
  out->first_chunk = calloc((size_t)num_tensors + 1, sizeof(*out->first_chunk));
  out->shard_bytes = calloc(num_shards, sizeof(*out->shard_bytes));
  order = malloc(total * sizeof(*order));
  if (!out->chunks || !out->first_chunk || !out->shard_bytes || !order) goto fail;
  out->num_tensors = num_tensors;
  out->num_shards = num_shards;
  out->num_chunks = total;

  size_t c = 0;
  for (uint32_t t = 0; t < num_tensors; t++) {
    uint64_t n = (counts[t] + chunk_elems - 1) / chunk_elems;
    uint64_t base = counts[t] / n, extra = counts[t] % n, off = 0;
    out->first_chunk[t] = c;
    for (uint64_t i = 0; i < n; i++, c++) {
      struct placement_chunk *ch = &out->chunks[c];
      ch->key = PLACEMENT_KEY(t, i);
      ch->tensor = t;
      ch->offset = off;
      ch->count = base + (i < extra ? 1 : 0);
      off += ch->count;
      order[c] = ch;
    }
  }
  out->first_chunk[num_tensors] = c;

  qsort(order, total, sizeof(*order), cmp_by_size_desc);
  for (size_t i = 0; i < total; i++) {
    uint32_t best = 0;
    for (uint32_t s = 1; s < num_shards; s++)
      if (out->shard_bytes[s] < out->shard_bytes[best]) best = s;
    order[i]->shard = best;
    out->shard_bytes[best] += order[i]->count * 4;
  }
  free(order);
  return 0;
fail:
  free(order);
  placement_free(out);
  return ret;
}

void placement_free(struct placement *p) {
  if (!p) return;
  free(p->chunks);
  free(p->first_chunk);
  free(p->shard_bytes);
  memset(p, 0, sizeof(*p));
}

const struct placement_chunk *placement_find(const struct placement *p, uint64_t key) {
  size_t lo = 0, hi = p->num_chunks;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    uint64_t k = p->chunks[mid].key;
    if (k == key) return &p->chunks[mid];
    if (k < key)
      lo = mid + 1;
    else
      hi = mid;
  }
  return NULL;
}

static uint64_t fnv(uint64_t h, const void *data, size_t n) {
  const uint8_t *p = data;
  for (size_t i = 0; i < n; i++) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

uint64_t placement_layout_hash(const char *const *names, const uint64_t *counts,
                               uint32_t num_tensors, uint64_t chunk_bytes, uint32_t num_shards) {
  uint64_t h = 0xcbf29ce484222325ull;
  h = fnv(h, &num_tensors, sizeof(num_tensors));
  for (uint32_t t = 0; t < num_tensors; t++) {
    const char *name = names && names[t] ? names[t] : "";
    h = fnv(h, name, strlen(name) + 1);
    h = fnv(h, &counts[t], sizeof(counts[t]));
  }
  h = fnv(h, &chunk_bytes, sizeof(chunk_bytes));
  h = fnv(h, &num_shards, sizeof(num_shards));
  return h;
}
