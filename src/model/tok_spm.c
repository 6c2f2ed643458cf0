/*
 * model/tok_spm.c - SentencePiece BPE as llama.cpp runs it (llm_tokenizer_spm):
 *
 *  1. spaces become U+2581, and a U+2581 prefix is added when asked;
 *  2. the text is split into UTF-8 characters, the symbols;
 *  3. every adjacent pair whose concatenation is a vocabulary token is a candidate
 *     merge, scored by that token's score; the best (highest score, leftmost on
 *     ties) is merged, its neighbours become new candidates, and so on until no
 *     pair forms a token;
 *  4. each final symbol is its token, or else its bytes' <0xNN> tokens.
 *
 * Candidates live in a binary heap and symbols in a linked list, so a text of n
 * characters costs O(n log n), not the O(n^2) of rescanning for the best pair.
 */
#include "model/tok_impl.h"

#include <stdlib.h>
#include <string.h>

typedef struct spm_symbol {
    int prev, next; /* neighbours in the list, -1 at the ends */
    uint32_t start; /* byte offset in the escaped text */
    uint32_t n;     /* bytes; 0 once merged into its left neighbour */
} spm_symbol;

typedef struct spm_bigram {
    float score;
    int left, right;
    uint32_t size; /* bytes of the merged text, to detect stale entries */
} spm_bigram;

typedef struct spm_session {
    const td_tokenizer *t;
    const char *text;
    spm_symbol *sym;
    spm_bigram *heap;
    size_t n_heap, cap_heap;
} spm_session;

/* Heap order: higher score first, then the leftmost pair. */
static bool bigram_before(const spm_bigram *a, const spm_bigram *b)
{
    return a->score > b->score || (a->score == b->score && a->left < b->left);
}

static void heap_push(spm_session *s, spm_bigram b)
{
    TD_ASSERT(s->n_heap < s->cap_heap);
    size_t i = s->n_heap++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!bigram_before(&b, &s->heap[parent])) break;
        s->heap[i] = s->heap[parent];
        i = parent;
    }
    s->heap[i] = b;
}

static spm_bigram heap_pop(spm_session *s)
{
    spm_bigram top = s->heap[0];
    spm_bigram last = s->heap[--s->n_heap];
    size_t i = 0, n = s->n_heap;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, best = i;
        const spm_bigram *bb = &last;
        if (l < n && bigram_before(&s->heap[l], bb)) {
            best = l;
            bb = &s->heap[l];
        }
        if (r < n && bigram_before(&s->heap[r], bb)) best = r;
        if (best == i) break;
        s->heap[i] = s->heap[best];
        i = best;
    }
    if (n > 0) s->heap[i] = last;
    return top;
}

static void try_add_bigram(spm_session *s, int left, int right)
{
    if (left < 0 || right < 0) return;
    const spm_symbol *l = &s->sym[left], *r = &s->sym[right];
    int32_t id = tok__map_find(&s->t->text_map, s->text + l->start, l->n + r->n);
    if (id < 0) return;
    heap_push(s, (spm_bigram){s->t->scores[id], left, right, l->n + r->n});
}

int tok__spm_encode(const td_tokenizer *t, const char *text, size_t len, bool space_prefix,
                    tok__out *out, td_err *err)
{
    /* Escape: ' ' -> U+2581 (3 bytes), with the optional prefix. */
    size_t n_spaces = space_prefix ? 1 : 0;
    for (size_t i = 0; i < len; i++)
        n_spaces += text[i] == ' ';
    size_t esc_len = len + (space_prefix ? 1 : 0) + 2 * n_spaces;
    if (esc_len == 0) return 0;
    char *esc = malloc(esc_len);
    spm_session s = {.t = t, .text = esc};
    s.sym = malloc(esc_len * sizeof(spm_symbol));
    s.cap_heap = 3 * esc_len + 1; /* n-1 seeds + at most 2 per merge */
    s.heap = malloc(s.cap_heap * sizeof(spm_bigram));
    if (!esc || !s.sym || !s.heap) {
        free(esc);
        free(s.sym);
        free(s.heap);
        return td_err_set(err, TD_ENOMEM, "tokenizer: out of memory");
    }
    size_t w = 0;
    if (space_prefix) {
        memcpy(esc, "\xe2\x96\x81", 3);
        w = 3;
    }
    for (size_t i = 0; i < len; i++) {
        if (text[i] == ' ') {
            memcpy(esc + w, "\xe2\x96\x81", 3);
            w += 3;
        } else {
            esc[w++] = text[i];
        }
    }
    TD_ASSERT(w == esc_len);

    /* One symbol per UTF-8 character (the text is valid UTF-8). */
    int n_sym = 0;
    for (size_t off = 0; off < esc_len;) {
        uint32_t n = (uint32_t)tok__utf8_len((unsigned char)esc[off]);
        if (n > esc_len - off) n = (uint32_t)(esc_len - off);
        s.sym[n_sym] = (spm_symbol){n_sym - 1, -1, (uint32_t)off, n};
        off += n;
        if (off < esc_len) s.sym[n_sym].next = n_sym + 1;
        n_sym++;
    }

    for (int i = 1; i < n_sym; i++)
        try_add_bigram(&s, i - 1, i);

    while (s.n_heap > 0) {
        spm_bigram b = heap_pop(&s);
        spm_symbol *l = &s.sym[b.left], *r = &s.sym[b.right];
        /* Stale: one side was merged away or grew since this pair was scored. */
        if (l->n == 0 || r->n == 0 || l->n + r->n != b.size) continue;
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0) s.sym[r->next].prev = b.left;
        try_add_bigram(&s, l->prev, b.left);
        try_add_bigram(&s, b.left, l->next);
    }

    for (int i = 0; i != -1; i = s.sym[i].next) {
        const spm_symbol *sy = &s.sym[i];
        int32_t id = tok__map_find(&t->text_map, esc + sy->start, sy->n);
        if (id >= 0) {
            tok__emit(out, id);
            continue;
        }
        /* Not a token: byte fallback, one <0xNN> token per byte. */
        for (uint32_t k = 0; k < sy->n; k++) {
            int32_t bid = t->byte_token[(unsigned char)esc[sy->start + k]];
            if (bid >= 0) tok__emit(out, bid);
        }
    }

    free(esc);
    free(s.sym);
    free(s.heap);
    return 0;
}
