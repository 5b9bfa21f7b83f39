/* Placement: chunking, determinism, balance and the layout hash. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "placement.h"
#include "check.h"

static void check_cover(const struct placement *p, const uint64_t *counts, uint32_t nt) {
  for (uint32_t t = 0; t < nt; t++) {
    uint64_t off = 0;
    for (size_t c = p->first_chunk[t]; c < p->first_chunk[t + 1]; c++) {
      CHECK(p->chunks[c].tensor == t && p->chunks[c].offset == off, "tensor %u chunk %zu", t, c);
      CHECK(p->chunks[c].key == PLACEMENT_KEY(t, c - p->first_chunk[t]), "key");
      CHECK(placement_find(p, p->chunks[c].key) == &p->chunks[c], "find");
      off += p->chunks[c].count;
    }
    CHECK(off == counts[t], "tensor %u covers %llu of %llu", t, (unsigned long long)off,
          (unsigned long long)counts[t]);
  }
}

int main(void) {
  /* chunks are near-equal, never a tiny tail */
  uint64_t one[] = {1025};
  struct placement p;
  CHECK(placement_build(one, 1, 1024 * 4, 3, &p) == 0, "build");
  CHECK(p.num_chunks == 2 && p.chunks[0].count == 513 && p.chunks[1].count == 512, "split %zu",
        p.num_chunks);
  check_cover(&p, one, 1);
  placement_free(&p);

  /* a model like the issue's: 20 tensors of mixed sizes, 100M float32 over 4 shards */
  uint64_t counts[20];
  uint64_t total = 0;
  for (int i = 0; i < 20; i++) {
    counts[i] = (i % 3 == 0) ? 12000000ull + (uint64_t)i * 77777 : 1000ull * (uint64_t)(i + 1);
    total += counts[i];
  }
  counts[19] = 100000000ull - (total - counts[19]);
  CHECK(placement_build(counts, 20, PLACEMENT_DEFAULT_CHUNK_BYTES, 4, &p) == 0, "build big");
  check_cover(&p, counts, 20);
  uint64_t sum = 0;
  for (int s = 0; s < 4; s++) sum += p.shard_bytes[s];
  CHECK(sum == 400000000ull, "bytes %llu", (unsigned long long)sum);
  for (int s = 0; s < 4; s++) {
    double dev = (double)p.shard_bytes[s] / (sum / 4.0) - 1.0;
    CHECK(dev < 0.05 && dev > -0.05, "shard %d holds %.3f%% off the mean", s, dev * 100);
    printf("shard %d: %llu bytes\n", s, (unsigned long long)p.shard_bytes[s]);
  }
  /* recomputing gives the same map (every worker and shard agrees) */
  struct placement q;
  CHECK(placement_build(counts, 20, PLACEMENT_DEFAULT_CHUNK_BYTES, 4, &q) == 0, "rebuild");
  CHECK(q.num_chunks == p.num_chunks, "chunk count");
  for (size_t i = 0; i < p.num_chunks && i < q.num_chunks; i++)
    CHECK(memcmp(&p.chunks[i], &q.chunks[i], sizeof(p.chunks[i])) == 0, "chunk %zu differs", i);
  placement_free(&q);
  placement_free(&p);

  /* many small tensors on more shards than tensors still spread */
  uint64_t small[3] = {10, 10, 10};
  CHECK(placement_build(small, 3, 4096, 3, &p) == 0, "small");
  CHECK(p.chunks[0].shard != p.chunks[1].shard && p.chunks[1].shard != p.chunks[2].shard &&
            p.chunks[0].shard != p.chunks[2].shard,
        "3 equal tensors on 3 shards share a shard");
  placement_free(&p);

  /* bad input */
  uint64_t zero[] = {0};
  CHECK(placement_build(zero, 1, 4096, 2, &p) < 0, "zero-size tensor accepted");
  CHECK(placement_build(one, 1, 4096, 0, &p) < 0, "zero shards accepted");

  /* the hash sees every field */
  const char *n1[] = {"a", "b"}, *n2[] = {"a", "c"};
  uint64_t c1[] = {5, 6}, c2[] = {5, 7};
  uint64_t h = placement_layout_hash(n1, c1, 2, 4096, 2);
  CHECK(h == placement_layout_hash(n1, c1, 2, 4096, 2), "hash not stable");
  CHECK(h != placement_layout_hash(n2, c1, 2, 4096, 2), "name ignored");
  CHECK(h != placement_layout_hash(n1, c2, 2, 4096, 2), "count ignored");
  CHECK(h != placement_layout_hash(n1, c1, 2, 8192, 2), "chunk ignored");
  CHECK(h != placement_layout_hash(n1, c1, 2, 4096, 3), "shards ignored");
  CHECK(h != placement_layout_hash(n1, c1, 1, 4096, 2), "tensor count ignored");
  return failures ? 1 : 0;
}
