/* worker_ckpt_agree: see worker_ckpt_agree.h. */
#include "worker_ckpt_agree.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "le.h"
#include "log.h"

/* What a rank says about its checkpoints (little-endian). */
#define SCAN_WIRE \
  (8 * (5 + WORKER_CKPT_SCAN_MAX) + sizeof(((struct worker_ckpt_scan *)0)->skip_why))

static void scan_put(uint8_t *w, const struct worker_ckpt_scan *sc) {
  le_put64(w, (uint64_t)sc->n);
  le_put64(w + 8, (uint64_t)sc->files);
  le_put64(w + 16, sc->newest_file);
  le_put64(w + 24, (uint64_t)sc->skipped);
  le_put64(w + 32, sc->skip_step);
  for (int i = 0; i < WORKER_CKPT_SCAN_MAX; i++) le_put64(w + 40 + 8 * i, sc->steps[i]);
  memcpy(w + 40 + 8 * WORKER_CKPT_SCAN_MAX, sc->skip_why, sizeof(sc->skip_why));
}

static void scan_get(const uint8_t *w, struct worker_ckpt_scan *sc) {
  uint64_t n = le_get64(w);
  sc->n = n > WORKER_CKPT_SCAN_MAX ? WORKER_CKPT_SCAN_MAX : (int)n;
  sc->files = (int)le_get64(w + 8);
  sc->newest_file = le_get64(w + 16);
  sc->skipped = (int)le_get64(w + 24);
  sc->skip_step = le_get64(w + 32);
  for (int i = 0; i < WORKER_CKPT_SCAN_MAX; i++) sc->steps[i] = le_get64(w + 40 + 8 * i);
  memcpy(sc->skip_why, w + 40 + 8 * WORKER_CKPT_SCAN_MAX, sizeof(sc->skip_why));
  sc->skip_why[sizeof(sc->skip_why) - 1] = '\0';
}

static bool scan_holds(const struct worker_ckpt_scan *sc, uint64_t step) {
  for (int i = 0; i < sc->n; i++)
    if (sc->steps[i] == step) return true;
  return false;
}

/* Why no step is common, rank by rank, into buf. */
static void no_common_why(const struct worker_ckpt_scan *all, int world, char *buf, size_t len) {
  size_t at = 0;
  buf[0] = '\0';
  for (int r = 0; r < world && at < len; r++) {
    const struct worker_ckpt_scan *sc = &all[r];
    int k = snprintf(buf + at, len - at, "%srank %d: ", r ? "; " : "", r);
    at += k > 0 ? (size_t)k : 0;
    for (int i = 0; i < sc->n && at < len; i++) {
      k = snprintf(buf + at, len - at, "%s%llu", i ? "," : "valid steps ",
                   (unsigned long long)sc->steps[i]);
      at += k > 0 ? (size_t)k : 0;
    }
    if (at >= len) break;
    if (!sc->files)
      k = snprintf(buf + at, len - at, "no checkpoint files");
    else if (!sc->n)
      k = snprintf(buf + at, len - at, "%d files, none loads", sc->files);
    else
      k = 0;
    at += k > 0 ? (size_t)k : 0;
    if (sc->skipped && at < len) {
      k = snprintf(buf + at, len - at, " (newest that does not load: %s)", sc->skip_why);
      at += k > 0 ? (size_t)k : 0;
    }
  }
}

