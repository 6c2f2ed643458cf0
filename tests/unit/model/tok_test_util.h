/* Helpers shared by the tokenizer tests: finding ../shared and loading vocabularies. */
#ifndef TD_TESTS_TOK_TEST_UTIL_H
#define TD_TESTS_TOK_TEST_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/gguf.h"
#include "model/tok.h"

/* The shared data folder, from TD_SHARED_DIR (ctest sets it). */
static inline const char *shared_dir(void)
{
    const char *d = getenv("TD_SHARED_DIR");
    if (!d || !*d) {
        fprintf(stderr, "tokenizer tests: set TD_SHARED_DIR to the shared data folder "
                        "(the one holding tokenizer/ and models/)\n");
        fail_msg("TD_SHARED_DIR is not set");
    }
    return d;
}

/* Read a whole file; *len gets its size. Fails the test when it cannot. */
static inline char *read_file_or_fail(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("cannot open %s (is TD_SHARED_DIR right?)", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    buf[n] = '\0';
    *len = (size_t)n;
    return buf;
}

typedef struct loaded_tok {
    gguf_file *file;
    td_tokenizer *tok;
} loaded_tok;

/* Load shared/<rel> (a GGUF file) and its tokenizer. */
static inline loaded_tok load_tok(const char *rel)
{
    char path[1024];
    snprintf(path, sizeof(path), "%s/%s", shared_dir(), rel);
    loaded_tok lt = {0};
    td_err err;
    td_err_clear(&err);
    int rc = gguf_open(&lt.file, path, &err);
    if (rc) fail_msg("gguf_open(%s): %s", path, err.msg);
    rc = tok_load(&lt.tok, lt.file, &err);
    if (rc) fail_msg("tok_load(%s): %s", path, err.msg);
    return lt;
}

static inline void unload_tok(loaded_tok *lt)
{
    tok_free(lt->tok);
    gguf_close(lt->file);
}

/* Encode into a fresh array (caller frees); *n gets the count. */
static inline int32_t *encode_alloc(const td_tokenizer *t, const char *text, size_t len,
                                    bool add_special, bool parse_special, int *n)
{
    td_err err;
    td_err_clear(&err);
    int cap = (int)len + 8;
    int32_t *ids = malloc((size_t)cap * sizeof(int32_t));
    assert_non_null(ids);
    int rc = tok_encode(t, text, len, add_special, parse_special, ids, cap, &err);
    if (rc < 0) fail_msg("tok_encode failed: %s", err.msg);
    assert_true(rc <= cap);
    *n = rc;
    return ids;
}

/* Decode into a fresh NUL-terminated string (caller frees). */
static inline char *decode_alloc(const td_tokenizer *t, const int32_t *ids, int n,
                                 bool skip_special, int *len)
{
    int need = tok_decode(t, ids, n, skip_special, NULL, 0);
    assert_true(need >= 0);
    char *buf = malloc((size_t)need + 1);
    assert_non_null(buf);
    assert_int_equal(tok_decode(t, ids, n, skip_special, buf, need + 1), need);
    assert_int_equal(buf[need], '\0');
    *len = need;
    return buf;
}

/* Stream ids through a tok_stream (and flush); caller frees. */
static inline char *stream_alloc(const td_tokenizer *t, const int32_t *ids, int n,
                                 bool skip_special, int *len)
{
    size_t cap = 64, w = 0;
    char *buf = malloc(cap);
    assert_non_null(buf);
    tok_stream s;
    tok_stream_init(&s, t, skip_special);
    char tmp[2048];
    for (int i = 0; i <= n; i++) {
        int k = i < n ? tok_stream_push(&s, ids[i], tmp, (int)sizeof(tmp))
                      : tok_stream_flush(&s, tmp, (int)sizeof(tmp));
        assert_true(k >= 0);
        if (w + (size_t)k + 1 > cap) {
            cap = (w + (size_t)k + 1) * 2;
            buf = realloc(buf, cap);
            assert_non_null(buf);
        }
        memcpy(buf + w, tmp, (size_t)k);
        w += (size_t)k;
    }
    buf[w] = '\0';
    *len = (int)w;
    return buf;
}

#endif
