/*
 * model/gguf_write.c - the GGUF v3 writer.
 *
 * Keys are kept as their serialized value bytes (the same bytes a reader sees),
 * which makes copying keys from another file, nested arrays included, a plain
 * byte copy. Tensors are declared first with a fill callback; gguf_writer_write
 * lays out the header, then streams each tensor's data through a bounded buffer
 * (per tensor, or per chunk of rows for gguf_writer_add_tensor_rows), so a model
 * of any size is written without holding it in memory.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/gguf.h"
#include "model/gguf_impl.h"

/* Chunk size for row-streamed tensors and for fwrite calls. */
#define GGUF_WRITE_CHUNK (8u << 20)

typedef struct wkv {
    char *key;
    gguf_vtype type;
    uint8_t *blob; /* serialized value */
    size_t len;
} wkv;

typedef struct wtensor {
    gguf_tensor info; /* offset and nbytes filled at declaration */
    gguf_fill_fn fill;
    gguf_fill_rows_fn fill_rows;
    void *ctx;
} wtensor;

struct gguf_writer {
    wkv *kvs;
    size_t n_kv, cap_kv;
    wtensor *tensors;
    size_t n_tensors, cap_tensors;
    uint64_t data_size; /* running size of the data section */
};

gguf_writer *gguf_writer_new(void)
{
    return td_xcalloc(1, sizeof(gguf_writer));
}

void gguf_writer_free(gguf_writer *w)
{
    if (!w) return;
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kvs[i].key);
        free(w->kvs[i].blob);
    }
    free(w->kvs);
    free(w->tensors);
    free(w);
}

/* Set (or replace) a key's serialized value; takes ownership of blob. */
static void set_raw(gguf_writer *w, const char *key, gguf_vtype type, uint8_t *blob, size_t len)
{
    for (size_t i = 0; i < w->n_kv; i++) {
        if (!strcmp(w->kvs[i].key, key)) {
            free(w->kvs[i].blob);
            w->kvs[i].type = type;
            w->kvs[i].blob = blob;
            w->kvs[i].len = len;
            return;
        }
    }
    if (w->n_kv == w->cap_kv) {
        w->cap_kv = w->cap_kv ? w->cap_kv * 2 : 32;
        w->kvs = realloc(w->kvs, w->cap_kv * sizeof(*w->kvs));
        TD_ASSERT(w->kvs);
    }
    size_t klen = strlen(key);
    char *k = td_xmalloc(klen + 1);
    memcpy(k, key, klen + 1);
    w->kvs[w->n_kv++] = (wkv){k, type, blob, len};
}

static void set_scalar(gguf_writer *w, const char *key, gguf_vtype type, const void *v, size_t n)
{
    uint8_t *blob = td_xmalloc(n);
    memcpy(blob, v, n);
    set_raw(w, key, type, blob, n);
}

void gguf_writer_set_u32(gguf_writer *w, const char *key, uint32_t v)
{
    set_scalar(w, key, GGUF_VT_UINT32, &v, 4);
}

void gguf_writer_set_i32(gguf_writer *w, const char *key, int32_t v)
{
    set_scalar(w, key, GGUF_VT_INT32, &v, 4);
}

void gguf_writer_set_f32(gguf_writer *w, const char *key, float v)
{
    set_scalar(w, key, GGUF_VT_FLOAT32, &v, 4);
}

void gguf_writer_set_bool(gguf_writer *w, const char *key, bool v)
{
    uint8_t b = v ? 1 : 0;
    set_scalar(w, key, GGUF_VT_BOOL, &b, 1);
}

void gguf_writer_set_str(gguf_writer *w, const char *key, const char *v)
{
    uint64_t len = strlen(v);
    uint8_t *blob = td_xmalloc(8 + len);
    memcpy(blob, &len, 8);
    memcpy(blob + 8, v, len);
    set_raw(w, key, GGUF_VT_STRING, blob, 8 + len);
}

void gguf_writer_set_arr(gguf_writer *w, const char *key, gguf_vtype elem_type, const void *data,
                         uint64_t n)
{
    size_t es = gguf__scalar_size(elem_type);
    TD_ASSERT(es > 0); /* numeric element types only */
    size_t bytes = (size_t)n * es;
    uint8_t *blob = td_xmalloc(12 + bytes);
    uint32_t t = elem_type;
    memcpy(blob, &t, 4);
    memcpy(blob + 4, &n, 8);
    if (bytes) memcpy(blob + 12, data, bytes);
    set_raw(w, key, GGUF_VT_ARRAY, blob, 12 + bytes);
}

void gguf_writer_set_arr_str(gguf_writer *w, const char *key, const gguf_str *strs, uint64_t n)
{
    size_t total = 12;
    for (uint64_t i = 0; i < n; i++)
        total += 8 + (size_t)strs[i].len;
    uint8_t *blob = td_xmalloc(total), *p = blob;
    uint32_t t = GGUF_VT_STRING;
    memcpy(p, &t, 4);
    memcpy(p + 4, &n, 8);
    p += 12;
    for (uint64_t i = 0; i < n; i++) {
        memcpy(p, &strs[i].len, 8);
        if (strs[i].len) memcpy(p + 8, strs[i].ptr, strs[i].len);
        p += 8 + strs[i].len;
    }
    set_raw(w, key, GGUF_VT_ARRAY, blob, total);
}

