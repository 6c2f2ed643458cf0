/*
 * Unit tests for the tokenizer's edges: invalid UTF-8 input, the streaming
 * detokenizer (characters split across byte tokens, U+FFFD for bytes that can
 * never be valid), the llama3 and qwen2 pre-tokenizers, load-time validation,
 * and random inputs (no crash, lossless round trips, stream == decode).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <unistd.h>

#include "model/tok_impl.h"
#include "unit/model/tok_test_util.h"

#define FFFD "\xef\xbf\xbd"

static bool tok__is_spm(const td_tokenizer *t)
{
    return t->kind == TOK_KIND_SPM;
}

static void test_invalid_utf8(void **state)
{
    (void)state;
    loaded_tok lt = load_tok("tokenizer/ggml-vocab-llama-spm.gguf");
    loaded_tok g2 = load_tok("tokenizer/ggml-vocab-gpt-2.gguf");
    static const struct {
        const char *text;
        size_t len;
        size_t offset;
    } cases[] = {
        {"\xff", 1, 0},             /* never valid */
        {"ab\xff", 3, 2},           /* the offset names the byte */
        {"x\xf0\x9f\xa6", 4, 1},    /* truncated 4-byte sequence */
        {"\xc0\xaf", 2, 0},         /* overlong '/' */
        {"ok\xe0\x80\xaf", 5, 2},   /* overlong, 3 bytes */
        {"\xed\xa0\x80", 3, 0},     /* UTF-16 surrogate U+D800 */
        {"\xf4\x90\x80\x80", 4, 0}, /* above U+10FFFF */
        {"a\x80", 2, 1},            /* lone continuation byte */
        {"\xe2\x82 ", 3, 0},        /* bad continuation */
    };
    int32_t ids[16];
    for (size_t i = 0; i < TD_ARRAY_LEN(cases); i++) {
        const td_tokenizer *toks[2] = {lt.tok, g2.tok};
        for (int k = 0; k < 2; k++) {
            td_err err;
            td_err_clear(&err);
            int rc = tok_encode(toks[k], cases[i].text, cases[i].len, true, true, ids, 16, &err);
            assert_int_equal(rc, TD_EINVAL);
            assert_int_equal(err.code, TD_EINVAL);
            char want[64];
            snprintf(want, sizeof(want), "byte offset %zu", cases[i].offset);
            if (!strstr(err.msg, want)) fail_msg("message '%s' lacks '%s'", err.msg, want);
            assert_int_equal(tok_utf8_valid_prefix(cases[i].text, cases[i].len), cases[i].offset);
        }
    }
    /* Valid edge cases pass: U+0000, U+007F, U+0080, U+07FF, U+FFFF, U+10FFFF. */
    const char ok[] = "\x00\x7f\xc2\x80\xdf\xbf\xef\xbf\xbf\xf4\x8f\xbf\xbf";
    assert_int_equal(tok_utf8_valid_prefix(ok, sizeof(ok) - 1), sizeof(ok) - 1);
    assert_true(tok_encode(lt.tok, ok, sizeof(ok) - 1, false, false, ids, 16, NULL) > 0);
    /* Bad arguments. */
    assert_int_equal(tok_encode(lt.tok, NULL, 3, false, false, ids, 16, NULL), TD_EINVAL);
    assert_int_equal(tok_encode(lt.tok, "abc", 3, false, false, NULL, 16, NULL), TD_EINVAL);
    /* A small buffer: the count is still returned, only cap ids are written. */
    int n = tok_encode(lt.tok, "Hello world again", 17, true, false, ids, 2, NULL);
    assert_true(n > 2);
    assert_int_equal(ids[0], 1);
    unload_tok(&g2);
    unload_tok(&lt);
}

