/*
 * Unit tests for model/gguf.c and model/gguf_write.c: the shared real files,
 * a writer round trip over every value and tensor type, and malformed inputs
 * (every truncation of a valid file, and one hand-built file per check), each
 * asserting the error code and the message.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "test_shared.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model/gguf.h"

/* ---- helpers ---------------------------------------------------------------- */

static void shared_path(char *buf, size_t cap, const char *rel)
{
    snprintf(buf, cap, "%s/%s", td_test_shared_dir(), rel);
}

static void tmp_path(char *buf, size_t cap, const char *name)
{
    const char *dir = getenv("TMPDIR");
    snprintf(buf, cap, "%s/td_test_gguf_%d_%s", dir && *dir ? dir : "/tmp", (int)getpid(), name);
}

#define assert_err(rc_expr, err, code, substr)                                                     \
    do {                                                                                           \
        int rc_ = (rc_expr);                                                                       \
        if (rc_ != (code) || !strstr((err).msg, (substr)))                                         \
            fail_msg("expected %d with '%s', got %d: '%s'", (code), (substr), rc_, (err).msg);     \
    } while (0)

static bool str_eq(gguf_str s, const char *c)
{
    return s.len == strlen(c) && memcmp(s.ptr, c, s.len) == 0;
}

/* Read a whole file into an exactly sized heap buffer (so ASan sees any overread). */
static uint8_t *read_all(const char *path, size_t *size)
{
    FILE *fp = fopen(path, "rb");
    assert_non_null(fp);
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    uint8_t *p = malloc((size_t)n + 1);
    assert_int_equal(fread(p, 1, (size_t)n, fp), (size_t)n);
    fclose(fp);
    *size = (size_t)n;
    return p;
}

/* A growable byte buffer for hand-built files. */
typedef struct bb {
    uint8_t *p;
    size_t n, cap;
} bb;

static void bb_put(bb *b, const void *v, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, v, n);
    b->n += n;
}
static void bb_u32(bb *b, uint32_t v)
{
    bb_put(b, &v, 4);
}
static void bb_u64(bb *b, uint64_t v)
{
    bb_put(b, &v, 8);
}
static void bb_str(bb *b, const char *s)
{
    bb_u64(b, strlen(s));
    bb_put(b, s, strlen(s));
}
static void bb_pad(bb *b, size_t align)
{
    static const uint8_t z[64];
    bb_put(b, z, (align - b->n % align) % align);
}
static void bb_header(bb *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv)
{
    bb_put(b, "GGUF", 4);
    bb_u32(b, version);
    bb_u64(b, n_tensors);
    bb_u64(b, n_kv);
}
static void bb_kv_str(bb *b, const char *key, const char *v)
{
    bb_str(b, key);
    bb_u32(b, GGUF_VT_STRING);
    bb_str(b, v);
}
static void bb_tensor(bb *b, const char *name, uint32_t n_dims, const uint64_t *ne, uint32_t type,
                      uint64_t offset)
{
    bb_str(b, name);
    bb_u32(b, n_dims);
    for (uint32_t i = 0; i < n_dims; i++)
        bb_u64(b, ne[i]);
    bb_u32(b, type);
    bb_u64(b, offset);
}

/* Parse a buffer from an exactly sized copy; returns the code, fills err. */
static int parse_bb(const bb *b, td_err *err)
{
    uint8_t *copy = malloc(b->n ? b->n : 1);
    memcpy(copy, b->p, b->n);
    gguf_file *f = NULL;
    td_err_clear(err);
    int rc = gguf_open_buffer(&f, copy, b->n, err);
    if (rc == 0) {
        assert_non_null(f);
        gguf_close(f);
    } else {
        assert_null(f);
        assert_true(err->msg[0] != 0);
    }
    free(copy);
    return rc;
}

/* One-tensor file: one KV, then the tensor info, padding and `data_bytes` of data. */
static int one_tensor(uint32_t type, uint32_t n_dims, const uint64_t *ne, uint64_t offset,
                      size_t data_bytes, td_err *err)
{
    bb b = {0};
    bb_header(&b, 3, 1, 1);
    bb_kv_str(&b, "general.architecture", "llama");
    bb_tensor(&b, "blk.0.attn_q.weight", n_dims, ne, type, offset);
    bb_pad(&b, 32);
    for (size_t i = 0; i < data_bytes; i++)
        bb_put(&b, "\x11", 1);
    int rc = parse_bb(&b, err);
    free(b.p);
    return rc;
}

/* ---- the shared files ------------------------------------------------------- */

