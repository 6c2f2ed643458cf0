/*
 * model/tok_impl.h - internals shared by the tokenizer's files: tok.c (loading,
 * special tokens, the encode driver), tok_spm.c (SentencePiece), tok_bpe.c
 * (byte-level BPE and its pre-tokenizer regexes) and tok_decode.c (pieces,
 * decoding, the streaming detokenizer). Not a public header.
 *
 * The algorithms follow llama.cpp's llama-vocab.cpp and unicode.cpp so that the
 * ids match its output exactly (the vectors in shared/tokenizer/ come from it).
 */
#ifndef TD_MODEL_TOK_IMPL_H
#define TD_MODEL_TOK_IMPL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "model/tok.h"

/* GGUF token types (tokenizer.ggml.token_type). */
enum {
    TOK_TYPE_UNDEFINED = 0,
    TOK_TYPE_NORMAL = 1,
    TOK_TYPE_UNKNOWN = 2,
    TOK_TYPE_CONTROL = 3,
    TOK_TYPE_USER_DEFINED = 4,
    TOK_TYPE_UNUSED = 5,
    TOK_TYPE_BYTE = 6,
};

typedef enum tok__kind { TOK_KIND_SPM = 0, TOK_KIND_BPE = 1 } tok__kind;

/* The most regexes one pre-tokenizer applies in sequence. */
#define TOK_MAX_REGEX 6
/* The most end-of-generation ids we track. */
#define TOK_MAX_EOG 8

/** Strings stored back to back: string i is data[off[i] .. off[i+1]). */
typedef struct tok__strtab {
    char *data;
    uint32_t *off; /* n + 1 entries */
    uint32_t n;
} tok__strtab;

static inline const char *tok__str(const tok__strtab *t, uint32_t i, uint32_t *len)
{
    *len = t->off[i + 1] - t->off[i];
    return t->data + t->off[i];
}

/**
 * Open-addressing hash map from a string of `keys` to its index there. Slots hold
 * the key's index + 1 (0 = empty) and 32 bits of its hash, so most probes that
 * miss never touch the key bytes.
 */
typedef struct tok__map {
    uint32_t *idx;  /* index + 1, or 0 */
    uint32_t *hash; /* low 32 bits of the key's hash */
    uint32_t mask;  /* capacity - 1 (capacity is a power of two) */
    const tok__strtab *keys;
} tok__map;

/** Index of `key` in the map's table, or -1. */
int32_t tok__map_find(const tok__map *m, const char *key, size_t len);

struct td_tokenizer {
    tok__kind kind;
    int n_vocab;
    tok__strtab text;   /* token texts, as in the file */
    float *scores;      /* [n_vocab]; 0 when the file has none */
    uint8_t *types;     /* [n_vocab] TOK_TYPE_* */
    tok__map text_map;  /* text -> id (first id on duplicates) */
    tok__strtab pieces; /* [n_vocab] the bytes each token decodes to (special ones rendered) */
    int max_piece_len;

    int32_t bos, eos, unk, pad, eot, eom; /* -1 when absent */
    bool add_bos, add_eos;
    bool add_space_prefix; /* SentencePiece: prefix the text with a space */

    int32_t eog[TOK_MAX_EOG];
    int n_eog;

    /* Special tokens matched in text before tokenizing (control, unknown and
     * user-defined types), longest text first. */
    int32_t *special;
    int n_special;

    /* SentencePiece: the <0xNN> token of each byte (or the 1-byte token, or unk, or -1). */
    int32_t byte_token[256];

    /* BPE */
    tok__strtab merges; /* the merge strings "left right", rank = index */
    tok__map merge_map;
    bool ignore_merges; /* a pre-tokenized word that is a token is taken whole */
    char pre[64];       /* the tokenizer.ggml.pre name */
    int n_regex;
    pcre2_code *regex[TOK_MAX_REGEX];
};

/** Where encoders write ids: up to cap are stored, n counts all of them. */
typedef struct tok__out {
    int32_t *ids;
    int cap;
    int n;
} tok__out;

static inline void tok__emit(tok__out *o, int32_t id)
{
    if (o->n < o->cap) o->ids[o->n] = id;
    o->n++;
}

/* UTF-8 helpers. */
/** Length of the UTF-8 sequence that starts with byte c (1 for invalid leads). */
static inline int tok__utf8_len(unsigned char c)
{
    static const uint8_t lookup[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return lookup[c >> 4];
}
/** Encode a code point (<= 0x10FFFF) into out (4 bytes room); returns the length. */
int tok__utf8_put(uint32_t cp, char *out);

/*
 * The UTF-8 rules for a lead byte c >= 0x80 (RFC 3629): how many continuation bytes
 * follow, and the allowed range of the first one (which excludes overlong forms,
 * surrogates and code points above U+10FFFF). Returns 0 for a byte that can never
 * start a character (a continuation byte, C0, C1, F5..FF).
 */
static inline int tok__utf8_lead(unsigned c, unsigned *lo, unsigned *hi)
{
    *lo = 0x80;
    *hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) return 1;
    if (c >= 0xE0 && c <= 0xEF) {
        if (c == 0xE0) *lo = 0xA0;
        if (c == 0xED) *hi = 0x9F;
        return 2;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        if (c == 0xF0) *lo = 0x90;
        if (c == 0xF4) *hi = 0x8F;
        return 3;
    }
    return 0;
}

/* SentencePiece (tok_spm.c): tokenize one fragment of raw text. */
int tok__spm_encode(const td_tokenizer *t, const char *text, size_t len, bool space_prefix,
                    tok__out *out, td_err *err);

/* BPE (tok_bpe.c). */
/** Choose and compile the pre-tokenizer regexes for t->pre. */
int tok__bpe_init(td_tokenizer *t, td_err *err);
void tok__bpe_free(td_tokenizer *t);
/** Tokenize one fragment of raw (valid UTF-8) text. */
int tok__bpe_encode(const td_tokenizer *t, const char *text, size_t len, tok__out *out,
                    td_err *err);
/**
 * Pre-tokenize one fragment (valid UTF-8) into words: *words gets 2 * *n size_t
 * values, (offset, length) pairs in text order (caller frees). For tests.
 */
int tok__bpe_split(const td_tokenizer *t, const char *text, size_t len, size_t **words, size_t *n,
                   td_err *err);
/**
 * The GPT-2 byte-level decoding of a token text: each character maps back to one
 * byte; characters outside the mapping are copied as they are. Writes at most
 * len bytes to out (a decoding never grows) and returns the length.
 */
int tok__bpe_unmap(const char *text, int len, char *out);

/* Decoding (tok_decode.c): build t->pieces once the vocabulary is loaded. */
int tok__build_pieces(td_tokenizer *t, td_err *err);

#endif