/* Push ids one by one, checking each chunk; `want` lists the expected chunks. */
static void expect_stream(const td_tokenizer *t, const int32_t *ids, int n, const char *const *want,
                          const char *want_flush)
{
    tok_stream s;
    tok_stream_init(&s, t, true);
    char out[1024];
    for (int i = 0; i < n; i++) {
        int k = tok_stream_push(&s, ids[i], out, (int)sizeof(out));
        assert_true(k >= 0);
        assert_int_equal((size_t)k, strlen(want[i]));
        assert_memory_equal(out, want[i], (size_t)k);
        /* Nothing emitted is ever part of a character. */
        assert_int_equal(tok_utf8_valid_prefix(out, (size_t)k), (size_t)k);
    }
    int k = tok_stream_flush(&s, out, (int)sizeof(out));
    assert_int_equal((size_t)k, strlen(want_flush));
    assert_memory_equal(out, want_flush, (size_t)k);
    assert_int_equal(tok_stream_flush(&s, out, (int)sizeof(out)), 0);
}

static int32_t byte_tok(const td_tokenizer *t, unsigned b)
{
    char name[8];
    snprintf(name, sizeof(name), "<0x%02X>", b);
    int32_t id = tok_find(t, name, 6);
    assert_true(id >= 0);
    return id;
}

static void test_stream(void **state)
{
    (void)state;
    loaded_tok lt = load_tok("tokenizer/ggml-vocab-llama-spm.gguf");
    const td_tokenizer *t = lt.tok;

    /* The byte fallback of U+1F999 (llama, not in the vocabulary) is 4 byte tokens. */
    int n;
    int32_t *ids = encode_alloc(t, "\xf0\x9f\xa6\x99", 4, false, false, &n);
    assert_int_equal(n, 5); /* "▁" then 4 bytes */
    assert_int_equal(ids[1], byte_tok(t, 0xF0));
    free(ids);
    {
        int32_t seq[] = {byte_tok(t, 0xF0), byte_tok(t, 0x9F), byte_tok(t, 0xA6),
                         byte_tok(t, 0x99)};
        const char *want[] = {"", "", "", "\xf0\x9f\xa6\x99"};
        expect_stream(t, seq, 4, want, "");
    }
    /* A character completed by the next normal token's bytes is not possible, but a
     * broken one followed by text gives U+FFFD and then the text. */
    {
        int32_t hello = tok_find(t, "\xe2\x96\x81Hello", 8);
        int32_t seq[] = {byte_tok(t, 0xE2), hello, byte_tok(t, 0x41)};
        const char *want[] = {"", FFFD " Hello", "A"};
        expect_stream(t, seq, 3, want, "");
    }
    /* Bytes that can never be valid: each maximal bad subpart is one U+FFFD. */
    {
        int32_t seq[] = {byte_tok(t, 0xFF), byte_tok(t, 0x80), byte_tok(t, 0xC0),
                         byte_tok(t, 0x80)};
        const char *want[] = {FFFD, FFFD, FFFD, FFFD};
        expect_stream(t, seq, 4, want, "");
    }
    {
        int32_t seq[] = {byte_tok(t, 0xED), byte_tok(t, 0xA0), byte_tok(t, 0x80)};
        const char *want[] = {"", FFFD FFFD, FFFD}; /* surrogate: ED then A0, 80 */
        expect_stream(t, seq, 3, want, "");
    }
    {
        int32_t seq[] = {byte_tok(t, 0xF0), byte_tok(t, 0x9F), byte_tok(t, 0x41)};
        const char *want[] = {"", "", FFFD "A"};
        expect_stream(t, seq, 3, want, "");
    }
    {
        /* Unfinished at the end: flushed as one U+FFFD. */
        int32_t seq[] = {byte_tok(t, 0x41), byte_tok(t, 0xE2), byte_tok(t, 0x82)};
        const char *want[] = {"A", "", ""};
        expect_stream(t, seq, 3, want, FFFD);
    }
    /* A buffer too small is an error and consumes nothing. */
    {
        tok_stream s;
        tok_stream_init(&s, t, true);
        char out[16];
        assert_int_equal(tok_stream_push(&s, byte_tok(t, 0xF0), out, 0), 0);
        assert_int_equal(tok_stream_push(&s, byte_tok(t, 0x9F), out, 0), 0);
        assert_int_equal(tok_stream_push(&s, byte_tok(t, 0xA6), out, 0), 0);
        assert_int_equal(tok_stream_push(&s, byte_tok(t, 0x99), out, 3), TD_ERANGE);
        assert_int_equal(tok_stream_push(&s, byte_tok(t, 0x99), out, 16), 4);
        assert_memory_equal(out, "\xf0\x9f\xa6\x99", 4);
        assert_int_equal(tok_stream_push(&s, 32000, out, 16), TD_ERANGE);
        assert_int_equal(tok_stream_push(&s, -5, out, 16), TD_ERANGE);
    }
    /* The space prefix: dropped after a leading BOS, kept in a continuation. */
    {
        int32_t hello = tok_find(t, "\xe2\x96\x81Hello", 8);
        int32_t seq[] = {1, hello, hello};
        const char *want[] = {"", "Hello", " Hello"};
        expect_stream(t, seq, 3, want, "");
        const char *want2[] = {" Hello", " Hello"};
        expect_stream(t, seq + 1, 2, want2, "");
        int dl;
        char *dec = decode_alloc(t, seq, 3, true, &dl);
        assert_string_equal(dec, "Hello Hello");
        free(dec);
        dec = decode_alloc(t, seq + 1, 2, true, &dl);
        assert_string_equal(dec, " Hello Hello");
        free(dec);
        dec = decode_alloc(t, seq, 3, false, &dl);
        assert_string_equal(dec, "<s>Hello Hello");
        free(dec);
        assert_int_equal(tok_decode(t, (int32_t[]){1, 40000}, 2, true, NULL, 0), TD_ERANGE);
        /* Truncated decode: returns the full length, writes what fits. */
        char small[4];
        assert_int_equal(tok_decode(t, seq, 3, true, small, (int)sizeof(small)), 11);
        assert_memory_equal(small, "Hell", 4);
    }
    unload_tok(&lt);
}

