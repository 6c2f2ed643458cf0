/*
 * model/tok.c - the tokenizer: loading from GGUF metadata, the vocabulary hash
 * map, special-token splitting and the encode driver. The two algorithms live in
 * tok_spm.c and tok_bpe.c; decoding in tok_decode.c.
 *
 * Everything the tokenizer needs is copied out of the GGUF file, so the file may
 * be closed once tok_load returns. A loaded tokenizer is immutable: tok_encode and
 * the decoders may run on it from several threads at once.
 */
#include "model/tok_impl.h"

#include <float.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

/* ---- string tables and the hash map ---------------------------------------------- */

static void strtab_free(tok__strtab *t)
{
    free(t->data);
    free(t->off);
    memset(t, 0, sizeof(*t));
}

/* Copy a GGUF string array into a table. */
static int strtab_from_gguf(tok__strtab *t, const gguf_file *f, const char *key, uint64_t n,
                            td_err *err)
{
    uint64_t total = 0;
    for (uint64_t i = 0; i < n; i++)
        total += gguf_get_arr_str(f, key, i).len;
    if (total >= UINT32_MAX)
        return td_err_set(err, TD_ETOOLARGE, "%s: %llu bytes of strings is too many", key,
                          (unsigned long long)total);
    t->n = (uint32_t)n;
    t->data = malloc(total + 1);
    t->off = malloc((n + 1) * sizeof(uint32_t));
    if (!t->data || !t->off) return td_err_set(err, TD_ENOMEM, "%s: out of memory", key);
    uint32_t pos = 0;
    for (uint64_t i = 0; i < n; i++) {
        gguf_str s = gguf_get_arr_str(f, key, i);
        t->off[i] = pos;
        if (s.len) memcpy(t->data + pos, s.ptr, s.len);
        pos += (uint32_t)s.len;
    }
    t->off[n] = pos;
    t->data[pos] = '\0';
    return 0;
}

static uint64_t key_hash(const char *key, size_t len)
{
    return td_hash64(key, len, 0x746f6b);
}

static void map_free(tok__map *m)
{
    free(m->idx);
    free(m->hash);
    memset(m, 0, sizeof(*m));
}

/*
 * Index every string of `keys` (capacity at least twice the count, so probes stay
 * short). On duplicates the first index wins; *n_dups counts the others.
 */
static int map_build(tok__map *m, const tok__strtab *keys, uint32_t *n_dups, td_err *err)
{
    uint64_t cap = 16;
    while (cap < (uint64_t)keys->n * 2)
        cap <<= 1;
    m->keys = keys;
    m->mask = (uint32_t)(cap - 1);
    m->idx = calloc(cap, sizeof(uint32_t));
    m->hash = calloc(cap, sizeof(uint32_t));
    if (!m->idx || !m->hash) return td_err_set(err, TD_ENOMEM, "tokenizer: out of memory");
    *n_dups = 0;
    for (uint32_t i = 0; i < keys->n; i++) {
        uint32_t len;
        const char *s = tok__str(keys, i, &len);
        uint64_t h = key_hash(s, len);
        uint32_t slot = (uint32_t)h & m->mask;
        for (;;) {
            uint32_t e = m->idx[slot];
            if (e == 0) {
                m->idx[slot] = i + 1;
                m->hash[slot] = (uint32_t)h;
                break;
            }
            uint32_t elen;
            const char *es = tok__str(keys, e - 1, &elen);
            if (m->hash[slot] == (uint32_t)h && elen == len && memcmp(es, s, len) == 0) {
                (*n_dups)++;
                break;
            }
            slot = (slot + 1) & m->mask;
        }
    }
    return 0;
}

