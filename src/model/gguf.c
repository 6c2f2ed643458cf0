/*
 * model/gguf.c - the GGUF reader (v2 and v3).
 *
 * File layout (all little-endian):
 *
 *   "GGUF" | u32 version | u64 n_tensors | u64 n_kv
 *   n_kv x   { string key | u32 value type | value }
 *   n_tensors x { string name | u32 n_dims | u64 ne[n_dims] | u32 type | u64 offset }
 *   padding to general.alignment (default 32)
 *   data section: tensor i at data_offset + offset_i
 *
 * where a string is u64 length + bytes (no NUL) and an array value is
 * u32 element type + u64 count + elements.
 *
 * Every read goes through a cursor (struct rd) that checks the remaining size
 * first, so a hostile file can make us fail but never read outside the buffer.
 * Counts are checked against the bytes left before anything is allocated, which
 * bounds every allocation by a small multiple of the file size.
 */
#include "model/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model/gguf_impl.h"

typedef struct gguf_kv {
    gguf_str key;
    gguf_vtype type;
    const uint8_t *val; /* the value's bytes in the buffer (see gguf__raw) */
    size_t val_len;
    /* arrays only */
    gguf_vtype arr_type;
    uint64_t arr_n;
    const void *arr_data;     /* numeric elements; an aligned copy when the file's are not */
    const uint8_t **arr_strs; /* string arrays: where each string (u64 len) starts */
    void *arr_copy;           /* owned aligned copy of arr_data, or NULL */
} gguf_kv;

struct gguf_file {
    const uint8_t *base;
    size_t size;
    bool mapped; /* base is our mmap, unmapped on close */
    uint32_t version;
    size_t alignment;
    size_t data_offset; /* start of the data section */

    int64_t n_kv;
    gguf_kv *kvs;
    int64_t n_tensors;
    gguf_tensor *tensors;

    /* Open-addressing hash indexes holding idx, or -1 for an empty slot. */
    int64_t *key_index;
    size_t key_index_cap; /* power of two */
    int64_t *tensor_index;
    size_t tensor_index_cap;
};

/* ---- type tables ----------------------------------------------------------- */

size_t gguf__scalar_size(uint32_t type)
{
    switch (type) {
    case GGUF_VT_UINT8:
    case GGUF_VT_INT8:
    case GGUF_VT_BOOL:
        return 1;
    case GGUF_VT_UINT16:
    case GGUF_VT_INT16:
        return 2;
    case GGUF_VT_UINT32:
    case GGUF_VT_INT32:
    case GGUF_VT_FLOAT32:
        return 4;
    case GGUF_VT_UINT64:
    case GGUF_VT_INT64:
    case GGUF_VT_FLOAT64:
        return 8;
    default:
        return 0;
    }
}

static const char *vtype_name(uint32_t type)
{
    static const char *names[] = {"u8",   "i8",     "u16",   "i16", "u32", "i32", "f32",
                                  "bool", "string", "array", "u64", "i64", "f64"};
    return type < TD_ARRAY_LEN(names) ? names[type] : "unknown";
}

bool gguf__tensor_type_ok(uint32_t type)
{
    /* TD_TYPE_FP8_E4M3 is a KV-cache type only and never valid in a file. */
    switch (type) {
    case TD_TYPE_F32:
    case TD_TYPE_F16:
    case TD_TYPE_BF16:
    case TD_TYPE_Q8_0:
    case TD_TYPE_Q4_0:
        return true;
    default:
        return false;
    }
}

const char *gguf__ggml_type_name(uint32_t type)
{
    static const char *names[] = {
        "f32",   "f16",        "q4_0",       "q4_1",       "q4_2",     "q4_3",     "q5_0",
        "q5_1",  "q8_0",       "q8_1",       "q2_K",       "q3_K",     "q4_K",     "q5_K",
        "q6_K",  "q8_K",       "iq2_xxs",    "iq2_xs",     "iq3_xxs",  "iq1_s",    "iq4_nl",
        "iq3_s", "iq2_s",      "iq4_xs",     "i8",         "i16",      "i32",      "i64",
        "f64",   "iq1_m",      "bf16",       "q4_0_4_4",   "q4_0_4_8", "q4_0_8_8", "tq1_0",
        "tq2_0", "iq4_nl_4_4", "iq4_nl_4_8", "iq4_nl_8_8", "mxfp4",
    };
    return type < TD_ARRAY_LEN(names) ? names[type] : "?";
}

