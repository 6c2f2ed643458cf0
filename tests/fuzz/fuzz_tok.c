/*
 * libFuzzer target for the tokenizer: encode the input as text (SentencePiece,
 * gpt-2 and deepseek-llm vocabularies), decode and stream the ids, and also read
 * the input as an id sequence and detokenize it. Any crash, sanitizer report or
 * broken invariant (abort) is a bug.
 *
 * The first input byte chooses the vocabulary and the flags; the rest is the text.
 * The vocabularies come from TD_SHARED_DIR, or else the shared/ folder beside the
 * source tree this file was compiled from, or ../shared and shared from the cwd.
 *
 *   build-fuzz/fuzz_tok -max_total_time=60 tests/fuzz/corpus_tok
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/gguf.h"
#include "model/tok.h"

#define N_VOCABS 3
static const char *const k_vocab_files[N_VOCABS] = {
    "tokenizer/ggml-vocab-llama-spm.gguf",
    "tokenizer/ggml-vocab-gpt-2.gguf",
    "tokenizer/ggml-vocab-deepseek-llm.gguf",
};
static gguf_file *g_files[N_VOCABS];
static td_tokenizer *g_toks[N_VOCABS];

static bool try_load(const char *dir)
{
    for (int i = 0; i < N_VOCABS; i++) {
        char path[4096];
        snprintf(path, sizeof(path), "%s/%s", dir, k_vocab_files[i]);
        if (access(path, R_OK) != 0) return false;
    }
    for (int i = 0; i < N_VOCABS; i++) {
        char path[4096];
        snprintf(path, sizeof(path), "%s/%s", dir, k_vocab_files[i]);
        td_err err;
        if (gguf_open(&g_files[i], path, &err) || tok_load(&g_toks[i], g_files[i], &err)) {
            fprintf(stderr, "fuzz_tok: cannot load %s: %s\n", path, err.msg);
            abort();
        }
    }
    return true;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    td_log_set_level(TD_LOG_ERROR);
    char beside[4096];
    /* __FILE__ is .../tests/fuzz/fuzz_tok.c: the shared folder is ../shared from the root. */
    snprintf(beside, sizeof(beside), "%s", __FILE__);
    char *cut = strstr(beside, "tests/fuzz/fuzz_tok.c");
    if (cut) strcpy(cut, "../shared");
    const char *env = getenv("TD_SHARED_DIR");
    if ((env && try_load(env)) || (cut && try_load(beside)) || try_load("../shared") ||
        try_load("shared") || try_load("../../shared"))
        return 0;
    fprintf(stderr, "fuzz_tok: cannot find the tokenizer vocabularies; set TD_SHARED_DIR to "
                    "the shared data folder\n");
    abort();
}

static void check(bool ok, const char *what)
{
    if (!ok) {
        fprintf(stderr, "fuzz_tok: invariant broken: %s\n", what);
        abort();
    }
}

/* Stream ids; returns the text (malloc'd) and checks it is valid UTF-8. */
static char *stream(const td_tokenizer *t, const int32_t *ids, int n, bool skip, size_t *len)
{
    char *buf = malloc((size_t)n * 1024 + 16);
    size_t w = 0;
    tok_stream s;
    tok_stream_init(&s, t, skip);
    for (int i = 0; i < n; i++) {
        int k = tok_stream_push(&s, ids[i], buf + w, 1024);
        check(k >= 0 && k <= 1024, "stream push");
        w += (size_t)k;
    }
    int k = tok_stream_flush(&s, buf + w, 16);
    check(k >= 0, "stream flush");
    w += (size_t)k;
    check(tok_utf8_valid_prefix(buf, w) == w, "stream output is valid UTF-8");
    *len = w;
    return buf;
}

/* Decode and stream ids; when decode is valid UTF-8 the two must agree. */
static void detokenize(const td_tokenizer *t, const int32_t *ids, int n, bool skip)
{
    int need = tok_decode(t, ids, n, skip, NULL, 0);
    check(need >= 0, "decode length");
    char *dec = malloc((size_t)need + 1);
    check(tok_decode(t, ids, n, skip, dec, need + 1) == need, "decode");
    size_t slen;
    char *str = stream(t, ids, n, skip, &slen);
    if (tok_utf8_valid_prefix(dec, (size_t)need) == (size_t)need)
        check(slen == (size_t)need && memcmp(dec, str, slen) == 0, "stream == decode");
    free(str);
    free(dec);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    uint8_t mode = data[0];
    const td_tokenizer *t = g_toks[(mode & 3) % N_VOCABS];
    bool add_special = mode & 4, parse_special = mode & 8, skip = mode & 16;
    const char *text = (const char *)data + 1;
    size_t len = size - 1;

    if (mode & 32) {
        /* The bytes as little-endian 16-bit ids (wrapped into the vocabulary). */
        int n = (int)(len / 2), n_vocab = tok_n_vocab(t);
        int32_t *ids = malloc((size_t)(n ? n : 1) * sizeof(int32_t));
        for (int i = 0; i < n; i++)
            ids[i] = (int32_t)((data[1 + 2 * i] | (data[2 + 2 * i] << 8)) % n_vocab);
        detokenize(t, ids, n, skip);
        free(ids);
        return 0;
    }

    char *fixed = NULL;
    if (mode & 64) {
        /* Make the text valid UTF-8 (bad bytes become '?'), to reach the tokenizers more. */
        fixed = malloc(len ? len : 1);
        memcpy(fixed, text, len);
        for (size_t off = 0; off < len;) {
            off += tok_utf8_valid_prefix(fixed + off, len - off);
            if (off < len) fixed[off++] = '?';
        }
        text = fixed;
    }

    int cap = (int)len + 4;
    int32_t *ids = malloc((size_t)cap * sizeof(int32_t));
    td_err err;
    int n = tok_encode(t, text, len, add_special, parse_special, ids, cap, &err);
    bool valid = tok_utf8_valid_prefix(text, len) == len;
    if (!valid) {
        check(n == TD_EINVAL, "invalid UTF-8 is rejected");
        free(ids);
        free(fixed);
        return 0;
    }
    check(n >= 0 && n <= cap, "encode");
    for (int i = 0; i < n; i++)
        check(ids[i] >= 0 && ids[i] < tok_n_vocab(t), "ids in range");
    /* A smaller buffer gives the same count and a prefix of the same ids. */
    if (n > 1) {
        int32_t *few = malloc((size_t)(n / 2) * sizeof(int32_t));
        check(tok_encode(t, text, len, add_special, parse_special, few, n / 2, &err) == n,
              "count with a small buffer");
        check(memcmp(few, ids, (size_t)(n / 2) * sizeof(int32_t)) == 0, "prefix");
        free(few);
    }
    detokenize(t, ids, n, skip);
    /* Without special parsing, text round-trips exactly through gpt2's byte-level BPE
     * (SentencePiece turns a literal U+2581 into a space, so it is not checked there). */
    if (!parse_special && (mode & 3) % N_VOCABS == 1) {
        int need = tok_decode(t, ids, n, true, NULL, 0);
        char *dec = malloc((size_t)need + 1);
        tok_decode(t, ids, n, true, dec, need + 1);
        check((size_t)need == len && memcmp(dec, text, len) == 0, "gpt-2 round trip");
        free(dec);
    }
    free(ids);
    free(fixed);
    return 0;
}