/* Random id sequences: the stream equals decode when decode is valid UTF-8, and is
 * always valid UTF-8 itself. */
static void test_stream_random(void **state)
{
    (void)state;
    const char *vocabs[] = {"tokenizer/ggml-vocab-llama-spm.gguf",
                            "tokenizer/ggml-vocab-gpt-2.gguf"};
    td_rng rng;
    td_rng_seed(&rng, 42);
    for (int v = 0; v < 2; v++) {
        loaded_tok lt = load_tok(vocabs[v]);
        int n_vocab = tok_n_vocab(lt.tok);
        int n_valid = 0;
        for (int it = 0; it < 400; it++) {
            int32_t ids[24];
            int n = 1 + (int)(td_rng_next(&rng) % 24);
            for (int i = 0; i < n; i++) {
                /* Favour byte tokens, where characters get split. */
                uint64_t r = td_rng_next(&rng);
                ids[i] = (r & 1)
                             ? (v == 0 ? 3 + (int32_t)((r >> 8) % 256) : (int32_t)((r >> 8) % 256))
                             : (int32_t)((r >> 8) % (uint64_t)n_vocab);
            }
            bool skip = (td_rng_next(&rng) & 1) != 0;
            int dl, sl;
            char *dec = decode_alloc(lt.tok, ids, n, skip, &dl);
            char *str = stream_alloc(lt.tok, ids, n, skip, &sl);
            assert_int_equal(tok_utf8_valid_prefix(str, (size_t)sl), (size_t)sl);
            if (tok_utf8_valid_prefix(dec, (size_t)dl) == (size_t)dl) {
                n_valid++;
                assert_int_equal(dl, sl);
                assert_memory_equal(dec, str, (size_t)dl);
            }
            free(dec);
            free(str);
        }
        assert_true(n_valid > 20);
        unload_tok(&lt);
    }
}