int32_t tok__map_find(const tok__map *m, const char *key, size_t len)
{
    uint64_t h = key_hash(key, len);
    uint32_t slot = (uint32_t)h & m->mask;
    for (;;) {
        uint32_t e = m->idx[slot];
        if (e == 0) return -1;
        if (m->hash[slot] == (uint32_t)h) {
            uint32_t elen;
            const char *es = tok__str(m->keys, e - 1, &elen);
            if (elen == len && memcmp(es, key, len) == 0) return (int32_t)(e - 1);
        }
        slot = (slot + 1) & m->mask;
    }
}

/* ---- loading ------------------------------------------------------------------- */

void tok_free(td_tokenizer *t)
{
    if (!t) return;
    tok__bpe_free(t);
    strtab_free(&t->text);
    strtab_free(&t->pieces);
    strtab_free(&t->merges);
    map_free(&t->text_map);
    map_free(&t->merge_map);
    free(t->scores);
    free(t->types);
    free(t->special);
    free(t);
}

/*
 * A numeric array of at least n elements: scores (out_f; f32, or i32 as llama.cpp
 * also accepts) or token types (out_type; i32). Types outside 0..6 count as
 * undefined, as in llama.cpp; a NaN score counts as the lowest possible.
 */
static int read_num_array(const gguf_file *f, const char *key, uint64_t n, float *out_f,
                          uint8_t *out_type, td_err *err)
{
    gguf_vtype et;
    uint64_t count;
    int rc = gguf_get_arr(f, key, &et, &count, err);
    if (rc == TD_ENOTFOUND) {
        td_err_clear(err);
        return 0;
    }
    if (rc) return rc;
    bool ok = et == GGUF_VT_INT32 || et == GGUF_VT_UINT32 || (out_f && et == GGUF_VT_FLOAT32);
    if (!ok)
        return td_err_set(err, TD_EFORMAT, "%s has element type %d, expected %s", key, (int)et,
                          out_f ? "f32" : "i32");
    if (count < n)
        return td_err_set(err, TD_EFORMAT, "%s has %llu entries but the vocabulary has %llu", key,
                          (unsigned long long)count, (unsigned long long)n);
    const unsigned char *data = gguf_get_arr_data(f, key);
    if (!data && n) return td_err_set(err, TD_EFORMAT, "%s: not a numeric array", key);
    for (uint64_t i = 0; i < n; i++) {
        if (et == GGUF_VT_FLOAT32) {
            float v;
            memcpy(&v, data + 4 * i, 4);
            out_f[i] = v == v ? v : -FLT_MAX;
            continue;
        }
        int32_t v;
        memcpy(&v, data + 4 * i, 4);
        if (out_f) out_f[i] = (float)v;
        if (out_type) out_type[i] = (v >= 0 && v <= TOK_TYPE_BYTE) ? (uint8_t)v : 0;
    }
    return 0;
}

/*
 * An optional token id. Absent, -1 and 0xFFFFFFFF (how some converters write "none")
 * give -1; an id outside the vocabulary is an error when `required_in_range`, else
 * it is dropped with a warning (llama.cpp does the same for these).
 */
static int read_token_id(const td_tokenizer *t, const gguf_file *f, const char *key, int32_t *id,
                         bool required_in_range, td_err *err)
{
    int64_t v;
    int rc = gguf_get_i64(f, key, &v, err);
    if (rc == TD_ENOTFOUND) {
        td_err_clear(err);
        return 0;
    }
    if (rc) return rc;
    if (v == -1 || v == 0xFFFFFFFFll) {
        *id = -1;
        return 0;
    }
    if (v < 0 || v >= t->n_vocab) {
        if (required_in_range)
            return td_err_set(err, TD_EFORMAT, "%s = %lld is outside the vocabulary (%d tokens)",
                              key, (long long)v, t->n_vocab);
        TD_WARN("tokenizer: %s = %lld is outside the vocabulary (%d tokens); ignored", key,
                (long long)v, t->n_vocab);
        *id = -1;
        return 0;
    }
    *id = (int32_t)v;
    return 0;
}

