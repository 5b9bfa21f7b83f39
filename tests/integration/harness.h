/* harness: helpers for integration tests that run the real binaries on
 * 127.0.0.1. Servers listen on port 0 and report the bound address through
 * --port-file, so parallel tests never race for ports. Every process started
 * here is killed at exit (atexit), also when a REQUIRE fails. */
#ifndef PS_TEST_HARNESS_H
#define PS_TEST_HARNESS_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>

/* REQUIRE(cond, fmt, ...): the integration tests' assertion, which stops the
 * test at the first failure: it prints the file, line, condition and message,
 * dumps the logs of the processes started here and exits 1 (they are killed
 * at exit). The unit tests' CHECK (tests/unit/check.h) reports and goes on. */
#define REQUIRE(cond, ...)                                                       \
  do {                                                                           \
    if (!(cond)) {                                                               \
      fprintf(stderr, "%s:%d: REQUIRE(%s) failed: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                              \
      fprintf(stderr, "\n");                                                     \
      harness_dump_logs();                                                       \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

/* HARNESS_UNDER_ASAN: 1 when this test is built with AddressSanitizer (the
 * binaries it starts are too): memory caps must allow for its shadow and
 * quarantine. */
#if defined(__SANITIZE_ADDRESS__)
#define HARNESS_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define HARNESS_UNDER_ASAN 1
#endif
#endif
#ifndef HARNESS_UNDER_ASAN
#define HARNESS_UNDER_ASAN 0
#endif

struct test_server {
  pid_t pid;
  char addr[64]; /* "127.0.0.1:port" */
  char log[512];
};

/* Makes a private temp dir for this test (removed at exit). */
const char *harness_dir(void);
/* Writes a fresh auth token (64 random hex digits, mode 0600) to
 * harness_dir()/name and its path into path. Each call gives another token. */
void harness_token_file(const char *name, char *path, size_t len);
/* Path of a built binary: $PS_BUILD_DIR/<rel>, e.g. "ps-server/ps-server". */
const char *harness_bin(const char *rel, char *buf, size_t len);

/* Starts ps-server with --listen 127.0.0.1:0 and the extra args (NULL-terminated
 * array, may be NULL) and waits until it listens. */
void harness_start_server(struct test_server *s, int shard, int num_shards, int num_workers,
                          double lr, const char *const *extra);
/* Sends sig and waits up to timeout_ms; returns the wait status, or -1 on timeout. */
int harness_stop(pid_t pid, int sig, int timeout_ms);
/* Waits for pid up to timeout_ms; returns the wait status or -1 on timeout. */
int harness_wait(pid_t pid, int timeout_ms);
/* Starts argv[0] (a path) with stdout to out_path and stderr to log_path
 * (either may be NULL = inherit) and OPENBLAS_NUM_THREADS=1. */
pid_t harness_spawn(const char *const *argv, const char *out_path, const char *log_path);
/* Starts S shards and W ps-worker processes (extra worker args appended) and
 * waits for all; returns 0 if every process exited 0. Rank 0's stdout goes
 * to out_path. Skips the test (harness_require_dataset) if the dataset is
 * missing. */
int harness_train(int shards, int workers, const char *const *server_args,
                  const char *const *worker_args, const char *out_path, int timeout_ms);
/* Where the training tests read Fashion-MNIST (dataset-fashion-mnist). */
#define HARNESS_DATA_DIR "/usr/share/datasets/fashion-mnist"
/* Whether its four IDX files (raw or .gz) are there. */
bool harness_have_dataset(void);
/* Skips the whole test (exit 77, saying why) if they are not. */
void harness_require_dataset(void);
/* A part of the test that cannot run here: prints "SKIP: <why>" and makes
 * harness_status() 77, so a test that ran only some of its parts is reported
 * skipped, never passed. */
void harness_skip(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* What main returns once every part ran or was skipped: 0, or 77. */
int harness_status(void);

/* Rank 0's (and ps-local's) last line:
 * "summary accuracy=A epochs=E wall_s=T samples_per_s=R[ workers_lost=N]". */
struct harness_summary {
  double accuracy, wall_s, samples_per_s;
  int epochs;
  int workers_lost; /* -1 when the line does not say */
};
/* Parses line (a trailing newline allowed), which must be exactly such a
 * line; returns 0, or -EINVAL. */
int harness_parse_summary(const char *line, struct harness_summary *out);
/* The first summary line of the file at path; -ENOENT if it has none. */
int harness_read_summary(const char *path, struct harness_summary *out);

/* Forks a child that runs fn(arg) and exits with its return value. */
pid_t harness_fork(int (*fn)(void *), void *arg);
void harness_dump_logs(void);
/* Counts lines of file containing needle. */
int harness_grep(const char *file, const char *needle);
/* Waits up to timeout_ms for at least want lines of file containing needle
 * (the event a test waits on: a log line); returns the count then, or the
 * count at the deadline (less than want). */
int harness_wait_grep(const char *file, const char *needle, int want, int timeout_ms);

#endif
