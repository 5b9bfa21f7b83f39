/* data: the training set in memory, and the order the trainer walks it.
 *
 * A dataset is a pair of IDX files (the MNIST family format: a big-endian
 * magic 0x000008NN where NN is the number of dimensions, one big-endian u32 per
 * dimension, then unsigned bytes), gzipped or raw. Images are kept as the file's
 * bytes in one contiguous [n][rows][cols] array (47 MB for Fashion-MNIST train,
 * where floats would take 188 MB) and become float32 pixel/255 in dataset_gather, labels as bytes
 * 0..9; the whole set lives in memory (Fashion-MNIST train is 188 MB as floats).
 *
 * Sharding convention (the trainer, libps tests and tools/bench/ps-torch-ref all
 * follow it, so W workers with batch B each compute exactly what one process
 * with batch B*W computes):
 *   perm = dataset_epoch_order(seed, epoch, n)
 *   global step t of an epoch covers perm[t*B*W .. (t+1)*B*W);
 *   worker r (0-based rank) takes perm[t*B*W + r*B .. t*B*W + r*B + B);
 *   an epoch has floor(n / (B*W)) steps: the last incomplete global batch is
 *   dropped, so every step has the same size on every worker.
 * The mean of the W per-worker mean gradients then equals the mean gradient of
 * the global batch, which is what BSP averaging and ring all-reduce compute. */
#ifndef PS_DATA_H
#define PS_DATA_H

#include <stddef.h>
#include <stdint.h>

#define DATASET_NUM_CLASSES 10

struct dataset {
  uint32_t n, rows, cols;
  uint8_t *pixels; /* n*rows*cols raw bytes, row-major per image; dataset_gather
                      turns them into pixel/255.0f (kept as bytes: 4x less memory) */
  uint8_t *labels; /* n, each < DATASET_NUM_CLASSES */
};

/* One IDX file read whole. dims[k] for k >= ndim are 0. */
struct idx_file {
  uint32_t magic; /* 0x00000803 for images, 0x00000801 for labels */
  uint32_t ndim;
  uint32_t dims[3];
  uint8_t *data; /* dims[0]*...*dims[ndim-1] bytes */
  size_t size;
};

#define IDX_MAGIC_IMAGES 0x00000803u
#define IDX_MAGIC_LABELS 0x00000801u
/* Files whose header promises more than this many data bytes are refused before
 * anything is allocated (a hostile or corrupt header must not cost 16 GB). */
#define IDX_MAX_BYTES ((size_t)1 << 30)

/* Reads the IDX file at path, gzipped or raw (zlib reads both), and checks that
 * its magic equals want_magic (0x000008NN, NN = 1..3), that every dimension is
 * non-zero, that the data fits IDX_MAX_BYTES, and that the file holds exactly
 * the bytes its header announces. On success *out owns the data (release with
 * idx_file_free). On failure *out is zeroed, err (if errlen > 0) holds a
 * message that starts with path, and the return is -ENOENT (missing), -EBADMSG
 * (bad magic, truncated, trailing bytes), -EFBIG (absurd dimensions), -ENOMEM
 * or -EIO. */
int idx_load_file(const char *path, uint32_t want_magic, struct idx_file *out, char *err,
                  size_t errlen);
/* Releases f->data and zeroes *f; accepts NULL or a zeroed struct. */
void idx_file_free(struct idx_file *f);

/* Loads <dir>/<split>-images-idx3-ubyte and <dir>/<split>-labels-idx1-ubyte,
 * each raw if that file exists, else with ".gz" appended. split is "train" or
 * "t10k". Beyond idx_load_file's checks, it refuses image and label counts that
 * disagree and labels >= DATASET_NUM_CLASSES (-EBADMSG, the message names the
 * file); a path that does not fit PATH_MAX is -ENAMETOOLONG. On failure *out
 * is zeroed. */
int dataset_load(const char *dir, const char *split, struct dataset *out, char *err, size_t errlen);
/* Releases the arrays and zeroes *ds; accepts NULL or a zeroed struct. */
void dataset_free(struct dataset *ds);

/* Fills perm[0..n) with the permutation of 0..n-1 used in epoch `epoch`.
 * Exact algorithm (tools/bench/ps-torch-ref re-implements it bit-for-bit):
 *   state = seed ^ (epoch * 0x9E3779B97F4A7C15 mod 2^64)
 *   perm[i] = i for all i
 *   for i = n-1 down to 1:
 *     j = splitmix64_next(&state) % (i+1)
 *     swap(perm[i], perm[j])
 * where splitmix64_next is the reference one (Steele, Lea, Flood 2014):
 *   state += 0x9E3779B97F4A7C15
 *   z = state
 *   z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
 *   z = (z ^ (z >> 27)) * 0x94D049BB133111EB
 *   return z ^ (z >> 31)
 * all in unsigned 64-bit arithmetic. The modulo bias (< 2^-47 for n <= 2^17) is
 * irrelevant here and keeps the algorithm trivial to reproduce. */
void dataset_epoch_order(uint64_t seed, uint32_t epoch, uint32_t n, uint32_t *perm);

/* Number of global steps in one epoch: floor(n / (batch * world)), 0 if either
 * is 0 (see the sharding convention above). */
uint32_t dataset_steps_per_epoch(uint32_t n, uint32_t batch, uint32_t world);

/* Copies samples idx[0..count) into x (count*rows*cols floats) and y (count
 * bytes), in that order. Every idx[k] must be < ds->n. */
void dataset_gather(const struct dataset *ds, const uint32_t *idx, uint32_t count, float *x,
                    uint8_t *y);

#endif