static int read_bool(const gguf_file *f, const char *key, bool *out, td_err *err)
{
    int rc = gguf_get_bool(f, key, out, err);
    if (rc == TD_ENOTFOUND) {
        td_err_clear(err);
        return 0;
    }
    return rc;
}

typedef struct special_key {
    uint32_t len;
    int32_t id;
} special_key;

/* Special tokens: longest text first, then by id (llama.cpp sorts by length only). */
static int cmp_special(const void *a, const void *b)
{
    const special_key *x = a, *y = b;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

static void add_eog(td_tokenizer *t, int32_t id)
{
    if (id < 0) return;
    for (int i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id) return;
    if (t->n_eog < TOK_MAX_EOG) t->eog[t->n_eog++] = id;
}

static int build_special(td_tokenizer *t, td_err *err)
{
    int n = 0;
    for (int i = 0; i < t->n_vocab; i++) {
        uint8_t ty = t->types[i];
        uint32_t len;
        const char *s = tok__str(&t->text, (uint32_t)i, &len);
        /* Only tokens whose text is valid UTF-8 can be matched in (valid) text without
         * splitting a character, so the fragments around them stay valid too. */
        if ((ty == TOK_TYPE_CONTROL || ty == TOK_TYPE_UNKNOWN || ty == TOK_TYPE_USER_DEFINED) &&
            len > 0 && tok_utf8_valid_prefix(s, len) == len)
            n++;
    }
    t->special = malloc((size_t)(n ? n : 1) * sizeof(int32_t));
    special_key *keys = malloc((size_t)(n ? n : 1) * sizeof(special_key));
    if (!t->special || !keys) {
        free(keys);
        return td_err_set(err, TD_ENOMEM, "tokenizer: out of memory");
    }
    n = 0;
    for (int i = 0; i < t->n_vocab; i++) {
        uint8_t ty = t->types[i];
        uint32_t len;
        const char *s = tok__str(&t->text, (uint32_t)i, &len);
        if ((ty == TOK_TYPE_CONTROL || ty == TOK_TYPE_UNKNOWN || ty == TOK_TYPE_USER_DEFINED) &&
            len > 0 && tok_utf8_valid_prefix(s, len) == len)
            keys[n++] = (special_key){len, i};
    }
    qsort(keys, (size_t)n, sizeof(special_key), cmp_special);
    for (int i = 0; i < n; i++)
        t->special[i] = keys[i].id;
    t->n_special = n;
    free(keys);
    return 0;
}

/* The SentencePiece byte-fallback table: <0xNN>, else the 1-byte token, else unk. */
static int build_byte_tokens(td_tokenizer *t, td_err *err)
{
    for (int b = 0; b < 256; b++) {
        char name[8];
        static const char hex[] = "0123456789ABCDEF";
        name[0] = '<';
        name[1] = '0';
        name[2] = 'x';
        name[3] = hex[b >> 4];
        name[4] = hex[b & 15];
        name[5] = '>';
        int32_t id = tok__map_find(&t->text_map, name, 6);
        if (id < 0) {
            char c = (char)b;
            id = tok__map_find(&t->text_map, &c, 1);
        }
        t->byte_token[b] = id >= 0 ? id : t->unk;
    }
    /* A byte-type token must name its byte as <0xNN>, or decoding could not give it. */
    for (int i = 0; i < t->n_vocab; i++) {
        if (t->types[i] != TOK_TYPE_BYTE) continue;
        uint32_t len;
        const char *s = tok__str(&t->text, (uint32_t)i, &len);
        bool ok = len == 6 && memcmp(s, "<0x", 3) == 0 && s[5] == '>';
        for (int k = 3; k < 5 && ok; k++)
            ok = (s[k] >= '0' && s[k] <= '9') || (s[k] >= 'A' && s[k] <= 'F') ||
                 (s[k] >= 'a' && s[k] <= 'f');
        if (!ok) goto bad;
        continue;
    bad:
        return td_err_set(err, TD_EFORMAT, "token %d has the byte type but its text is not <0xNN>",
                          i);
    }
    return 0;
}

int tok_load(td_tokenizer **out, const gguf_file *f, td_err *err)
{
    int rc;
    *out = NULL;
    if (!f) return td_err_set(err, TD_EINVAL, "tok_load: no GGUF file");

    gguf_str model;
    rc = gguf_get_str(f, "tokenizer.ggml.model", &model, err);
    if (rc == TD_ENOTFOUND)
        return td_err_set(err, TD_EFORMAT, "the file has no tokenizer (tokenizer.ggml.model)");
    if (rc) return rc;

    td_tokenizer *t = calloc(1, sizeof(*t));
    if (!t) return td_err_set(err, TD_ENOMEM, "tokenizer: out of memory");
    t->bos = t->eos = t->unk = t->pad = t->eot = t->eom = -1;

    if (model.len == 5 && memcmp(model.ptr, "llama", 5) == 0) {
        t->kind = TOK_KIND_SPM;
    } else if (model.len == 4 && memcmp(model.ptr, "gpt2", 4) == 0) {
        t->kind = TOK_KIND_BPE;
    } else {
        rc = td_err_set(err, TD_EUNSUPPORTED,
                        "tokenizer model '%.*s' is not supported (only 'llama' and 'gpt2')",
                        (int)TD_MIN(model.len, 64), model.ptr);
        goto fail;
    }

    /* The vocabulary. */
    gguf_vtype et;
    uint64_t n;
    rc = gguf_get_arr(f, "tokenizer.ggml.tokens", &et, &n, err);
    if (rc == TD_ENOTFOUND) {
        rc = td_err_set(err, TD_EFORMAT, "the file has no tokenizer.ggml.tokens");
        goto fail;
    }
    if (rc) goto fail;
    if (et != GGUF_VT_STRING) {
        rc = td_err_set(err, TD_EFORMAT, "tokenizer.ggml.tokens is not a string array");
        goto fail;
    }
    if (n == 0 || n > (1u << 24)) {
        rc = td_err_set(err, TD_EFORMAT, "tokenizer.ggml.tokens has %llu tokens",
                        (unsigned long long)n);
        goto fail;
    }
    t->n_vocab = (int)n;
    if ((rc = strtab_from_gguf(&t->text, f, "tokenizer.ggml.tokens", n, err))) goto fail;
    t->scores = calloc(n, sizeof(float));
    t->types = malloc(n);
    if (!t->scores || !t->types) {
        rc = td_err_set(err, TD_ENOMEM, "tokenizer: out of memory");
        goto fail;
    }
    memset(t->types, TOK_TYPE_NORMAL, n);
    if ((rc = read_num_array(f, "tokenizer.ggml.scores", n, t->scores, NULL, err)) ||
        (rc = read_num_array(f, "tokenizer.ggml.token_type", n, NULL, t->types, err)))
        goto fail;

    uint32_t n_dups;
    if ((rc = map_build(&t->text_map, &t->text, &n_dups, err))) goto fail;
    if (n_dups)
        TD_WARN("tokenizer: %u duplicate token texts; the first id of each is used", n_dups);

    /* Special ids. SentencePiece files default to llama's 1/2/0. */
    if (t->kind == TOK_KIND_SPM) {
        t->bos = t->n_vocab > 1 ? 1 : -1;
        t->eos = t->n_vocab > 2 ? 2 : -1;
        t->unk = 0;
    }
    if ((rc = read_token_id(t, f, "tokenizer.ggml.bos_token_id", &t->bos, true, err)) ||
        (rc = read_token_id(t, f, "tokenizer.ggml.eos_token_id", &t->eos, true, err)) ||
        (rc = read_token_id(t, f, "tokenizer.ggml.unknown_token_id", &t->unk, true, err)) ||
        (rc = read_token_id(t, f, "tokenizer.ggml.padding_token_id", &t->pad, false, err)) ||
        (rc = read_token_id(t, f, "tokenizer.ggml.eot_token_id", &t->eot, false, err)) ||
        (rc = read_token_id(t, f, "tokenizer.ggml.eom_token_id", &t->eom, false, err)))
        goto fail;

    /* The pre-tokenizer name (BPE). */
    gguf_str pre = {"default", 7};
    bool has_pre = false;
    rc = gguf_get_str(f, "tokenizer.ggml.pre", &pre, err);
    if (rc == 0) {
        has_pre = true;
    } else if (rc == TD_ENOTFOUND) {
        td_err_clear(err);
        pre = (gguf_str){"default", 7};
    } else {
        goto fail;
    }
    size_t pre_len = TD_MIN(pre.len, sizeof(t->pre) - 1);
    memcpy(t->pre, pre.ptr, pre_len);
    t->pre[pre_len] = '\0';

    /* Flags, with llama.cpp's defaults: SentencePiece adds BOS and a space prefix. */
    t->add_bos = t->kind == TOK_KIND_SPM;
    t->add_eos = false;
    t->add_space_prefix = t->kind == TOK_KIND_SPM;
    if (t->kind == TOK_KIND_BPE) {
        if (!has_pre)
            TD_WARN("tokenizer: no tokenizer.ggml.pre; using the 'default' pre-tokenizer");
        if ((rc = tok__bpe_init(t, err))) goto fail; /* may set add_bos (llama3) */
    }
    if ((rc = read_bool(f, "tokenizer.ggml.add_bos_token", &t->add_bos, err)) ||
        (rc = read_bool(f, "tokenizer.ggml.add_eos_token", &t->add_eos, err)))
        goto fail;
    if (t->kind == TOK_KIND_SPM &&
        (rc = read_bool(f, "tokenizer.ggml.add_space_prefix", &t->add_space_prefix, err)))
        goto fail;
    if (t->add_bos && t->bos < 0) {
        rc = td_err_set(err, TD_EFORMAT,
                        "tokenizer.ggml.add_bos_token is true but there is no bos_token_id");
        goto fail;
    }
    if (t->add_eos && t->eos < 0) {
        rc = td_err_set(err, TD_EFORMAT,
                        "tokenizer.ggml.add_eos_token is true but there is no eos_token_id");
        goto fail;
    }

    /* BPE merges: the string "left right" of rank i. */
    if (t->kind == TOK_KIND_BPE) {
        rc = gguf_get_arr(f, "tokenizer.ggml.merges", &et, &n, err);
        if (rc == TD_ENOTFOUND) {
            rc = td_err_set(err, TD_EFORMAT, "a gpt2 tokenizer needs tokenizer.ggml.merges");
            goto fail;
        }
        if (rc) goto fail;
        if (et != GGUF_VT_STRING || n > (1u << 26)) {
            rc = td_err_set(err, TD_EFORMAT, "tokenizer.ggml.merges is not a string array");
            goto fail;
        }
        if ((rc = strtab_from_gguf(&t->merges, f, "tokenizer.ggml.merges", n, err))) goto fail;
        if ((rc = map_build(&t->merge_map, &t->merges, &n_dups, err))) goto fail;
    }

    /* End of generation: EOS, EOT, EOM and the usual end-of-turn names. */
    add_eog(t, t->eos);
    add_eog(t, t->eot);
    add_eog(t, t->eom);
    static const char *const eog_names[] = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>",
                                            "<|eom_id|>"};
    for (size_t i = 0; i < TD_ARRAY_LEN(eog_names); i++)
        add_eog(t, tok__map_find(&t->text_map, eog_names[i], strlen(eog_names[i])));

    if ((rc = build_special(t, err))) goto fail;
    if (t->kind == TOK_KIND_SPM && (rc = build_byte_tokens(t, err))) goto fail;
    if ((rc = tok__build_pieces(t, err))) goto fail;

    *out = t;
    return 0;
fail:
    tok_free(t);
    return rc;
}