int gguf_writer_copy_kv(gguf_writer *w, const gguf_file *src, const char *prefix, td_err *err)
{
    size_t plen = strlen(prefix);
    for (int64_t i = 0; i < gguf_n_kv(src); i++) {
        gguf_str k = gguf_key_name(src, i);
        if (k.len < plen || memcmp(k.ptr, prefix, plen) != 0) continue;
        if (memchr(k.ptr, 0, k.len))
            return td_err_set(err, TD_EFORMAT, "gguf: cannot copy a key with a NUL byte");
        char *key = td_xmalloc(k.len + 1);
        memcpy(key, k.ptr, k.len);
        key[k.len] = 0;
        gguf__raw raw = gguf__kv_raw(src, i);
        uint8_t *blob = td_xmalloc(raw.len ? raw.len : 1);
        memcpy(blob, raw.bytes, raw.len);
        set_raw(w, key, raw.type, blob, raw.len);
        free(key);
    }
    return 0;
}

static int add_tensor(gguf_writer *w, const char *name, td_type type, int n_dims, const int64_t *ne,
                      gguf_fill_fn fill, gguf_fill_rows_fn fill_rows, void *ctx, td_err *err)
{
    wtensor t = {.fill = fill, .fill_rows = fill_rows, .ctx = ctx};
    size_t nlen = strlen(name);
    if (nlen == 0 || nlen >= sizeof(t.info.name))
        return td_err_set(err, TD_EINVAL, "gguf writer: tensor name '%s' is empty or too long",
                          name);
    for (size_t i = 0; i < w->n_tensors; i++)
        if (!strcmp(w->tensors[i].info.name, name))
            return td_err_set(err, TD_EINVAL, "gguf writer: duplicate tensor '%s'", name);
    if (!gguf__tensor_type_ok((uint32_t)type))
        return td_err_set(err, TD_EUNSUPPORTED, "gguf writer: tensor '%s': unsupported type %d",
                          name, (int)type);
    if (n_dims < 1 || n_dims > 4)
        return td_err_set(err, TD_EINVAL, "gguf writer: tensor '%s': %d dims (1..4 allowed)", name,
                          n_dims);
    memcpy(t.info.name, name, nlen + 1);
    t.info.type = type;
    t.info.n_dims = n_dims;
    int64_t nelem = 1;
    for (int d = 0; d < 4; d++) {
        t.info.ne[d] = d < n_dims ? ne[d] : 1;
        if (t.info.ne[d] < 1 || __builtin_mul_overflow(nelem, t.info.ne[d], &nelem))
            return td_err_set(err, TD_EINVAL, "gguf writer: tensor '%s': bad dim %d", name, d);
    }
    size_t row = td_row_bytes(type, t.info.ne[0]);
    if (row == 0)
        return td_err_set(err, TD_EINVAL,
                          "gguf writer: tensor '%s': row length %lld not a multiple of the %s "
                          "block size",
                          name, (long long)t.info.ne[0], td_type_name(type));
    t.info.nbytes = row * (size_t)(nelem / t.info.ne[0]);
    t.info.offset = w->data_size;
    w->data_size = TD_ALIGN_UP(w->data_size + t.info.nbytes, GGUF_DEFAULT_ALIGNMENT);
    if (w->n_tensors == w->cap_tensors) {
        w->cap_tensors = w->cap_tensors ? w->cap_tensors * 2 : 64;
        w->tensors = realloc(w->tensors, w->cap_tensors * sizeof(*w->tensors));
        TD_ASSERT(w->tensors);
    }
    w->tensors[w->n_tensors++] = t;
    return 0;
}

int gguf_writer_add_tensor(gguf_writer *w, const char *name, td_type type, int n_dims,
                           const int64_t *ne, gguf_fill_fn fill, void *ctx, td_err *err)
{
    return add_tensor(w, name, type, n_dims, ne, fill, NULL, ctx, err);
}

int gguf_writer_add_tensor_rows(gguf_writer *w, const char *name, td_type type, int n_dims,
                                const int64_t *ne, gguf_fill_rows_fn fill, void *ctx, td_err *err)
{
    return add_tensor(w, name, type, n_dims, ne, NULL, fill, ctx, err);
}

/* ---- output ---------------------------------------------------------------- */

typedef struct wout {
    FILE *fp;
    const char *path;
    uint64_t pos;
    td_err *err;
} wout;

static int out_bytes(wout *o, const void *p, size_t n)
{
    const uint8_t *b = p;
    while (n) {
        size_t k = n < GGUF_WRITE_CHUNK ? n : GGUF_WRITE_CHUNK;
        if (fwrite(b, 1, k, o->fp) != k)
            return td_err_set(o->err, TD_EIO, "gguf writer: write to '%s' failed: %s", o->path,
                              strerror(errno));
        b += k;
        n -= k;
        o->pos += k;
    }
    return 0;
}