static void test_stories260k(void **state)
{
    (void)state;
    char path[1024];
    shared_path(path, sizeof(path), "models/stories260K.gguf");
    gguf_file *f;
    td_err err;
    td_err_clear(&err);
    if (gguf_open(&f, path, &err)) fail_msg("%s", err.msg);
    assert_int_equal(gguf_version(f), 3);
    assert_int_equal(gguf_alignment(f), 32);
    assert_int_equal(gguf_n_kv(f), 19);
    assert_int_equal(gguf_n_tensors(f), 48);

    gguf_str s;
    assert_int_equal(gguf_get_str(f, "general.architecture", &s, &err), 0);
    assert_true(str_eq(s, "llama"));
    uint32_t u;
    assert_int_equal(gguf_get_u32(f, "llama.embedding_length", &u, &err), 0);
    assert_int_equal(u, 64);
    assert_int_equal(gguf_get_u32(f, "tokenizer.ggml.padding_token_id", &u, &err), 0);
    assert_int_equal(u, 4294967295u);
    int64_t i64;
    assert_int_equal(gguf_get_i64(f, "llama.block_count", &i64, &err), 0);
    assert_int_equal(i64, 5);
    float eps;
    assert_int_equal(gguf_get_f32(f, "llama.attention.layer_norm_rms_epsilon", &eps, &err), 0);
    assert_true(eps == 1e-5f);

    /* errors of the getters */
    assert_err(gguf_get_str(f, "llama.block_count", &s, &err), err, TD_EFORMAT,
               "key 'llama.block_count' has type u32, expected string");
    assert_err(gguf_get_u32(f, "no.such.key", &u, &err), err, TD_ENOTFOUND, "no.such.key");
    bool b;
    assert_err(gguf_get_bool(f, "general.name", &b, &err), err, TD_EFORMAT, "expected bool");
    assert_int_equal(gguf_find_key(f, "nope"), -1);

    /* arrays */
    gguf_vtype et;
    uint64_t n;
    assert_int_equal(gguf_get_arr(f, "tokenizer.ggml.tokens", &et, &n, &err), 0);
    assert_int_equal(et, GGUF_VT_STRING);
    assert_int_equal(n, 512);
    assert_true(str_eq(gguf_get_arr_str(f, "tokenizer.ggml.tokens", 1), "<s>"));
    assert_true(str_eq(gguf_get_arr_str(f, "tokenizer.ggml.tokens", 3), "<0x00>"));
    assert_int_equal(gguf_get_arr_str(f, "tokenizer.ggml.tokens", 512).len, 0);
    assert_null(gguf_get_arr_data(f, "tokenizer.ggml.tokens"));
    const float *scores = gguf_get_arr_data(f, "tokenizer.ggml.scores");
    assert_non_null(scores);
    assert_int_equal((uintptr_t)scores % 4, 0); /* safe to use as float * */
    assert_err(gguf_get_arr(f, "general.name", &et, &n, &err), err, TD_EFORMAT, "expected array");

    /* tensors */
    const gguf_tensor *t = gguf_find_tensor(f, "token_embd.weight");
    assert_non_null(t);
    assert_int_equal(t->type, TD_TYPE_F32);
    assert_int_equal(t->n_dims, 2);
    assert_int_equal(t->ne[0], 64);
    assert_int_equal(t->ne[1], 512);
    assert_int_equal(t->ne[2], 1);
    assert_int_equal(t->nbytes, 64 * 512 * 4);
    assert_int_equal((uintptr_t)t->data % 32, 0);
    t = gguf_find_tensor(f, "blk.4.ffn_down.weight");
    assert_non_null(t);
    assert_int_equal(t->ne[0], 172);
    assert_int_equal(t->ne[1], 64);
    assert_null(gguf_find_tensor(f, "blk.5.ffn_down.weight"));
    for (int64_t i = 0; i < gguf_n_tensors(f); i++)
        assert_ptr_equal(gguf_find_tensor(f, gguf_tensor_at(f, i)->name), gguf_tensor_at(f, i));
    assert_null(gguf_tensor_at(f, 48));
    gguf_close(f);
}

static void test_tiny_random(void **state)
{
    (void)state;
    char path[1024];
    shared_path(path, sizeof(path), "models/llama-2-tiny-random.gguf");
    gguf_file *f;
    td_err err;
    if (gguf_open(&f, path, &err)) fail_msg("%s", err.msg);
    assert_int_equal(gguf_n_tensors(f), 12);
    const gguf_tensor *t = gguf_find_tensor(f, "token_embd.weight");
    assert_non_null(t);
    assert_int_equal(t->type, TD_TYPE_F16);
    assert_int_equal(t->ne[0], 8);
    assert_int_equal(t->ne[1], 32000);
    assert_int_equal(t->nbytes, 8 * 32000 * 2);
    gguf_vtype et;
    uint64_t n;
    assert_int_equal(gguf_get_arr(f, "tokenizer.ggml.token_type", &et, &n, &err), 0);
    assert_int_equal(et, GGUF_VT_INT32);
    assert_int_equal(n, 32000);
    gguf_close(f);
}

static void test_shared_vocabs(void **state)
{
    (void)state;
    static const char *names[] = {"deepseek-llm", "falcon", "gpt-2",
                                  "llama-spm",    "phi-3",  "starcoder"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        char rel[128], path[1024];
        snprintf(rel, sizeof(rel), "tokenizer/ggml-vocab-%s.gguf", names[i]);
        shared_path(path, sizeof(path), rel);
        gguf_file *f;
        td_err err;
        if (gguf_open(&f, path, &err)) fail_msg("%s: %s", names[i], err.msg);
        gguf_vtype et;
        uint64_t n;
        assert_int_equal(gguf_get_arr(f, "tokenizer.ggml.tokens", &et, &n, &err), 0);
        assert_true(n > 30000);
        assert_int_equal(gguf_n_tensors(f), 0);
        gguf_close(f);
    }
}