/* ---- the bounds-checked cursor --------------------------------------------- */

typedef struct rd {
    const uint8_t *p;
    size_t size;
    size_t pos;
    td_err *err;
    char what[160]; /* what is being read, for the truncation message */
} rd;

static int rd_need(rd *r, uint64_t n)
{
    if (n <= r->size - r->pos) return 0;
    return td_err_set(r->err, TD_EFORMAT,
                      "gguf: truncated file: %s needs %llu bytes at offset %zu, file has %zu",
                      r->what, (unsigned long long)n, r->pos, r->size);
}

static int rd_u32(rd *r, uint32_t *v)
{
    int rc = rd_need(r, 4);
    if (rc) return rc;
    memcpy(v, r->p + r->pos, 4);
    r->pos += 4;
    return 0;
}

static int rd_u64(rd *r, uint64_t *v)
{
    int rc = rd_need(r, 8);
    if (rc) return rc;
    memcpy(v, r->p + r->pos, 8);
    r->pos += 8;
    return 0;
}

static int rd_str(rd *r, gguf_str *s)
{
    uint64_t len;
    int rc = rd_u64(r, &len);
    if (rc) return rc;
    if ((rc = rd_need(r, len))) return rc;
    s->ptr = (const char *)r->p + r->pos;
    s->len = len;
    r->pos += (size_t)len;
    return 0;
}

/* ---- hash indexes ---------------------------------------------------------- */

static uint64_t name_hash(const char *s, size_t len)
{
    return td_hash64(s, len, 0x67677566u);
}

static size_t index_cap_for(int64_t n)
{
    size_t cap = 16;
    while (cap < (size_t)n * 2)
        cap *= 2;
    return cap;
}

/* ---- parsing --------------------------------------------------------------- */

static void set_what_key(rd *r, const char *part, int64_t i, gguf_str key)
{
    int n = key.len > 64 ? 64 : (int)key.len;
    snprintf(r->what, sizeof(r->what), "%s of key %lld ('%.*s%s')", part, (long long)i, n, key.ptr,
             key.len > 64 ? "..." : "");
}

/*
 * Validate and skip the elements of an array whose header (type, count) has been
 * read. `depth` is the nesting level of this array (1 = the key's own value).
 * For a top-level string array, `strs` (count entries) receives where each
 * string starts.
 */
static int skip_array_elems(rd *r, uint32_t elem_type, uint64_t n, int depth, const uint8_t **strs,
                            const char *key)
{
    size_t esize = gguf__scalar_size(elem_type);
    if (esize) {
        if (n > (r->size - r->pos) / esize)
            return td_err_set(r->err, TD_EFORMAT,
                              "gguf: truncated file: %s needs %llu elements of %zu bytes at "
                              "offset %zu, file has %zu",
                              r->what, (unsigned long long)n, esize, r->pos, r->size);
        r->pos += (size_t)n * esize;
        return 0;
    }
    if (elem_type == GGUF_VT_STRING) {
        /* each string takes at least its 8-byte length */
        if (n > (r->size - r->pos) / 8)
            return td_err_set(r->err, TD_EFORMAT,
                              "gguf: truncated file: %s declares %llu strings at offset %zu, "
                              "file has %zu",
                              r->what, (unsigned long long)n, r->pos, r->size);
        for (uint64_t i = 0; i < n; i++) {
            if (strs) strs[i] = r->p + r->pos;
            gguf_str s;
            int rc = rd_str(r, &s);
            if (rc) return rc;
        }
        return 0;
    }
    if (elem_type == GGUF_VT_ARRAY) {
        if (depth >= GGUF_MAX_ARRAY_DEPTH)
            return td_err_set(r->err, TD_EFORMAT, "gguf: key '%s': arrays nested deeper than %d",
                              key, GGUF_MAX_ARRAY_DEPTH);
        /* each nested array takes at least 12 bytes (type + count) */
        if (n > (r->size - r->pos) / 12)
            return td_err_set(r->err, TD_EFORMAT,
                              "gguf: truncated file: %s declares %llu arrays at offset %zu, "
                              "file has %zu",
                              r->what, (unsigned long long)n, r->pos, r->size);
        for (uint64_t i = 0; i < n; i++) {
            uint32_t t;
            uint64_t m;
            int rc = rd_u32(r, &t);
            if (!rc) rc = rd_u64(r, &m);
            if (!rc) rc = skip_array_elems(r, t, m, depth + 1, NULL, key);
            if (rc) return rc;
        }
        return 0;
    }
    return td_err_set(r->err, TD_EFORMAT, "gguf: key '%s': array has unknown element type %u", key,
                      elem_type);
}

