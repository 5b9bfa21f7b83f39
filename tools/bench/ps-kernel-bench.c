/* ps-kernel-bench: how fast one shard core reduces and applies gradients, so
 * the reduction can be compared with what the network delivers (a loopback
 * TCP stream carries ~5 GB/s here, docs/ARCHITECTURE.md, Pitfalls).
 *
 * For each size (one key's float32 values; 64 KiB and 1 MiB stay in cache,
 * 4 MiB is the default chunk, 16 and 64 MiB are not cached) it times, on one
 * thread:
 *   add        tm_add(sum, grad): what a shard does with every push after
 *              the first of a BSP step (the kernel the issue calls "the
 *              reduction")
 *   copy       memcpy(sum, grad): the first push of a step
 *   sgd, momentum, adam
 *              opt_apply with gscale 1/W: the update applied once per step
 *   step W=4   the whole BSP step of one key with 4 workers: copy + 3 adds
 *              + momentum, per pushed byte
 *   fused W=4  the same step as the shard runs it: copy + 2 adds + the last
 *              push added inside momentum's pass (opt_apply_fused)
 * and prints the median over --reps repetitions of GB/s of gradient bytes
 * consumed (n * 4 bytes per call; for "step", 4 pushes), plus the memory
 * traffic the kernel implies (add reads two arrays and writes one: 3x).
 * With --dtypes it times the ring's reduction kernels on every element type
 * instead (dtype.h: dtype_combine's add and max, dtype_divide's mean over
 * W = 4), in GB/s of the buffer's bytes, float32 first as the baseline:
 * what a type costs per byte next to float32 and next to the wire.
 * A benchmark, not a test: run it on a quiet machine. Each repetition runs
 * the kernel for at least --min-ms milliseconds. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <time.h>

#include "clock.h"
#include "config.h"
#include "dtype.h"
#include "optimizer.h"
#include "tensor_math.h"

struct bench_config {
  char sizes[256];
  int64_t reps;
  int64_t min_ms;
  bool dtypes;
};

#define CONFIG_STRUCT struct bench_config
static const struct config_option bench_options[] = {
    CONFIG_OPT("sizes", CONFIG_STRING, sizes, "64KiB,1MiB,4MiB,16MiB,64MiB", 0, 0,
               "bytes of one key, comma-separated (suffixes KiB, MiB)"),
    CONFIG_OPT("reps", CONFIG_INT, reps, "7", 1, 1000,
               "repetitions per measurement (median shown)"),
    CONFIG_OPT("min-ms", CONFIG_INT, min_ms, "100", 1, 100000,
               "shortest repetition in milliseconds"),
    CONFIG_OPT("dtypes", CONFIG_BOOL, dtypes, "false", 0, 0,
               "time the ring's reduction kernels (add, max, mean) on every element type instead"),
};

static const struct config_spec bench_spec = {
    "ps-kernel-bench",
    "GB/s of the shard's reduction (tm_add) and optimizer kernels on one core, by key size",
    bench_options, sizeof(bench_options) / sizeof(bench_options[0]), NULL};

enum kernel { K_ADD, K_COPY, K_SGD, K_MOMENTUM, K_ADAM, K_STEP4, K_FUSED4, NUM_KERNELS };
static const char *const kernel_names[NUM_KERNELS] = {"add",  "copy",     "sgd",      "momentum",
                                                      "adam", "step W=4", "fused W=4"};
/* bytes of memory traffic per gradient byte consumed */
static const double traffic[NUM_KERNELS] = {3, 2, 3, 5, 7, 4, 3.5};

struct bufs {
  float *p, *sum, *g, *state;
  size_t n;
};

static struct opt_params params_for(enum kernel k) {
  struct opt_params o = {
      .kind = OPT_SGD, .lr = 1e-3, .momentum = 0.9, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8};
  if (k == K_MOMENTUM || k == K_STEP4 || k == K_FUSED4) o.kind = OPT_MOMENTUM;
  if (k == K_ADAM) o.kind = OPT_ADAM;
  return o;
}

