/*
 * model/tok_bpe.c - byte-level BPE (tokenizer.ggml.model = gpt2), as llama.cpp
 * runs it (llm_tokenizer_bpe):
 *
 *  1. pre-tokenize: the regexes named by tokenizer.ggml.pre split the text in
 *     sequence, each one splitting every piece the previous one produced; text
 *     between two matches is a piece of its own;
 *  2. each piece (a "word") is mapped byte by byte through GPT-2's
 *     bytes_to_unicode, so every byte becomes one printable character;
 *  3. adjacent symbols merge by rank (the index of "left right" in
 *     tokenizer.ggml.merges), lowest rank first, leftmost on ties;
 *  4. each final symbol is looked up in the vocabulary.
 *
 * The regexes run on PCRE2 (UTF + UCP, JIT-compiled when the platform allows).
 * llama.cpp runs them on its own Unicode tables, in which "whitespace" is exactly
 * Unicode's White_Space property; PCRE2's \s also matches U+180E, so \s and \S are
 * rewritten to an explicit class before compiling.
 */
#include "model/tok_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- pre-tokenizers ------------------------------------------------------------ */

#define RE_GPT2 "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
#define RE_LLAMA3                                                                                  \
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"     \
    "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define RE_QWEN2                                                                                   \
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"     \
    "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define RE_TEKKEN_WORDS                                                                            \
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+"                         \
    "|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*"
#define RE_CONTRACTIONS "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
/*
 * CJK ranges of the deepseek pre-tokenizers: U+4E00-U+9FA5, U+0800-U+4E00 and
 * U+AC00-U+D7FF. llama.cpp replaces non-ASCII whitespace in the text by U+000B
 * before running regexes that have no \p{..} class, so such characters never
 * match a literal range; the middle range is therefore written without the
 * White_Space code points it spans (U+1680, U+2000-U+200A, U+2028, U+2029,
 * U+202F, U+205F, U+3000).
 */
#define RE_CJK                                                                                     \
    "[\\x{4E00}-\\x{9FA5}\\x{0800}-\\x{167F}\\x{1681}-\\x{1FFF}\\x{200B}-\\x{2027}"                \
    "\\x{202A}-\\x{202E}\\x{2030}-\\x{205E}\\x{2060}-\\x{2FFF}\\x{3001}-\\x{4E00}"                 \
    "\\x{AC00}-\\x{D7FF}]+"

typedef struct pre_tokenizer {
    const char *names[12];
    const char *regex[TOK_MAX_REGEX];
    bool ignore_merges;
    bool add_bos;
} pre_tokenizer;