static int parse_kv(gguf_file *f, rd *r, int64_t i)
{
    gguf_kv *kv = &f->kvs[i];
    snprintf(r->what, sizeof(r->what), "key %lld", (long long)i);
    int rc = rd_str(r, &kv->key);
    if (rc) return rc;
    char key[72]; /* a printable, bounded copy of the key for messages */
    snprintf(key, sizeof(key), "%.*s%s", kv->key.len > 64 ? 64 : (int)kv->key.len, kv->key.ptr,
             kv->key.len > 64 ? "..." : "");
    if (kv->key.len == 0)
        return td_err_set(r->err, TD_EFORMAT, "gguf: key %lld has an empty name", (long long)i);

    set_what_key(r, "type", i, kv->key);
    uint32_t type;
    if ((rc = rd_u32(r, &type))) return rc;
    kv->type = (gguf_vtype)type;
    set_what_key(r, "value", i, kv->key);
    kv->val = r->p + r->pos;

    size_t ssize = gguf__scalar_size(type);
    if (ssize) {
        if ((rc = rd_need(r, ssize))) return rc;
        r->pos += ssize;
    } else if (type == GGUF_VT_STRING) {
        gguf_str s;
        if ((rc = rd_str(r, &s))) return rc;
    } else if (type == GGUF_VT_ARRAY) {
        uint32_t et;
        uint64_t n;
        if ((rc = rd_u32(r, &et)) || (rc = rd_u64(r, &n))) return rc;
        kv->arr_type = (gguf_vtype)et;
        kv->arr_n = n;
        kv->arr_data = r->p + r->pos;
        if (et == GGUF_VT_STRING && n > 0) {
            if (n > (r->size - r->pos) / 8) /* checked again below; guards the allocation */
                return skip_array_elems(r, et, n, 1, NULL, key);
            kv->arr_strs = malloc((size_t)n * sizeof(*kv->arr_strs));
            if (!kv->arr_strs)
                return td_err_set(r->err, TD_ENOMEM, "gguf: out of memory for key '%s'", key);
        }
        if ((rc = skip_array_elems(r, et, n, 1, kv->arr_strs, key))) return rc;
        /* Numeric arrays are handed out as typed pointers (the tokenizer reads scores
         * as float *); copy them when the file leaves them misaligned. */
        size_t es = gguf__scalar_size(et);
        if (es > 1 && n > 0 && ((uintptr_t)kv->arr_data % es) != 0) {
            kv->arr_copy = malloc((size_t)n * es);
            if (!kv->arr_copy)
                return td_err_set(r->err, TD_ENOMEM, "gguf: out of memory for key '%s'", key);
            memcpy(kv->arr_copy, kv->arr_data, (size_t)n * es);
            kv->arr_data = kv->arr_copy;
        }
    } else {
        return td_err_set(r->err, TD_EFORMAT, "gguf: key '%s' has unknown value type %u", key,
                          type);
    }
    kv->val_len = (size_t)(r->p + r->pos - kv->val);

    /* Insert into the key index, rejecting duplicates. */
    size_t mask = f->key_index_cap - 1;
    for (size_t h = name_hash(kv->key.ptr, kv->key.len) & mask;; h = (h + 1) & mask) {
        int64_t j = f->key_index[h];
        if (j < 0) {
            f->key_index[h] = i;
            break;
        }
        if (f->kvs[j].key.len == kv->key.len &&
            !memcmp(f->kvs[j].key.ptr, kv->key.ptr, kv->key.len))
            return td_err_set(r->err, TD_EFORMAT,
                              "gguf: duplicate key '%s' (entries %lld and %lld)", key, (long long)j,
                              (long long)i);
    }
    return 0;
}

