/* failpoint: a named place where a test build can crash the process.
 * Production builds compile FAILPOINT(name) and FAILPOINT_STEP(prefix, step)
 * to nothing; the latter is the failpoint named "PREFIX-STEP" (durable.c:
 * one commit protocol, each caller's own names). The test builds of
 * the shard's and the workers' checkpoint code (tests/faults, -DPS_FAILPOINTS) makes it _exit(97)
 * when the environment variable PS_FAILPOINT equals name, so a test can stop
 * a commit exactly between two of its steps, as a kill -9 would. */
#ifndef PS_FAILPOINT_H
#define PS_FAILPOINT_H

#ifdef PS_FAILPOINTS
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#define FAILPOINT(name)                           \
  do {                                            \
    const char *fp_ = getenv("PS_FAILPOINT");     \
    if (fp_ && strcmp(fp_, name) == 0) _exit(97); \
  } while (0)
#define FAILPOINT_STEP(prefix, step)                                \
  do {                                                              \
    const char *fp_ = getenv("PS_FAILPOINT");                       \
    size_t fl_ = strlen(prefix);                                    \
    if (fp_ && strncmp(fp_, prefix, fl_) == 0 && fp_[fl_] == '-' && \
        strcmp(fp_ + fl_ + 1, step) == 0)                           \
      _exit(97);                                                    \
  } while (0)
#else
#define FAILPOINT(name) ((void)0)
#define FAILPOINT_STEP(prefix, step) ((void)0)
#endif

#endif
