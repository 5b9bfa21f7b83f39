/* optimizer: update rules (see optimizer.h). Each rule is one pass over the
 * key, written as a plain loop the compiler vectorises; scalars that torch
 * computes in double (bias corrections, step size) are computed in double
 * here too and rounded to float once, at the same points torch rounds them.
 * Where torch's CPU kernels fuse a multiply-add (Tensor.add with alpha is
 * vec::fmadd) the loops call fmaf, and only there (C17 mode does not
 * contract a*b+c by itself): a fused and an unfused p - lr*g differ by an ulp
 * of lr*g, which is a large relative error when p nearly cancels it.
 * Built at -O3 with target_clones (the x86-64-v3/v4 clones have FMA, so fmaf
 * is one vector instruction) and -fno-math-errno so sqrt vectorises.
 *
 * Every rule reads the gradient as GRAD(i) = (g[i] + g2[i]) * gs, or
 * g[i] * gs without g2, and writes the parameters to pd from ps (the same
 * array, or a fresh one when the old is still being sent): so the shard
 * adds the last push of a step, averages and updates in one pass, without
 * first writing the sum back, and never copies parameters to update them.
 * g2 is loop-invariant, so -O3 unswitches each loop into a vectorised one
 * per case; (g[i] + g2[i]) * gs rounds exactly as the separate sum did. */
#include "optimizer.h"

#include <errno.h>
#include <math.h>
#include <string.h>

#include "config.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define OPT_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#elif defined(__x86_64__) && defined(__clang__)
#define OPT_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define OPT_CLONES
#endif

static const char *const kind_names[] = {[OPT_SGD] = "sgd",
                                         [OPT_MOMENTUM] = "momentum",
                                         [OPT_ADAM] = "adam",
                                         [OPT_ADAMW] = "adamw",
                                         [OPT_SUM] = "sum"};
#define NUM_KINDS (sizeof(kind_names) / sizeof(kind_names[0]))

int opt_parse(const char *name, enum opt_kind *out) {
  int i = config_choice(name, kind_names, NUM_KINDS, NULL, 0);
  if (i < 0) return i;
  *out = (enum opt_kind)i;
  return 0;
}

int opt_check(const char *value, char *err, size_t errlen) {
  return config_choice(value, kind_names, NUM_KINDS, err, errlen) < 0 ? -EINVAL : 0;
}

const char *opt_name(enum opt_kind kind) {
  return (size_t)kind < NUM_KINDS ? kind_names[kind] : "?";
}

size_t opt_state_floats(enum opt_kind kind) {
  switch (kind) {
    case OPT_MOMENTUM:
      return 1;
    case OPT_ADAM:
    case OPT_ADAMW:
      return 2;
    case OPT_SGD:
    case OPT_SUM:
      break;
  }
  return 0;
}

#define GRAD(i) ((g2 ? g[i] + g2[i] : g[i]) * gs)

/* torch: d = grad.add(p, alpha=wd); p.add_(d, alpha=-lr) */
OPT_CLONES static void sgd(float *pd, const float *ps, const float *restrict g,
                           const float *restrict g2, size_t n, float gs, float lr, float wd) {
  for (size_t i = 0; i < n; i++) pd[i] = fmaf(-lr, fmaf(wd, ps[i], GRAD(i)), ps[i]);
}

/* torch: d = grad.add(p, alpha=wd); buf.mul_(mu).add_(d);
 *        d = nesterov ? d.add(buf, alpha=mu) : buf; p.add_(d, alpha=-lr) */
OPT_CLONES static void momentum(float *pd, const float *ps, const float *restrict g,
                                const float *restrict g2, float *restrict v, size_t n, float gs,
                                float lr, float mu, float wd, bool nesterov) {
  if (nesterov) {
    for (size_t i = 0; i < n; i++) {
      float d = fmaf(wd, ps[i], GRAD(i));
      float vi = v[i] * mu + d;
      v[i] = vi;
      pd[i] = fmaf(-lr, fmaf(mu, vi, d), ps[i]);
    }
  } else {
    for (size_t i = 0; i < n; i++) {
      float vi = v[i] * mu + fmaf(wd, ps[i], GRAD(i));
      v[i] = vi;
      pd[i] = fmaf(-lr, vi, ps[i]);
    }
  }
}