static int parse_tensor_info(gguf_file *f, rd *r, int64_t i)
{
    gguf_tensor *t = &f->tensors[i];
    snprintf(r->what, sizeof(r->what), "tensor info %lld", (long long)i);
    gguf_str name;
    int rc = rd_str(r, &name);
    if (rc) return rc;
    if (name.len == 0 || name.len >= sizeof(t->name) || memchr(name.ptr, 0, name.len))
        return td_err_set(r->err, TD_EFORMAT,
                          "gguf: tensor %lld has an invalid name (%llu bytes; names are 1..%zu "
                          "bytes without NUL)",
                          (long long)i, (unsigned long long)name.len, sizeof(t->name) - 1);
    memcpy(t->name, name.ptr, name.len);
    t->name[name.len] = 0;
    snprintf(r->what, sizeof(r->what), "tensor info %lld ('%s')", (long long)i, t->name);

    uint32_t n_dims;
    if ((rc = rd_u32(r, &n_dims))) return rc;
    if (n_dims < 1 || n_dims > 4)
        return td_err_set(r->err, TD_EFORMAT, "gguf: tensor '%s' has %u dimensions (1..4 allowed)",
                          t->name, n_dims);
    t->n_dims = (int)n_dims;
    int64_t nelem = 1;
    for (int d = 0; d < 4; d++) {
        uint64_t ne = 1;
        if (d < t->n_dims && (rc = rd_u64(r, &ne))) return rc;
        if (ne < 1 || ne > (uint64_t)INT64_MAX ||
            __builtin_mul_overflow(nelem, (int64_t)ne, &nelem))
            return td_err_set(r->err, TD_EFORMAT,
                              "gguf: tensor '%s' has an invalid shape (dim %d is %llu)", t->name, d,
                              (unsigned long long)ne);
        t->ne[d] = (int64_t)ne;
    }
    uint32_t type;
    if ((rc = rd_u32(r, &type)) || (rc = rd_u64(r, &t->offset))) return rc;
    if (!gguf__tensor_type_ok(type))
        return td_err_set(r->err, TD_EUNSUPPORTED,
                          "gguf: tensor '%s' has unsupported type %u (%s); supported: f32, f16, "
                          "bf16, q8_0, q4_0",
                          t->name, type, gguf__ggml_type_name(type));
    t->type = (td_type)type;
    int be = td_type_block_elems(t->type);
    if (t->ne[0] % be)
        return td_err_set(r->err, TD_EFORMAT,
                          "gguf: tensor '%s': row length %lld is not a multiple of the %s block "
                          "size %d",
                          t->name, (long long)t->ne[0], td_type_name(t->type), be);
    uint64_t nbytes;
    if (__builtin_mul_overflow((uint64_t)(nelem / be), (uint64_t)td_type_block_bytes(t->type),
                               &nbytes) ||
        nbytes > SIZE_MAX)
        return td_err_set(r->err, TD_EFORMAT, "gguf: tensor '%s' is too large", t->name);
    t->nbytes = (size_t)nbytes;

    size_t mask = f->tensor_index_cap - 1;
    size_t len = name.len;
    for (size_t h = name_hash(t->name, len) & mask;; h = (h + 1) & mask) {
        int64_t j = f->tensor_index[h];
        if (j < 0) {
            f->tensor_index[h] = i;
            break;
        }
        if (!strcmp(f->tensors[j].name, t->name))
            return td_err_set(r->err, TD_EFORMAT,
                              "gguf: duplicate tensor '%s' (entries %lld and %lld)", t->name,
                              (long long)j, (long long)i);
    }
    return 0;
}

