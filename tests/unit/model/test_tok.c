/*
 * Unit tests for the tokenizer (model/tok*.c) against reference outputs:
 *  - llama.cpp's test vectors for six vocabularies (shared/tokenizer/NAME.gguf.inp and .out),
 *    with decode round trips and stream == decode;
 *  - the Llama-2 prompts of shared/golden/llama-2-tiny-random.jsonl (BOS added);
 *  - the stories260K vocabulary's decoded texts (shared/golden/stories260K-greedy.jsonl);
 *  - special tokens, end-of-generation ids, and encoding speed.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <cjson/cJSON.h>

#include "unit/model/tok_test_util.h"

#if defined(__SANITIZE_ADDRESS__)
#define TOK_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TOK_TEST_SANITIZED 1
#endif
#endif
#ifndef TOK_TEST_SANITIZED
#define TOK_TEST_SANITIZED 0
#endif

static const char *const k_vocabs[] = {"llama-spm",    "phi-3",     "gpt-2",
                                       "deepseek-llm", "starcoder", "falcon"};

#define SEPARATOR "\n__ggml_vocab_test__\n"

/* Parse "1 2 3" into ids; returns the count. */
static int parse_ids(const char *line, size_t len, int32_t *ids, int cap)
{
    int n = 0;
    size_t i = 0;
    while (i < len) {
        while (i < len && line[i] == ' ')
            i++;
        if (i >= len) break;
        long v = 0;
        while (i < len && line[i] >= '0' && line[i] <= '9')
            v = v * 10 + (line[i++] - '0');
        assert_true(n < cap);
        ids[n++] = (int32_t)v;
    }
    return n;
}

static void print_ids(const char *what, const int32_t *ids, int n)
{
    fprintf(stderr, "    %s:", what);
    for (int i = 0; i < n; i++)
        fprintf(stderr, " %d", ids[i]);
    fprintf(stderr, "\n");
}

/* Every vector of one vocabulary: exact ids, decode round trip, stream == decode. */
static void check_vocab(const char *name)
{
    char rel[256], path[1024];
    snprintf(rel, sizeof(rel), "tokenizer/ggml-vocab-%s.gguf", name);
    loaded_tok lt = load_tok(rel);
    size_t inp_len, out_len;
    snprintf(path, sizeof(path), "%s/%s.inp", shared_dir(), rel);
    char *inp = read_file_or_fail(path, &inp_len);
    snprintf(path, sizeof(path), "%s/%s.out", shared_dir(), rel);
    char *out = read_file_or_fail(path, &out_len);

    int n_cases = 0, n_pass = 0, n_roundtrip = 0;
    const char *ip = inp, *ip_end = inp + inp_len;
    const char *op = out, *op_end = out + out_len;
    /* Inputs are separated (and terminated) by SEPARATOR; outputs are one per line. */
    while (ip < ip_end) {
        const char *sep = strstr(ip, SEPARATOR);
        size_t text_len = sep ? (size_t)(sep - ip) : (size_t)(ip_end - ip);
        const char *nl = memchr(op, '\n', (size_t)(op_end - op));
        assert_non_null(nl);
        size_t line_len = (size_t)(nl - op);

        int32_t want[4096];
        int n_want = parse_ids(op, line_len, want, 4096);
        int n_got;
        int32_t *got = encode_alloc(lt.tok, ip, text_len, false, false, &n_got);
        n_cases++;
        bool same = n_got == n_want && memcmp(got, want, (size_t)n_got * sizeof(int32_t)) == 0;
        if (same) {
            n_pass++;
        } else {
            fprintf(stderr, "  %s case %d mismatch: text '%.*s'\n", name, n_cases,
                    (int)TD_MIN(text_len, 200), ip);
            print_ids("want", want, n_want);
            print_ids("got ", got, n_got);
        }

        /* Decoding gives the text back (byte fallback and byte-level BPE are lossless;
         * the SentencePiece space prefix goes again after BOS), and streaming agrees. */
        int n_full, dec_len, str_len;
        int32_t *full = encode_alloc(lt.tok, ip, text_len, true, false, &n_full);
        char *dec = decode_alloc(lt.tok, full, n_full, true, &dec_len);
        char *str = stream_alloc(lt.tok, full, n_full, true, &str_len);
        if ((size_t)dec_len == text_len && memcmp(dec, ip, text_len) == 0)
            n_roundtrip++;
        else
            fprintf(stderr, "  %s case %d: decode gives '%s' for '%.*s'\n", name, n_cases, dec,
                    (int)text_len, ip);
        assert_int_equal(dec_len, str_len);
        assert_memory_equal(dec, str, (size_t)dec_len);
        free(full);
        free(dec);
        free(str);
        free(got);

        op = nl + 1;
        if (!sep) break;
        ip = sep + strlen(SEPARATOR);
    }
    fprintf(stderr, "[ tok ] %-13s %d/%d vectors match llama.cpp, %d/%d round-trip\n", name, n_pass,
            n_cases, n_roundtrip, n_cases);
    assert_true(n_cases >= 40);
    assert_int_equal(n_pass, n_cases);
    assert_int_equal(n_roundtrip, n_cases);
    free(inp);
    free(out);
    unload_tok(&lt);
}

