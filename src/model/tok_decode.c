/*
 * model/tok_decode.c - from ids back to text: token pieces, whole-sequence
 * decoding and the streaming detokenizer.
 *
 * Every token's piece (the bytes it stands for, special tokens rendered as their
 * text) is computed once at load time, so decoding a token in the serving loop is
 * a table lookup and a copy, with no allocation.
 */
#include "model/tok_impl.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

/* The bytes of token id, special tokens included (no skip_special filtering here). */
static int piece_of(const td_tokenizer *t, int32_t id, char *out)
{
    uint32_t len;
    const char *s = tok__str(&t->text, (uint32_t)id, &len);
    switch (t->types[id]) {
    case TOK_TYPE_CONTROL:
    case TOK_TYPE_UNKNOWN:
    case TOK_TYPE_USER_DEFINED:
        memcpy(out, s, len);
        return (int)len;
    case TOK_TYPE_BYTE:
        if (len == 6 && memcmp(s, "<0x", 3) == 0 && s[5] == '>') {
            int v = 0;
            for (int k = 3; k < 5; k++) {
                char c = s[k];
                v = v * 16 + (c >= '0' && c <= '9'   ? c - '0'
                              : c >= 'a' && c <= 'f' ? c - 'a' + 10
                              : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                                     : 0);
            }
            out[0] = (char)v;
            return 1;
        }
        memcpy(out, s, len); /* a gpt2 vocabulary may mark odd tokens as bytes */
        return (int)len;
    case TOK_TYPE_NORMAL:
        if (t->kind == TOK_KIND_BPE) return tok__bpe_unmap(s, (int)len, out);
        {
            /* SentencePiece: U+2581 (e2 96 81) is a space. */
            int w = 0;
            for (uint32_t i = 0; i < len;) {
                if (i + 2 < len && memcmp(s + i, "\xe2\x96\x81", 3) == 0) {
                    out[w++] = ' ';
                    i += 3;
                } else {
                    out[w++] = s[i++];
                }
            }
            return w;
        }
    default:
        return 0; /* unused and undefined tokens render as nothing, as in llama.cpp */
    }
}

int tok__build_pieces(td_tokenizer *t, td_err *err)
{
    /* A piece is never longer than its token text. */
    size_t total = t->text.off[t->n_vocab];
    tok__strtab *p = &t->pieces;
    p->n = (uint32_t)t->n_vocab;
    p->data = malloc(total + 1);
    p->off = malloc(((size_t)t->n_vocab + 1) * sizeof(uint32_t));
    if (!p->data || !p->off) return td_err_set(err, TD_ENOMEM, "tokenizer: out of memory");
    uint32_t pos = 0;
    t->max_piece_len = 0;
    for (int i = 0; i < t->n_vocab; i++) {
        p->off[i] = pos;
        int n = piece_of(t, i, p->data + pos);
        /* The engine streams a token's text through a buffer of 3 * (TOK_MAX_PIECE + 3)
         * bytes (every byte may become U+FFFD); no real vocabulary comes near. */
        if (n > TOK_MAX_PIECE)
            return td_err_set(err, TD_EFORMAT,
                              "tokenizer: token %d's text is %d bytes; at most %d are supported", i,
                              n, TOK_MAX_PIECE);
        pos += (uint32_t)n;
        t->max_piece_len = TD_MAX(t->max_piece_len, n);
    }
    p->off[t->n_vocab] = pos;
    return 0;
}

int tok_max_piece_len(const td_tokenizer *t)
{
    return t->max_piece_len;
}

/* The piece to output for id, after skip_special filtering. */
static const char *visible_piece(const td_tokenizer *t, int32_t id, bool render_special,
                                 uint32_t *len)
{
    uint8_t ty = t->types[id];
    if (!render_special && (ty == TOK_TYPE_CONTROL || ty == TOK_TYPE_UNKNOWN)) {
        *len = 0;
        return "";
    }
    return tok__str(&t->pieces, (uint32_t)id, len);
}

int tok_piece(const td_tokenizer *t, int32_t id, bool render_special, char *buf, int cap)
{
    if (id < 0 || id >= t->n_vocab) return TD_ERANGE;
    uint32_t len;
    const char *s = visible_piece(t, id, render_special, &len);
    if (cap > 0 && buf) memcpy(buf, s, TD_MIN((size_t)len, (size_t)cap));
    return (int)len;
}

/*
 * SentencePiece text starts with the space prefix the encoder added, so the token
 * right after a leading BOS loses one leading space (as HF's decode and llama.cpp's
 * old common detokenizer do). Sequences without a leading BOS are continuations:
 * their pieces are concatenated as they are. Returns the bytes of the piece to skip.
 */
static uint32_t leading_skip(const td_tokenizer *t, bool strip, const char *s, uint32_t len)
{
    return (strip && t->kind == TOK_KIND_SPM && t->add_space_prefix && len > 0 && s[0] == ' ') ? 1
                                                                                               : 0;
}