static int cmp_by_offset(const void *a, const void *b)
{
    const gguf_tensor *x = *(const gguf_tensor *const *)a, *y = *(const gguf_tensor *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* general.alignment: a u32 power of two (llama.cpp insists on the u32 type too). */
static int read_alignment(gguf_file *f, td_err *err)
{
    f->alignment = GGUF_DEFAULT_ALIGNMENT;
    int64_t i = gguf_find_key(f, "general.alignment");
    if (i < 0) return 0;
    if (f->kvs[i].type != GGUF_VT_UINT32)
        return td_err_set(err, TD_EFORMAT,
                          "gguf: key 'general.alignment' has type %s, expected u32",
                          vtype_name(f->kvs[i].type));
    uint32_t a;
    memcpy(&a, f->kvs[i].val, 4);
    if (a == 0 || (a & (a - 1)) != 0 || a > (1u << 30))
        return td_err_set(err, TD_EFORMAT, "gguf: general.alignment is %u, expected a power of two",
                          a);
    f->alignment = a;
    return 0;
}

static int parse(gguf_file *f, td_err *err)
{
    rd r = {.p = f->base, .size = f->size, .pos = 0, .err = err};
    snprintf(r.what, sizeof(r.what), "header");
    int rc = rd_need(&r, 4);
    if (rc) return rc;
    if (memcmp(f->base, GGUF_MAGIC, 4) != 0)
        return td_err_set(err, TD_EFORMAT, "gguf: bad magic %02x %02x %02x %02x (not a GGUF file)",
                          f->base[0], f->base[1], f->base[2], f->base[3]);
    r.pos = 4;
    uint64_t n_tensors, n_kv;
    if ((rc = rd_u32(&r, &f->version))) return rc;
    if (f->version == 1)
        return td_err_set(err, TD_EUNSUPPORTED,
                          "gguf: version 1 is not supported (re-convert the model; v2 and v3 are)");
    if (f->version != 2 && f->version != 3)
        return td_err_set(err, TD_EUNSUPPORTED,
                          "gguf: unknown version %u (v2 and v3 are supported)", f->version);
    if ((rc = rd_u64(&r, &n_tensors)) || (rc = rd_u64(&r, &n_kv))) return rc;

    /* A KV takes at least 13 bytes and a tensor info at least 32, so counts that could
     * not fit in the file are rejected before anything is allocated. */
    size_t left = f->size - r.pos;
    if (n_kv > GGUF_MAX_KV || n_kv > left / 13)
        return td_err_set(err, TD_EFORMAT, "gguf: implausible key count %llu for a %zu-byte file",
                          (unsigned long long)n_kv, f->size);
    if (n_tensors > GGUF_MAX_TENSORS || n_tensors > left / 32)
        return td_err_set(err, TD_EFORMAT,
                          "gguf: implausible tensor count %llu for a %zu-byte file",
                          (unsigned long long)n_tensors, f->size);

    f->kvs = calloc(n_kv ? n_kv : 1, sizeof(*f->kvs));
    f->key_index_cap = index_cap_for((int64_t)n_kv);
    f->key_index = malloc(f->key_index_cap * sizeof(int64_t));
    f->tensors = calloc(n_tensors ? n_tensors : 1, sizeof(*f->tensors));
    f->tensor_index_cap = index_cap_for((int64_t)n_tensors);
    f->tensor_index = malloc(f->tensor_index_cap * sizeof(int64_t));
    if (!f->kvs || !f->key_index || !f->tensors || !f->tensor_index)
        return td_err_set(err, TD_ENOMEM, "gguf: out of memory for the file's index");
    memset(f->key_index, 0xff, f->key_index_cap * sizeof(int64_t));
    memset(f->tensor_index, 0xff, f->tensor_index_cap * sizeof(int64_t));

    for (uint64_t i = 0; i < n_kv; i++) {
        f->n_kv = (int64_t)i + 1; /* so close frees what this entry allocated */
        if ((rc = parse_kv(f, &r, (int64_t)i))) return rc;
    }
    if ((rc = read_alignment(f, err))) return rc;
    for (uint64_t i = 0; i < n_tensors; i++)
        if ((rc = parse_tensor_info(f, &r, (int64_t)i))) return rc;
    f->n_tensors = (int64_t)n_tensors;

    /* The data section starts at the next multiple of the alignment. A file with no
     * tensors may end before it (vocabulary-only files do). */
    f->data_offset = TD_ALIGN_UP(r.pos, f->alignment);
    for (int64_t i = 0; i < f->n_tensors; i++) {
        gguf_tensor *t = &f->tensors[i];
        if (t->offset % f->alignment)
            return td_err_set(err, TD_EFORMAT,
                              "gguf: tensor '%s' has offset %llu, not a multiple of the "
                              "alignment %zu",
                              t->name, (unsigned long long)t->offset, f->alignment);
        uint64_t start, end;
        if (__builtin_add_overflow((uint64_t)f->data_offset, t->offset, &start) ||
            __builtin_add_overflow(start, (uint64_t)t->nbytes, &end) || end > f->size)
            return td_err_set(err, TD_EFORMAT,
                              "gguf: tensor '%s' data (offset %llu, %zu bytes) lies outside the "
                              "file (data section starts at %zu, file has %zu bytes)",
                              t->name, (unsigned long long)t->offset, t->nbytes, f->data_offset,
                              f->size);
        /* The kernels read f32 as floats and f16, bf16 and block scales as 16-bit words:
         * data placed off those boundaries (general.alignment 1, say) is refused. */
        size_t natural = t->type == TD_TYPE_F32 ? 4 : 2;
        if (start % natural)
            return td_err_set(err, TD_EFORMAT,
                              "gguf: tensor '%s' (%s) starts at file offset %llu, not a multiple "
                              "of %zu",
                              t->name, td_type_name(t->type), (unsigned long long)start, natural);
        t->data = f->base + start;
    }
    /* No two tensors share bytes: a file whose tensors overlap describes no real model. */
    if (f->n_tensors > 1) {
        gguf_tensor **by = malloc((size_t)f->n_tensors * sizeof(*by));
        if (!by) return td_err_set(err, TD_ENOMEM, "gguf: out of memory");
        for (int64_t i = 0; i < f->n_tensors; i++)
            by[i] = &f->tensors[i];
        qsort(by, (size_t)f->n_tensors, sizeof(*by), cmp_by_offset);
        for (int64_t i = 1; i < f->n_tensors; i++)
            if (by[i - 1]->offset + by[i - 1]->nbytes > by[i]->offset && by[i]->nbytes) {
                rc = td_err_set(err, TD_EFORMAT,
                                "gguf: the data of tensors '%s' and '%s' overlap (offsets %llu "
                                "and %llu)",
                                by[i - 1]->name, by[i]->name, (unsigned long long)by[i - 1]->offset,
                                (unsigned long long)by[i]->offset);
                break;
            }
        free(by);
        if (rc) return rc;
    }
    return 0;
}

static void free_file(gguf_file *f)
{
    if (!f) return;
    for (int64_t i = 0; i < f->n_kv; i++) {
        free(f->kvs[i].arr_strs);
        free(f->kvs[i].arr_copy);
    }
    free(f->kvs);
    free(f->key_index);
    free(f->tensors);
    free(f->tensor_index);
    if (f->mapped && f->size) munmap((void *)f->base, f->size);
    free(f);
}

int gguf_open_buffer(gguf_file **out, const void *data, size_t size, td_err *err)
{
    *out = NULL;
    if (!data && size) return td_err_set(err, TD_EINVAL, "gguf: NULL buffer");
    gguf_file *f = calloc(1, sizeof(*f));
    if (!f) return td_err_set(err, TD_ENOMEM, "gguf: out of memory");
    static const uint8_t empty[1];
    f->base = data ? data : empty;
    f->size = size;
    int rc = parse(f, err);
    if (rc) {
        free_file(f);
        return rc;
    }
    *out = f;
    return 0;
}

int gguf_open(gguf_file **out, const char *path, td_err *err)
{
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return td_err_set(err, TD_EIO, "gguf: cannot open '%s': %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return td_err_set(err, TD_EIO, "gguf: cannot stat '%s': %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return td_err_set(err, TD_EIO, "gguf: '%s' is not a regular file", path);
    }
    size_t size = (size_t)st.st_size;
    if (size < 24) {
        close(fd);
        return td_err_set(err, TD_EFORMAT,
                          "gguf: '%s': truncated file: header needs 24 bytes, file has %zu", path,
                          size);
    }
    void *p = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd); /* the mapping keeps the file alive */
    if (p == MAP_FAILED)
        return td_err_set(err, TD_EIO, "gguf: cannot map '%s': %s", path, strerror(e));

    gguf_file *f = calloc(1, sizeof(*f));
    if (!f) {
        munmap(p, size);
        return td_err_set(err, TD_ENOMEM, "gguf: out of memory");
    }
    f->base = p;
    f->size = size;
    f->mapped = true;
    td_err local;
    td_err_clear(&local);
    int rc = parse(f, &local);
    if (rc) {
        free_file(f);
        /* Name the file: "gguf: 'path': <what the parser said>". */
        const char *msg = strncmp(local.msg, "gguf: ", 6) ? local.msg : local.msg + 6;
        return td_err_set(err, rc, "gguf: '%s': %s", path, msg);
    }
    *out = f;
    return 0;
}

void gguf_close(gguf_file *f)
{
    free_file(f);
}

void gguf_prefault(const gguf_file *f)
{
    if (!f || !f->mapped) return;
#ifdef MADV_POPULATE_READ
    if (madvise((void *)f->base, f->size, MADV_POPULATE_READ) == 0) return;
#endif
    /* Older kernels: read one byte per page. */
    long page = sysconf(_SC_PAGESIZE);
    volatile uint8_t sink = 0;
    for (size_t o = 0; o < f->size; o += (size_t)page) sink ^= f->base[o];
    (void)sink;
}

/* ---- accessors ------------------------------------------------------------- */

uint32_t gguf_version(const gguf_file *f)
{
    return f->version;
}

size_t gguf_alignment(const gguf_file *f)
{
    return f->alignment;
}

int64_t gguf_n_kv(const gguf_file *f)
{
    return f->n_kv;
}

int64_t gguf_find_key(const gguf_file *f, const char *key)
{
    if (!f || !key) return -1;
    size_t len = strlen(key), mask = f->key_index_cap - 1;
    for (size_t h = name_hash(key, len) & mask;; h = (h + 1) & mask) {
        int64_t j = f->key_index[h];
        if (j < 0) return -1;
        if (f->kvs[j].key.len == len && !memcmp(f->kvs[j].key.ptr, key, len)) return j;
    }
}

gguf_str gguf_key_name(const gguf_file *f, int64_t idx)
{
    if (idx < 0 || idx >= f->n_kv) return (gguf_str){"", 0};
    return f->kvs[idx].key;
}

gguf_vtype gguf_kv_type(const gguf_file *f, int64_t idx)
{
    if (idx < 0 || idx >= f->n_kv) return (gguf_vtype)-1;
    return f->kvs[idx].type;
}

gguf__raw gguf__kv_raw(const gguf_file *f, int64_t idx)
{
    const gguf_kv *kv = &f->kvs[idx];
    return (gguf__raw){kv->type, kv->val, kv->val_len};
}

static const gguf_kv *lookup(const gguf_file *f, const char *key, int *rc, td_err *err)
{
    int64_t i = gguf_find_key(f, key);
    if (i < 0) {
        *rc = td_err_set(err, TD_ENOTFOUND, "gguf: missing key '%s'", key);
        return NULL;
    }
    *rc = 0;
    return &f->kvs[i];
}

static int wrong_type(const gguf_kv *kv, const char *key, const char *expected, td_err *err)
{
    return td_err_set(err, TD_EFORMAT, "gguf: key '%s' has type %s, expected %s", key,
                      vtype_name(kv->type), expected);
}

/* Read an integer value as sign + magnitude; false when the key is not an integer. */
static bool kv_int(const gguf_kv *kv, bool *neg, uint64_t *mag)
{
    int64_t s = 0;
    uint64_t u = 0;
    bool is_signed = true;
    switch (kv->type) {
    case GGUF_VT_UINT8: {
        uint8_t v;
        memcpy(&v, kv->val, 1);
        u = v;
        is_signed = false;
        break;
    }
    case GGUF_VT_UINT16: {
        uint16_t v;
        memcpy(&v, kv->val, 2);
        u = v;
        is_signed = false;
        break;
    }
    case GGUF_VT_UINT32: {
        uint32_t v;
        memcpy(&v, kv->val, 4);
        u = v;
        is_signed = false;
        break;
    }
    case GGUF_VT_UINT64: {
        memcpy(&u, kv->val, 8);
        is_signed = false;
        break;
    }
    case GGUF_VT_INT8: {
        int8_t v;
        memcpy(&v, kv->val, 1);
        s = v;
        break;
    }
    case GGUF_VT_INT16: {
        int16_t v;
        memcpy(&v, kv->val, 2);
        s = v;
        break;
    }
    case GGUF_VT_INT32: {
        int32_t v;
        memcpy(&v, kv->val, 4);
        s = v;
        break;
    }
    case GGUF_VT_INT64: {
        memcpy(&s, kv->val, 8);
        break;
    }
    default:
        return false;
    }
    if (is_signed) {
        *neg = s < 0;
        *mag = s < 0 ? (uint64_t)0 - (uint64_t)s : (uint64_t)s;
    } else {
        *neg = false;
        *mag = u;
    }
    return true;
}

int gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out, td_err *err)
{
    int rc;
    const gguf_kv *kv = lookup(f, key, &rc, err);
    if (!kv) return rc;
    bool neg;
    uint64_t mag;
    if (!kv_int(kv, &neg, &mag)) return wrong_type(kv, key, "an unsigned 32-bit integer", err);
    if (neg || mag > UINT32_MAX)
        return td_err_set(err, TD_EFORMAT, "gguf: key '%s' = %s%llu does not fit in u32", key,
                          neg ? "-" : "", (unsigned long long)mag);
    *out = (uint32_t)mag;
    return 0;
}

