/* check: the assertion of the unit tests, which report every failed check
 * and go on (the test's exit status comes from `failures` at the end of
 * main). CHECK(cond) or CHECK(cond, fmt, ...) prints the file, line, the
 * condition and the message, if any, when cond is false. Include once per
 * test executable, after the header of the module under test.
 *
 * The integration tests' harness.h has the other kind, REQUIRE, which stops
 * the test at the first failure (the processes it started are killed). */
#ifndef PS_TEST_CHECK_H
#define PS_TEST_CHECK_H

#include <stdio.h>

static int failures;

#define CHECK(c, ...)                                               \
  do {                                                              \
    if (!(c)) {                                                     \
      fprintf(stderr, "%s:%d: CHECK(%s):", __FILE__, __LINE__, #c); \
      fprintf(stderr, " " __VA_ARGS__);                             \
      fputc('\n', stderr);                                          \
      failures++;                                                   \
    }                                                               \
  } while (0)

#endif
