/* ps-ckpt-bench: how long a shard takes to write and load one checkpoint of
 * a given size. Builds a store of --params floats (tensors of 25M floats in
 * 4 MiB chunks, one shard) with the given optimizer (momentum adds one state
 * float per parameter, adam two), applies one step so the state exists, then
 * writes --repeat checkpoints with each available backend (io_uring, sync)
 * into --dir and loads the newest back, printing a table: backend, bytes,
 * snapshot (loop-thread) seconds, write seconds (temp + fsync + rename + dir
 * fsync), GB/s, load seconds.
 * usage: ps-ckpt-bench [--params N] [--optimizer sgd|momentum|adam]
 *                      [--dir DIR] [--repeat R] */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ckpt.h"
#include "clock.h"
#include "log.h"
#include "placement.h"

static void serve(struct store_key *k, struct store_waiter *w, void *arg) {
  (void)k;
  (void)arg;
  free(w);
}

static int make_store(struct store *s, uint64_t params, enum opt_kind kind) {
  struct store_opts o = {
      .shard = 0,
      .num_shards = 1,
      .num_workers = 2,
      .consistency = STORE_BSP,
      .opt = {
          .kind = kind, .lr = 0.01, .momentum = 0.9, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8}};
  if (store_init(s, &o, serve, NULL) < 0) return -ENOMEM;
  uint64_t per = 25000000;
  uint32_t nt = (uint32_t)((params + per - 1) / per);
  char **names = calloc(nt, sizeof(char *));
  uint64_t *counts = calloc(nt, sizeof(uint64_t));
  for (uint32_t i = 0; i < nt; i++) {
    names[i] = malloc(32);
    snprintf(names[i], 32, "layer%u.weight", i);
    counts[i] = i + 1 < nt ? per : params - per * (nt - 1);
  }
  struct store_layout l = {.num_tensors = nt,
                           .names = names,
                           .counts = counts,
                           .chunk_bytes = 4u << 20,
                           .num_shards = 1};
  l.hash = placement_layout_hash((const char *const *)names, counts, nt, l.chunk_bytes, 1);
  char msg[256];
  int r = store_set_layout(s, &l, msg, sizeof(msg));
  for (uint32_t i = 0; i < nt; i++) free(names[i]);
  free(names);
  free(counts);
  if (r < 0) {
    fprintf(stderr, "layout: %s\n", msg);
    return r;
  }
  float *buf = malloc((4u << 20));
  for (size_t i = 0; i < (1u << 20); i++) buf[i] = (float)(i % 1000) * 1e-3f;
  for (size_t i = 0; i < s->num_keys; i++) {
    store_init_key(s, &s->keys[i], buf);
    for (uint32_t w = 0; w < 2; w++)
      store_push(s, &s->keys[i], w, 0, STORE_NO_BASE, buf, msg, sizeof(msg));
  }
  free(buf);
  return 0;
}

int main(int argc, char **argv) {
  uint64_t params = 100000000;
  const char *dir = "/tmp/ps-ckpt-bench", *optname = "momentum";
  int repeat = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (strcmp(argv[i], "--params") == 0)
      params = strtoull(argv[i + 1], NULL, 10);
    else if (strcmp(argv[i], "--dir") == 0)
      dir = argv[i + 1];
    else if (strcmp(argv[i], "--optimizer") == 0)
      optname = argv[i + 1];
    else if (strcmp(argv[i], "--repeat") == 0)
      repeat = atoi(argv[i + 1]);
    else {
      fprintf(stderr, "ps-ckpt-bench: unknown option %s\n", argv[i]);
      return 2;
    }
  }
  enum opt_kind kind;
  if (opt_parse(optname, &kind) < 0 || params == 0 || repeat < 1) {
    fprintf(stderr, "ps-ckpt-bench: bad --optimizer, --params or --repeat\n");
    return 2;
  }
  log_setup("ps-ckpt-bench", LOG_WARN);
  mkdir(dir, 0755);
  struct store s;
  if (make_store(&s, params, kind) < 0) return 1;
  printf("# %llu parameters, optimizer %s, %zu keys, dir %s\n", (unsigned long long)params, optname,
         s.num_keys, dir);
  printf("%-9s %14s %11s %10s %8s %10s\n", "backend", "bytes", "snapshot_s", "write_s", "GB/s",
         "load_s");
  enum ckpt_io_kind kinds[] = {CKPT_IO_URING, CKPT_IO_SYNC};
  for (int b = 0; b < 2; b++) {
    struct ckpt_io *io;
    if (ckpt_io_open(kinds[b], &io) < 0) {
      printf("%-9s unavailable\n", b == 0 ? "io_uring" : "sync");
      continue;
    }
    for (int rep = 0; rep < repeat; rep++) {
      double t0 = clock_now_s();
      struct ckpt_snapshot *snap = ckpt_snapshot_take(&s);
      double t_snap = clock_now_s() - t0;
      snap->clock = (uint64_t)(b * repeat + rep + 1);
      struct ckpt_write_result res;
      char err[400];
      if (!snap || ckpt_write(io, dir, snap, &res, err, sizeof(err)) < 0) {
        fprintf(stderr, "write: %s\n", err);
        return 1;
      }
      ckpt_snapshot_free(snap);
      struct store l;
      store_init(&l, &s.opts, serve, NULL);
      struct ckpt_info info;
      t0 = clock_now_s();
      int r = ckpt_load_latest(dir, &l, &info, err, sizeof(err));
      double t_load = clock_now_s() - t0;
      store_deinit(&l);
      if (r < 0) {
        fprintf(stderr, "load: %s\n", err);
        return 1;
      }
      printf("%-9s %14llu %11.3f %10.3f %8.2f %10.3f\n", ckpt_io_name(io),
             (unsigned long long)res.bytes, t_snap, res.seconds, res.bytes / res.seconds / 1e9,
             t_load);
      fflush(stdout);
    }
    ckpt_io_close(io);
  }
  store_deinit(&s);
  return 0;
}