int gguf_get_i64(const gguf_file *f, const char *key, int64_t *out, td_err *err)
{
    int rc;
    const gguf_kv *kv = lookup(f, key, &rc, err);
    if (!kv) return rc;
    bool neg;
    uint64_t mag;
    if (!kv_int(kv, &neg, &mag)) return wrong_type(kv, key, "an integer", err);
    if (neg) {
        *out = mag > (uint64_t)INT64_MAX ? INT64_MIN : -(int64_t)mag;
        return 0;
    }
    if (mag > (uint64_t)INT64_MAX)
        return td_err_set(err, TD_EFORMAT, "gguf: key '%s' = %llu does not fit in i64", key,
                          (unsigned long long)mag);
    *out = (int64_t)mag;
    return 0;
}

int gguf_get_f32(const gguf_file *f, const char *key, float *out, td_err *err)
{
    int rc;
    const gguf_kv *kv = lookup(f, key, &rc, err);
    if (!kv) return rc;
    if (kv->type == GGUF_VT_FLOAT32) {
        memcpy(out, kv->val, 4);
        return 0;
    }
    if (kv->type == GGUF_VT_FLOAT64) {
        double d;
        memcpy(&d, kv->val, 8);
        *out = (float)d;
        return 0;
    }
    bool neg;
    uint64_t mag;
    if (!kv_int(kv, &neg, &mag)) return wrong_type(kv, key, "a number", err);
    *out = neg ? -(float)mag : (float)mag;
    return 0;
}

