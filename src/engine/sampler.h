/*
 * engine/sampler.h - turn one row of logits into a token.
 *
 * Greedy is an argmax (lowest id on ties). Otherwise: temperature, then top-k,
 * top-p and min-p filters over the softmax, then one draw from the request's own
 * generator, so a request with a seed gives the same tokens whatever else is in
 * the batch.
 */
#ifndef TD_ENGINE_SAMPLER_H
#define TD_ENGINE_SAMPLER_H

#include "util/td.h"

typedef struct sampler_params {
    float temperature; /* <= 0: greedy */
    int top_k;         /* <= 0: off */
    float top_p;       /* >= 1: off */
    float min_p;       /* <= 0: off */
} sampler_params;

/** Scratch for one sampling call over a vocabulary of n_vocab (reused across calls). */
typedef struct sampler_scratch {
    float *prob;       /* [n_vocab] */
    int32_t *idx;      /* [n_vocab] */
    uint64_t *key, *tmp; /* [n_vocab] each: the radix sort of large candidate sets */
    float *pen;          /* [n_vocab]: a penalised copy of a row of logits */
    uint8_t *seen;       /* [n_vocab], zero between uses: tokens already penalised */
    int n_vocab;
} sampler_scratch;

int sampler_scratch_init(sampler_scratch *s, int n_vocab);
void sampler_scratch_free(sampler_scratch *s);

/** Validate parameters; fills err with a message for the user. */
int sampler_check(const sampler_params *p, td_err *err);

int32_t sampler_argmax(const float *logits, int n);

/** Sample a token. logits are not modified. */
int32_t sampler_sample(const sampler_params *p, const float *logits, int n_vocab, td_rng *rng,
                       sampler_scratch *s);

#endif
