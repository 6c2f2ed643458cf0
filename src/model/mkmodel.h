/*
 * model/mkmodel.h - write a GGUF model with random weights at any shape
 * (`tandem mkmodel`), for tests and for benchmarks at real model sizes.
 *
 * The weights come from the same generator as td_model_load_dummy, so a file
 * written here with (shape, type, seed) holds exactly the weights that
 * `--load-format dummy` builds in memory from the same triple.
 */
#ifndef TD_MODEL_MKMODEL_H
#define TD_MODEL_MKMODEL_H

#include "model/gguf.h"
#include "model/model.h"

/**
 * Write a model to `path`.
 *
 * Vocabulary: with `vocab_from` (a GGUF holding `tokenizer.*` keys, e.g. a
 * ggml-vocab-*.gguf), every `tokenizer.*` key is copied; shape->n_vocab = 0 means
 * "the vocabulary's size", a larger n_vocab pads the vocabulary with unused tokens
 * "<pad_N>", and a smaller one is an error. Without it (NULL), a byte-level
 * SentencePiece vocabulary of shape->n_vocab tokens is generated (see
 * td_mkmodel_add_byte_vocab). shape->head_dim = 0 means n_embd / n_head.
 *
 * Tensor data is streamed to the file a few MiB at a time.
 */
int td_mkmodel_write(const char *path, const td_model_shape *shape, td_type wtype,
                     const char *vocab_from, uint64_t seed, td_err *err);

/**
 * Check, without writing anything, what td_mkmodel_write would reject in its
 * arguments: the shape (td_model_shape_validate; n_vocab 0 is allowed with a
 * vocabulary file), the weight type against the row lengths, and the minimum
 * generated vocabulary. Returns 0 or TD_EINVAL/TD_EUNSUPPORTED with err filled.
 */
int td_mkmodel_check(const td_model_shape *shape, td_type wtype, bool has_vocab_from, td_err *err);

/**
 * Add a generated SentencePiece-style (`tokenizer.ggml.model = llama`) byte-level
 * vocabulary of n_vocab >= 259 tokens to a writer: <unk>=0 (UNKNOWN), <s>=1 and
 * </s>=2 (CONTROL), the 256 byte tokens <0x00>..<0xFF> (BYTE), then "<pad_N>"
 * (UNUSED) up to n_vocab; scores all 0; BOS 1, EOS 2, UNK 0, add_bos_token true,
 * add_eos_token false, pre-tokenizer "default".
 */
int td_mkmodel_add_byte_vocab(gguf_writer *w, int n_vocab, td_err *err);

/** Smallest vocabulary td_mkmodel_add_byte_vocab can generate (3 specials + 256 bytes). */
#define TD_MKMODEL_MIN_VOCAB 259

#endif
