/* bench_device_train: samples/s of the trainer's model on one device, for
 * docs/BENCHMARKS.md (a benchmark program, not a test).
 *
 * The loop is the trainer's step without communication: gather a batch of
 * Fashion-MNIST in the trainer's epoch order (data.h), forward, softmax
 * cross-entropy, backward, SGD; every step waits for its loss, as the trainer
 * does. --mode local keeps parameters and gradients on the device and runs
 * SGD there (what PyTorch's own loop does, tests/gpu/torch-bench);
 * --mode mirror also moves what a sync backend moves each step: parameters
 * host -> device before the step, each gradient device -> host through the
 * callbacks, SGD on the host mirror (the device half of a PS-mode step, no
 * network). After --warmup steps (graph capture, cuBLAS heuristics, clocks),
 * --steps steps are timed with CLOCK_MONOTONIC; one line is printed:
 *   bench device="..." mode=local model=... batch=128 steps=... samples_per_s=...
 *   us_per_step=... loss_start=... loss_end=...
 * loss_start/loss_end average 20 steps: they show that it trains. */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "config.h"
#include "data.h"
#include "device.h"
#include "log.h"
#include "model.h"

struct bench_config {
  char device[16];
  char mode[16];
  char model[256];
  char data[1024];
  int64_t batch_size;
  int64_t steps;
  int64_t warmup;
  int64_t seed;
  double lr;
  bool eager;
};

#define CONFIG_STRUCT struct bench_config
static const struct config_option bench_options[] = {
    CONFIG_OPT("device", CONFIG_STRING, device, "auto", 0, 0, "auto, cpu or cuda"),
    CONFIG_OPT("mode", CONFIG_STRING, mode, "local", 0, 0,
               "local (parameters and SGD on the device) or mirror (plus the host copies a sync "
               "backend needs, SGD on the host)"),
    CONFIG_OPT("model", CONFIG_STRING, model, "mlp:784-256-10", 0, 0,
               "model: mlp:IN-HIDDEN...-OUT"),
    CONFIG_OPT("data", CONFIG_STRING, data, "/usr/share/datasets/fashion-mnist", 0, 0,
               "directory with the IDX files"),
    CONFIG_OPT("batch-size", CONFIG_INT, batch_size, "128", 1, 65536, "samples per step"),
    CONFIG_OPT("steps", CONFIG_INT, steps, "2000", 1, 1e9, "timed steps"),
    CONFIG_OPT("warmup", CONFIG_INT, warmup, "100", 0, 1e9, "untimed steps first"),
    CONFIG_OPT("seed", CONFIG_INT, seed, "1", 0, 9.2e18,
               "seed of the initial weights and the data order"),
    CONFIG_OPT("lr", CONFIG_DOUBLE, lr, "0.1", 0, 1e6, "SGD learning rate"),
    CONFIG_OPT("eager", CONFIG_BOOL, eager, "false", 0, 0,
               "CUDA: launch kernel by kernel instead of replaying a CUDA graph"),
};

static const struct config_spec bench_spec = {
    "bench_device_train", "samples/s of the trainer's model on one device (no communication)",
    bench_options, sizeof(bench_options) / sizeof(bench_options[0]), NULL};

static void ignore_grad(int tensor, size_t done, void *arg) {
  (void)tensor;
  (void)done;
  (void)arg;
}