/* ---- accessors ----------------------------------------------------------------- */

int tok_n_vocab(const td_tokenizer *t)
{
    return t->n_vocab;
}
int32_t tok_bos(const td_tokenizer *t)
{
    return t->bos;
}
int32_t tok_eos(const td_tokenizer *t)
{
    return t->eos;
}
bool tok_add_bos(const td_tokenizer *t)
{
    return t->add_bos;
}
bool tok_add_eos(const td_tokenizer *t)
{
    return t->add_eos;
}

bool tok_is_eog(const td_tokenizer *t, int32_t id)
{
    for (int i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id) return true;
    return false;
}

bool tok_is_control(const td_tokenizer *t, int32_t id)
{
    return id >= 0 && id < t->n_vocab && t->types[id] == TOK_TYPE_CONTROL;
}

int32_t tok_find(const td_tokenizer *t, const char *text, size_t len)
{
    return tok__map_find(&t->text_map, text, len);
}

const char *tok_text(const td_tokenizer *t, int32_t id, int *len)
{
    if (id < 0 || id >= t->n_vocab) {
        *len = 0;
        return NULL;
    }
    uint32_t l;
    const char *s = tok__str(&t->text, (uint32_t)id, &l);
    *len = (int)l;
    return s;
}

/* ---- UTF-8 ------------------------------------------------------------------- */

