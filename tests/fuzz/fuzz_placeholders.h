/* fuzz_placeholders: values fuzz_handshake.c and make-seeds.c agree on.
 *
 * Nonces are random, so no stored input can hold a valid handshake proof or
 * frame tag. An input holds these placeholders instead, and the harness
 * replaces them with what an honest peer holding FUZZ_TOKEN would send; any
 * other bytes are taken as they are (and must be refused). */
#ifndef PS_FUZZ_PLACEHOLDERS_H
#define PS_FUZZ_PLACEHOLDERS_H

#define FUZZ_PROOF_PLACEHOLDER "fuzz-placeholder-proof-32-bytes!" /* AUTH_PROOF_BYTES */
#define FUZZ_TAG_PLACEHOLDER "fuzz-placeholder"                   /* AUTH_TAG_BYTES */
#define FUZZ_TOKEN "the-fuzzed-job-shared-token-0123"
#define FUZZ_OTHER_TOKEN "a-different-token-of-another-job"

#endif
