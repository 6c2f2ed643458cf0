/*
 * libFuzzer target for building a tokenizer from hostile GGUF metadata: parse the
 * input as a GGUF file, load its tokenizer, then encode a few texts (with and
 * without special-token parsing) and detokenize every id. A bad file must only
 * ever give an error, never a crash or a sanitizer report.
 *
 *   build-fuzz/fuzz_tok_load -max_total_time=60 tests/fuzz/corpus_tok_load
 *
 * The seeds are tiny tokenizers (llama with byte tokens and scores; gpt2 with the
 * gpt-2, llama3 and deepseek-llm pre-tokenizers and a few merges) written with
 * gguf_writer, each with <unk>, <s>, </s>, <|endoftext|> and <|im_end|>.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/gguf.h"
#include "model/tok.h"

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    td_log_set_level(TD_LOG_ERROR);
    return 0;
}

static void check(bool ok, const char *what)
{
    if (!ok) {
        fprintf(stderr, "fuzz_tok_load: invariant broken: %s\n", what);
        abort();
    }
}

static const char *const k_texts[] = {
    "Hello world, it's 2024!\n\n  x",
    "<s>[INST] hi [/INST]</s><|endoftext|><|im_end|>",
    "\xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\xa6\x99 \xc3\xb6\xc3\xa9 \xe2\x96\x81 \t\r\n",
    "",
};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    gguf_file *f;
    td_err err;
    if (gguf_open_buffer(&f, data, size, &err) != 0) return 0;
    td_tokenizer *t;
    if (tok_load(&t, f, &err) != 0) {
        gguf_close(f);
        return 0;
    }
    gguf_close(f); /* the tokenizer must not keep pointers into the file */

    int n_vocab = tok_n_vocab(t);
    check(n_vocab > 0, "vocabulary size");
    int max_piece = tok_max_piece_len(t);
    char *piece = malloc((size_t)max_piece + 1);
    for (int32_t id = 0; id < n_vocab && id < 4096; id++) {
        int n = tok_piece(t, id, true, piece, max_piece + 1);
        check(n >= 0 && n <= max_piece, "piece length");
        (void)tok_is_eog(t, id);
        (void)tok_is_control(t, id);
    }
    free(piece);

    int32_t ids[512];
    for (size_t i = 0; i < sizeof(k_texts) / sizeof(k_texts[0]); i++) {
        for (int parse = 0; parse < 2; parse++) {
            size_t len = strlen(k_texts[i]);
            int n = tok_encode(t, k_texts[i], len, true, parse, ids, 512, &err);
            if (n < 0) continue; /* e.g. a pre-tokenizer regex limit */
            check(n <= 512, "count fits");
            for (int k = 0; k < n; k++)
                check(ids[k] >= 0 && ids[k] < n_vocab, "id in range");
            int need = tok_decode(t, ids, n, parse == 0, NULL, 0);
            check(need >= 0, "decode");
            char *dec = malloc((size_t)need + 1);
            check(tok_decode(t, ids, n, parse == 0, dec, need + 1) == need, "decode again");
            free(dec);
            size_t cap = 3 * ((size_t)tok_max_piece_len(t) + 3);
            char *out = malloc(cap);
            tok_stream s;
            tok_stream_init(&s, t, parse == 0);
            for (int k = 0; k < n; k++)
                check(tok_stream_push(&s, ids[k], out, (int)cap) >= 0, "push");
            check(tok_stream_flush(&s, out, (int)cap) >= 0, "flush");
            free(out);
        }
    }
    tok_free(t);
    return 0;
}
