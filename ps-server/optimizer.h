/* optimizer: the update a shard applies to a key once its step's gradients
 * are averaged. Semantics follow torch.optim exactly so results can be
 * compared with a PyTorch reference:
 *   sgd:       g = grad + wd * p;                 p -= lr * g
 *   momentum:  g = grad + wd * p; v = mu * v + g  (v starts at 0, so v1 = g)
 *              p -= lr * (nesterov ? g + mu * v : v)
 * State (v) is allocated per key on its first update.
 * Learning-rate schedule: with decay_steps > 0 the rate of the update that
 * makes version v+1 is lr * (1 + cos(pi * min(v, decay_steps) / decay_steps)) / 2
 * (cosine annealing to 0, torch's CosineAnnealingLR with eta_min 0); in BSP the
 * version is the global step, so every shard follows the same schedule. */
#ifndef PS_OPTIMIZER_H
#define PS_OPTIMIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum opt_kind { OPT_SGD = 0, OPT_MOMENTUM = 1 };

struct opt_params {
  enum opt_kind kind;
  float lr;
  float momentum;
  float weight_decay;
  bool nesterov;
  uint64_t decay_steps; /* 0 = constant learning rate */
};

/* The learning rate of the update applied at version `step`. */
float opt_lr_at(const struct opt_params *o, uint64_t step);

/* "sgd" or "momentum"; returns 0 or -EINVAL. */
int opt_parse(const char *name, enum opt_kind *out);
const char *opt_name(enum opt_kind kind);

/* Floats of state per parameter (0 for sgd, 1 for momentum). */
size_t opt_state_floats(enum opt_kind kind);

/* Applies one update to p[0..n) with the averaged gradient g (g is used as
 * scratch and clobbered); state has opt_state_floats(kind) * n floats,
 * zeroed before the first call. */
void opt_apply(const struct opt_params *o, float lr, float *p, float *g, float *state, size_t n);

#endif
