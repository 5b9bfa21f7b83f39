/* metrics: counters, gauges and fixed-bucket histograms that several threads
 * update and one thread renders in the Prometheus text exposition format
 * (version 0.0.4, what /metrics serves).
 *
 * A registry (struct metrics) owns metric families in registration order.
 * Families are registered by the owner before any other thread looks at the
 * registry (in main, before the HTTP thread starts); after that the set of
 * families never changes, so rendering needs no lock. Every value is a C11
 * atomic: counters are unsigned 64-bit integers, gauges doubles (integral
 * gauges such as versions are exact up to 2^53), histograms a count per
 * bucket plus a sum; writers use relaxed atomics, so an update costs one
 * uncontended atomic add and a scrape sees each value whole (never torn),
 * though not necessarily all values of the same instant.
 *
 * A family is either a single series or a vector of series with one label
 * ("errors by kind", "version by key"). The label values of a vector are set
 * once: at registration when they are known (error kinds, ranks), or later by
 * the owner with metric_vec_set_labels (keys, known after the layout); the
 * count is published with release order, so the renderer sees either no
 * series or all of them with their label strings. Label values are escaped
 * as the format requires; names are checked at registration. */
#ifndef PS_METRICS_H
#define PS_METRICS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

struct metrics;
struct metric;

/* Returns NULL when out of memory. */
struct metrics *metrics_new(void);
/* Frees the registry and its families; accepts NULL. No thread may use it. */
void metrics_free(struct metrics *m);

/* Registration (owner thread, before the registry is shared). Each returns
 * NULL on a bad name or when out of memory; names follow the Prometheus
 * rules ([a-zA-Z_:][a-zA-Z0-9_:]*), counters should end in _total. */
struct metric *metrics_counter(struct metrics *m, const char *name, const char *help);
struct metric *metrics_gauge(struct metrics *m, const char *name, const char *help);
/* bounds: n strictly increasing upper bounds (le); +Inf is implied. */
struct metric *metrics_histogram(struct metrics *m, const char *name, const char *help,
                                 const double *bounds, size_t n);
/* Vectors with one label; values (n strings, copied) may be NULL and set
 * later with metric_vec_set_labels. capacity >= n bounds what may be set. */
struct metric *metrics_counter_vec(struct metrics *m, const char *name, const char *help,
                                   const char *label, size_t capacity, const char *const *values,
                                   size_t n);
struct metric *metrics_gauge_vec(struct metrics *m, const char *name, const char *help,
                                 const char *label, size_t capacity, const char *const *values,
                                 size_t n);

/* Sets the label values of a vector registered without them (n <= capacity,
 * strings copied). Once only: returns 0, -EBUSY if already set, -EINVAL if
 * n > capacity, -ENOMEM. Any thread may then update series 0..n-1. */
int metric_vec_set_labels(struct metric *v, const char *const *values, size_t n);

/* Updates (any thread). Out-of-range indexes and NULL metrics are ignored,
 * so callers need no checks for metrics that are turned off. */
void metric_inc(struct metric *c, uint64_t n);
void metric_vec_inc(struct metric *c, size_t i, uint64_t n);
void metric_set(struct metric *g, double v);
void metric_vec_set(struct metric *g, size_t i, double v);
void metric_observe(struct metric *h, double v);
/* n observations of v at once, adding sum (not n * v) to the histogram's sum:
 * for values counted elsewhere in groups (the group's bucket is v's). */
void metric_observe_n(struct metric *h, double v, uint64_t n, double sum);

/* Reads one series (counter or gauge; a histogram gives its count). */
double metric_value(const struct metric *x, size_t i);

/* Writes every family (# HELP, # TYPE, series) to out. Returns 0 or -EIO. */
int metrics_render(const struct metrics *m, FILE *out);

/* The content type of what metrics_render writes. */
#define METRICS_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

#endif