static void test_vectors(void **state)
{
    const char *name = *state;
    check_vocab(name);
}

/* Llama-2 prompts with their reference ids (BOS added by add_special). */
static void test_llama2_golden(void **state)
{
    (void)state;
    loaded_tok lt = load_tok("models/llama-2-tiny-random.gguf");
    assert_int_equal(tok_n_vocab(lt.tok), 32000);
    assert_int_equal(tok_bos(lt.tok), 1);
    assert_int_equal(tok_eos(lt.tok), 2);
    assert_true(tok_add_bos(lt.tok));
    assert_false(tok_add_eos(lt.tok));
    char path[1024];
    snprintf(path, sizeof(path), "%s/golden/llama-2-tiny-random.jsonl", shared_dir());
    size_t len;
    char *data = read_file_or_fail(path, &len);
    int n_lines = 0;
    for (char *line = strtok(data, "\n"); line; line = strtok(NULL, "\n")) {
        cJSON *j = cJSON_Parse(line);
        assert_non_null(j);
        const char *prompt = cJSON_GetObjectItem(j, "prompt")->valuestring;
        cJSON *want = cJSON_GetObjectItem(j, "prompt_ids");
        int n;
        int32_t *got = encode_alloc(lt.tok, prompt, strlen(prompt), true, false, &n);
        assert_int_equal(n, cJSON_GetArraySize(want));
        for (int i = 0; i < n; i++)
            assert_int_equal(got[i], cJSON_GetArrayItem(want, i)->valueint);
        /* Decoding (skipping BOS) gives the prompt back. */
        int dl;
        char *dec = decode_alloc(lt.tok, got, n, true, &dl);
        assert_string_equal(dec, prompt);
        free(dec);
        free(got);
        cJSON_Delete(j);
        n_lines++;
    }
    assert_true(n_lines >= 5);
    free(data);
    unload_tok(&lt);
}

