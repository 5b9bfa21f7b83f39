/* token_impl: how the rest of libps reaches the auth_token (common/auth.h)
 * inside a public ps_token (ps.h). Internal to libps: it is not in include/
 * and nothing outside this folder includes it. */
#ifndef PS_TOKEN_IMPL_H
#define PS_TOKEN_IMPL_H

#include "auth.h"
#include "ps.h"

/* The token t wraps, or NULL for t NULL (no authentication). Borrowed from
 * t. */
const struct auth_token *token_auth(const ps_token *t);

#endif