/* One call of kernel k; returns gradient bytes consumed. */
static double run_once(enum kernel k, struct bufs *b, uint64_t t) {
  struct opt_params o = params_for(k);
  switch (k) {
    case K_ADD:
      tm_add(b->sum, b->g, b->n);
      return (double)b->n * 4;
    case K_COPY:
      memcpy(b->sum, b->g, b->n * 4);
      return (double)b->n * 4;
    case K_SGD:
    case K_MOMENTUM:
    case K_ADAM:
      opt_apply(&o, o.lr, t, 0.25f, b->p, b->g, b->state, b->n);
      return (double)b->n * 4;
    case K_STEP4:
      memcpy(b->sum, b->g, b->n * 4);
      for (int w = 1; w < 4; w++) tm_add(b->sum, b->g, b->n);
      opt_apply(&o, o.lr, t, 0.25f, b->p, b->sum, b->state, b->n);
      return (double)b->n * 4 * 4;
    case K_FUSED4:
      memcpy(b->sum, b->g, b->n * 4);
      for (int w = 1; w < 3; w++) tm_add(b->sum, b->g, b->n);
      opt_apply_fused(&o, o.lr, t, 0.25f, b->p, b->p, b->sum, b->g, b->state, b->n);
      return (double)b->n * 4 * 4;
    case NUM_KERNELS:
      break;
  }
  return 0;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Median GB/s over reps of >= min_ms each: run(ctx) consumes `bytes`. */
static double median_rate(const struct bench_config *cfg, double *samples, void (*run)(void *),
                          void *ctx, double bytes) {
  run(ctx); /* warm the caches and the pages */
  for (int rep = 0; rep < cfg->reps; rep++) {
    double done = 0, t0 = clock_now_s(), el;
    do {
      run(ctx);
      done += bytes;
      el = clock_now_s() - t0;
    } while (el * 1000 < (double)cfg->min_ms);
    samples[rep] = done / el / 1e9;
  }
  qsort(samples, (size_t)cfg->reps, sizeof(double), cmp_double);
  return samples[cfg->reps / 2];
}

struct dtype_run {
  int t, what; /* 0 add, 1 max, 2 mean */
  void *a, *b;
  size_t n;
};

static void dtype_once(void *p) {
  struct dtype_run *d = p;
  if (d->what == 2)
    dtype_divide((enum dtype)d->t, d->a, d->n, 4);
  else
    dtype_combine((enum dtype)d->t, d->what ? DTYPE_MAX : DTYPE_ADD, d->a, d->b, d->n);
}

/* --dtypes: per size, a row per type; gradients-like values (the 16-bit
 * floats' conversions cost the same for any normal number) */
static int dtype_table(const struct bench_config *cfg, const uint64_t *sizes, int ns,
                       double *samples) {
  printf("%10s %9s %10s %10s %10s %9s\n", "bytes", "dtype", "add GB/s", "max GB/s", "mean GB/s",
         "add/f32");
  for (int si = 0; si < ns; si++) {
    void *a = aligned_alloc(64, (sizes[si] + 63) / 64 * 64),
         *b = aligned_alloc(64, (sizes[si] + 63) / 64 * 64);
    if (!a || !b) {
      fprintf(stderr, "ps-kernel-bench: out of memory for %llu bytes\n",
              (unsigned long long)sizes[si]);
      return 1;
    }
    double f32 = 0;
    for (int t = 0; t < DTYPE_COUNT; t++) {
      size_t z = dtype_size(t), n = sizes[si] / z;
      for (size_t i = 0; i < n; i++) { /* small values: no overflow in any type */
        uint64_t v = (i * 2654435761u) % 97;
        float f = ((float)v - 48.0f) / 8.0f;
        if (t == DTYPE_FLOAT32)
          ((float *)a)[i] = f, ((float *)b)[i] = -f;
        else if (t == DTYPE_FLOAT64)
          ((double *)a)[i] = f, ((double *)b)[i] = -f;
        else if (t == DTYPE_FLOAT16)
          ((uint16_t *)a)[i] = dtype_float_to_half(f), ((uint16_t *)b)[i] = dtype_float_to_half(-f);
        else if (t == DTYPE_BFLOAT16)
          ((uint16_t *)a)[i] = dtype_float_to_bf16(f), ((uint16_t *)b)[i] = dtype_float_to_bf16(-f);
        else
          memcpy((char *)a + i * z, &v, z), memcpy((char *)b + i * z, &v, z);
      }
      double rate[3];
      for (int what = 0; what < 3; what++) {
        struct dtype_run d = {t, what, a, b, n};
        rate[what] = median_rate(cfg, samples, dtype_once, &d, (double)(n * z));
      }
      if (t == DTYPE_FLOAT32) f32 = rate[0];
      printf("%10llu %9s %10.1f %10.1f %10.1f %8.2fx\n", (unsigned long long)sizes[si],
             dtype_name(t), rate[0], rate[1], rate[2], rate[0] / f32);
      fflush(stdout);
    }
    free(a);
    free(b);
  }
  return 0;
}

static int parse_sizes(const char *s, uint64_t *out, int max) {
  int n = 0;
  char buf[256];
  snprintf(buf, sizeof(buf), "%s", s);
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    if (n == max || config_parse_size(tok, &out[n]) < 0 || out[n] < 4 || out[n] % 4) return -EINVAL;
    n++;
  }
  return n ? n : -EINVAL;
}