/* stories260K: a 512-piece SentencePiece vocabulary; check decoding against the golden texts. */
static void test_stories_golden(void **state)
{
    (void)state;
    loaded_tok lt = load_tok("models/stories260K.gguf");
    assert_int_equal(tok_n_vocab(lt.tok), 512);
    assert_int_equal(tok_bos(lt.tok), 1);
    assert_int_equal(tok_eos(lt.tok), 2);
    assert_true(tok_is_eog(lt.tok, 2));
    assert_false(tok_is_eog(lt.tok, 1));
    char path[1024];
    snprintf(path, sizeof(path), "%s/golden/stories260K-greedy.jsonl", shared_dir());
    size_t len;
    char *data = read_file_or_fail(path, &len);
    int n_lines = 0;
    for (char *line = strtok(data, "\n"); line; line = strtok(NULL, "\n")) {
        cJSON *j = cJSON_Parse(line);
        assert_non_null(j);
        cJSON *p = cJSON_GetObjectItem(j, "prompt_ids"), *o = cJSON_GetObjectItem(j, "output_ids");
        int np = cJSON_GetArraySize(p), no = cJSON_GetArraySize(o);
        int32_t ids[512];
        assert_true(np + no <= 512);
        for (int i = 0; i < np; i++)
            ids[i] = cJSON_GetArrayItem(p, i)->valueint;
        for (int i = 0; i < no; i++)
            ids[np + i] = cJSON_GetArrayItem(o, i)->valueint;
        /* prompt_text_decoded is llama.cpp's plain concatenation of the pieces after
         * BOS; our decode drops the space prefix after a leading BOS, so compare
         * without the BOS (a continuation) and with it (one space less). */
        int dl;
        const char *want_prompt = cJSON_GetObjectItem(j, "prompt_text_decoded")->valuestring;
        char *dec = decode_alloc(lt.tok, ids + 1, np - 1, true, &dl);
        assert_string_equal(dec, want_prompt);
        free(dec);
        dec = decode_alloc(lt.tok, ids, np, true, &dl);
        assert_string_equal(dec, want_prompt + (want_prompt[0] == ' '));
        free(dec);
        /* The continuation decodes to output_text, alone or after the prompt. */
        dec = decode_alloc(lt.tok, ids + np, no, true, &dl);
        assert_string_equal(dec, cJSON_GetObjectItem(j, "output_text")->valuestring);
        free(dec);
        dec = decode_alloc(lt.tok, ids, np + no, true, &dl);
        const char *want_out = cJSON_GetObjectItem(j, "output_text")->valuestring;
        size_t wl = strlen(want_out);
        assert_true((size_t)dl >= wl);
        assert_string_equal(dec + dl - wl, want_out);
        /* And streaming gives the same text. */
        int sl;
        char *str = stream_alloc(lt.tok, ids, np + no, true, &sl);
        assert_string_equal(str, dec);
        free(str);
        free(dec);
        /* Re-encoding the decoded prompt gives valid ids that decode to the same text. */
        dec = decode_alloc(lt.tok, ids, np, true, &dl);
        int n;
        int32_t *re = encode_alloc(lt.tok, dec, (size_t)dl, true, false, &n);
        assert_int_equal(re[0], 1);
        int dl2;
        char *dec2 = decode_alloc(lt.tok, re, n, true, &dl2);
        assert_string_equal(dec2, dec);
        free(dec2);
        free(re);
        free(dec);
        cJSON_Delete(j);
        n_lines++;
    }
    assert_true(n_lines >= 3);
    free(data);
    unload_tok(&lt);
}

static void expect_ids(const td_tokenizer *t, const char *text, bool add_special,
                       bool parse_special, const int32_t *want, int n_want)
{
    int n;
    int32_t *got = encode_alloc(t, text, strlen(text), add_special, parse_special, &n);
    if (n != n_want || (n > 0 && memcmp(got, want, (size_t)n * sizeof(int32_t)) != 0)) {
        fprintf(stderr, "  text '%s' (add_special %d, parse_special %d)\n", text, add_special,
                parse_special);
        print_ids("want", want, n_want);
        print_ids("got ", got, n);
        fail();
    }
    free(got);
}

static bool contains(const int32_t *ids, int n, int32_t id)
{
    for (int i = 0; i < n; i++)
        if (ids[i] == id) return true;
    return false;
}