/* ---- writer round trip ------------------------------------------------------ */

static int fill_pattern(void *ctx, const gguf_tensor *t, void *dst, td_err *err)
{
    (void)err;
    uint8_t seed = (uint8_t)(uintptr_t)ctx;
    for (size_t i = 0; i < t->nbytes; i++)
        ((uint8_t *)dst)[i] = (uint8_t)(seed + i * 7);
    return 0;
}

/* Row r of a row-filled tensor: every 4-byte word holds r. */
static int fill_rows_index(void *ctx, const gguf_tensor *t, int64_t row0, int64_t n_rows, void *dst,
                           td_err *err)
{
    (void)err;
    int *calls = ctx;
    (*calls)++;
    uint32_t *w = dst;
    for (int64_t r = 0; r < n_rows; r++)
        for (int64_t c = 0; c < t->ne[0]; c++)
            *w++ = (uint32_t)(row0 + r);
    return 0;
}

static int fill_fail(void *ctx, const gguf_tensor *t, void *dst, td_err *err)
{
    (void)ctx;
    (void)dst;
    return td_err_set(err, TD_EIO, "fill failed for '%s'", t->name);
}

static void test_writer_round_trip(void **state)
{
    (void)state;
    char path[512], path2[512];
    tmp_path(path, sizeof(path), "rt.gguf");
    tmp_path(path2, sizeof(path2), "rt2.gguf");
    td_err err;
    td_err_clear(&err);
    gguf_writer *w = gguf_writer_new();
    gguf_writer_set_u32(w, "a.u32", 0xdeadbeef);
    gguf_writer_set_i32(w, "a.i32", -7);
    gguf_writer_set_f32(w, "a.f32", 0.25f);
    gguf_writer_set_bool(w, "a.bool", true);
    gguf_writer_set_str(w, "a.str", "hello");
    gguf_writer_set_str(w, "a.replaced", "first");
    gguf_writer_set_str(w, "a.replaced", "second"); /* replaces, no duplicate key */
    gguf_writer_set_str(w, "a.empty", "");
    gguf_writer_set_u32(w, "general.alignment", 64); /* the writer aligns to 32: overridden */
    uint8_t u8s[3] = {1, 2, 255};
    int8_t i8s[2] = {-1, 5};
    uint16_t u16s[2] = {1, 65535};
    int16_t i16s[2] = {-300, 300};
    uint32_t u32s[2] = {7, 4000000000u};
    int32_t i32s[3] = {-1, 0, 1};
    float f32s[2] = {1.5f, -2.0f};
    uint8_t bools[2] = {1, 0};
    uint64_t u64s[1] = {1ull << 60};
    int64_t i64s[1] = {-(1ll << 60)};
    double f64s[1] = {3.25};
    gguf_writer_set_arr(w, "arr.u8", GGUF_VT_UINT8, u8s, 3);
    gguf_writer_set_arr(w, "arr.i8", GGUF_VT_INT8, i8s, 2);
    gguf_writer_set_arr(w, "arr.u16", GGUF_VT_UINT16, u16s, 2);
    gguf_writer_set_arr(w, "arr.i16", GGUF_VT_INT16, i16s, 2);
    gguf_writer_set_arr(w, "arr.u32", GGUF_VT_UINT32, u32s, 2);
    gguf_writer_set_arr(w, "arr.i32", GGUF_VT_INT32, i32s, 3);
    gguf_writer_set_arr(w, "arr.f32", GGUF_VT_FLOAT32, f32s, 2);
    gguf_writer_set_arr(w, "arr.bool", GGUF_VT_BOOL, bools, 2);
    gguf_writer_set_arr(w, "arr.u64", GGUF_VT_UINT64, u64s, 1);
    gguf_writer_set_arr(w, "arr.i64", GGUF_VT_INT64, i64s, 1);
    gguf_writer_set_arr(w, "arr.f64", GGUF_VT_FLOAT64, f64s, 1);
    gguf_writer_set_arr(w, "arr.empty", GGUF_VT_UINT32, NULL, 0);
    gguf_str strs[3] = {{"x", 1}, {"", 0}, {"a\0b", 3}};
    gguf_writer_set_arr_str(w, "arr.str", strs, 3);

    static const struct {
        const char *name;
        td_type type;
        int n_dims;
        int64_t ne[4];
    } ts[] = {
        {"t.f32", TD_TYPE_F32, 1, {5, 1, 1, 1}},    {"t.f16", TD_TYPE_F16, 2, {8, 3, 1, 1}},
        {"t.bf16", TD_TYPE_BF16, 2, {16, 2, 1, 1}}, {"t.q8_0", TD_TYPE_Q8_0, 2, {64, 2, 1, 1}},
        {"t.q4_0", TD_TYPE_Q4_0, 3, {32, 3, 2, 1}}, {"t.4d", TD_TYPE_F16, 4, {2, 3, 4, 5}},
    };
    for (size_t i = 0; i < sizeof(ts) / sizeof(ts[0]); i++)
        assert_int_equal(gguf_writer_add_tensor(w, ts[i].name, ts[i].type, ts[i].n_dims, ts[i].ne,
                                                fill_pattern, (void *)(uintptr_t)(i + 1), &err),
                         0);
    /* 3000 rows of 4 KiB = 12 MiB: streamed in more than one chunk */
    int calls = 0;
    int64_t big_ne[2] = {1024, 3000};
    assert_int_equal(gguf_writer_add_tensor_rows(w, "t.rows", TD_TYPE_F32, 2, big_ne,
                                                 fill_rows_index, &calls, &err),
                     0);
    /* declaration errors */
    int64_t bad_ne[2] = {33, 2};
    assert_err(
        gguf_writer_add_tensor(w, "t.bad", TD_TYPE_Q8_0, 2, bad_ne, fill_pattern, NULL, &err), err,
        TD_EINVAL, "not a multiple");
    assert_err(gguf_writer_add_tensor(w, "t.f32", TD_TYPE_F32, 1, big_ne, fill_pattern, NULL, &err),
               err, TD_EINVAL, "duplicate tensor 't.f32'");
    assert_err(gguf_writer_add_tensor(w, "t.k", (td_type)12, 1, big_ne, fill_pattern, NULL, &err),
               err, TD_EUNSUPPORTED, "unsupported type 12");

    if (gguf_writer_write(w, path, &err)) fail_msg("%s", err.msg);
    gguf_writer_free(w);
    assert_true(calls >= 2);

    gguf_file *f;
    if (gguf_open(&f, path, &err)) fail_msg("%s", err.msg);
    assert_int_equal(gguf_version(f), 3);
    uint32_t u;
    int64_t i64;
    float fl;
    bool b;
    gguf_str s;
    assert_int_equal(gguf_get_u32(f, "a.u32", &u, &err), 0);
    assert_int_equal(u, 0xdeadbeef);
    assert_int_equal(gguf_get_i64(f, "a.i32", &i64, &err), 0);
    assert_int_equal(i64, -7);
    assert_err(gguf_get_u32(f, "a.i32", &u, &err), err, TD_EFORMAT, "does not fit in u32");
    assert_int_equal(gguf_get_f32(f, "a.f32", &fl, &err), 0);
    assert_true(fl == 0.25f);
    assert_int_equal(gguf_get_bool(f, "a.bool", &b, &err), 0);
    assert_true(b);
    assert_int_equal(gguf_get_str(f, "a.str", &s, &err), 0);
    assert_true(str_eq(s, "hello"));
    assert_int_equal(gguf_get_str(f, "a.replaced", &s, &err), 0);
    assert_true(str_eq(s, "second"));
    assert_int_equal(gguf_get_str(f, "a.empty", &s, &err), 0);
    assert_int_equal(s.len, 0);
    assert_int_equal(gguf_n_kv(f), 21);
    assert_int_equal(gguf_alignment(f), 32);
    assert_int_equal(gguf_get_u32(f, "general.alignment", &u, &err), 0);
    assert_int_equal(u, 32);

    struct {
        const char *key;
        gguf_vtype t;
        const void *data;
        uint64_t n;
        size_t es;
    } arrs[] = {
        {"arr.u8", GGUF_VT_UINT8, u8s, 3, 1},     {"arr.i8", GGUF_VT_INT8, i8s, 2, 1},
        {"arr.u16", GGUF_VT_UINT16, u16s, 2, 2},  {"arr.i16", GGUF_VT_INT16, i16s, 2, 2},
        {"arr.u32", GGUF_VT_UINT32, u32s, 2, 4},  {"arr.i32", GGUF_VT_INT32, i32s, 3, 4},
        {"arr.f32", GGUF_VT_FLOAT32, f32s, 2, 4}, {"arr.bool", GGUF_VT_BOOL, bools, 2, 1},
        {"arr.u64", GGUF_VT_UINT64, u64s, 1, 8},  {"arr.i64", GGUF_VT_INT64, i64s, 1, 8},
        {"arr.f64", GGUF_VT_FLOAT64, f64s, 1, 8},
    };
    for (size_t i = 0; i < sizeof(arrs) / sizeof(arrs[0]); i++) {
        gguf_vtype et;
        uint64_t n;
        assert_int_equal(gguf_get_arr(f, arrs[i].key, &et, &n, &err), 0);
        assert_int_equal(et, arrs[i].t);
        assert_int_equal(n, arrs[i].n);
        const void *d = gguf_get_arr_data(f, arrs[i].key);
        assert_non_null(d);
        assert_int_equal((uintptr_t)d % arrs[i].es, 0);
        assert_memory_equal(d, arrs[i].data, arrs[i].n * arrs[i].es);
    }
    gguf_vtype et;
    uint64_t n;
    assert_int_equal(gguf_get_arr(f, "arr.empty", &et, &n, &err), 0);
    assert_int_equal(n, 0);
    assert_int_equal(gguf_get_arr(f, "arr.str", &et, &n, &err), 0);
    assert_int_equal(et, GGUF_VT_STRING);
    assert_int_equal(n, 3);
    assert_true(str_eq(gguf_get_arr_str(f, "arr.str", 0), "x"));
    assert_int_equal(gguf_get_arr_str(f, "arr.str", 1).len, 0);
    s = gguf_get_arr_str(f, "arr.str", 2);
    assert_int_equal(s.len, 3);
    assert_memory_equal(s.ptr, "a\0b", 3);

    assert_int_equal(gguf_n_tensors(f), 7);
    for (size_t i = 0; i < sizeof(ts) / sizeof(ts[0]); i++) {
        const gguf_tensor *t = gguf_find_tensor(f, ts[i].name);
        assert_non_null(t);
        assert_int_equal(t->type, ts[i].type);
        assert_int_equal(t->n_dims, ts[i].n_dims);
        for (int d = 0; d < 4; d++)
            assert_int_equal(t->ne[d], ts[i].ne[d]);
        assert_int_equal(t->offset % 32, 0);
        uint8_t *want = malloc(t->nbytes);
        fill_pattern((void *)(uintptr_t)(i + 1), t, want, &err);
        assert_memory_equal(t->data, want, t->nbytes);
        free(want);
    }
    const gguf_tensor *t = gguf_find_tensor(f, "t.rows");
    assert_non_null(t);
    assert_int_equal(t->nbytes, 1024 * 3000 * 4);
    for (int64_t r = 0; r < 3000; r += 499) {
        uint32_t v;
        memcpy(&v, (const uint8_t *)t->data + (size_t)r * 4096 + 4092, 4);
        assert_int_equal(v, r);
    }

    /* copy_kv with a prefix, into a second file */
    gguf_writer *w2 = gguf_writer_new();
    assert_int_equal(gguf_writer_copy_kv(w2, f, "arr.", &err), 0);
    if (gguf_writer_write(w2, path2, &err)) fail_msg("%s", err.msg);
    gguf_writer_free(w2);
    gguf_file *f2;
    if (gguf_open(&f2, path2, &err)) fail_msg("%s", err.msg);
    assert_int_equal(gguf_n_kv(f2), 13);
    assert_int_equal(gguf_n_tensors(f2), 0);
    assert_memory_equal(gguf_get_arr_data(f2, "arr.f64"), f64s, 8);
    assert_true(str_eq(gguf_get_arr_str(f2, "arr.str", 0), "x"));
    assert_int_equal(gguf_find_key(f2, "a.u32"), -1);
    gguf_close(f2);
    gguf_close(f);

    /* a failing fill: error passed through, no file left behind */
    w = gguf_writer_new();
    int64_t ne1 = 4;
    assert_int_equal(gguf_writer_add_tensor(w, "x", TD_TYPE_F32, 1, &ne1, fill_fail, NULL, &err),
                     0);
    assert_err(gguf_writer_write(w, path2, &err), err, TD_EIO, "fill failed for 'x'");
    gguf_writer_free(w);
    assert_int_not_equal(access(path2, F_OK), 0);
    w = gguf_writer_new();
    assert_err(gguf_writer_write(w, "/nonexistent-dir/x.gguf", &err), err, TD_EIO, "cannot create");
    gguf_writer_free(w);
    unlink(path);
}