int main(int argc, char **argv) {
  struct bench_config cfg;
  memset(&cfg, 0, sizeof(cfg));
  int r = config_parse(&bench_spec, &cfg, argc, argv, NULL, stderr);
  if (r == CONFIG_HELP || r == CONFIG_VERSION) return 0;
  if (r < 0) return 2;
  uint64_t sizes[16];
  int ns = parse_sizes(cfg.sizes, sizes, 16);
  if (ns < 0) {
    fprintf(stderr,
            "ps-kernel-bench: option --sizes: \"%s\" is not a list of byte sizes that "
            "are multiples of 4\n",
            cfg.sizes);
    return 2;
  }
  struct utsname u;
  uname(&u);
  time_t now = time(NULL);
  char date[32];
  strftime(date, sizeof(date), "%Y-%m-%dT%H:%MZ", gmtime(&now));
  printf("# ps-kernel-bench %s host=%s one thread, median of %lld reps of >= %lld ms\n", date,
         u.nodename, (long long)cfg.reps, (long long)cfg.min_ms);
  double *samples = malloc((size_t)cfg.reps * sizeof(double));
  if (!samples) return 1;
  if (cfg.dtypes) {
    printf("# GB/s of the buffer's bytes (1 GB = 1e9 B): dst (op)= src, and dst /= 4\n");
    r = dtype_table(&cfg, sizes, ns, samples);
    free(samples);
    return r;
  }
  printf("# GB/s of gradient bytes consumed (1 GB = 1e9 B); mem = implied memory traffic\n");
  printf("%10s", "bytes");
  for (int k = 0; k < NUM_KERNELS; k++) printf(" %18s", kernel_names[k]);
  printf("\n");

  for (int si = 0; si < ns; si++) {
    struct bufs b = {.n = sizes[si] / 4};
    b.p = malloc(b.n * 4);
    b.sum = malloc(b.n * 4);
    b.g = malloc(b.n * 4);
    b.state = calloc(2 * b.n, 4);
    if (!b.p || !b.sum || !b.g || !b.state) {
      fprintf(stderr, "ps-kernel-bench: out of memory for %llu bytes\n",
              (unsigned long long)sizes[si]);
      return 1;
    }
    for (size_t i = 0; i < b.n; i++) {
      b.p[i] = (float)(i % 977) * 1e-3f;
      b.sum[i] = 0;
      b.g[i] = (float)(i % 131) * 1e-4f - 6e-3f;
    }
    printf("%10llu", (unsigned long long)sizes[si]);
    for (int k = 0; k < NUM_KERNELS; k++) {
      uint64_t t = 1;
      run_once((enum kernel)k, &b, t++); /* warm the caches and the pages */
      for (int rep = 0; rep < cfg.reps; rep++) {
        double bytes = 0, t0 = clock_now_s(), el;
        do {
          bytes += run_once((enum kernel)k, &b, t++);
          el = clock_now_s() - t0;
        } while (el * 1000 < (double)cfg.min_ms);
        samples[rep] = bytes / el / 1e9;
      }
      qsort(samples, (size_t)cfg.reps, sizeof(double), cmp_double);
      double med = samples[cfg.reps / 2];
      char cell[40];
      snprintf(cell, sizeof(cell), "%.1f (mem %.0f)", med, med * traffic[k]);
      printf(" %18s", cell);
      fflush(stdout);
    }
    printf("\n");
    free(b.p);
    free(b.sum);
    free(b.g);
    free(b.state);
  }
  free(samples);
  return 0;
}