static int out_u32(wout *o, uint32_t v)
{
    return out_bytes(o, &v, 4);
}

static int out_u64(wout *o, uint64_t v)
{
    return out_bytes(o, &v, 8);
}

static int out_pad(wout *o)
{
    static const uint8_t zeros[GGUF_DEFAULT_ALIGNMENT];
    size_t pad = (size_t)(TD_ALIGN_UP(o->pos, GGUF_DEFAULT_ALIGNMENT) - o->pos);
    return out_bytes(o, zeros, pad);
}

static int write_header(gguf_writer *w, wout *o)
{
    int rc = out_bytes(o, GGUF_MAGIC, 4);
    if (!rc) rc = out_u32(o, 3);
    if (!rc) rc = out_u64(o, w->n_tensors);
    if (!rc) rc = out_u64(o, w->n_kv);
    for (size_t i = 0; !rc && i < w->n_kv; i++) {
        uint64_t klen = strlen(w->kvs[i].key);
        rc = out_u64(o, klen);
        if (!rc) rc = out_bytes(o, w->kvs[i].key, klen);
        if (!rc) rc = out_u32(o, w->kvs[i].type);
        if (!rc) rc = out_bytes(o, w->kvs[i].blob, w->kvs[i].len);
    }
    for (size_t i = 0; !rc && i < w->n_tensors; i++) {
        const gguf_tensor *t = &w->tensors[i].info;
        uint64_t nlen = strlen(t->name);
        rc = out_u64(o, nlen);
        if (!rc) rc = out_bytes(o, t->name, nlen);
        if (!rc) rc = out_u32(o, (uint32_t)t->n_dims);
        for (int d = 0; !rc && d < t->n_dims; d++)
            rc = out_u64(o, (uint64_t)t->ne[d]);
        if (!rc) rc = out_u32(o, (uint32_t)t->type);
        if (!rc) rc = out_u64(o, t->offset);
    }
    if (!rc) rc = out_pad(o);
    return rc;
}

/* Stream one tensor: whole (fill) or in chunks of rows of at most GGUF_WRITE_CHUNK bytes. */
static int write_tensor(const wtensor *t, wout *o, uint8_t **buf, size_t *buf_cap)
{
    const gguf_tensor *info = &t->info;
    size_t row_bytes = td_row_bytes(info->type, info->ne[0]);
    int64_t n_rows = (int64_t)(info->nbytes / row_bytes);
    int64_t rows_per_chunk =
        t->fill_rows ? (int64_t)TD_MAX(1, GGUF_WRITE_CHUNK / row_bytes) : n_rows;
    size_t need = (size_t)TD_MIN(rows_per_chunk, n_rows) * row_bytes;
    if (need > *buf_cap) {
        free(*buf);
        *buf = malloc(need);
        *buf_cap = *buf ? need : 0;
        if (!*buf)
            return td_err_set(o->err, TD_ENOMEM,
                              "gguf writer: no memory for tensor '%s' (%zu bytes)", info->name,
                              need);
    }
    for (int64_t r0 = 0; r0 < n_rows; r0 += rows_per_chunk) {
        int64_t nr = TD_MIN(rows_per_chunk, n_rows - r0);
        int rc = t->fill_rows ? t->fill_rows(t->ctx, info, r0, nr, *buf, o->err)
                              : t->fill(t->ctx, info, *buf, o->err);
        if (rc) return rc;
        if ((rc = out_bytes(o, *buf, (size_t)nr * row_bytes))) return rc;
    }
    return out_pad(o);
}

int gguf_writer_write(gguf_writer *w, const char *path, td_err *err)
{
    /* Written in place (not to a temporary and renamed), so that paths such as
     * /proc/self/fd/N of a memfd work; a failed write removes the partial file, and
     * a file cut short by a crash is rejected by the reader as truncated. */
    /* This writer always aligns to 32 bytes; a general.alignment copied from another
     * file (or set by the caller) must not claim otherwise. */
    for (size_t i = 0; i < w->n_kv; i++)
        if (!strcmp(w->kvs[i].key, "general.alignment"))
            gguf_writer_set_u32(w, "general.alignment", GGUF_DEFAULT_ALIGNMENT);
    FILE *fp = fopen(path, "wb");
    if (!fp)
        return td_err_set(err, TD_EIO, "gguf writer: cannot create '%s': %s", path,
                          strerror(errno));
    setvbuf(fp, NULL, _IOFBF, 1 << 20);
    wout o = {.fp = fp, .path = path, .pos = 0, .err = err};
    uint8_t *buf = NULL;
    size_t buf_cap = 0;
    int rc = write_header(w, &o);
    uint64_t data_start = o.pos;
    for (size_t i = 0; !rc && i < w->n_tensors; i++) {
        TD_ASSERT(o.pos == data_start + w->tensors[i].info.offset);
        rc = write_tensor(&w->tensors[i], &o, &buf, &buf_cap);
    }
    free(buf);
    if (fclose(fp) != 0 && !rc)
        rc = td_err_set(err, TD_EIO, "gguf writer: closing '%s' failed: %s", path, strerror(errno));
    if (rc) unlink(path);
    return rc;
}
