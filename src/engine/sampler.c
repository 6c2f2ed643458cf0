/* engine/sampler.c - greedy, temperature, top-k, top-p, min-p (see sampler.h). */
#include "engine/sampler.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int sampler_scratch_init(sampler_scratch *s, int n_vocab)
{
    s->n_vocab = n_vocab;
    s->prob = malloc((size_t)n_vocab * sizeof(float));
    s->idx = malloc((size_t)n_vocab * sizeof(int32_t));
    s->key = malloc((size_t)n_vocab * sizeof(uint64_t));
    s->tmp = malloc((size_t)n_vocab * sizeof(uint64_t));
    s->pen = malloc((size_t)n_vocab * sizeof(float));
    s->seen = calloc((size_t)n_vocab, 1);
    if (!s->prob || !s->idx || !s->key || !s->tmp || !s->pen || !s->seen) {
        sampler_scratch_free(s);
        return TD_ENOMEM;
    }
    return 0;
}

void sampler_scratch_free(sampler_scratch *s)
{
    free(s->prob);
    free(s->idx);
    free(s->key);
    free(s->tmp);
    free(s->pen);
    free(s->seen);
    s->pen = NULL;
    s->seen = NULL;
    s->prob = NULL;
    s->idx = NULL;
    s->key = NULL;
    s->tmp = NULL;
}

int sampler_check(const sampler_params *p, td_err *err)
{
    if (!(p->temperature >= 0.0f) || p->temperature > 100.0f)
        return td_err_set(err, TD_EINVAL, "temperature must be in [0, 100], got %g",
                          (double)p->temperature);
    if (p->top_k < 0) return td_err_set(err, TD_EINVAL, "top_k must be >= 0 (0 = off)");
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return td_err_set(err, TD_EINVAL, "top_p must be in (0, 1], got %g", (double)p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return td_err_set(err, TD_EINVAL, "min_p must be in [0, 1], got %g", (double)p->min_p);
    return 0;
}

int32_t sampler_argmax(const float *logits, int n)
{
    int32_t best = 0;
    float bv = logits[0];
    for (int i = 1; i < n; i++)
        if (logits[i] > bv) {
            bv = logits[i];
            best = i;
        }
    return best;
}

/* Sort candidates by descending probability (ties: lower id first, so the order is total). */
static int cmp_desc(const void *a, const void *b, void *ctx)
{
    const float *prob = ctx;
    int32_t ia = *(const int32_t *)a, ib = *(const int32_t *)b;
    float pa = prob[ia], pb = prob[ib];
    if (pa != pb) return pa > pb ? -1 : 1;
    return ia < ib ? -1 : 1;
}

/*
 * Order idx[0..n) (kept tokens: p > 0, not NaN) by probability descending, ties by id
 * ascending (cmp_desc's order). Large sets go through an LSD radix sort of one 64-bit key
 * per token, ascending: the complement of the probability's bits (positive floats order
 * as their bits), then the id; bytes that every key shares are skipped. A comparison sort
 * of a 32k-token row took milliseconds, as long as a decode step.
 */
static void sort_desc(sampler_scratch *s, int32_t *idx, int n)
{
    if (n < 256) {
        qsort_r(idx, (size_t)n, sizeof(int32_t), cmp_desc, s->prob);
        return;
    }
    uint64_t *a = s->key, *b = s->tmp;
    for (int i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &s->prob[idx[i]], 4);
        a[i] = (uint64_t)~u << 32 | (uint32_t)idx[i];
    }
    for (int shift = 0; shift < 64; shift += 8) {
        uint32_t count[256] = {0};
        for (int i = 0; i < n; i++) count[a[i] >> shift & 0xff]++;
        if (count[a[0] >> shift & 0xff] == (uint32_t)n) continue; /* one digit for all */
        uint32_t at = 0;
        for (int d = 0; d < 256; d++) {
            uint32_t c = count[d];
            count[d] = at;
            at += c;
        }
        for (int i = 0; i < n; i++) b[count[a[i] >> shift & 0xff]++] = a[i];
        uint64_t *t = a;
        a = b;
        b = t;
    }
    for (int i = 0; i < n; i++) idx[i] = (int32_t)(uint32_t)a[i];
}

/*
 * The candidates an ordered cut needs: the kept tokens whose probability's binary exponent
 * is at least that of the top_k-th (with top-k), or at which the kept mass reaches `limit`
 * (top-p alone), found from one histogram of the kept probabilities by exponent. Only the
 * candidates are sorted (the vocabulary can be 128k tokens, and most of its mass sits in a
 * few of them); they hold every token the cut can keep, in the same order. Returns their
 * count, ids in s->idx.
 */
