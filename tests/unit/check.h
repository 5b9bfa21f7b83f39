/* check: the assertion of the unit tests that report every failed check and
 * go on (the test's exit status comes from `failures` at the end of main).
 * CHECK(cond, fmt, ...) prints the file, line, the condition and the
 * message when cond is false. Include once per test executable. */
#ifndef PS_TEST_CHECK_H
#define PS_TEST_CHECK_H

#include <stdio.h>

static int failures;

#define CHECK(c, ...)                                                \
  do {                                                               \
    if (!(c)) {                                                      \
      fprintf(stderr, "%s:%d: CHECK(%s): ", __FILE__, __LINE__, #c); \
      fprintf(stderr, __VA_ARGS__);                                  \
      fputc('\n', stderr);                                           \
      failures++;                                                    \
    }                                                                \
  } while (0)

#endif