/* A file with nested arrays (legal GGUF, not produced by our writer) and a misaligned
 * numeric array; copy_kv must carry the nested array over byte for byte. */
static void test_nested_and_misaligned(void **state)
{
    (void)state;
    bb b = {0};
    bb_header(&b, 2, 0, 2);
    bb_str(&b, "nested"); /* [[1, 2], [3]] as arrays of u16 */
    bb_u32(&b, GGUF_VT_ARRAY);
    bb_u32(&b, GGUF_VT_ARRAY);
    bb_u64(&b, 2);
    bb_u32(&b, GGUF_VT_UINT16);
    bb_u64(&b, 2);
    uint16_t v[3] = {1, 2, 3};
    bb_put(&b, v, 4);
    bb_u32(&b, GGUF_VT_UINT16);
    bb_u64(&b, 1);
    bb_put(&b, v + 2, 2);
    bb_str(&b, "f"); /* the f32 elements land at an odd offset */
    bb_u32(&b, GGUF_VT_ARRAY);
    bb_u32(&b, GGUF_VT_FLOAT32);
    bb_u64(&b, 2);
    float fv[2] = {1.0f, 2.0f};
    bb_put(&b, fv, 8);

    uint8_t *copy = malloc(b.n);
    memcpy(copy, b.p, b.n);
    gguf_file *f;
    td_err err;
    if (gguf_open_buffer(&f, copy, b.n, &err)) fail_msg("%s", err.msg);
    assert_int_equal(gguf_version(f), 2);
    gguf_vtype et;
    uint64_t n;
    assert_int_equal(gguf_get_arr(f, "nested", &et, &n, &err), 0);
    assert_int_equal(et, GGUF_VT_ARRAY);
    assert_int_equal(n, 2);
    assert_null(gguf_get_arr_data(f, "nested"));
    const float *fp = gguf_get_arr_data(f, "f");
    assert_int_equal((uintptr_t)fp % 4, 0);
    assert_true(fp[0] == 1.0f && fp[1] == 2.0f);

    char path[512];
    tmp_path(path, sizeof(path), "nested.gguf");
    gguf_writer *w = gguf_writer_new();
    assert_int_equal(gguf_writer_copy_kv(w, f, "", &err), 0);
    if (gguf_writer_write(w, path, &err)) fail_msg("%s", err.msg);
    gguf_writer_free(w);
    gguf_file *f2;
    if (gguf_open(&f2, path, &err)) fail_msg("%s", err.msg);
    assert_int_equal(gguf_get_arr(f2, "nested", &et, &n, &err), 0);
    assert_int_equal(et, GGUF_VT_ARRAY);
    assert_int_equal(n, 2);
    gguf_close(f2);
    gguf_close(f);
    unlink(path);
    free(copy);
    free(b.p);
}

