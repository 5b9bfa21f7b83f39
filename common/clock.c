/* clock: CLOCK_MONOTONIC readings and absolute-deadline sleeps (clock.h). */
#include "clock.h"

#include <errno.h>
#include <time.h>

uint64_t clock_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

uint64_t clock_now_ms(void) {
  return clock_now_ns() / 1000000u;
}

double clock_now_s(void) {
  return (double)clock_now_ns() / 1e9;
}

void clock_sleep_ns(uint64_t ns) {
  if (ns == 0) return;
  uint64_t until = clock_now_ns() + ns;
  struct timespec t = {.tv_sec = (time_t)(until / 1000000000u),
                       .tv_nsec = (long)(until % 1000000000u)};
  /* An absolute wake-up time makes a signal-interrupted sleep resume, not restart. */
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &t, NULL) == EINTR) continue;
}

void clock_sleep_ms(int64_t ms) {
  if (ms > 0) clock_sleep_ns((uint64_t)ms * 1000000u);
}