/* Random text: no crash, and valid UTF-8 round-trips exactly. */
static void test_encode_random(void **state)
{
    (void)state;
    const char *vocabs[] = {
        "tokenizer/ggml-vocab-llama-spm.gguf", "tokenizer/ggml-vocab-gpt-2.gguf",
        "tokenizer/ggml-vocab-deepseek-llm.gguf", "tokenizer/ggml-vocab-falcon.gguf"};
    static const uint32_t pool[] = {' ',     '\n',   '\t',   'a',    'Z',      '0',  '9',    '\'',
                                    's',     '<',    '>',    '|',    0xA0,     0xE9, 0x3000, 0x4E2D,
                                    0x1F999, 0x200D, 0x0301, 0xFFFD, 0x10FFFF, 0x85, 0x2581, 0};
    td_rng rng;
    td_rng_seed(&rng, 7);
    char text[512];
    for (size_t v = 0; v < TD_ARRAY_LEN(vocabs); v++) {
        loaded_tok lt = load_tok(vocabs[v]);
        for (int it = 0; it < 300; it++) {
            size_t len = 0;
            int n_chars = (int)(td_rng_next(&rng) % 60);
            for (int i = 0; i < n_chars; i++) {
                uint64_t r = td_rng_next(&rng);
                uint32_t cp =
                    (r & 3) ? pool[(r >> 8) % TD_ARRAY_LEN(pool)] : (uint32_t)((r >> 8) % 0x30000);
                if (cp >= 0xD800 && cp <= 0xDFFF) cp = 'x';
                /* SentencePiece spells spaces U+2581, so a literal one decodes as a space. */
                if (cp == 0x2581 && tok__is_spm(lt.tok)) cp = 'y';
                len += (size_t)tok__utf8_put(cp, text + len);
            }
            /* Without special parsing every text round-trips; with it, a special token's
             * text comes back too, except that SentencePiece puts its space prefix after
             * each special token (as llama.cpp does), so check that only for BPE. */
            bool parse = (td_rng_next(&rng) & 1) != 0 && !tok__is_spm(lt.tok);
            int n;
            int32_t *ids = encode_alloc(lt.tok, text, len, true, parse, &n);
            int skip = tok_add_bos(lt.tok) ? 1 : 0; /* the added BOS */
            int dl;
            char *dec =
                decode_alloc(lt.tok, ids + (parse ? skip : 0), n - (parse ? skip : 0), !parse, &dl);
            if ((size_t)dl != len || memcmp(dec, text, len) != 0)
                fail_msg("%s: round trip of '%.*s' gave '%s'", vocabs[v], (int)len, text, dec);
            free(dec);
            free(ids);
            /* And raw bytes never crash. */
            for (size_t i = 0; i < 40; i++)
                text[i] = (char)td_rng_next(&rng);
            int32_t out[64];
            int rc = tok_encode(lt.tok, text, 40, true, true, out, 64, NULL);
            assert_true(rc == TD_EINVAL || rc >= 0);
        }
        unload_tok(&lt);
    }
}

/* ---- tokenizers built from scratch: pre-tokenizers and validation ------------------ */

typedef struct kv_spec {
    const char *model; /* tokenizer.ggml.model, or NULL to leave it out */
    const char *pre;   /* tokenizer.ggml.pre, or NULL */
    int n_tokens;      /* 0: no token list */
    bool merges;       /* gpt2: write a few merges */
    int64_t bos;       /* -2: leave out */
    int n_scores;      /* -1: no scores */
    bool bad_byte_token;
} kv_spec;

static bool g_long_token; /* build_tok: token 200 (llama) is 1,025 bytes of text */

