/* engine/sampler.c - greedy, temperature, top-k, top-p, min-p (see sampler.h). */
#include "engine/sampler.h"

#include <math.h>
#include <stdlib.h>

int sampler_scratch_init(sampler_scratch *s, int n_vocab)
{
    s->n_vocab = n_vocab;
    s->prob = malloc((size_t)n_vocab * sizeof(float));
    s->idx = malloc((size_t)n_vocab * sizeof(int32_t));
    if (!s->prob || !s->idx) {
        sampler_scratch_free(s);
        return TD_ENOMEM;
    }
    return 0;
}

void sampler_scratch_free(sampler_scratch *s)
{
    free(s->prob);
    free(s->idx);
    s->prob = NULL;
    s->idx = NULL;
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

/* Keep the k most probable of idx[0..n) at the front, sorted. A partial selection with a
 * small heap would be faster for tiny k, but qsort over the survivors of the cheap filters
 * below is already well under the cost of a forward step. */
static int sort_candidates(int32_t *idx, int n, const float *prob)
{
    qsort_r(idx, (size_t)n, sizeof(int32_t), cmp_desc, (void *)prob);
    return n;
}

int32_t sampler_sample(const sampler_params *p, const float *logits, int n_vocab, td_rng *rng,
                       sampler_scratch *s)
{
    if (p->temperature <= 0.0f || p->top_k == 1) return sampler_argmax(logits, n_vocab);
    TD_ASSERT(s->n_vocab >= n_vocab);
    float maxl = logits[0];
    for (int i = 1; i < n_vocab; i++) maxl = fmaxf(maxl, logits[i]);
    float inv_t = 1.0f / p->temperature;
    double sum = 0;
    for (int i = 0; i < n_vocab; i++) {
        float e = expf((logits[i] - maxl) * inv_t);
        s->prob[i] = e;
        sum += e;
    }
    /* min-p keeps tokens with prob >= min_p * max prob; max prob is exp(0) = 1 before
     * normalisation, so the threshold is simply min_p. Apply it first: it is the cheapest
     * filter and shrinks what the sort has to touch. */
    int n = 0;
    float thresh = p->min_p > 0.0f ? p->min_p : 0.0f;
    for (int i = 0; i < n_vocab; i++)
        if (s->prob[i] >= thresh && s->prob[i] > 0.0f) s->idx[n++] = i;
    bool need_sort = p->top_k > 0 || p->top_p < 1.0f;
    if (need_sort) {
        sort_candidates(s->idx, n, s->prob);
        if (p->top_k > 0 && n > p->top_k) n = p->top_k;
    }
    sum = 0;
    for (int i = 0; i < n; i++) sum += s->prob[s->idx[i]];
    if (p->top_p < 1.0f) {
        double cum = 0, limit = p->top_p * sum;
        int keep = n;
        for (int i = 0; i < n; i++) {
            cum += s->prob[s->idx[i]];
            if (cum >= limit) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
        sum = 0;
        for (int i = 0; i < n; i++) sum += s->prob[s->idx[i]];
    }
    double r = (double)td_rng_float(rng) * sum;
    double acc = 0;
    for (int i = 0; i < n; i++) {
        acc += s->prob[s->idx[i]];
        if (r < acc) return s->idx[i];
    }
    return s->idx[n > 0 ? n - 1 : 0];
}