/* Adam and AdamW share the moment updates; decay is L2 (added to the
 * gradient) for Adam, or a multiplicative shrink first for AdamW (pshrink).
 * torch: m.mul_(b1).add_(g, alpha=1-b1); s.mul_(b2).addcmul_(g, g, value=1-b2);
 *        p.addcdiv_(m, s.sqrt() / bc2_sqrt + eps, value=-step)  (addcmul and
 *        addcdiv are not fused in torch's kernels) */
OPT_CLONES static void adam(float *pd, const float *ps, const float *restrict g,
                            const float *restrict g2, float *restrict m, float *restrict s,
                            size_t n, float gs, float wd, float pshrink, float b1, float one_b1,
                            float b2, float one_b2, float bc2_sqrt, float eps, float neg_step) {
  for (size_t i = 0; i < n; i++) {
    float pi = ps[i] * pshrink;
    float gi = fmaf(wd, pi, GRAD(i));
    float mi = fmaf(one_b1, gi, m[i] * b1);
    float si = s[i] * b2 + one_b2 * gi * gi;
    m[i] = mi;
    s[i] = si;
    pd[i] = pi + neg_step * mi / (sqrtf(si) / bc2_sqrt + eps);
  }
}

OPT_CLONES static void assign(float *restrict pd, const float *restrict g, const float *restrict g2,
                              size_t n, float gs) {
  for (size_t i = 0; i < n; i++) pd[i] = GRAD(i);
}
#undef GRAD

/* The look-ahead momentum rule (optimizer.h, opt_lookahead): phi holds the
 * point the workers compute on, theta = phi + lr_prev * mu * vsum. */
OPT_CLONES static void lookahead(float *pd, const float *ps, const float *restrict g,
                                 float *restrict vr, float *restrict vsum, size_t n, float gs,
                                 float back, float lr, float ahead, float mu, float wd) {
  for (size_t i = 0; i < n; i++) {
    float theta = fmaf(back, vsum[i], ps[i]);
    float vi = vr[i] * mu + fmaf(wd, theta, g[i] * gs);
    float si = vsum[i] + (vi - vr[i]);
    vr[i] = vi;
    vsum[i] = si;
    pd[i] = fmaf(-ahead, si, fmaf(-lr, vi, theta));
  }
}

void opt_lookahead(const struct opt_params *o, double lr_prev, double lr, float gscale, float *dst,
                   const float *phi, const float *g, float *vr, float *vsum, size_t n) {
  lookahead(dst, phi, g, vr, vsum, n, gscale, (float)(lr_prev * o->momentum), (float)lr,
            (float)(lr * o->momentum), (float)o->momentum, (float)o->weight_decay);
}

double opt_lr_at(const struct opt_params *o, uint64_t step) {
  if (o->decay_steps == 0) return o->lr;
  double f = step >= o->decay_steps ? 1.0 : (double)step / (double)o->decay_steps;
  return o->lr * 0.5 * (1.0 + cos(M_PI * f));
}

void opt_apply(const struct opt_params *o, double lr, uint64_t t, float gscale, float *p,
               const float *g, float *state, size_t n) {
  opt_apply_fused(o, lr, t, gscale, p, p, g, NULL, state, n);
}

void opt_apply_fused(const struct opt_params *o, double lr, uint64_t t, float gscale, float *dst,
                     const float *p, const float *g, const float *g2, float *state, size_t n) {
  switch (o->kind) {
    case OPT_SGD:
      sgd(dst, p, g, g2, n, gscale, (float)lr, (float)o->weight_decay);
      break;
    case OPT_MOMENTUM:
      momentum(dst, p, g, g2, state, n, gscale, (float)lr, (float)o->momentum,
               (float)o->weight_decay, o->nesterov);
      break;
    case OPT_ADAM:
    case OPT_ADAMW: {
      double step = (double)(t ? t : 1);
      double bc1 = 1.0 - pow(o->beta1, step);
      double bc2 = 1.0 - pow(o->beta2, step);
      bool decoupled = o->kind == OPT_ADAMW;
      float wd = decoupled ? 0.0f : (float)o->weight_decay;
      float shrink = decoupled ? (float)(1.0 - lr * o->weight_decay) : 1.0f;
      adam(dst, p, g, g2, state, state + n, n, gscale, wd, shrink, (float)o->beta1,
           (float)(1.0 - o->beta1), (float)o->beta2, (float)(1.0 - o->beta2), (float)sqrt(bc2),
           (float)o->eps, (float)(-(lr / bc1)));
      break;
    }
    case OPT_SUM:
      assign(dst, g, g2, n, gscale);
      break;
  }
}
