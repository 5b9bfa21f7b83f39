/* metrics: atomic counters, gauges and histograms rendered as Prometheus text
 * (see metrics.h).
 *
 * Storage: a family holds `capacity` series allocated at registration and
 * never moved, so writers index them without a lock. The visible count of a
 * vector (`num`) is published with a release store after its label strings
 * are written; the renderer reads it with acquire. Histogram buckets are
 * stored per bucket (not cumulative) and summed while rendering, and the
 * rendered _count is that sum, so one scrape is always self-consistent
 * (le="+Inf" == _count) even while observations land. */
#include "metrics.h"

#include <errno.h>
#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

enum metric_type { METRIC_COUNTER, METRIC_GAUGE, METRIC_HISTOGRAM };

struct metric {
  struct metric *next;
  enum metric_type type;
  char *name, *help, *label; /* label NULL = a single series */
  size_t capacity;
  atomic_size_t num;       /* series visible to readers */
  char **values;           /* label values [capacity] */
  _Atomic uint64_t *count; /* counters; histogram buckets [nbounds + 1] */
  _Atomic double *gauge;   /* gauges */
  double *bounds;          /* histogram */
  size_t nbounds;
  _Atomic double sum; /* histogram */
};

struct metrics {
  struct metric *head, *tail;
};

struct metrics *metrics_new(void) {
  return calloc(1, sizeof(struct metrics));
}

static void metric_free(struct metric *x) {
  if (!x) return;
  if (x->values)
    for (size_t i = 0; i < x->capacity; i++) free(x->values[i]);
  free(x->values);
  free(x->name);
  free(x->help);
  free(x->label);
  free((void *)x->count);
  free((void *)x->gauge);
  free(x->bounds);
  free(x);
}

void metrics_free(struct metrics *m) {
  if (!m) return;
  struct metric *x = m->head;
  while (x) {
    struct metric *next = x->next;
    metric_free(x);
    x = next;
  }
  free(m);
}