static const pre_tokenizer k_pre[] = {
    {{"gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "roberta-bpe", "jina-v1-en", "jina-v2-code",
      "jina-es", "jina-de"},
     {RE_GPT2},
     false,
     false},
    {{"jina-v2-es", "jina-v2-de", "gigachat", "a.x-4.0", "mellum", "modern-bert", "exaone4",
      "trillion", "granite-docling"},
     {RE_GPT2},
     false,
     false},
    {{"default"},
     {"[\\p{P}\\$\\+<=>\\^~\\|]+", RE_GPT2, "\\p{N}+", "[0-9][0-9][0-9]"},
     false,
     false},
    {{"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"},
     {RE_LLAMA3},
     true,
     true},
    {{"dbrx", "smaug-bpe", "glm4", "chatglm-bpe"}, {RE_LLAMA3}, false, false},
    {{"qwen2", "deepseek-r1-qwen", "stablelm2", "hunyuan", "megrez", "kormo"},
     {RE_QWEN2},
     false,
     false},
    {{"deepseek-llm"},
     {"[\\r\\n]",
      "\\s?[A-Za-z\\x{B5}\\x{C0}-\\x{D6}\\x{D8}-\\x{F6}\\x{F8}-\\x{1BA}"
      "\\x{1BC}-\\x{1BF}\\x{1C4}-\\x{293}\\x{295}-\\x{2AF}\\x{370}-\\x{373}"
      "\\x{376}\\x{377}\\x{37B}-\\x{37D}\\x{37F}\\x{386}\\x{388}-\\x{38A}"
      "\\x{38C}\\x{38E}-\\x{3A1}\\x{3A3}-\\x{3F5}\\x{3F7}-\\x{481}"
      "\\x{48A}-\\x{52F}\\x{531}-\\x{556}\\x{10A0}-\\x{10C5}"
      "\\x{13A0}-\\x{13F5}\\x{13F8}-\\x{13FD}\\x{1C90}-\\x{1CBA}"
      "\\x{1CBD}-\\x{1CBF}\\x{1D00}-\\x{1D2B}\\x{1D6B}-\\x{1D77}"
      "\\x{1D79}-\\x{1D9A}\\x{1E00}-\\x{1F15}\\x{1F18}-\\x{1F1D}"
      "\\x{1F20}-\\x{1F45}\\x{1F48}-\\x{1F4D}\\x{1F50}-\\x{1F57}\\x{1F59}"
      "\\x{1F5B}\\x{1F5D}\\x{1F5F}-\\x{1F7D}\\x{1F80}-\\x{1FB4}"
      "\\x{1FB6}-\\x{1FBC}\\x{1FBE}\\x{1FC2}-\\x{1FC4}\\x{1FC6}-\\x{1FCC}"
      "\\x{1FD0}-\\x{1FD3}\\x{1FD6}-\\x{1FDB}\\x{1FE0}-\\x{1FEC}"
      "\\x{1FF2}-\\x{1FF4}\\x{1FF6}-\\x{1FFC}\\x{2102}\\x{2107}"
      "\\x{210A}-\\x{2113}\\x{2115}\\x{2119}-\\x{211D}\\x{2124}\\x{2126}"
      "\\x{2128}\\x{212A}-\\x{212D}\\x{212F}-\\x{2134}\\x{2139}"
      "\\x{213C}-\\x{213F}\\x{2145}-\\x{2149}\\x{214E}\\x{2183}\\x{2184}"
      "\\x{2C00}-\\x{2C7B}\\x{2C7E}-\\x{2CE4}\\x{2CEB}-\\x{2CEE}\\x{2CF2}"
      "\\x{2CF3}\\x{A640}-\\x{A66D}\\x{A680}-\\x{A69B}\\x{A722}-\\x{A76F}"
      "\\x{A771}-\\x{A787}\\x{A78B}-\\x{A78E}\\x{AB70}-\\x{ABBF}"
      "\\x{FB00}-\\x{FB06}\\x{FB13}-\\x{FB17}\\x{FF21}-\\x{FF3A}"
      "\\x{FF41}-\\x{FF5A}\\x{10400}-\\x{1044F}\\x{104B0}-\\x{104D3}"
      "\\x{104D8}-\\x{104FB}\\x{10C80}-\\x{10CB2}\\x{10CC0}-\\x{10CF2}"
      "\\x{118A0}-\\x{118DF}\\x{1E900}-\\x{1E943}]+",
      /* llama.cpp's range is U+3000-U+3002; U+3000 is whitespace (see RE_CJK). */
      "\\s?[!-/:-~\\x{FF01}-\\x{FF0F}\\x{FF1A}-\\x{FF5E}\\x{2018}-\\x{201F}\\x{3001}-\\x{3002}]+",
      "\\s+$", RE_CJK, "\\p{N}+"},
     false,
     false},
    {{"deepseek-coder"},
     {"[\\r\\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", RE_CJK, "\\p{N}"},
     false,
     false},
    {{"deepseek-v3"},
     {"\\p{N}{1,3}", "[\\x{4E00}-\\x{9FA5}\\x{3040}-\\x{309F}\\x{30A0}-\\x{30FF}]+",
      "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}"
      "\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     false,
     false},
    {{"falcon"}, {"[\\p{P}\\$\\+<=>\\^~\\|`]+", RE_GPT2, "[0-9][0-9][0-9]"}, false, false},
    {{"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"},
     {"\\p{N}", RE_GPT2},
     false,
     false},
    {{"poro-chat", "bloom", "gpt3-finnish"},
     {" ?[^(\\s|.,!?\\x{2026}\\x{3002}\\x{FF0C}\\x{3001}\\x{964}\\x{6D4}\\x{60C})]+"},
     false,
     false},
    {{"viking"},
     {" ?[^(\\s|.,!?\\x{2026}\\x{3002}\\x{FF0C}\\x{3001}\\x{964}\\x{6D4}\\x{60C})]+", "\\p{N}"},
     false,
     false},
    {{"tekken"},
     {RE_TEKKEN_WORDS "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     true,
     true},
    {{"gpt-4o", "llama4"},
     {"[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+" RE_CONTRACTIONS
      "?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*" RE_CONTRACTIONS
      "?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     false,
     false},
};

/* Unicode White_Space, as a character-class body. */
#define WS_CLASS                                                                                   \
    "\\t\\n\\x0B\\f\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}"      \
    "\\x{205F}\\x{3000}"

/* Rewrite \s and \S to explicit classes. Returns a malloc'd pattern, or NULL. */
static char *rewrite_whitespace(const char *src)
{
    size_t n = strlen(src), cap = n * 2 + 1;
    for (size_t i = 0; i + 1 < n; i++)
        if (src[i] == '\\' && (src[i + 1] == 's' || src[i + 1] == 'S')) cap += sizeof(WS_CLASS) + 4;
    char *dst = malloc(cap), *w = dst;
    if (!dst) return NULL;
    bool in_class = false;
    for (size_t i = 0; i < n; i++) {
        char c = src[i];
        if (c == '\\' && i + 1 < n) {
            char e = src[i + 1];
            i++;
            if (e == 's' || (e == 'S' && !in_class)) {
                const char *open = in_class ? "" : (e == 's' ? "[" : "[^");
                w += sprintf(w, "%s%s%s", open, WS_CLASS, in_class ? "" : "]");
            } else {
                TD_ASSERT(e != 'S'); /* \S inside a class: not used by any pattern */
                *w++ = c;
                *w++ = e;
            }
            continue;
        }
        if (c == '[' && !in_class) {
            in_class = true;
            *w++ = c;
            if (i + 1 < n && src[i + 1] == '^') *w++ = src[++i];
            continue;
        }
        if (c == ']' && in_class) in_class = false;
        *w++ = c;
    }
    *w = '\0';
    return dst;
}

int tok__bpe_init(td_tokenizer *t, td_err *err)
{
    const pre_tokenizer *pt = NULL;
    for (size_t i = 0; i < TD_ARRAY_LEN(k_pre) && !pt; i++)
        for (size_t k = 0; k < TD_ARRAY_LEN(k_pre[i].names) && k_pre[i].names[k]; k++)
            if (strcmp(k_pre[i].names[k], t->pre) == 0) pt = &k_pre[i];
    if (!pt) {
        TD_WARN("tokenizer: unknown pre-tokenizer '%s'; using the gpt-2 split rules", t->pre);
        pt = &k_pre[0];
    }
    t->ignore_merges = pt->ignore_merges;
    t->add_bos = pt->add_bos;
    for (int i = 0; i < TOK_MAX_REGEX && pt->regex[i]; i++) {
        char *pattern = rewrite_whitespace(pt->regex[i]);
        if (!pattern) return td_err_set(err, TD_ENOMEM, "tokenizer: out of memory");
        int ecode;
        PCRE2_SIZE eoff;
        /* DOLLAR_ENDONLY: "$" is the end of the piece, as in std::regex (deepseek's \s+$). */
        pcre2_code *re =
            pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED,
                          PCRE2_UTF | PCRE2_UCP | PCRE2_DOLLAR_ENDONLY, &ecode, &eoff, NULL);
        free(pattern);
        if (!re) {
            PCRE2_UCHAR msg[128];
            pcre2_get_error_message(ecode, msg, sizeof(msg));
            return td_err_set(err, TD_EUNSUPPORTED,
                              "pre-tokenizer '%s': regex %d does not compile at offset %zu: %s",
                              t->pre, i, (size_t)eoff, (const char *)msg);
        }
        /* JIT is an optimisation only: without it the interpreter gives the same matches. */
        if (pcre2_jit_compile(re, PCRE2_JIT_COMPLETE) != 0)
            TD_DEBUG("tokenizer: PCRE2 JIT unavailable for pre-tokenizer regex %d", i);
        t->regex[t->n_regex++] = re;
    }
    return 0;
}

void tok__bpe_free(td_tokenizer *t)
{
    for (int i = 0; i < t->n_regex; i++)
        pcre2_code_free(t->regex[i]);
    t->n_regex = 0;
}

/* ---- splitting ----------------------------------------------------------------- */

typedef struct span {
    size_t off, len;
} span;

typedef struct span_vec {
    span *v;
    size_t n, cap;
} span_vec;

static int span_push(span_vec *s, size_t off, size_t len)
{
    if (s->n == s->cap) {
        size_t ncap = s->cap ? s->cap * 2 : 64;
        span *nv = realloc(s->v, ncap * sizeof(span));
        if (!nv) return TD_ENOMEM;
        s->v = nv;
        s->cap = ncap;
    }
    s->v[s->n++] = (span){off, len};
    return 0;
}

/* Split each span of `in` by one regex into `out`: matches and the gaps between them. */
static int split_by(const td_tokenizer *t, const pcre2_code *re, pcre2_match_data *md,
                    const char *text, const span_vec *in, span_vec *out, td_err *err)
{
    out->n = 0;
    for (size_t i = 0; i < in->n; i++) {
        const span sp = in->v[i];
        PCRE2_SPTR subject = (PCRE2_SPTR)(text + sp.off);
        size_t start = 0, prev_end = 0;
        while (start < sp.len) {
            int rc = pcre2_match(re, subject, sp.len, start, PCRE2_NO_UTF_CHECK, md, NULL);
            if (rc == PCRE2_ERROR_NOMATCH) break;
            if (rc ==
                PCRE2_ERROR_JIT_STACKLIMIT) /* deep backtracking: the heap-based interpreter */
                rc = pcre2_match(re, subject, sp.len, start, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md,
                                 NULL);
            if (rc < 0 && rc != PCRE2_ERROR_NOMATCH) {
                PCRE2_UCHAR msg[128];
                pcre2_get_error_message(rc, msg, sizeof(msg));
                return td_err_set(err, TD_ETOOLARGE,
                                  "pre-tokenizer '%s' failed on a %zu-byte piece: %s", t->pre,
                                  sp.len, (const char *)msg);
            }
            if (rc == PCRE2_ERROR_NOMATCH) break;
            const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
            size_t ms = ov[0], me = ov[1];
            if (ms < prev_end || me < ms || me > sp.len) break; /* cannot happen; be safe */
            if (ms > prev_end && span_push(out, sp.off + prev_end, ms - prev_end)) goto nomem;
            if (me > ms && span_push(out, sp.off + ms, me - ms)) goto nomem;
            prev_end = me;
            if (me > start) {
                start = me;
            } else if (me >= sp.len) {
                break;
            } else {
                /* An empty match: step over one character (the text is valid UTF-8). */
                start = me + (size_t)tok__utf8_len(subject[me]);
            }
        }
        if (prev_end < sp.len && span_push(out, sp.off + prev_end, sp.len - prev_end)) goto nomem;
    }
    return 0;
nomem:
    return td_err_set(err, TD_ENOMEM, "tokenizer: out of memory");
}

/* ---- bytes_to_unicode ---------------------------------------------------------- */

/*
 * GPT-2's bytes_to_unicode: printable bytes ('!'..'~', U+00A1..U+00AC,
 * U+00AE..U+00FF) map to themselves, the other 68 to U+0100 onwards in byte order.
 */
static uint32_t byte_to_cp(unsigned b)
{
    if ((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE) return b;
    if (b <= 0x20) return 256 + b;              /* 0x00..0x20 -> U+0100..U+0120 */
    if (b >= 0x7F && b <= 0xA0) return b + 162; /* 0x7F..0xA0 -> U+0121..U+0142 */
    return 323;                                 /* 0xAD -> U+0143 */
}

static int cp_to_byte(uint32_t cp)
{
    if ((cp >= 0x21 && cp <= 0x7E) || (cp >= 0xA1 && cp <= 0xAC) || (cp >= 0xAE && cp <= 0xFF))
        return (int)cp;
    if (cp >= 256 && cp <= 288) return (int)(cp - 256);
    if (cp >= 289 && cp <= 322) return (int)(cp - 162);
    if (cp == 323) return 0xAD;
    return -1;
}

int tok__bpe_unmap(const char *text, int len, char *out)
{
    const unsigned char *p = (const unsigned char *)text;
    int i = 0, w = 0;
    while (i < len) {
        int n = tok__utf8_len(p[i]);
        if (n > len - i || tok_utf8_valid_prefix(text + i, (size_t)n) != (size_t)n) {
            out[w++] = text[i++]; /* not UTF-8: keep the byte */
            continue;
        }
        uint32_t cp;
        if (n == 1)
            cp = p[i];
        else if (n == 2)
            cp = ((p[i] & 0x1Fu) << 6) | (p[i + 1] & 0x3Fu);
        else
            cp = 0x10000000; /* 3- and 4-byte characters are never mapped bytes */
        int b = cp_to_byte(cp);
        if (b >= 0) {
            out[w++] = (char)b;
        } else {
            memcpy(out + w, text + i, (size_t)n);
            w += n;
        }
        i += n;
    }
    return w;
}

/* ---- merging ------------------------------------------------------------------- */

typedef struct bpe_symbol {
    int prev, next;
    uint32_t start, n; /* bytes in the encoded word; n = 0 once merged away */
} bpe_symbol;

typedef struct bpe_bigram {
    int32_t rank;
    int left, right;
    uint32_t size;
} bpe_bigram;

typedef struct bpe_work {
    char *enc; /* the encoded word */
    char *key; /* "left right" for merge lookups */
    bpe_symbol *sym;
    bpe_bigram *heap;
    size_t n_heap, cap_heap;
    size_t cap_bytes; /* capacity of the buffers, in source bytes */
} bpe_work;

/* Lower rank first, then the leftmost pair. */
static bool bigram_before(const bpe_bigram *a, const bpe_bigram *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static void heap_push(bpe_work *w, bpe_bigram b)
{
    TD_ASSERT(w->n_heap < w->cap_heap);
    size_t i = w->n_heap++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!bigram_before(&b, &w->heap[parent])) break;
        w->heap[i] = w->heap[parent];
        i = parent;
    }
    w->heap[i] = b;
}

static bpe_bigram heap_pop(bpe_work *w)
{
    bpe_bigram top = w->heap[0];
    bpe_bigram last = w->heap[--w->n_heap];
    size_t i = 0, n = w->n_heap;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, best = i;
        const bpe_bigram *bb = &last;
        if (l < n && bigram_before(&w->heap[l], bb)) {
            best = l;
            bb = &w->heap[l];
        }
        if (r < n && bigram_before(&w->heap[r], bb)) best = r;
        if (best == i) break;
        w->heap[i] = w->heap[best];
        i = best;
    }
    if (n > 0) w->heap[i] = last;
    return top;
}

static void add_bigram(const td_tokenizer *t, bpe_work *w, int left, int right)
{
    if (left < 0 || right < 0) return;
    const bpe_symbol *l = &w->sym[left], *r = &w->sym[right];
    memcpy(w->key, w->enc + l->start, l->n);
    w->key[l->n] = ' ';
    memcpy(w->key + l->n + 1, w->enc + r->start, r->n);
    int32_t rank = tok__map_find(&t->merge_map, w->key, l->n + 1 + r->n);
    if (rank < 0) return;
    heap_push(w, (bpe_bigram){rank, left, right, l->n + r->n});
}

static int work_reserve(bpe_work *w, size_t bytes)
{
    if (bytes <= w->cap_bytes) return 0;
    free(w->enc);
    free(w->key);
    free(w->sym);
    free(w->heap);
    w->enc = malloc(2 * bytes);
    w->key = malloc(2 * bytes + 1);
    w->sym = malloc(bytes * sizeof(bpe_symbol));
    w->cap_heap = 3 * bytes + 1;
    w->heap = malloc(w->cap_heap * sizeof(bpe_bigram));
    w->cap_bytes = bytes;
    if (!w->enc || !w->key || !w->sym || !w->heap) {
        w->cap_bytes = 0;
        return TD_ENOMEM;
    }
    return 0;
}

static void encode_word(const td_tokenizer *t, bpe_work *w, const char *word, size_t len,
                        tok__out *out)
{
    /* Map bytes to characters: one symbol per source byte. */
    size_t enc_len = 0;
    for (size_t i = 0; i < len; i++) {
        int n = tok__utf8_put(byte_to_cp((unsigned char)word[i]), w->enc + enc_len);
        w->sym[i] =
            (bpe_symbol){(int)i - 1, i + 1 < len ? (int)i + 1 : -1, (uint32_t)enc_len, (uint32_t)n};
        enc_len += (size_t)n;
    }

    if (t->ignore_merges) {
        int32_t id = tok__map_find(&t->text_map, w->enc, enc_len);
        if (id >= 0) {
            tok__emit(out, id);
            return;
        }
    }

    w->n_heap = 0;
    for (size_t i = 1; i < len; i++)
        add_bigram(t, w, (int)i - 1, (int)i);
    while (w->n_heap > 0) {
        bpe_bigram b = heap_pop(w);
        bpe_symbol *l = &w->sym[b.left], *r = &w->sym[b.right];
        if (l->n == 0 || r->n == 0 || l->n + r->n != b.size) continue; /* stale */
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0) w->sym[r->next].prev = b.left;
        add_bigram(t, w, l->prev, b.left);
        add_bigram(t, w, b.left, l->next);
    }

    for (int i = 0; i != -1; i = w->sym[i].next) {
        const bpe_symbol *s = &w->sym[i];
        int32_t id = tok__map_find(&t->text_map, w->enc + s->start, s->n);
        if (id >= 0) {
            tok__emit(out, id);
            continue;
        }
        /* Not a token: llama.cpp looks up each byte of the encoded text on its own. */
        for (uint32_t k = 0; k < s->n; k++) {
            int32_t bid = tok__map_find(&t->text_map, w->enc + s->start + k, 1);
            if (bid >= 0) tok__emit(out, bid);
        }
    }
}