int tok_decode(const td_tokenizer *t, const int32_t *ids, int n, bool skip_special, char *buf,
               int cap)
{
    if (n < 0 || (n > 0 && !ids) || cap < 0 || (cap > 0 && !buf)) return TD_EINVAL;
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_vocab) return TD_ERANGE;
        uint32_t len;
        const char *s = visible_piece(t, ids[i], !skip_special, &len);
        uint32_t skip = leading_skip(t, i == 1 && ids[0] == t->bos, s, len);
        s += skip;
        len -= skip;
        if (total < (size_t)cap) memcpy(buf + total, s, TD_MIN((size_t)len, (size_t)cap - total));
        total += len;
        if (total > INT_MAX - 1) return TD_ETOOLARGE;
    }
    if (total < (size_t)cap) buf[total] = '\0';
    return (int)total;
}

/* ---- streaming --------------------------------------------------------------- */

void tok_stream_init(tok_stream *s, const td_tokenizer *t, bool skip_special)
{
    memset(s, 0, sizeof(*s));
    s->tok = t;
    s->skip_special = skip_special;
    s->at_start = true;
}

static const char k_replacement[3] = {'\xef', '\xbf', '\xbd'}; /* U+FFFD */

/*
 * Pass the bytes pending ++ in through a UTF-8 checker: complete characters are
 * written to out (or only counted when out is NULL), a valid but unfinished
 * character at the end is returned in new_pending (unless flush), and each maximal
 * invalid subsequence becomes one U+FFFD (Unicode's "substitution of maximal
 * subparts", as browsers and Python do). Returns the output length.
 */
static size_t utf8_filter(const unsigned char *pending, int n_pending, const unsigned char *in,
                          size_t n_in, bool flush, char *out, unsigned char *new_pending,
                          int *n_new_pending)
{
    size_t total = (size_t)n_pending + n_in, w = 0, k = 0;
#define AT(i) ((i) < (size_t)n_pending ? pending[i] : in[(i) - (size_t)n_pending])
#define PUT(src, len)                                                                              \
    do {                                                                                           \
        if (out) memcpy(out + w, (src), (len));                                                    \
        w += (len);                                                                                \
    } while (0)
    if (n_new_pending) *n_new_pending = 0;
    while (k < total) {
        unsigned c = AT(k);
        if (c < 0x80) {
            char ch = (char)c;
            PUT(&ch, 1);
            k++;
            continue;
        }
        unsigned lo, hi;
        size_t need = (size_t)tok__utf8_lead(c, &lo, &hi);
        if (!need) {
            PUT(k_replacement, 3); /* continuation byte, C0, C1, F5..FF: never valid */
            k++;
            continue;
        }
        size_t j = 1;
        while (j <= need && k + j < total) {
            unsigned b = AT(k + j);
            bool ok = j == 1 ? (b >= lo && b <= hi) : ((b & 0xC0) == 0x80);
            if (!ok) break;
            j++;
        }
        if (j > need) {
            char tmp[4];
            for (size_t i = 0; i <= need; i++)
                tmp[i] = (char)AT(k + i);
            PUT(tmp, need + 1);
            k += need + 1;
        } else if (k + j == total && !flush) {
            /* Valid so far but unfinished: hold it for the next piece. */
            for (size_t i = 0; i < j; i++)
                new_pending[i] = AT(k + i);
            *n_new_pending = (int)j;
            k = total;
        } else {
            PUT(k_replacement, 3); /* a broken sequence: one U+FFFD, then retry the byte after */
            k += j;
        }
    }
#undef AT
#undef PUT
    return w;
}

int tok_stream_push(tok_stream *s, int32_t id, char *out, int cap)
{
    const td_tokenizer *t = s->tok;
    if (id < 0 || id >= t->n_vocab) return TD_ERANGE;
    if (cap < 0 || (cap > 0 && !out)) return TD_EINVAL;
    uint32_t len;
    const char *p = visible_piece(t, id, !s->skip_special, &len);
    bool at_start = s->at_start, after_bos = s->after_bos;
    uint32_t skip = leading_skip(t, after_bos, p, len);
    after_bos = at_start && id == t->bos;
    at_start = false;
    p += skip;
    len -= skip;

    unsigned char np[8];
    int n_np;
    size_t need = utf8_filter(s->pending, s->n_pending, (const unsigned char *)p, len, false, NULL,
                              np, &n_np);
    /* Too small a buffer: nothing is consumed, so the caller can retry with more room. */
    if (need > (size_t)cap) return TD_ERANGE;
    utf8_filter(s->pending, s->n_pending, (const unsigned char *)p, len, false, out, np, &n_np);
    memcpy(s->pending, np, (size_t)n_np);
    s->n_pending = n_np;
    s->at_start = at_start;
    s->after_bos = after_bos;
    return (int)need;
}

int tok_stream_flush(tok_stream *s, char *out, int cap)
{
    if (cap < 0 || (cap > 0 && !out)) return TD_EINVAL;
    size_t need = utf8_filter(s->pending, s->n_pending, NULL, 0, true, NULL, NULL, NULL);
    if (need > (size_t)cap) return TD_ERANGE;
    utf8_filter(s->pending, s->n_pending, NULL, 0, true, out, NULL, NULL);
    s->n_pending = 0;
    return (int)need;
}