static void test_special_tokens(void **state)
{
    (void)state;
    /* SentencePiece: <s> parsed only on request; a space prefix follows a special token. */
    loaded_tok spm = load_tok("tokenizer/ggml-vocab-llama-spm.gguf");
    expect_ids(spm.tok, "<s>Hello", false, true, (int32_t[]){1, 15043}, 2);
    expect_ids(spm.tok, "Hello", true, false, (int32_t[]){1, 15043}, 2);
    expect_ids(spm.tok, "", true, false, (int32_t[]){1}, 1);
    expect_ids(spm.tok, "", false, false, (int32_t[]){0}, 0);
    int n;
    int32_t *ids = encode_alloc(spm.tok, "<s>Hello</s>", 12, false, false, &n);
    assert_false(contains(ids, n, 1));
    assert_false(contains(ids, n, 2));
    free(ids);
    ids = encode_alloc(spm.tok, "<s>Hello</s>", 12, false, true, &n);
    assert_true(n >= 3 && ids[0] == 1 && ids[n - 1] == 2);
    /* Decoding renders them only when asked. */
    int dl;
    char *dec = decode_alloc(spm.tok, ids, n, true, &dl);
    assert_string_equal(dec, "Hello");
    free(dec);
    dec = decode_alloc(spm.tok, ids, n, false, &dl);
    assert_string_equal(dec, "<s>Hello</s>");
    free(dec);
    free(ids);
    char piece[64];
    assert_int_equal(tok_piece(spm.tok, 1, false, piece, sizeof(piece)), 0);
    assert_int_equal(tok_piece(spm.tok, 1, true, piece, sizeof(piece)), 3);
    assert_memory_equal(piece, "<s>", 3);
    assert_int_equal(tok_piece(spm.tok, 15043, false, piece, sizeof(piece)), 6);
    assert_memory_equal(piece, " Hello", 6);
    assert_int_equal(tok_piece(spm.tok, 15043, false, piece, 3), 6); /* truncated */
    assert_int_equal(tok_piece(spm.tok, 32000, false, piece, sizeof(piece)), TD_ERANGE);
    assert_int_equal(tok_piece(spm.tok, -1, false, piece, sizeof(piece)), TD_ERANGE);
    assert_true(tok_is_control(spm.tok, 1));
    assert_false(tok_is_control(spm.tok, 15043));
    assert_int_equal(tok_find(spm.tok, "<0x0A>", 6), 13);
    assert_int_equal(tok_find(spm.tok, "no such token", 13), -1);
    int tl;
    const char *tt = tok_text(spm.tok, 15043, &tl);
    assert_int_equal(tl, 8);
    assert_memory_equal(tt, "\xe2\x96\x81Hello", 8);
    assert_null(tok_text(spm.tok, 32000, &tl));
    assert_int_equal(tok_max_piece_len(spm.tok), 27);
    unload_tok(&spm);

    /* phi-3: chat markers are control tokens and end-of-generation ids. */
    loaded_tok phi = load_tok("tokenizer/ggml-vocab-phi-3.gguf");
    ids = encode_alloc(phi.tok, "<|user|>\nHi<|end|>", 18, false, true, &n);
    assert_int_equal(ids[0], 32010);
    assert_int_equal(ids[n - 1], 32007);
    free(ids);
    ids = encode_alloc(phi.tok, "<|user|>\nHi<|end|>", 18, false, false, &n);
    assert_false(contains(ids, n, 32010));
    assert_false(contains(ids, n, 32007));
    free(ids);
    assert_true(tok_is_eog(phi.tok, 32000)); /* EOS */
    assert_true(tok_is_eog(phi.tok, 32007)); /* <|end|> */
    assert_false(tok_is_eog(phi.tok, 32010));
    unload_tok(&phi);

    /* gpt-2: <|endoftext|> is the one control token. */
    loaded_tok g2 = load_tok("tokenizer/ggml-vocab-gpt-2.gguf");
    expect_ids(g2.tok, "Hello<|endoftext|>", false, true, (int32_t[]){15496, 50256}, 2);
    ids = encode_alloc(g2.tok, "<|endoftext|>", 13, false, false, &n);
    assert_true(n > 1 && !contains(ids, n, 50256));
    free(ids);
    assert_false(tok_add_bos(g2.tok));
    expect_ids(g2.tok, "Hello", true, false, (int32_t[]){15496}, 1);
    assert_true(tok_is_eog(g2.tok, 50256));
    assert_int_equal(tok_piece(g2.tok, 220, false, piece, sizeof(piece)), 1); /* "Ġ" */
    assert_int_equal(piece[0], ' ');
    unload_tok(&g2);

    /* deepseek-llm: user-defined tokens are split out even without parse_special (as
     * llama.cpp and HF tokenizers do), control ones only with it. */
    loaded_tok ds = load_tok("tokenizer/ggml-vocab-deepseek-llm.gguf");
    assert_true(tok_add_bos(ds.tok));
    assert_int_equal(tok_bos(ds.tok), 100000);
    ids = encode_alloc(ds.tok, "\xc3\xb6", 2, false, false, &n); /* "ö" */
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], 100003);
    free(ids);
    const char *bos_text = "<\xef\xbd\x9c"
                           "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>";
    ids = encode_alloc(ds.tok, bos_text, strlen(bos_text), false, false, &n);
    assert_true(n > 1);
    free(ids);
    ids = encode_alloc(ds.tok, bos_text, strlen(bos_text), true, true, &n);
    assert_int_equal(n, 2);
    assert_int_equal(ids[0], 100000);
    assert_int_equal(ids[1], 100000);
    free(ids);
    unload_tok(&ds);
}