/* ---- malformed inputs ------------------------------------------------------- */

/* Every prefix of a valid file either fails cleanly or, once all tensor data is
 * present, parses. */
static void test_every_truncation(void **state)
{
    (void)state;
    char path[512];
    tmp_path(path, sizeof(path), "trunc.gguf");
    td_err err;
    gguf_writer *w = gguf_writer_new();
    gguf_writer_set_str(w, "general.architecture", "llama");
    gguf_writer_set_u32(w, "general.alignment", 32);
    gguf_writer_set_f32(w, "x.f", 1.0f);
    gguf_str strs[2] = {{"ab", 2}, {"cde", 3}};
    gguf_writer_set_arr_str(w, "x.strs", strs, 2);
    int32_t ints[3] = {1, 2, 3};
    gguf_writer_set_arr(w, "x.ints", GGUF_VT_INT32, ints, 3);
    int64_t ne_a[2] = {32, 2}, ne_b[1] = {3};
    assert_int_equal(
        gguf_writer_add_tensor(w, "a", TD_TYPE_Q8_0, 2, ne_a, fill_pattern, NULL, &err), 0);
    assert_int_equal(gguf_writer_add_tensor(w, "b", TD_TYPE_F32, 1, ne_b, fill_pattern, NULL, &err),
                     0);
    if (gguf_writer_write(w, path, &err)) fail_msg("%s", err.msg);
    gguf_writer_free(w);

    size_t size;
    uint8_t *full = read_all(path, &size);
    gguf_file *f;
    assert_int_equal(gguf_open_buffer(&f, full, size, &err), 0);
    const gguf_tensor *tb = gguf_find_tensor(f, "b");
    size_t data_end = (size_t)((const uint8_t *)tb->data - full) + tb->nbytes;
    gguf_close(f);

    for (size_t len = 0; len < size; len++) {
        uint8_t *p = malloc(len ? len : 1);
        memcpy(p, full, len);
        td_err_clear(&err);
        int rc = gguf_open_buffer(&f, p, len, &err);
        if (len >= data_end) {
            if (rc) fail_msg("len %zu: %s", len, err.msg);
            gguf_close(f);
        } else {
            if (rc != TD_EFORMAT) fail_msg("len %zu: rc %d '%s'", len, rc, err.msg);
            if (!strstr(err.msg, "truncated file") && !strstr(err.msg, "outside the file") &&
                !strstr(err.msg, "implausible"))
                fail_msg("len %zu: unexpected message '%s'", len, err.msg);
        }
        free(p);
    }
    /* one message in full, to pin its format */
    uint8_t *p = malloc(100);
    memcpy(p, full, 100);
    assert_err(gguf_open_buffer(&f, p, 100, &err), err, TD_EFORMAT,
               "gguf: truncated file: value of key 1 ('general.alignment') needs 4 bytes at "
               "offset 98, file has 100");
    free(p);

    /* the mmap path names the file */
    FILE *fp = fopen(path, "wb");
    fwrite(full, 1, 100, fp);
    fclose(fp);
    assert_err(gguf_open(&f, path, &err), err, TD_EFORMAT, "truncated file");
    assert_true(strstr(err.msg, path) != NULL);
    free(full);
    unlink(path);
    assert_err(gguf_open(&f, path, &err), err, TD_EIO, "cannot open");
}