/*
 * Strict UTF-8 (RFC 3629): no overlong forms, no surrogates, nothing above
 * U+10FFFF. The second byte's range depends on the lead byte.
 */
size_t tok_utf8_valid_prefix(const char *s, size_t len)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;
    while (i < len) {
        unsigned c = p[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        unsigned lo, hi;
        int need = tok__utf8_lead(c, &lo, &hi);
        if (!need) return i;
        if ((size_t)need >= len - i) return i; /* truncated */
        if (p[i + 1] < lo || p[i + 1] > hi) return i;
        for (int k = 2; k <= need; k++)
            if ((p[i + k] & 0xC0) != 0x80) return i;
        i += (size_t)need + 1;
    }
    return i;
}

int tok__utf8_put(uint32_t cp, char *out)
{
    unsigned char *o = (unsigned char *)out;
    if (cp < 0x80) {
        o[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (unsigned char)(0xC0 | (cp >> 6));
        o[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xE0 | (cp >> 12));
        o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (unsigned char)(0xF0 | (cp >> 18));
    o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

/* ---- special-token splitting --------------------------------------------------- */

/* A piece of the input: raw text to tokenize, or one special token. */
typedef struct fragment {
    int32_t token; /* -1 for raw text */
    size_t off, len;
} fragment;

typedef struct occurrence {
    int order; /* the token's place in t->special */
    size_t pos;
} occurrence;

static int cmp_occurrence(const void *a, const void *b)
{
    const occurrence *x = a, *y = b;
    if (x->order != y->order) return x->order < y->order ? -1 : 1;
    return x->pos < y->pos ? -1 : x->pos > y->pos;
}

static int cmp_occurrence_pos(const void *a, const void *b)
{
    const occurrence *x = a, *y = b;
    return x->pos < y->pos ? -1 : x->pos > y->pos;
}

static bool special_allowed(const td_tokenizer *t, int32_t id, bool parse_special)
{
    /* User-defined tokens are always split out, as llama.cpp and HF tokenizers do;
     * control and unknown ones only when the caller asks for special parsing. */
    return parse_special || t->types[id] == TOK_TYPE_USER_DEFINED;
}

static int push_occurrence(occurrence **occ, size_t *n, size_t *cap, int order, size_t pos)
{
    if (*n == *cap) {
        size_t ncap = *cap ? *cap * 2 : 16;
        occurrence *no = realloc(*occ, ncap * sizeof(**occ));
        if (!no) return TD_ENOMEM;
        *occ = no;
        *cap = ncap;
    }
    (*occ)[(*n)++] = (occurrence){order, pos};
    return 0;
}

/*
 * Split text into raw fragments and special tokens, with llama.cpp's result: it
 * takes the special tokens longest first, and splits every raw fragment on each
 * non-overlapping occurrence, left to right. Instead of searching the text once per
 * special token (thousands of them in some vocabularies) we find every occurrence
 * in one pass, looking up the text's prefixes of each special-token length in the
 * vocabulary map at positions whose byte starts some special token; then replay
 * llama.cpp's order over the occurrences, claiming bytes as tokens take them.
 */
static int partition(const td_tokenizer *t, const char *text, size_t len, bool parse_special,
                     fragment **out_frags, size_t *out_n, td_err *err)
{
    fragment *frags = NULL;
    occurrence *occ = NULL;
    unsigned char *claimed = NULL;
    int *order_of = NULL;
    size_t n_occ = 0, cap_occ = 0, n_frags = 0;

    /* The distinct lengths of the special tokens that can occur, and their first bytes. */
    uint32_t lens[64];
    int n_lens = 0;
    bool many_lens = false, any = false;
    uint8_t first_byte[32] = {0};
    for (int k = 0; k < t->n_special; k++) {
        int32_t id = t->special[k];
        uint32_t l;
        const char *s = tok__str(&t->text, (uint32_t)id, &l);
        if (!special_allowed(t, id, parse_special) || l > len) continue;
        any = true;
        first_byte[(unsigned char)s[0] >> 3] |= (uint8_t)(1u << ((unsigned char)s[0] & 7));
        bool seen = false;
        for (int i = 0; i < n_lens && !seen; i++)
            seen = lens[i] == l;
        if (!seen) {
            if (n_lens < (int)TD_ARRAY_LEN(lens))
                lens[n_lens++] = l;
            else
                many_lens = true;
        }
    }

    if (any && !many_lens) {
        order_of = malloc((size_t)t->n_vocab * sizeof(int));
        if (!order_of) goto nomem;
        for (int i = 0; i < t->n_vocab; i++)
            order_of[i] = -1;
        for (int k = 0; k < t->n_special; k++)
            order_of[t->special[k]] = k;
    }
    for (size_t p = 0; any && p < len; p++) {
        unsigned char c = (unsigned char)text[p];
        if (!(first_byte[c >> 3] & (1u << (c & 7)))) continue;
        if (!many_lens) {
            for (int i = 0; i < n_lens; i++) {
                if (lens[i] > len - p) continue;
                int32_t id = tok__map_find(&t->text_map, text + p, lens[i]);
                if (id < 0 || order_of[id] < 0 || !special_allowed(t, id, parse_special)) continue;
                if (push_occurrence(&occ, &n_occ, &cap_occ, order_of[id], p)) goto nomem;
            }
        } else {
            /* Too many distinct lengths for the map: compare each candidate. */
            for (int k = 0; k < t->n_special; k++) {
                int32_t id = t->special[k];
                uint32_t l;
                const char *s = tok__str(&t->text, (uint32_t)id, &l);
                if (l > len - p || (unsigned char)s[0] != c || memcmp(s, text + p, l) != 0 ||
                    !special_allowed(t, id, parse_special))
                    continue;
                if (push_occurrence(&occ, &n_occ, &cap_occ, k, p)) goto nomem;
            }
        }
    }

    if (n_occ == 0) {
        frags = malloc(sizeof(*frags));
        if (!frags) goto nomem;
        if (len > 0) frags[n_frags++] = (fragment){-1, 0, len};
        goto done;
    }

    /* Replay: tokens in llama.cpp's order, each one's occurrences left to right. An
     * occurrence is taken when none of its bytes is taken yet: then it lies inside
     * one raw fragment and does not overlap an earlier match of the same token. */
    qsort(occ, n_occ, sizeof(*occ), cmp_occurrence);
    claimed = calloc(len, 1);
    frags = malloc((2 * n_occ + 1) * sizeof(*frags));
    if (!claimed || !frags) goto nomem;
    size_t n_taken = 0;
    for (size_t i = 0; i < n_occ; i++) {
        int32_t id = t->special[occ[i].order];
        uint32_t l = t->text.off[id + 1] - t->text.off[id];
        size_t p = occ[i].pos;
        bool free_run = true;
        for (uint32_t k = 0; k < l && free_run; k++)
            free_run = claimed[p + k] == 0;
        if (!free_run) continue;
        memset(claimed + p, 1, l);
        occ[n_taken].order = id; /* from here on: the token id */
        occ[n_taken].pos = p;
        n_taken++;
    }
    /* Taken occurrences never overlap, so sorting by position gives the text order. */
    n_occ = n_taken;
    qsort(occ, n_occ, sizeof(*occ), cmp_occurrence_pos);
    size_t p = 0;
    for (size_t i = 0; i <= n_occ; i++) {
        size_t next = i < n_occ ? occ[i].pos : len;
        if (next > p) frags[n_frags++] = (fragment){-1, p, next - p};
        if (i == n_occ) break;
        uint32_t l = t->text.off[occ[i].order + 1] - t->text.off[occ[i].order];
        frags[n_frags++] = (fragment){occ[i].order, next, l};
        p = next + l;
    }
    goto done;

nomem:
    free(frags);
    frags = NULL;
    n_frags = 0;
    free(occ);
    free(claimed);
    free(order_of);
    return td_err_set(err, TD_ENOMEM, "tokenizer: out of memory");
done:
    free(occ);
    free(claimed);
    free(order_of);
    *out_frags = frags;
    *out_n = n_frags;
    return 0;
}

/* ---- encoding ------------------------------------------------------------------ */

int tok_encode(const td_tokenizer *t, const char *text, size_t len, bool add_special,
               bool parse_special, int32_t *out, int cap, td_err *err)
{
    if (!t || (!text && len) || cap < 0 || (cap > 0 && !out))
        return td_err_set(err, TD_EINVAL, "tok_encode: bad arguments");
    /* Each byte gives at most one token (plus BOS/EOS), so the count fits an int. */
    if (len > (size_t)INT_MAX / 4)
        return td_err_set(err, TD_ETOOLARGE, "tok_encode: %zu bytes of text is too long", len);
    size_t valid = tok_utf8_valid_prefix(text, len);
    if (valid != len)
        return td_err_set(err, TD_EINVAL, "invalid UTF-8 in the text at byte offset %zu (0x%02x)",
                          valid, (unsigned char)text[valid]);

    fragment *frags = NULL;
    size_t n_frags = 0;
    int rc = partition(t, text, len, parse_special, &frags, &n_frags, err);
    if (rc) return rc;

    tok__out o = {out, cap, 0};
    if (add_special && t->add_bos) tok__emit(&o, t->bos);
    bool prev_special = true; /* SentencePiece prefixes a space at the start and after specials */
    for (size_t i = 0; i < n_frags && rc == 0; i++) {
        const fragment *fr = &frags[i];
        if (fr->token >= 0) {
            tok__emit(&o, fr->token);
            prev_special = true;
            continue;
        }
        if (t->kind == TOK_KIND_SPM) {
            rc = tok__spm_encode(t, text + fr->off, fr->len, t->add_space_prefix && prev_special,
                                 &o, err);
        } else {
            rc = tok__bpe_encode(t, text + fr->off, fr->len, &o, err);
        }
        prev_special = false;
    }
    free(frags);
    if (rc) return rc;
    if (add_special && t->add_eos) tok__emit(&o, t->eos);
    return o.n;
}