/* Longest special token wins where two overlap, as in llama.cpp. */
static void test_special_overlap(void **state)
{
    (void)state;
    loaded_tok sc = load_tok("tokenizer/ggml-vocab-starcoder.gguf");
    /* "<pr_diff_hunk>" and "<pr_diff>" share a prefix; the longer must be taken. */
    int32_t hunk = tok_find(sc.tok, "<pr_diff_hunk>", 14), diff = tok_find(sc.tok, "<pr_diff>", 9);
    assert_true(hunk > 0 && diff > 0);
    expect_ids(sc.tok, "<pr_diff_hunk><pr_diff>", false, true, (int32_t[]){hunk, diff}, 2);
    unload_tok(&sc);
}

/* About 2,000 tokens of mixed text must encode well under 10 ms. */
static void test_speed(void **state)
{
    (void)state;
    for (size_t v = 0; v < TD_ARRAY_LEN(k_vocabs); v++) {
        char rel[256], path[1024];
        snprintf(rel, sizeof(rel), "tokenizer/ggml-vocab-%s.gguf", k_vocabs[v]);
        loaded_tok lt = load_tok(rel);
        snprintf(path, sizeof(path), "%s/%s.inp", shared_dir(), rel);
        size_t len;
        char *inp = read_file_or_fail(path, &len);
        /* Repeat the vectors (mixed scripts, emoji, code, numbers) until ~2,000 tokens. */
        size_t cap = len * 8, w = 0;
        char *text = malloc(cap);
        int n = 0;
        for (int rep = 0; rep < 8; rep++) {
            memcpy(text + w, inp, len);
            w += len;
            int32_t *ids = encode_alloc(lt.tok, text, w, false, false, &n);
            free(ids);
            if (n >= 2000) break;
        }
        int32_t *ids = malloc((size_t)(n + 16) * sizeof(int32_t));
        double best = 1e9;
        for (int it = 0; it < 5; it++) {
            double t0 = td_now_s();
            int m = tok_encode(lt.tok, text, w, false, false, ids, n + 16, NULL);
            double dt = td_now_s() - t0;
            assert_int_equal(m, n);
            best = TD_MIN(best, dt);
        }
        fprintf(stderr, "[ tok ] %-13s %d tokens (%zu bytes) encode in %.2f ms\n", k_vocabs[v], n,
                w, best * 1e3);
        /* Sanitizers slow everything down several times; only check the budget without. */
        assert_true(best < (TOK_TEST_SANITIZED ? 0.2 : 0.010));
        free(ids);
        free(text);
        free(inp);
        unload_tok(&lt);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_prestate(test_vectors, (void *)"llama-spm"),
        cmocka_unit_test_prestate(test_vectors, (void *)"phi-3"),
        cmocka_unit_test_prestate(test_vectors, (void *)"gpt-2"),
        cmocka_unit_test_prestate(test_vectors, (void *)"deepseek-llm"),
        cmocka_unit_test_prestate(test_vectors, (void *)"starcoder"),
        cmocka_unit_test_prestate(test_vectors, (void *)"falcon"),
        cmocka_unit_test(test_llama2_golden),
        cmocka_unit_test(test_stories_golden),
        cmocka_unit_test(test_special_tokens),
        cmocka_unit_test(test_special_overlap),
        cmocka_unit_test(test_speed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