/* Apply the pre-tokenizer's regexes in sequence; the words end up in *a. */
static int pretokenize(const td_tokenizer *t, const char *text, size_t len, span_vec *a,
                       td_err *err)
{
    span_vec b = {0};
    int rc = 0;
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    if (!md || span_push(a, 0, len)) {
        rc = td_err_set(err, TD_ENOMEM, "tokenizer: out of memory");
        goto done;
    }
    for (int i = 0; i < t->n_regex; i++) {
        if ((rc = split_by(t, t->regex[i], md, text, a, &b, err))) goto done;
        span_vec tmp = *a;
        *a = b;
        b = tmp;
    }
done:
    pcre2_match_data_free(md);
    free(b.v);
    return rc;
}

int tok__bpe_split(const td_tokenizer *t, const char *text, size_t len, size_t **words, size_t *n,
                   td_err *err)
{
    span_vec a = {0};
    *words = NULL;
    *n = 0;
    int rc = len ? pretokenize(t, text, len, &a, err) : 0;
    if (rc) {
        free(a.v);
        return rc;
    }
    *words = malloc((a.n ? a.n : 1) * 2 * sizeof(size_t));
    if (!*words) {
        free(a.v);
        return td_err_set(err, TD_ENOMEM, "tokenizer: out of memory");
    }
    for (size_t i = 0; i < a.n; i++) {
        (*words)[2 * i] = a.v[i].off;
        (*words)[2 * i + 1] = a.v[i].len;
    }
    *n = a.n;
    free(a.v);
    return 0;
}

int tok__bpe_encode(const td_tokenizer *t, const char *text, size_t len, tok__out *out, td_err *err)
{
    if (len == 0) return 0;
    span_vec a = {0};
    bpe_work w = {0};
    int rc = pretokenize(t, text, len, &a, err);
    if (rc) goto done;
    size_t longest = 0;
    for (size_t i = 0; i < a.n; i++)
        longest = TD_MAX(longest, a.v[i].len);
    if (work_reserve(&w, longest)) {
        rc = td_err_set(err, TD_ENOMEM, "tokenizer: out of memory");
        goto done;
    }
    for (size_t i = 0; i < a.n; i++)
        if (a.v[i].len > 0) encode_word(t, &w, text + a.v[i].off, a.v[i].len, out);
done:
    free(a.v);
    free(w.enc);
    free(w.key);
    free(w.sym);
    free(w.heap);
    return rc;
}
