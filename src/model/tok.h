/*
 * model/tok.h - tokenizers built from GGUF metadata.
 *
 *  - `tokenizer.ggml.model = llama`: SentencePiece BPE over scores, with byte
 *    fallback (<0xNN> tokens), a space prefix and U+2581 for spaces.
 *  - `tokenizer.ggml.model = gpt2`: byte-level BPE over merges, with the
 *    pre-tokenizer split rules named by `tokenizer.ggml.pre` (gpt2, llama3/llama-bpe,
 *    qwen2, deepseek-llm, starcoder, falcon, ...), implemented with PCRE2.
 *
 * Special tokens of the control and unknown types are matched in the text only
 * when `parse_special` is set; user-defined tokens (added tokens, such as
 * deepseek's "ö") are always matched, as llama.cpp and HF tokenizers do. BOS/EOS
 * are added as the metadata says (tokenizer.ggml.add_bos_token / add_eos_token,
 * defaulting like llama.cpp: BOS for llama and the llama3 pre-tokenizer) when
 * `add_special` is set.
 *
 * The file may be closed once tok_load returns (the tokenizer copies what it
 * needs). A loaded tokenizer is immutable: it may be used from many threads.
 */
#ifndef TD_MODEL_TOK_H
#define TD_MODEL_TOK_H

#include "model/gguf.h"
#include "util/td.h"

typedef struct td_tokenizer td_tokenizer;

/**
 * Build a tokenizer from a GGUF file's `tokenizer.*` metadata. Errors:
 * TD_EUNSUPPORTED for a tokenizer model other than llama/gpt2 (err names it),
 * TD_EFORMAT for missing or inconsistent keys (err names the key).
 */
int tok_load(td_tokenizer **out, const gguf_file *f, td_err *err);
void tok_free(td_tokenizer *t);

int tok_n_vocab(const td_tokenizer *t);
int32_t tok_bos(const td_tokenizer *t); /* -1 if none */
int32_t tok_eos(const td_tokenizer *t); /* -1 if none */
bool tok_add_bos(const td_tokenizer *t);
bool tok_add_eos(const td_tokenizer *t);
/** End-of-generation token (EOS, EOT, <|im_end|>, ...). */
bool tok_is_eog(const td_tokenizer *t, int32_t id);
/** Control tokens render as nothing when decoding with skip_special. */
bool tok_is_control(const td_tokenizer *t, int32_t id);

/**
 * The id of the token whose text is exactly text[0..len) (e.g. "<|im_end|>"), or -1.
 * The text is the vocabulary's spelling (SentencePiece U+2581, gpt2 byte characters).
 */
int32_t tok_find(const td_tokenizer *t, const char *text, size_t len);
/** A token's text as the vocabulary spells it (not NUL-terminated); NULL if out of range. */
const char *tok_text(const td_tokenizer *t, int32_t id, int *len);
/** The longest piece tok_piece can return, in bytes (special tokens rendered). */
int tok_max_piece_len(const td_tokenizer *t);
/* The longest token text a vocabulary may have (tok_load refuses longer). */
#define TOK_MAX_PIECE 1024

/**
 * Encode UTF-8 text. Invalid UTF-8 is an error (TD_EINVAL, err says at which
 * byte offset). Returns the number of tokens (which may exceed `cap`: then only
 * `cap` were written and the caller retries with a bigger buffer), or a negative
 * error code.
 */
int tok_encode(const td_tokenizer *t, const char *text, size_t len, bool add_special,
               bool parse_special, int32_t *out, int cap, td_err *err);

/**
 * The bytes a token stands for (byte-fallback tokens give their byte, U+2581
 * becomes a space, gpt2 byte-level characters map back to bytes). Returns the
 * length (which may exceed cap; then the output is truncated), or TD_ERANGE for an
 * id outside the vocabulary. Control tokens give "" unless `render_special`.
 */
int tok_piece(const td_tokenizer *t, int32_t id, bool render_special, char *buf, int cap);

/**
 * Decode a whole sequence into buf (NUL-terminated when it fits). Handles the
 * SentencePiece leading space: when the sequence starts with BOS, the token right
 * after it loses one leading space (the prefix the encoder added), so
 * decode(encode(text, add_special)) == text. A sequence without a leading BOS is
 * a continuation and decodes as its pieces concatenated (a generated " there"
 * keeps its space). Returns the byte length needed, or a negative error
 * (TD_ERANGE for an id outside the vocabulary).
 */
int tok_decode(const td_tokenizer *t, const int32_t *ids, int n, bool skip_special, char *buf,
               int cap);

/**
 * Streaming detokenizer: feed ids one at a time, get out only complete UTF-8
 * characters; bytes of an unfinished character are held until it completes.
 * Bytes that can never form valid UTF-8 are emitted as U+FFFD.
 */
typedef struct tok_stream {
    const td_tokenizer *tok;
    bool skip_special;
    bool at_start;      /* no id pushed yet (for the SentencePiece leading space) */
    bool after_bos;     /* the first id was BOS: the next piece loses a leading space */
    unsigned char pending[8];
    int n_pending;
} tok_stream;

void tok_stream_init(tok_stream *s, const td_tokenizer *t, bool skip_special);
/**
 * Push one id; writes the completed text to out (not NUL-terminated) and returns
 * its length (<= cap), or a negative error: TD_ERANGE for an unknown id, or when the
 * text does not fit in cap (then nothing is consumed: retry with more room). The
 * output is at most 3 * (tok_max_piece_len() + 3) bytes (every byte of a piece may
 * become U+FFFD), so a buffer that big always suffices; for real vocabularies
 * pieces are at most 256 bytes of mostly valid text, so 1024 is plenty.
 */
int tok_stream_push(tok_stream *s, int32_t id, char *out, int cap);
/** At the end of a sequence: flush held bytes as U+FFFD. Returns the length (at most 3),
 *  or TD_ERANGE when cap is too small (nothing is consumed). */
int tok_stream_flush(tok_stream *s, char *out, int cap);

/** Length of the longest valid UTF-8 prefix of s[0..len). */
size_t tok_utf8_valid_prefix(const char *s, size_t len);

#endif