static int candidates(const sampler_params *p, int n_vocab, float thresh, double limit,
                      sampler_scratch *s)
{
    uint32_t cnt[256] = {0};
    double mass[256] = {0};
    for (int i = 0; i < n_vocab; i++) {
        float v = s->prob[i];
        if (!(v >= thresh && v > 0.0f)) continue;
        uint32_t u;
        memcpy(&u, &v, 4);
        cnt[u >> 23 & 0xff]++;
        mass[u >> 23 & 0xff] += v;
    }
    uint64_t c = 0;
    double m = 0;
    int e = 255;
    for (; e > 0; e--) {
        c += cnt[e];
        m += mass[e];
        if (p->top_k > 0 ? c >= (uint64_t)p->top_k : m >= limit) break;
    }
    int n = 0;
    for (int i = 0; i < n_vocab; i++) {
        float v = s->prob[i];
        if (!(v >= thresh && v > 0.0f)) continue;
        uint32_t u;
        memcpy(&u, &v, 4);
        if ((int)(u >> 23 & 0xff) >= e) s->idx[n++] = i;
    }
    return n;
}

int32_t sampler_sample(const sampler_params *p, const float *logits, int n_vocab, td_rng *rng,
                       sampler_scratch *s)
{
    if (p->temperature <= 0.0f || p->top_k == 1) return sampler_argmax(logits, n_vocab);
    TD_ASSERT(s->n_vocab >= n_vocab);
    float maxl = -INFINITY; /* NaN never counts (as fmaxf has it), without fmaxf's call */
    for (int i = 0; i < n_vocab; i++)
        if (logits[i] > maxl) maxl = logits[i];
    /* An infinite logit would make inf - inf below, and no token kept: it takes all. */
    if (maxl == INFINITY) return sampler_argmax(logits, n_vocab);
    float inv_t = 1.0f / p->temperature;
    /* min-p keeps tokens with prob >= min_p * max prob; max prob is exp(0) = 1 before
     * normalisation, so the threshold is simply min_p. */
    float thresh = p->min_p > 0.0f ? p->min_p : 0.0f;
    double sum = 0;
    int n = 0;
    for (int i = 0; i < n_vocab; i++) {
        float e = expf((logits[i] - maxl) * inv_t);
        s->prob[i] = e;
        if (e >= thresh && e > 0.0f) {
            sum += e;
            n++;
        }
    }
    bool need_sort = p->top_k > 0 || p->top_p < 1.0f;
    if (!need_sort) { /* no order asked for: the kept tokens in id order */
        double r = (double)td_rng_float(rng) * sum, acc = 0;
        int32_t last = 0;
        for (int i = 0; i < n_vocab; i++) {
            float e = s->prob[i];
            if (!(e >= thresh && e > 0.0f)) continue;
            acc += e;
            last = i;
            if (r < acc) return i;
        }
        return last;
    }
    /* Ordered: by probability, ties by id. Top-k keeps the first top_k; top-p then the
     * shortest prefix whose mass reaches top_p of what is kept (all the kept tokens' mass
     * when there is no top-k). Only the candidates that can be kept are sorted; if rounding
     * leaves a top-p cut outside them, all the kept tokens are. */
    double limit = p->top_k > 0 ? 0 : p->top_p * sum;
    int nc = candidates(p, n_vocab, thresh, limit, s);
    for (int full = 0;; full++) {
        sort_desc(s, s->idx, nc);
        n = nc;
        if (p->top_k > 0 && n > p->top_k) n = p->top_k;
        if (p->top_k > 0) {
            sum = 0;
            for (int i = 0; i < n; i++) sum += s->prob[s->idx[i]];
            limit = p->top_p * sum;
        }
        if (p->top_p >= 1.0f) break;
        double cum = 0;
        int keep = -1;
        for (int i = 0; i < n; i++) {
            cum += s->prob[s->idx[i]];
            if (cum >= limit) {
                keep = i + 1;
                break;
            }
        }
        if (keep < 0 && p->top_k <= 0 && !full) { /* the cut lies past the candidates */
            nc = 0;
            for (int i = 0; i < n_vocab; i++)
                if (s->prob[i] >= thresh && s->prob[i] > 0.0f) s->idx[nc++] = i;
            continue;
        }
        n = keep < 0 ? n : keep;
        sum = 0;
        for (int i = 0; i < n; i++) sum += s->prob[s->idx[i]];
        break;
    }
    double r = (double)td_rng_float(rng) * sum;
    double acc = 0;
    for (int i = 0; i < n; i++) {
        acc += s->prob[s->idx[i]];
        if (r < acc) return s->idx[i];
    }
    return s->idx[n > 0 ? n - 1 : 0];
}
