/* optimizer: update rules (see optimizer.h). Loops are written so the
 * compiler vectorises them; built at -O3 with target_clones like the
 * tensor_math kernels. */
#include "optimizer.h"

#include <errno.h>
#include <math.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define OPT_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define OPT_CLONES
#endif

int opt_parse(const char *name, enum opt_kind *out) {
  if (strcmp(name, "sgd") == 0) *out = OPT_SGD;
  else if (strcmp(name, "momentum") == 0) *out = OPT_MOMENTUM;
  else return -EINVAL;
  return 0;
}

const char *opt_name(enum opt_kind kind) {
  return kind == OPT_MOMENTUM ? "momentum" : "sgd";
}

size_t opt_state_floats(enum opt_kind kind) {
  return kind == OPT_MOMENTUM ? 1 : 0;
}

OPT_CLONES static void sgd(float *restrict p, float *restrict g, size_t n, float lr, float wd) {
  for (size_t i = 0; i < n; i++) p[i] -= lr * (g[i] + wd * p[i]);
}

OPT_CLONES static void momentum(float *restrict p, const float *restrict g, float *restrict v,
                                size_t n, float lr, float mu, float wd, bool nesterov) {
  if (nesterov) {
    for (size_t i = 0; i < n; i++) {
      float gi = g[i] + wd * p[i];
      v[i] = mu * v[i] + gi;
      p[i] -= lr * (gi + mu * v[i]);
    }
  } else {
    for (size_t i = 0; i < n; i++) {
      v[i] = mu * v[i] + (g[i] + wd * p[i]);
      p[i] -= lr * v[i];
    }
  }
}

float opt_lr_at(const struct opt_params *o, uint64_t step) {
  if (o->decay_steps == 0) return o->lr;
  double f = step >= o->decay_steps ? 1.0 : (double)step / (double)o->decay_steps;
  return (float)(o->lr * 0.5 * (1.0 + cos(M_PI * f)));
}

void opt_apply(const struct opt_params *o, float lr, float *p, float *g, float *state, size_t n) {
  switch (o->kind) {
    case OPT_SGD:
      sgd(p, g, n, lr, o->weight_decay);
      break;
    case OPT_MOMENTUM:
      momentum(p, g, state, n, lr, o->momentum, o->weight_decay, o->nesterov);
      break;
  }
}
