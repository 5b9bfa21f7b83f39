/* optimizer: the update a shard applies to a key once its step's gradients
 * are averaged. Semantics follow torch.optim exactly so results can be
 * compared with a PyTorch reference:
 *   sgd:       g = grad + wd * p;                 p -= lr * g
 *   momentum:  g = grad + wd * p; v = mu * v + g  (v starts at 0, so v1 = g)
 *              p -= lr * (nesterov ? g + mu * v : v)
 * State (v) is allocated per key on its first update. */
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
};

/* "sgd" or "momentum"; returns 0 or -EINVAL. */
int opt_parse(const char *name, enum opt_kind *out);
const char *opt_name(enum opt_kind kind);

/* Floats of state per parameter (0 for sgd, 1 for momentum). */
size_t opt_state_floats(enum opt_kind kind);

/* Applies one update to p[0..n) with the averaged gradient g (g is used as
 * scratch and clobbered); state has opt_state_floats(kind) * n floats,
 * zeroed before the first call. */
void opt_apply(const struct opt_params *o, float *p, float *g, float *state, size_t n);

#endif
