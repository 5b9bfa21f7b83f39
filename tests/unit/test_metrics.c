/* test_metrics: the Prometheus text of every metric type compared byte for
 * byte (HELP/TYPE lines, labels and their escaping, cumulative histogram
 * buckets with +Inf, _sum and _count), registration refusals (bad or
 * duplicate names, unsorted bounds, labels set twice or beyond capacity),
 * out-of-range updates ignored, and four threads updating the same series
 * at once without losing an increment. Exit 0 = pass, 1 = fail. */
#include "metrics.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

static char *render(const struct metrics *m) {
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  if (!f) abort();
  CHECK(metrics_render(m, f) == 0);
  fclose(f);
  return buf;
}

static void test_text(void) {
  struct metrics *m = metrics_new();
  struct metric *c = metrics_counter(m, "ps_pushes_total", "pushes received");
  struct metric *g = metrics_gauge(m, "ps_ready", "1 when \\ ready\nsecond line");
  const char *kinds[] = {"bad_frame", "say \"hi\""};
  struct metric *e =
      metrics_counter_vec(m, "ps_errors_total", "errors by kind", "kind", 2, kinds, 2);
  struct metric *kv = metrics_gauge_vec(m, "ps_key_version", "version by key", "key", 4, NULL, 0);
  const double bounds[] = {0.001, 0.5, 2};
  struct metric *h = metrics_histogram(m, "ps_step_seconds", "step time", bounds, 3);
  CHECK(c && g && e && kv && h);

  metric_inc(c, 3);
  metric_inc(c, 4);
  metric_set(g, 1);
  metric_vec_inc(e, 1, 2);
  metric_vec_inc(e, 7, 1);  /* out of range: ignored */
  metric_vec_set(kv, 0, 5); /* no labels yet: not rendered */
  metric_observe(h, 0.0005);
  metric_observe_n(h, 0.25, 2, 0.5); /* two at once */
  metric_observe_n(h, 1, 0, 7);      /* none: ignored */
  metric_observe(h, 100);
  metric_inc(NULL, 1); /* NULL metric: ignored */

  char *text = render(m);
  const char *want1 =
      "# HELP ps_pushes_total pushes received\n"
      "# TYPE ps_pushes_total counter\n"
      "ps_pushes_total 7\n"
      "# HELP ps_ready 1 when \\\\ ready\\nsecond line\n"
      "# TYPE ps_ready gauge\n"
      "ps_ready 1\n"
      "# HELP ps_errors_total errors by kind\n"
      "# TYPE ps_errors_total counter\n"
      "ps_errors_total{kind=\"bad_frame\"} 0\n"
      "ps_errors_total{kind=\"say \\\"hi\\\"\"} 2\n"
      "# HELP ps_key_version version by key\n"
      "# TYPE ps_key_version gauge\n"
      "# HELP ps_step_seconds step time\n"
      "# TYPE ps_step_seconds histogram\n"
      "ps_step_seconds_bucket{le=\"0.001\"} 1\n"
      "ps_step_seconds_bucket{le=\"0.5\"} 3\n"
      "ps_step_seconds_bucket{le=\"2\"} 3\n"
      "ps_step_seconds_bucket{le=\"+Inf\"} 4\n"
      "ps_step_seconds_sum 100.5005\n"
      "ps_step_seconds_count 4\n";
  if (!text || strcmp(text, want1) != 0)
    fprintf(stderr, "got:\n%s\nwant:\n%s\n", text ? text : "(null)", want1);
  CHECK(strcmp(text, want1) == 0);
  free(text);

  const char *keys[] = {"00000000000000a1", "00000000000000b2"};
  CHECK(metric_vec_set_labels(kv, keys, 2) == 0);
  CHECK(metric_vec_set_labels(kv, keys, 2) == -EBUSY);
  metric_vec_set(kv, 1, 12);
  metric_set(g, 0.25);
  text = render(m);
  CHECK(strstr(text, "ps_key_version{key=\"00000000000000a1\"} 5\n"));
  CHECK(strstr(text, "ps_key_version{key=\"00000000000000b2\"} 12\n"));
  CHECK(strstr(text, "ps_ready 0.25\n"));
  free(text);
  CHECK(metric_value(c, 0) == 7);
  CHECK(metric_value(h, 0) == 4);
  CHECK(metric_value(kv, 1) == 12);
  metrics_free(m);
}

