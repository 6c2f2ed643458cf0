/*
 * model/types.h - tensor element types and their storage layout.
 *
 * The numbering of the GGUF types is GGML's, so that a type read from a file is
 * used as is. Block-quantized types store `block_elems` elements in `block_bytes`
 * bytes; a row of K elements must have K divisible by block_elems.
 *
 *   Q8_0: 32 elements per block: fp16 scale d, then 32 int8 q; x = d * q.
 *   Q4_0: 32 elements per block: fp16 scale d, then 16 bytes; element j < 16 is the
 *         low nibble of byte j, element j + 16 its high nibble; x = d * (nibble - 8).
 *
 * TD_TYPE_FP8_E4M3 is not a GGUF type: it exists only as a KV-cache dtype.
 */
#ifndef TD_MODEL_TYPES_H
#define TD_MODEL_TYPES_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

typedef enum td_type {
    TD_TYPE_F32 = 0,
    TD_TYPE_F16 = 1,
    TD_TYPE_Q4_0 = 2,
    TD_TYPE_Q8_0 = 8,
    TD_TYPE_BF16 = 30,
    TD_TYPE_FP8_E4M3 = 200, /* KV cache only */
    TD_TYPE_INVALID = -1,
} td_type;

#define TD_QK8_0 32
#define TD_QK4_0 32

typedef struct {
    uint16_t d; /* fp16 scale */
    int8_t qs[TD_QK8_0];
} td_block_q8_0;

typedef struct {
    uint16_t d; /* fp16 scale */
    uint8_t qs[TD_QK4_0 / 2];
} td_block_q4_0;

/** True for a type this build can load and compute with. */
bool td_type_supported(td_type t);
/** "f32", "f16", "bf16", "q8_0", "q4_0", "fp8_e4m3"; "unknown(N)" style never NULL. */
const char *td_type_name(td_type t);
/** Parse a name as printed by td_type_name (also "fp8" for fp8_e4m3). -1 if unknown. */
td_type td_type_parse(const char *name);
/** Elements per block (1 for plain types), bytes per block. 0 for unsupported types. */
int td_type_block_elems(td_type t);
int td_type_block_bytes(td_type t);
/** Bytes of a row of n elements (n divisible by the block size), 0 if not. */
size_t td_row_bytes(td_type t, int64_t n);

/* Scalar conversions (exact, round-to-nearest-even where narrowing). */
float td_fp16_to_f32(uint16_t h);
uint16_t td_f32_to_fp16(float f);
float td_bf16_to_f32(uint16_t h);
uint16_t td_f32_to_bf16(float f);
float td_fp8e4m3_to_f32(uint8_t v);
/** Saturates to +-448 (e4m3fn has no infinity). */
uint8_t td_f32_to_fp8e4m3(float f);

/** Reference (plain C) row conversions; SIMD versions live in backend/cpu. */
void td_dequant_row_ref(td_type t, const void *src, float *dst, int64_t n);
void td_quant_row_ref(td_type t, const float *src, void *dst, int64_t n);

#endif