static void test_bad_headers(void **state)
{
    (void)state;
    td_err err;
    bb b = {0};
    bb_put(&b, "GGML", 4);
    bb_u32(&b, 3);
    bb_u64(&b, 0);
    bb_u64(&b, 0);
    assert_err(parse_bb(&b, &err), err, TD_EFORMAT, "bad magic");
    b.n = 0;
    bb_header(&b, 1, 0, 0);
    assert_err(parse_bb(&b, &err), err, TD_EUNSUPPORTED, "version 1 is not supported");
    b.n = 0;
    bb_header(&b, 4, 0, 0);
    assert_err(parse_bb(&b, &err), err, TD_EUNSUPPORTED, "unknown version 4");
    b.n = 0;
    bb_header(&b, 3, 0, 0); /* an empty v3 file is valid */
    assert_int_equal(parse_bb(&b, &err), 0);
    b.n = 0;
    bb_header(&b, 3, 0, 1ull << 40);
    assert_err(parse_bb(&b, &err), err, TD_EFORMAT, "implausible key count");
    b.n = 0;
    bb_header(&b, 3, ~0ull, 0);
    assert_err(parse_bb(&b, &err), err, TD_EFORMAT, "implausible tensor count");
    free(b.p);
}

static void test_bad_kvs(void **state)
{
    (void)state;
    td_err err;
    bb b = {0};
    /* string length beyond the file */
    bb_header(&b, 3, 0, 1);
    bb_u64(&b, 1ull << 62);
    bb_put(&b, "abcdefghijklmnop", 16);
    assert_err(parse_bb(&b, &err), err, TD_EFORMAT, "truncated file: key 0 needs");
    /* array count whose byte size overflows */
    b.n = 0;
    bb_header(&b, 3, 0, 1);
    bb_str(&b, "arr");
    bb_u32(&b, GGUF_VT_ARRAY);
    bb_u32(&b, GGUF_VT_UINT64);
    bb_u64(&b, (1ull << 61) + 1);
    bb_put(&b, "abcdefghijklmnop", 16);
    assert_err(parse_bb(&b, &err), err, TD_EFORMAT, "value of key 0 ('arr') needs");
    /* too many strings */
    b.n = 0;
    bb_header(&b, 3, 0, 1);
    bb_str(&b, "arr");
    bb_u32(&b, GGUF_VT_ARRAY);
    bb_u32(&b, GGUF_VT_STRING);
    bb_u64(&b, 1000);
    bb_put(&b, "abcdefghijklmnop", 16);
    assert_err(parse_bb(&b, &err), err, TD_EFORMAT, "declares 1000 strings");
    /* nesting deeper than allowed */
    b.n = 0;
    bb_header(&b, 3, 0, 1);
    bb_str(&b, "deep");
    bb_u32(&b, GGUF_VT_ARRAY);
    for (int i = 0; i < 6; i++) {
        bb_u32(&b, GGUF_VT_ARRAY);
        bb_u64(&b, 1);
    }
    bb_u32(&b, GGUF_VT_UINT8);
    bb_u64(&b, 0);
    assert_err(parse_bb(&b, &err), err, TD_EFORMAT, "nested deeper");
    /* unknown value type */
    b.n = 0;
    bb_header(&b, 3, 0, 1);
    bb_str(&b, "k");
    bb_u32(&b, 13);
    bb_u64(&b, 0);
    assert_err(parse_bb(&b, &err), err, TD_EFORMAT, "key 'k' has unknown value type 13");
    /* unknown array element type */
    b.n = 0;
    bb_header(&b, 3, 0, 1);
    bb_str(&b, "k");
    bb_u32(&b, GGUF_VT_ARRAY);
    bb_u32(&b, 99);
    bb_u64(&b, 0);
    assert_err(parse_bb(&b, &err), err, TD_EFORMAT, "unknown element type 99");
    /* duplicate key */
    b.n = 0;
    bb_header(&b, 3, 0, 2);
    bb_kv_str(&b, "a", "1");
    bb_kv_str(&b, "a", "2");
    assert_err(parse_bb(&b, &err), err, TD_EFORMAT, "duplicate key 'a'");
    /* empty key */
    b.n = 0;
    bb_header(&b, 3, 0, 1);
    bb_kv_str(&b, "", "1");
    assert_err(parse_bb(&b, &err), err, TD_EFORMAT, "empty name");
    /* alignment: not a power of two, wrong type */
    b.n = 0;
    bb_header(&b, 3, 0, 1);
    bb_str(&b, "general.alignment");
    bb_u32(&b, GGUF_VT_UINT32);
    bb_u32(&b, 48);
    assert_err(parse_bb(&b, &err), err, TD_EFORMAT, "alignment is 48, expected a power of two");
    b.n = 0;
    bb_header(&b, 3, 0, 1);
    bb_str(&b, "general.alignment");
    bb_u32(&b, GGUF_VT_UINT64);
    bb_u64(&b, 64);
    assert_err(parse_bb(&b, &err), err, TD_EFORMAT, "'general.alignment' has type u64");
    free(b.p);
}