static void test_refusals(void) {
  struct metrics *m = metrics_new();
  CHECK(metrics_counter(m, "ok_total", "") != NULL);
  CHECK(metrics_counter(m, "ok_total", "") == NULL); /* duplicate */
  CHECK(metrics_gauge(m, "", "") == NULL);
  CHECK(metrics_gauge(m, "1abc", "") == NULL);
  CHECK(metrics_gauge(m, "has space", "") == NULL);
  CHECK(metrics_gauge(m, "has-dash", "") == NULL);
  CHECK(metrics_gauge(m, "ns:sub_name", "") != NULL);
  CHECK(metrics_gauge_vec(m, "v1", "", "bad:label", 2, NULL, 0) == NULL);
  CHECK(metrics_gauge_vec(m, "v2", "", "__reserved", 2, NULL, 0) == NULL);
  CHECK(metrics_gauge_vec(m, "v3", "", NULL, 2, NULL, 0) == NULL);
  const char *three[] = {"a", "b", "c"};
  CHECK(metrics_gauge_vec(m, "v4", "", "l", 2, three, 3) == NULL); /* over capacity */
  struct metric *v = metrics_gauge_vec(m, "v5", "", "l", 2, NULL, 0);
  CHECK(v && metric_vec_set_labels(v, three, 3) == -EINVAL);
  const double unsorted[] = {1, 0.5};
  const double inf[] = {1, 1.0 / 0.0};
  CHECK(metrics_histogram(m, "h1", "", unsorted, 2) == NULL);
  CHECK(metrics_histogram(m, "h2", "", inf, 2) == NULL);
  CHECK(metrics_histogram(m, "h3", "", NULL, 0) == NULL);
  metrics_free(m);
  metrics_free(NULL);
}

struct hammer {
  struct metric *c, *h, *v;
};

enum { THREADS = 4, ITERS = 100000 };

static void *hammer_main(void *arg) {
  struct hammer *x = arg;
  for (int i = 0; i < ITERS; i++) {
    metric_inc(x->c, 1);
    metric_vec_inc(x->v, (size_t)(i & 1), 1);
    metric_observe(x->h, (i & 1) ? 1.0 : 3.0);
  }
  return NULL;
}

static void test_threads(void) {
  struct metrics *m = metrics_new();
  const char *lv[] = {"even", "odd"};
  const double b[] = {2};
  struct hammer x = {metrics_counter(m, "c_total", ""), metrics_histogram(m, "h", "", b, 1),
                     metrics_counter_vec(m, "v_total", "", "parity", 2, lv, 2)};
  pthread_t t[THREADS];
  for (int i = 0; i < THREADS; i++) pthread_create(&t[i], NULL, hammer_main, &x);
  /* render while they run: must never crash or tear */
  for (int i = 0; i < 20; i++) free(render(m));
  for (int i = 0; i < THREADS; i++) pthread_join(t[i], NULL);
  CHECK(metric_value(x.c, 0) == (double)THREADS * ITERS);
  CHECK(metric_value(x.v, 0) == (double)THREADS * ITERS / 2);
  CHECK(metric_value(x.h, 0) == (double)THREADS * ITERS);
  char *text = render(m);
  char want[128];
  snprintf(want, sizeof(want), "h_sum %d\n", THREADS * ITERS * 2);
  CHECK(strstr(text, want));
  snprintf(want, sizeof(want), "h_bucket{le=\"2\"} %d\n", THREADS * ITERS / 2);
  CHECK(strstr(text, want));
  free(text);
  metrics_free(m);
}

int main(void) {
  test_text();
  test_refusals();
  test_threads();
  if (failures) fprintf(stderr, "%d check(s) failed\n", failures);
  return failures ? 1 : 0;
}
