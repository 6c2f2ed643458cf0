/*
 * libFuzzer target for the GGUF reader and the model loader: parse the input as a
 * GGUF file, touch every key through every getter and every tensor's data, copy
 * the keys into a writer, then try to build a model over it. Any crash, ASan or
 * UBSan report is a bug: a hostile file must only ever produce an error.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "model/gguf.h"
#include "model/model.h"

/* Keep the compiler from dropping reads whose values are unused. */
static volatile uint64_t sink;

static void touch_bytes(const void *p, size_t n)
{
    const uint8_t *b = p;
    uint64_t h = 0;
    for (size_t i = 0; i < n; i++)
        h = h * 31 + b[i];
    sink += h;
}

static void touch_key(const gguf_file *f, int64_t i)
{
    gguf_str name = gguf_key_name(f, i);
    char key[256];
    if (name.len >= sizeof(key) || memchr(name.ptr, 0, name.len)) return;
    memcpy(key, name.ptr, name.len);
    key[name.len] = 0;
    if (gguf_find_key(f, key) != i) abort(); /* the index must find every key */

    td_err err;
    uint32_t u32;
    int64_t i64;
    float f32;
    bool b;
    gguf_str s;
    if (gguf_get_u32(f, key, &u32, &err) == 0) sink += u32;
    if (gguf_get_i64(f, key, &i64, &err) == 0) sink += (uint64_t)i64;
    if (gguf_get_f32(f, key, &f32, &err) == 0) sink += (uint64_t)(f32 == f32);
    if (gguf_get_bool(f, key, &b, &err) == 0) sink += b;
    if (gguf_get_str(f, key, &s, &err) == 0) touch_bytes(s.ptr, s.len);
    gguf_vtype et;
    uint64_t n;
    if (gguf_get_arr(f, key, &et, &n, &err) == 0) {
        const void *data = gguf_get_arr_data(f, key);
        static const size_t sizes[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
        if (data && (unsigned)et < 13) touch_bytes(data, n * sizes[et]);
        if (et == GGUF_VT_STRING)
            for (uint64_t k = 0; k <= n; k++) { /* one past the end: must give "" */
                gguf_str e = gguf_get_arr_str(f, key, k);
                touch_bytes(e.ptr, e.len);
            }
    }
    sink += (uint64_t)gguf_kv_type(f, i);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    gguf_file *f;
    td_err err;
    if (gguf_open_buffer(&f, data, size, &err) != 0) return 0;

    sink += gguf_version(f) + gguf_alignment(f);
    for (int64_t i = 0; i < gguf_n_kv(f); i++)
        touch_key(f, i);
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        if (gguf_find_tensor(f, t->name) != t) abort();
        if (t->nbytes) {
            touch_bytes(t->data, 1);
            touch_bytes((const uint8_t *)t->data + t->nbytes - 1, 1);
        }
    }
    gguf_key_name(f, -1);
    gguf_tensor_at(f, gguf_n_tensors(f));

    gguf_writer *w = gguf_writer_new();
    gguf_writer_copy_kv(w, f, "", &err);
    gguf_writer_free(w);

    /* The loader's shape checks must hold up too; on success the model owns f. */
    td_model *m;
    if (td_model_from_gguf(&m, f, &err) == 0) {
        char desc[512];
        td_model_describe(m, desc, sizeof(desc));
        td_model_free(m);
    } else {
        gguf_close(f);
    }
    return 0;
}
