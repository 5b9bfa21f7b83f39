/* placement: cutting a model layout into keys and placing keys on shards.
 *
 * A tensor of B bytes is cut into ceil(B / chunk_bytes) chunks of nearly equal
 * size (never a tiny tail chunk); each chunk is one key:
 *   key = (tensor index << 32) | chunk index.
 * Chunks are placed by longest-processing-time greedy: largest first (ties by
 * key), each onto the shard holding the fewest bytes so far (ties: lowest
 * shard id). The result depends only on (tensor sizes, chunk_bytes, shard
 * count), so every worker and every shard computes the same map with no
 * coordinator, and the bytes per shard stay within one chunk of each other. */
#ifndef PS_PLACEMENT_H
#define PS_PLACEMENT_H

#include <stddef.h>
#include <stdint.h>

struct placement_chunk {
  uint64_t key;
  uint32_t tensor;
  uint32_t shard;
  uint64_t offset; /* first element within the tensor */
  uint64_t count;  /* elements (float32) */
};

struct placement {
  uint32_t num_tensors;
  uint32_t num_shards;
  size_t num_chunks;
  struct placement_chunk *chunks; /* ordered by (tensor, chunk index) */
  size_t *first_chunk;            /* per tensor: index of its first chunk; [num_tensors] = end */
  uint64_t *shard_bytes;          /* per shard */
};

#define PLACEMENT_KEY(tensor, chunk) (((uint64_t)(tensor) << 32) | (uint64_t)(chunk))
#define PLACEMENT_DEFAULT_CHUNK_BYTES (4u * 1024u * 1024u)

/* counts[i] = element count (float32) of tensor i, each >= 1. chunk_bytes is
 * rounded down to a multiple of 4 (minimum 4). Returns 0, -EINVAL or -ENOMEM. */
int placement_build(const uint64_t *counts, uint32_t num_tensors, uint64_t chunk_bytes,
                    uint32_t num_shards, struct placement *out);
void placement_free(struct placement *p);

/* Finds a chunk by key (binary search); NULL if the key does not exist. */
const struct placement_chunk *placement_find(const struct placement *p, uint64_t key);

/* FNV-1a 64 of everything that defines a layout: names, element counts,
 * chunk_bytes and shard count. Shards compare it to refuse a mismatch. */
uint64_t placement_layout_hash(const char *const *names, const uint64_t *counts,
                               uint32_t num_tensors, uint64_t chunk_bytes, uint32_t num_shards);

#endif