int gguf_get_bool(const gguf_file *f, const char *key, bool *out, td_err *err)
{
    int rc;
    const gguf_kv *kv = lookup(f, key, &rc, err);
    if (!kv) return rc;
    if (kv->type != GGUF_VT_BOOL) return wrong_type(kv, key, "bool", err);
    *out = kv->val[0] != 0;
    return 0;
}

int gguf_get_str(const gguf_file *f, const char *key, gguf_str *out, td_err *err)
{
    int rc;
    const gguf_kv *kv = lookup(f, key, &rc, err);
    if (!kv) return rc;
    if (kv->type != GGUF_VT_STRING) return wrong_type(kv, key, "string", err);
    memcpy(&out->len, kv->val, 8);
    out->ptr = (const char *)kv->val + 8;
    return 0;
}

int gguf_get_arr(const gguf_file *f, const char *key, gguf_vtype *elem_type, uint64_t *n,
                 td_err *err)
{
    int rc;
    const gguf_kv *kv = lookup(f, key, &rc, err);
    if (!kv) return rc;
    if (kv->type != GGUF_VT_ARRAY) return wrong_type(kv, key, "array", err);
    if (elem_type) *elem_type = kv->arr_type;
    if (n) *n = kv->arr_n;
    return 0;
}

const void *gguf_get_arr_data(const gguf_file *f, const char *key)
{
    int64_t i = gguf_find_key(f, key);
    if (i < 0) return NULL;
    const gguf_kv *kv = &f->kvs[i];
    if (kv->type != GGUF_VT_ARRAY || !gguf__scalar_size(kv->arr_type)) return NULL;
    return kv->arr_data;
}