static void test_bad_tensors(void **state)
{
    (void)state;
    td_err err;
    uint64_t ne8[1] = {8};
    assert_int_equal(one_tensor(TD_TYPE_F32, 1, ne8, 0, 32, &err), 0);
    assert_err(one_tensor(TD_TYPE_F32, 1, ne8, 0, 31, &err), err, TD_EFORMAT,
               "tensor 'blk.0.attn_q.weight' data (offset 0, 32 bytes) lies outside the file");
    assert_err(one_tensor(TD_TYPE_F32, 1, ne8, 64, 64, &err), err, TD_EFORMAT, "outside the file");
    assert_err(one_tensor(TD_TYPE_F32, 1, ne8, ~0ull - 31, 64, &err), err, TD_EFORMAT,
               "outside the file");
    assert_err(one_tensor(TD_TYPE_F32, 1, ne8, 4, 64, &err), err, TD_EFORMAT,
               "offset 4, not a multiple of the alignment 32");
    assert_err(one_tensor(12, 1, ne8, 0, 64, &err), err, TD_EUNSUPPORTED,
               "tensor 'blk.0.attn_q.weight' has unsupported type 12 (q4_K)");
    assert_err(one_tensor(200, 1, ne8, 0, 64, &err), err, TD_EUNSUPPORTED, "unsupported type 200");
    uint64_t ne33[1] = {33};
    assert_err(one_tensor(TD_TYPE_Q8_0, 1, ne33, 0, 64, &err), err, TD_EFORMAT,
               "row length 33 is not a multiple of the q8_0 block size 32");
    uint64_t ne5[5] = {1, 1, 1, 1, 1};
    assert_err(one_tensor(TD_TYPE_F32, 5, ne5, 0, 64, &err), err, TD_EFORMAT, "has 5 dimensions");
    assert_err(one_tensor(TD_TYPE_F32, 0, ne5, 0, 64, &err), err, TD_EFORMAT, "has 0 dimensions");
    uint64_t ne_big[2] = {1ull << 40, 1ull << 40};
    assert_err(one_tensor(TD_TYPE_F32, 2, ne_big, 0, 64, &err), err, TD_EFORMAT, "invalid shape");
    uint64_t ne_zero[2] = {8, 0};
    assert_err(one_tensor(TD_TYPE_F32, 2, ne_zero, 0, 64, &err), err, TD_EFORMAT, "invalid shape");
    uint64_t ne_huge[2] = {1ull << 32, 1ull << 29}; /* fits int64, byte size overflows */
    assert_err(one_tensor(TD_TYPE_F32, 2, ne_huge, 0, 64, &err), err, TD_EFORMAT,
               "outside the file");

    /* duplicate tensor names, bad names */
    bb b = {0};
    bb_header(&b, 3, 2, 0);
    bb_tensor(&b, "t", 1, ne8, TD_TYPE_F32, 0);
    bb_tensor(&b, "t", 1, ne8, TD_TYPE_F32, 32);
    bb_pad(&b, 32);
    for (int i = 0; i < 64; i++)
        bb_put(&b, "", 1);
    assert_err(parse_bb(&b, &err), err, TD_EFORMAT, "duplicate tensor 't'");
    b.n = 0;
    bb_header(&b, 3, 1, 0);
    bb_tensor(&b, "", 1, ne8, TD_TYPE_F32, 0);
    bb_pad(&b, 32);
    for (int i = 0; i < 32; i++)
        bb_put(&b, "", 1);
    assert_err(parse_bb(&b, &err), err, TD_EFORMAT, "invalid name");
    /* two tensors whose data overlap */
    b.n = 0;
    bb_header(&b, 3, 2, 0);
    bb_tensor(&b, "a", 1, ne8, TD_TYPE_F32, 0);
    bb_tensor(&b, "b", 1, ne8, TD_TYPE_F32, 0);
    bb_pad(&b, 32);
    for (int i = 0; i < 64; i++)
        bb_put(&b, "", 1);
    assert_err(parse_bb(&b, &err), err, TD_EFORMAT, "the data of tensors 'a' and 'b' overlap");
    /* alignment 1 lets a tensor start anywhere: f32 data off a 4-byte boundary is refused */
    b.n = 0;
    bb_header(&b, 3, 1, 1);
    bb_str(&b, "general.alignment");
    bb_u32(&b, GGUF_VT_UINT32);
    bb_u32(&b, 1);
    bb_tensor(&b, "a", 1, ne8, TD_TYPE_F32, 0);
    assert_true(b.n % 4 != 0); /* the data section starts right here, off a 4-byte boundary */
    for (int i = 0; i < 64; i++)
        bb_put(&b, "", 1);
    assert_err(parse_bb(&b, &err), err, TD_EFORMAT, "not a multiple of 4");
    /* a truncated tensor info, with the full message */
    b.n = 0;
    bb_header(&b, 3, 1, 0);
    bb_str(&b, "blk.0.attn_q.weight");
    bb_u32(&b, 2);
    bb_u64(&b, 8);
    assert_err(parse_bb(&b, &err), err, TD_EFORMAT,
               "truncated file: tensor info 0 ('blk.0.attn_q.weight') needs 8 bytes at offset 63, "
               "file has 63");
    free(b.p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stories260k),           cmocka_unit_test(test_tiny_random),
        cmocka_unit_test(test_shared_vocabs),         cmocka_unit_test(test_writer_round_trip),
        cmocka_unit_test(test_nested_and_misaligned), cmocka_unit_test(test_every_truncation),
        cmocka_unit_test(test_bad_headers),           cmocka_unit_test(test_bad_kvs),
        cmocka_unit_test(test_bad_tensors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
