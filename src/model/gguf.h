/*
 * model/gguf.h - GGUF reader (v2 and v3) over a read-only mmap, and a writer.
 *
 * The reader validates everything it is given: every length, count, offset and
 * type is checked against the file size before it is used, so a truncated or
 * hostile file yields one clear error (td_err.msg names the problem and, where it
 * helps, the key or tensor) and never a crash. Tensor data stays in the mapping:
 * nothing is copied.
 */
#ifndef TD_MODEL_GGUF_H
#define TD_MODEL_GGUF_H

#include "model/types.h"
#include "util/td.h"

typedef enum gguf_vtype {
    GGUF_VT_UINT8 = 0,
    GGUF_VT_INT8 = 1,
    GGUF_VT_UINT16 = 2,
    GGUF_VT_INT16 = 3,
    GGUF_VT_UINT32 = 4,
    GGUF_VT_INT32 = 5,
    GGUF_VT_FLOAT32 = 6,
    GGUF_VT_BOOL = 7,
    GGUF_VT_STRING = 8,
    GGUF_VT_ARRAY = 9,
    GGUF_VT_UINT64 = 10,
    GGUF_VT_INT64 = 11,
    GGUF_VT_FLOAT64 = 12,
} gguf_vtype;

typedef struct gguf_file gguf_file;

/** A string inside the mapping: not NUL-terminated. */
typedef struct gguf_str {
    const char *ptr;
    uint64_t len;
} gguf_str;

typedef struct gguf_tensor {
    char name[128];   /* NUL-terminated copy (GGUF names are at most 64 bytes) */
    td_type type;
    int n_dims;       /* 1..4 */
    int64_t ne[4];    /* ne[0] is the contiguous dimension; unused dims are 1 */
    uint64_t offset;  /* from the start of the data section */
    size_t nbytes;
    const void *data; /* points into the mapping */
} gguf_tensor;

/** Map and parse a file. On failure *out is NULL and err says why. */
int gguf_open(gguf_file **out, const char *path, td_err *err);
/** Parse a buffer the caller keeps alive for the file's lifetime (fuzzing, tests). */
int gguf_open_buffer(gguf_file **out, const void *data, size_t size, td_err *err);
void gguf_close(gguf_file *f);
/** Map every page of a file-backed mapping now (reads it from the page cache or the disk);
 *  a no-op for buffers. */
void gguf_prefault(const gguf_file *f);

uint32_t gguf_version(const gguf_file *f);
size_t gguf_alignment(const gguf_file *f);

int64_t gguf_n_kv(const gguf_file *f);
/** Index of a key, or -1. */
int64_t gguf_find_key(const gguf_file *f, const char *key);
gguf_str gguf_key_name(const gguf_file *f, int64_t idx);
gguf_vtype gguf_kv_type(const gguf_file *f, int64_t idx);

/*
 * Typed getters by key name. Each returns 0, TD_ENOTFOUND when the key is absent,
 * or TD_EFORMAT when it has an incompatible type (err names the key). Integer
 * getters accept any integer type whose value fits.
 */
int gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out, td_err *err);
int gguf_get_i64(const gguf_file *f, const char *key, int64_t *out, td_err *err);
int gguf_get_f32(const gguf_file *f, const char *key, float *out, td_err *err);
int gguf_get_bool(const gguf_file *f, const char *key, bool *out, td_err *err);
int gguf_get_str(const gguf_file *f, const char *key, gguf_str *out, td_err *err);

/** Arrays: element type and count; TD_ENOTFOUND / TD_EFORMAT as above. */
int gguf_get_arr(const gguf_file *f, const char *key, gguf_vtype *elem_type, uint64_t *n,
                 td_err *err);
/**
 * Pointer to a numeric array's elements (little-endian, packed), aligned to the
 * element size (the reader keeps an aligned copy when the file's are not), so it
 * may be used as `const float *` etc. NULL for string and nested arrays.
 */
const void *gguf_get_arr_data(const gguf_file *f, const char *key);
/** The i-th string of a string array (i < n, checked; empty string when out of range). */
gguf_str gguf_get_arr_str(const gguf_file *f, const char *key, uint64_t i);

int64_t gguf_n_tensors(const gguf_file *f);
const gguf_tensor *gguf_tensor_at(const gguf_file *f, int64_t i);
/** Tensor by name, or NULL. */
const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name);

/* ---- writer ---------------------------------------------------------------- */

typedef struct gguf_writer gguf_writer;

/** Fills `n` bytes of tensor data at `dst` (called once per tensor, in order). */
typedef int (*gguf_fill_fn)(void *ctx, const gguf_tensor *t, void *dst, td_err *err);

gguf_writer *gguf_writer_new(void);
void gguf_writer_free(gguf_writer *w);
void gguf_writer_set_u32(gguf_writer *w, const char *key, uint32_t v);
void gguf_writer_set_i32(gguf_writer *w, const char *key, int32_t v);
void gguf_writer_set_f32(gguf_writer *w, const char *key, float v);
void gguf_writer_set_bool(gguf_writer *w, const char *key, bool v);
void gguf_writer_set_str(gguf_writer *w, const char *key, const char *v);
/** Numeric array (elem_type not STRING/ARRAY); data is copied. */
void gguf_writer_set_arr(gguf_writer *w, const char *key, gguf_vtype elem_type, const void *data,
                         uint64_t n);
/** String array; strings are copied (given with lengths, may contain NUL). */
void gguf_writer_set_arr_str(gguf_writer *w, const char *key, const gguf_str *strs, uint64_t n);
/** Copy every key/value of `src` whose name starts with `prefix` (e.g. "tokenizer."). */
int gguf_writer_copy_kv(gguf_writer *w, const gguf_file *src, const char *prefix, td_err *err);
/** Declare a tensor; its data is produced by `fill` when the file is written. */
int gguf_writer_add_tensor(gguf_writer *w, const char *name, td_type type, int n_dims,
                           const int64_t *ne, gguf_fill_fn fill, void *ctx, td_err *err);
/**
 * Fills rows [row0, row0 + n_rows) of a tensor at `dst` (n_rows * row bytes), where a
 * row is ne[0] elements and the tensor has ne[1]*ne[2]*ne[3] rows. Called in order,
 * in chunks of a few MiB, so no tensor is ever held whole in memory.
 */
typedef int (*gguf_fill_rows_fn)(void *ctx, const gguf_tensor *t, int64_t row0, int64_t n_rows,
                                 void *dst, td_err *err);
/** Like gguf_writer_add_tensor, with data produced a chunk of rows at a time. */
int gguf_writer_add_tensor_rows(gguf_writer *w, const char *name, td_type type, int n_dims,
                                const int64_t *ne, gguf_fill_rows_fn fill, void *ctx, td_err *err);
/** Write a GGUF v3 file (alignment 32); streams tensor data, never holds it all. */
int gguf_writer_write(gguf_writer *w, const char *path, td_err *err);

#endif