/* A 256-token vocabulary: for gpt2 the byte characters, for llama <0xNN> byte tokens. */
static int build_tok(const kv_spec *spec, td_tokenizer **out, td_err *err)
{
    gguf_writer *w = gguf_writer_new();
    if (spec->model) gguf_writer_set_str(w, "tokenizer.ggml.model", spec->model);
    if (spec->pre) gguf_writer_set_str(w, "tokenizer.ggml.pre", spec->pre);
    char(*names)[8] = calloc(300, 8);
    gguf_str strs[300];
    bool gpt2 = spec->model && strcmp(spec->model, "gpt2") == 0;
    for (int i = 0; i < spec->n_tokens; i++) {
        if (gpt2) {
            /* bytes_to_unicode, written out here independently of the code under test */
            unsigned cp =
                (i >= 0x21 && i <= 0x7E) || (i >= 0xA1 && i <= 0xAC) || i >= 0xAE ? (unsigned)i : 0;
            if (!cp) {
                int k = 0;
                for (int b = 0; b < i; b++)
                    if (!((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE)) k++;
                cp = 256u + (unsigned)k;
            }
            strs[i].len = (uint64_t)tok__utf8_put(cp, names[i]);
        } else {
            snprintf(names[i], 8, "<0x%02X>", i);
            if (spec->bad_byte_token && i == 7) memcpy(names[i], "<0xZZ>", 6);
            strs[i].len = 6;
        }
        strs[i].ptr = names[i];
    }
    static char long_text[1025];
    if (g_long_token && !gpt2 && spec->n_tokens > 200) {
        memset(long_text, 'x', sizeof(long_text));
        strs[200] = (gguf_str){long_text, sizeof(long_text)};
    }
    if (spec->n_tokens)
        gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", strs, (uint64_t)spec->n_tokens);
    if (!gpt2 && spec->n_tokens) {
        int32_t types[300];
        for (int i = 0; i < spec->n_tokens; i++)
            types[i] = g_long_token && i == 200 ? 1 : 6; /* byte tokens; the long one normal */
        gguf_writer_set_arr(w, "tokenizer.ggml.token_type", GGUF_VT_INT32, types,
                            (uint64_t)spec->n_tokens);
    }
    if (spec->n_scores >= 0) {
        float scores[300] = {0};
        gguf_writer_set_arr(w, "tokenizer.ggml.scores", GGUF_VT_FLOAT32, scores,
                            (uint64_t)spec->n_scores);
    }
    if (spec->merges) {
        gguf_str m[2] = {{"\xc4\xa0 t", 4}, {"h e", 3}};
        gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", m, 2);
    }
    if (spec->bos != -2) gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)spec->bos);
    char path[] = "/tmp/tandem_tok_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    int rc = gguf_writer_write(w, path, err);
    gguf_writer_free(w);
    free(names);
    assert_int_equal(rc, 0);
    gguf_file *f;
    rc = gguf_open(&f, path, err);
    assert_int_equal(rc, 0);
    rc = tok_load(out, f, err);
    gguf_close(f); /* the tokenizer keeps its own copies */
    unlink(path);
    return rc;
}

static void expect_load_error(const kv_spec *spec, int code, const char *needle)
{
    td_tokenizer *t = (td_tokenizer *)1;
    td_err err;
    td_err_clear(&err);
    int rc = build_tok(spec, &t, &err);
    assert_int_equal(rc, code);
    assert_null(t);
    if (!strstr(err.msg, needle)) fail_msg("message '%s' lacks '%s'", err.msg, needle);
}

static void test_load_errors(void **state)
{
    (void)state;
    expect_load_error(&(kv_spec){"bert", NULL, 256, false, -2, -1, false}, TD_EUNSUPPORTED,
                      "'bert'");
    expect_load_error(&(kv_spec){NULL, NULL, 256, false, -2, -1, false}, TD_EFORMAT,
                      "tokenizer.ggml.model");
    expect_load_error(&(kv_spec){"llama", NULL, 0, false, -2, -1, false}, TD_EFORMAT,
                      "tokenizer.ggml.tokens");
    expect_load_error(&(kv_spec){"llama", NULL, 256, false, 300, -1, false}, TD_EFORMAT,
                      "bos_token_id");
    expect_load_error(&(kv_spec){"llama", NULL, 256, false, -2, 10, false}, TD_EFORMAT,
                      "tokenizer.ggml.scores");
    expect_load_error(&(kv_spec){"gpt2", "gpt-2", 256, false, -2, -1, false}, TD_EFORMAT, "merges");
    expect_load_error(&(kv_spec){"llama", NULL, 256, false, -2, -1, true}, TD_EFORMAT, "<0xNN>");
    g_long_token = true;
    expect_load_error(&(kv_spec){"llama", NULL, 256, false, -2, 256, false}, TD_EFORMAT,
                      "token 200's text is 1025 bytes; at most 1024");
    g_long_token = false;

    /* A good one, with 0xFFFFFFFF as "no BOS" (as some converters write it). */
    td_tokenizer *t;
    td_err err;
    assert_int_equal(
        build_tok(&(kv_spec){"llama", NULL, 256, false, 0xFFFFFFFFll, 256, false}, &t, &err),
        TD_EFORMAT); /* add_bos defaults to true for llama and needs a BOS */
    assert_int_equal(
        build_tok(&(kv_spec){"gpt2", "no-such-pre", 256, true, 0xFFFFFFFFll, -1, false}, &t, &err),
        0); /* an unknown pre-tokenizer falls back to gpt-2's rules */
    assert_int_equal(tok_bos(t), -1);
    int n;
    int32_t *ids = encode_alloc(t, "the hat", 7, true, true, &n);
    /* gpt-2 split: "the", " hat"; merges "h e" and "Ġ t" do not apply to " h". */
    /* gpt-2 split: "the", " hat". The merge "h e" applies, but "he" is not in this
     * 256-token vocabulary, so its bytes come out one by one (llama.cpp's fallback). */
    int32_t want[] = {'t', 'h', 'e', ' ', 'h', 'a', 't'};
    assert_int_equal(n, 7);
    assert_memory_equal(ids, want, sizeof(want));
    int dl;
    char *dec = decode_alloc(t, ids, n, true, &dl);
    assert_string_equal(dec, "the hat");
    free(dec);
    free(ids);
    tok_free(t);
}