static bool valid_name(const char *s, bool label) {
  if (!s || !*s) return false;
  for (const char *p = s; *p; p++) {
    bool alpha =
        (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || *p == '_' || (!label && *p == ':');
    if (!alpha && !(p > s && *p >= '0' && *p <= '9')) return false;
  }
  return !(label && strncmp(s, "__", 2) == 0);
}

static int set_values(struct metric *x, const char *const *values, size_t n) {
  for (size_t i = 0; i < n; i++) {
    x->values[i] = strdup(values[i] ? values[i] : "");
    if (!x->values[i]) return -ENOMEM;
  }
  atomic_store_explicit(&x->num, n, memory_order_release);
  return 0;
}

static struct metric *add(struct metrics *m, enum metric_type type, const char *name,
                          const char *help, const char *label, size_t capacity,
                          const char *const *values, size_t n) {
  if (!m || !valid_name(name, false) || (label && !valid_name(label, true)) || n > capacity ||
      capacity == 0)
    return NULL;
  for (struct metric *y = m->head; y; y = y->next)
    if (strcmp(y->name, name) == 0) return NULL;
  struct metric *x = calloc(1, sizeof(*x));
  if (!x) return NULL;
  x->type = type;
  x->capacity = capacity;
  x->name = strdup(name);
  x->help = strdup(help ? help : "");
  if (label) x->label = strdup(label);
  x->values = calloc(capacity, sizeof(char *));
  if (type == METRIC_GAUGE)
    x->gauge = calloc(capacity, sizeof(*x->gauge));
  else
    x->count = calloc(capacity, sizeof(*x->count));
  if (!x->name || !x->help || (label && !x->label) || !x->values || (!x->gauge && !x->count))
    goto fail;
  if (!label)
    atomic_store_explicit(&x->num, 1, memory_order_release);
  else if (values && set_values(x, values, n) < 0)
    goto fail;
  if (m->tail)
    m->tail->next = x;
  else
    m->head = x;
  m->tail = x;
  return x;
fail:
  metric_free(x);
  return NULL;
}

struct metric *metrics_counter(struct metrics *m, const char *name, const char *help) {
  return add(m, METRIC_COUNTER, name, help, NULL, 1, NULL, 0);
}

struct metric *metrics_gauge(struct metrics *m, const char *name, const char *help) {
  return add(m, METRIC_GAUGE, name, help, NULL, 1, NULL, 0);
}

struct metric *metrics_counter_vec(struct metrics *m, const char *name, const char *help,
                                   const char *label, size_t capacity, const char *const *values,
                                   size_t n) {
  if (!label) return NULL;
  return add(m, METRIC_COUNTER, name, help, label, capacity, values, n);
}

struct metric *metrics_gauge_vec(struct metrics *m, const char *name, const char *help,
                                 const char *label, size_t capacity, const char *const *values,
                                 size_t n) {
  if (!label) return NULL;
  return add(m, METRIC_GAUGE, name, help, label, capacity, values, n);
}

struct metric *metrics_histogram(struct metrics *m, const char *name, const char *help,
                                 const double *bounds, size_t n) {
  if (!bounds || n == 0) return NULL;
  for (size_t i = 0; i < n; i++)
    if (!isfinite(bounds[i]) || (i > 0 && bounds[i] <= bounds[i - 1])) return NULL;
  struct metric *x = add(m, METRIC_HISTOGRAM, name, help, NULL, n + 1, NULL, 0);
  if (!x) return NULL;
  x->bounds = malloc(n * sizeof(double));
  if (!x->bounds) {
    /* unlink the family we just appended */
    struct metric **pp = &m->head, *prev = NULL;
    while (*pp != x) {
      prev = *pp;
      pp = &(*pp)->next;
    }
    *pp = NULL;
    m->tail = prev;
    metric_free(x);
    return NULL;
  }
  memcpy(x->bounds, bounds, n * sizeof(double));
  x->nbounds = n;
  atomic_store_explicit(&x->num, 1, memory_order_release);
  return x;
}

int metric_vec_set_labels(struct metric *v, const char *const *values, size_t n) {
  if (!v || !v->label || !values) return -EINVAL;
  if (atomic_load_explicit(&v->num, memory_order_acquire) != 0) return -EBUSY;
  if (n > v->capacity) return -EINVAL;
  int r = set_values(v, values, n);
  if (r < 0) {
    for (size_t i = 0; i < n; i++) {
      free(v->values[i]);
      v->values[i] = NULL;
    }
  }
  return r;
}

void metric_vec_inc(struct metric *c, size_t i, uint64_t n) {
  if (!c || c->type != METRIC_COUNTER || i >= c->capacity) return;
  atomic_fetch_add_explicit(&c->count[i], n, memory_order_relaxed);
}

void metric_inc(struct metric *c, uint64_t n) {
  metric_vec_inc(c, 0, n);
}

void metric_vec_set(struct metric *g, size_t i, double v) {
  if (!g || g->type != METRIC_GAUGE || i >= g->capacity) return;
  atomic_store_explicit(&g->gauge[i], v, memory_order_relaxed);
}

void metric_set(struct metric *g, double v) {
  metric_vec_set(g, 0, v);
}

void metric_observe_n(struct metric *h, double v, uint64_t n, double sum) {
  if (!h || h->type != METRIC_HISTOGRAM || isnan(v) || isnan(sum) || !n) return;
  size_t b = 0;
  while (b < h->nbounds && v > h->bounds[b]) b++;
  atomic_fetch_add_explicit(&h->count[b], n, memory_order_relaxed);
  double old = atomic_load_explicit(&h->sum, memory_order_relaxed);
  while (!atomic_compare_exchange_weak_explicit(&h->sum, &old, old + sum, memory_order_relaxed,
                                                memory_order_relaxed)) {
  }
}

void metric_observe(struct metric *h, double v) {
  metric_observe_n(h, v, 1, v);
}

double metric_value(const struct metric *x, size_t i) {
  if (!x || i >= x->capacity) return 0;
  switch (x->type) {
    case METRIC_COUNTER:
      return (double)atomic_load_explicit(&x->count[i], memory_order_relaxed);
    case METRIC_GAUGE:
      return atomic_load_explicit(&x->gauge[i], memory_order_relaxed);
    case METRIC_HISTOGRAM: {
      uint64_t n = 0;
      for (size_t b = 0; b <= x->nbounds; b++)
        n += atomic_load_explicit(&x->count[b], memory_order_relaxed);
      return (double)n;
    }
  }
  return 0;
}

/* ---- rendering ------------------------------------------------------------ */

static void put_double(FILE *out, double v) {
  if (isnan(v))
    fputs("NaN", out);
  else if (isinf(v))
    fputs(v > 0 ? "+Inf" : "-Inf", out);
  else if (v == (double)(int64_t)v && fabs(v) < 9.007199254740992e15)
    fprintf(out, "%lld", (long long)v);
  else {
    /* the shortest of %.15g..%.17g that reads back as v */
    char buf[32];
    for (int prec = 15; prec <= 17; prec++) {
      snprintf(buf, sizeof(buf), "%.*g", prec, v);
      if (strtod(buf, NULL) == v) break;
    }
    fputs(buf, out);
  }
}

/* HELP text escapes backslash and newline; label values also the quote. */
static void put_escaped(FILE *out, const char *s, bool quote) {
  for (; *s; s++) {
    if (*s == '\\')
      fputs("\\\\", out);
    else if (*s == '\n')
      fputs("\\n", out);
    else if (quote && *s == '"')
      fputs("\\\"", out);
    else
      fputc(*s, out);
  }
}

static void put_label(FILE *out, const struct metric *x, size_t i) {
  if (!x->label) return;
  fprintf(out, "{%s=\"", x->label);
  put_escaped(out, x->values[i], true);
  fputs("\"}", out);
}

static void render_histogram(const struct metric *x, FILE *out) {
  uint64_t cum = 0;
  for (size_t b = 0; b <= x->nbounds; b++) {
    cum += atomic_load_explicit(&x->count[b], memory_order_relaxed);
    fprintf(out, "%s_bucket{le=\"", x->name);
    put_double(out, b < x->nbounds ? x->bounds[b] : INFINITY);
    fprintf(out, "\"} %llu\n", (unsigned long long)cum);
  }
  fprintf(out, "%s_sum ", x->name);
  put_double(out, atomic_load_explicit(&x->sum, memory_order_relaxed));
  fprintf(out, "\n%s_count %llu\n", x->name, (unsigned long long)cum);
}

int metrics_render(const struct metrics *m, FILE *out) {
  static const char *const type_names[] = {"counter", "gauge", "histogram"};
  if (!m || !out) return -EINVAL;
  for (const struct metric *x = m->head; x; x = x->next) {
    fprintf(out, "# HELP %s ", x->name);
    put_escaped(out, x->help, false);
    fprintf(out, "\n# TYPE %s %s\n", x->name, type_names[x->type]);
    if (x->type == METRIC_HISTOGRAM) {
      render_histogram(x, out);
      continue;
    }
    size_t n = atomic_load_explicit(&x->num, memory_order_acquire);
    for (size_t i = 0; i < n; i++) {
      fputs(x->name, out);
      put_label(out, x, i);
      fputc(' ', out);
      put_double(out, metric_value(x, i));
      fputc('\n', out);
    }
  }
  return ferror(out) ? -EIO : 0;
}