int main(int argc, char **argv) {
  struct bench_config cfg;
  struct device_opts o = {0};
  struct dataset ds = {0};
  struct device_model *dm = NULL;
  uint32_t *perm = NULL;
  int sizes[MLP_MAX_SIZES], num_sizes, ret = 1;
  char err[512];

  memset(&cfg, 0, sizeof(cfg));
  int r = config_parse(&bench_spec, &cfg, argc, argv, NULL, stderr);
  if (r == CONFIG_HELP || r == CONFIG_VERSION) return 0;
  if (r < 0) return 2;
  bool mirror = strcmp(cfg.mode, "mirror") == 0;
  if (device_kind_parse(cfg.device, &o.kind) < 0 || (!mirror && strcmp(cfg.mode, "local") != 0)) {
    fprintf(stderr, "bench_device_train: bad --device \"%s\" or --mode \"%s\"\n", cfg.device,
            cfg.mode);
    return 2;
  }
  if (mlp_parse_spec(cfg.model, sizes, MLP_MAX_SIZES, &num_sizes, err, sizeof(err)) < 0) {
    fprintf(stderr, "bench_device_train: option --model: %s\n", err);
    return 2;
  }
  o.eager = cfg.eager;
  log_setup("bench_device_train", LOG_WARN);
  if (dataset_load(cfg.data, "train", &ds, err, sizeof(err)) < 0) {
    fprintf(stderr, "bench_device_train: %s\n", err);
    goto out;
  }
  int B = (int)cfg.batch_size;
  uint32_t steps_per_epoch = dataset_steps_per_epoch(ds.n, (uint32_t)B, 1);
  if (steps_per_epoch == 0) {
    fprintf(stderr, "bench_device_train: batch larger than the data set\n");
    goto out;
  }
  if ((r = device_model_open(&o, sizes, num_sizes, B, &dm, err, sizeof(err))) < 0) {
    fprintf(stderr, "bench_device_train: %s\n", err);
    ret = r == -ENODEV ? 77 : 1;
    goto out;
  }
  struct mlp *m = device_model_host(dm);
  mlp_init_params(m, (uint64_t)cfg.seed);
  perm = malloc(ds.n * sizeof(uint32_t));
  if (perm == NULL || device_model_load_params(dm) < 0) goto failed;

  int64_t total = cfg.warmup + cfg.steps;
  double t0 = clock_now_s(), loss_start = 0, loss_end = 0;
  uint32_t epoch = UINT32_MAX;
  for (int64_t i = 0; i < total; i++) {
    uint32_t t = (uint32_t)(i % steps_per_epoch);
    float loss;
    if (i == cfg.warmup) t0 = clock_now_s();
    if ((uint32_t)(i / steps_per_epoch) != epoch) {
      epoch = (uint32_t)(i / steps_per_epoch);
      dataset_epoch_order((uint64_t)cfg.seed, epoch, ds.n, perm);
    }
    if (device_model_load_batch(dm, &ds, perm + (size_t)t * B, B) < 0) goto failed;
    if (mirror) {
      if (device_model_load_params(dm) < 0 || device_model_step(dm, ignore_grad, NULL, &loss) < 0)
        goto failed;
      mlp_sgd_step(m, (float)cfg.lr);
    } else {
      if (device_model_step(dm, NULL, NULL, &loss) < 0 ||
          device_model_sgd_step(dm, (float)cfg.lr) < 0)
        goto failed;
    }
    if (!isfinite(loss)) {
      fprintf(stderr, "bench_device_train: loss %g at step %lld\n", (double)loss, (long long)i);
      goto out;
    }
    if (i < 20) loss_start += loss / 20.0;
    if (i >= total - 20) loss_end += loss / 20.0;
  }
  double dt = clock_now_s() - t0;
  printf(
      "bench device=\"%s\" mode=%s model=%s batch=%d steps=%lld samples_per_s=%.0f "
      "us_per_step=%.1f loss_start=%.4f loss_end=%.4f\n",
      device_model_name(dm), cfg.mode, cfg.model, B, (long long)cfg.steps,
      (double)cfg.steps * B / dt, dt / (double)cfg.steps * 1e6, loss_start, loss_end);
  ret = 0;
  goto out;

failed:
  fprintf(stderr, "bench_device_train: %s\n", dm ? device_model_errmsg(dm) : "out of memory");
out:
  free(perm);
  device_model_close(dm);
  dataset_free(&ds);
  return ret;
}