/* The llama3 and qwen2 pre-tokenizers split like HF's regexes (checked with Python's
 * `regex` module). */
static void check_split(const char *pre, const char *text, const char *const *want, int n_want)
{
    td_tokenizer *t;
    td_err err;
    assert_int_equal(build_tok(&(kv_spec){"gpt2", pre, 256, true, 0, -1, false}, &t, &err), 0);
    size_t *words, n;
    assert_int_equal(tok__bpe_split(t, text, strlen(text), &words, &n, &err), 0);
    bool same = (int)n == n_want;
    for (size_t i = 0; same && i < n; i++)
        same = words[2 * i + 1] == strlen(want[i]) &&
               memcmp(text + words[2 * i], want[i], words[2 * i + 1]) == 0;
    if (!same) {
        fprintf(stderr, "  %s split of '%s':\n", pre, text);
        for (size_t i = 0; i < n; i++)
            fprintf(stderr, "    [%.*s]\n", (int)words[2 * i + 1], text + words[2 * i]);
        fail();
    }
    free(words);
    tok_free(t);
}

static void test_pretokenizers(void **state)
{
    (void)state;
    const char *t1 = "Hello world's 12345 67\n\n  x  \t y";
    const char *t2 = "I'M don'T  1234567!!\r\n\r\n   ok?";
    const char *t3 = "\xe6\x88\x91\xe6\x83\xb3\xe5\x9c\xa8"
                     "apple\xe5\xb7\xa5\xe4\xbd\x9c"
                     "1314151"
                     "\xe5\xa4\xa9\xef\xbd\x9e \xf0\x9f\xa6\x99.cpp";
    const char *t4 = "$foo(bar) = 3.14;\n    return";
    check_split("llama3", t1,
                (const char *[]){"Hello", " world", "'s", " ", "123", "45", " ", "67", "\n\n", " ",
                                 " x", "  \t", " y"},
                13);
    check_split("llama-bpe", t2,
                (const char *[]){"I", "'M", " don", "'T", " ", " ", "123", "456", "7", "!!\r\n\r\n",
                                 "  ", " ok", "?"},
                13);
    check_split("llama3", t3,
                (const char *[]){"\xe6\x88\x91\xe6\x83\xb3\xe5\x9c\xa8"
                                 "apple\xe5\xb7\xa5\xe4\xbd\x9c",
                                 "131", "415", "1", "\xe5\xa4\xa9", "\xef\xbd\x9e",
                                 " \xf0\x9f\xa6\x99.", "cpp"},
                8);
    check_split(
        "llama3", t4,
        (const char *[]){"$foo", "(bar", ")", " =", " ", "3", ".", "14", ";\n", "   ", " return"},
        11);
    check_split("qwen2", t1,
                (const char *[]){"Hello", " world", "'s", " ", "1", "2", "3", "4", "5", " ", "6",
                                 "7", "\n\n", " ", " x", "  \t", " y"},
                17);
    check_split("qwen2", t2,
                (const char *[]){"I", "'M", " don", "'T", " ", " ", "1", "2", "3", "4", "5", "6",
                                 "7", "!!\r\n\r\n", "  ", " ok", "?"},
                17);
    check_split("qwen2", "   \n\n\t", (const char *[]){"   \n\n", "\t"}, 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_invalid_utf8),  cmocka_unit_test(test_stream),
        cmocka_unit_test(test_stream_random), cmocka_unit_test(test_encode_random),
        cmocka_unit_test(test_load_errors),   cmocka_unit_test(test_pretokenizers),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