int worker_ckpt_agree(ps_coll *c, const char *dir, const struct worker_ckpt_id *id,
                      const struct worker_ckpt_tensors *t, uint64_t *step, ps_status *coll_failed) {
  *step = 0;
  *coll_failed = PS_OK;
  int world = (int)id->world, me = (int)id->rank;
  struct worker_ckpt_scan *all = calloc((size_t)world, sizeof(*all));
  uint8_t *wire = malloc(SCAN_WIRE);
  char why[2048];
  int ret = -ENOMEM;
  if (!all || !wire) goto out;
  worker_ckpt_scan_tensors(dir, id, t, &all[me]);
  /* each rank in turn says what it holds: every rank then knows all */
  for (int r = 0; r < world && world > 1; r++) {
    if (r == me) scan_put(wire, &all[me]);
    ps_status st = ps_coll_broadcast(c, wire, SCAN_WIRE, r);
    if (st != PS_OK) {
      char msg[512];
      ps_coll_errmsg(c, msg, sizeof(msg));
      *coll_failed = st;
      ret = st == PS_ERR_IO || st == PS_ERR_CONNECT ? -ECONNRESET : -EPROTO;
      log_error("cannot agree on a checkpoint", "error=\"%s\"", msg);
      goto out;
    }
    if (r != me) scan_get(wire, &all[r]);
  }
  /* the newest of mine that every rank holds: the same answer everywhere
   * (the largest step in every list) */
  uint64_t best = 0;
  bool found = false;
  for (int i = 0; i < all[me].n && !found; i++) {
    found = true;
    for (int r = 0; r < world && found; r++) found = scan_holds(&all[r], all[me].steps[i]);
    if (found) best = all[me].steps[i];
  }
  int files = 0;
  for (int r = 0; r < world; r++) files += all[r].files;
  ret = 0;
  if (!found) {
    if (files) {
      no_common_why(all, world, why, sizeof(why));
      log_warn(
          "checkpoint files exist but no step every rank holds a valid checkpoint of: "
          "starting at step 0",
          "dir=%s why=\"%s\"", dir, why);
    } else {
      log_info("no checkpoints yet: starting at step 0", "dir=%s", dir);
    }
    worker_ckpt_set_aside_after(dir, id->rank, 0);
    goto out;
  }
  /* falling back: name each rank that holds something newer and why */
  bool fallback = false;
  for (int r = 0; r < world; r++) {
    const struct worker_ckpt_scan *sc = &all[r];
    if (sc->skipped && sc->skip_step > best) {
      log_warn("a rank's newer checkpoint does not load: the ranks fall back to an older step",
               "rank=%d file_step=%llu resume_step=%llu error=\"%s\"", r,
               (unsigned long long)sc->skip_step, (unsigned long long)best, sc->skip_why);
      fallback = true;
    } else if (sc->n && sc->steps[0] > best) {
      log_warn(
          "a rank holds a newer checkpoint than another rank: the ranks fall back to the "
          "newest step every rank holds",
          "rank=%d newest_step=%llu resume_step=%llu", r, (unsigned long long)sc->steps[0],
          (unsigned long long)best);
      fallback = true;
    }
  }
  char err[600];
  ret = worker_ckpt_load_tensors(dir, id, best, t, err, sizeof(err));
  if (ret < 0) {
    log_error("cannot load the agreed checkpoint", "step=%llu error=\"%s\"",
              (unsigned long long)best, err);
    goto out;
  }
  worker_ckpt_set_aside_after(dir, id->rank, best);
  *step = best;
  log_info("resumed from a checkpoint", "step=%llu dir=%s fell_back=%d", (unsigned long long)best,
           dir, fallback);
out:
  free(wire);
  free(all);
  return ret;
}

int worker_ckpt_save_counted(struct ckpt_io *io, const char *dir, const struct worker_ckpt_id *id,
                             uint64_t step, const struct worker_ckpt_tensors *t,
                             uint32_t max_failures, uint32_t *failures, char *msg, size_t msglen) {
  char err[600];
  double t0 = clock_now_s();
  int r = worker_ckpt_save_tensors(io, dir, id, step, t, err, sizeof(err));
  if (r == 0) {
    *failures = 0;
    log_info("checkpoint written", "step=%llu seconds=%.3f", (unsigned long long)step,
             clock_now_s() - t0);
    return 0;
  }
  (*failures)++;
  log_error("cannot write a checkpoint",
            "step=%llu failures_in_a_row=%u max_failures=%u error=\"%s\"", (unsigned long long)step,
            *failures, max_failures, err);
  if (!max_failures || *failures < max_failures) return 0;
  snprintf(msg, msglen,
           "checkpoint writes failed %u times in a row (--checkpoint-max-failures %u; 0 keeps "
           "training without them), the last: %.480s",
           *failures, max_failures, err);
  return -EIO;
}
