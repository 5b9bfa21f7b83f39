/* container_of: the struct that holds a member, from a pointer to that
 * member. libuv hands callbacks the handle, which lives inside the struct
 * that owns it (docs/ARCHITECTURE.md, Conventions); this recovers the owner. */
#ifndef PS_CONTAINER_OF_H
#define PS_CONTAINER_OF_H

#include <stddef.h>

#define container_of(ptr, type, member) ((type *)(void *)((char *)(ptr)-offsetof(type, member)))

#endif
