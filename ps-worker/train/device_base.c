/* device_base: what every device implementation and device.c share (see
 * device_impl.h): the names of the device kinds, the fields common to every
 * struct device_model, and its error message. It calls nothing else of the
 * trainer, so the implementations never call back into their factory
 * (device.c). */
#include "device.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "config.h"
#include "device_impl.h"

static const char *const kind_names[] = {"auto", "cpu", "cuda"};

#define NUM_KINDS (sizeof(kind_names) / sizeof(kind_names[0]))

int device_kind_parse(const char *s, enum device_kind *out) {
  int k = config_choice(s, kind_names, NUM_KINDS, NULL, 0);
  if (k < 0) return k;
  *out = (enum device_kind)k;
  return 0;
}

int device_kind_check(const char *value, char *err, size_t errlen) {
  return config_choice(value, kind_names, NUM_KINDS, err, errlen) < 0 ? -EINVAL : 0;
}

const char *device_kind_name(enum device_kind kind) {
  return (unsigned)kind < NUM_KINDS ? kind_names[kind] : "?";
}

void device_model_init_base(struct device_model *dm, const struct device_model_ops *ops,
                            enum device_kind kind, const int *sizes, int num_sizes, int max_batch) {
  dm->ops = ops;
  dm->kind = kind;
  dm->num_sizes = num_sizes;
  memcpy(dm->sizes, sizes, sizeof(int) * (size_t)num_sizes);
  dm->max_batch = max_batch;
  dm->loaded = 0;
  snprintf(dm->name, sizeof(dm->name), "%s", device_kind_name(kind));
  dm->err[0] = '\0';
}

int device_fail(struct device_model *dm, int code, const char *fmt, ...) {
  va_list ap;

  va_start(ap, fmt);
  vsnprintf(dm->err, sizeof(dm->err), fmt, ap);
  va_end(ap);
  return code;
}