gguf_str gguf_get_arr_str(const gguf_file *f, const char *key, uint64_t i)
{
    int64_t k = gguf_find_key(f, key);
    if (k < 0) return (gguf_str){"", 0};
    const gguf_kv *kv = &f->kvs[k];
    if (kv->type != GGUF_VT_ARRAY || kv->arr_type != GGUF_VT_STRING || i >= kv->arr_n)
        return (gguf_str){"", 0};
    gguf_str s;
    memcpy(&s.len, kv->arr_strs[i], 8);
    s.ptr = (const char *)kv->arr_strs[i] + 8;
    return s;
}

int64_t gguf_n_tensors(const gguf_file *f)
{
    return f->n_tensors;
}

const gguf_tensor *gguf_tensor_at(const gguf_file *f, int64_t i)
{
    if (i < 0 || i >= f->n_tensors) return NULL;
    return &f->tensors[i];
}

const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name)
{
    if (!f || !name) return NULL;
    size_t mask = f->tensor_index_cap - 1;
    for (size_t h = name_hash(name, strlen(name)) & mask;; h = (h + 1) & mask) {
        int64_t j = f->tensor_index[h];
        if (j < 0) return NULL;
        if (!strcmp(f->tensors[j].name, name)) return &f->tensors[j];
    }
}
