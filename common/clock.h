/* clock: the process's one monotonic clock, and sleeping on it.
 *
 * Every duration, deadline and rate in ps is measured on CLOCK_MONOTONIC,
 * which wall-clock steps (NTP, a user's date) never move. A sleep waits
 * until an absolute time on that clock, so a signal that interrupts it
 * resumes the same sleep instead of starting it over or cutting it short. */
#ifndef PS_CLOCK_H
#define PS_CLOCK_H

#include <stdint.h>

/* Now, on the monotonic clock, in nanoseconds, milliseconds or seconds. */
uint64_t clock_now_ns(void);
uint64_t clock_now_ms(void);
double clock_now_s(void);

/* Sleeps for ns nanoseconds (ms milliseconds); 0 or less returns at once. */
void clock_sleep_ns(uint64_t ns);
void clock_sleep_ms(int64_t ms);

#endif
