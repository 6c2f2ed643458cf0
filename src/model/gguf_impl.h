/*
 * model/gguf_impl.h - internals shared by the GGUF reader (gguf.c) and writer
 * (gguf_write.c). Not a public header: nothing outside model/gguf*.c includes it.
 */
#ifndef TD_MODEL_GGUF_IMPL_H
#define TD_MODEL_GGUF_IMPL_H

#include "model/gguf.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the GGUF reader and writer assume a little-endian host"
#endif

#define GGUF_MAGIC "GGUF"
#define GGUF_DEFAULT_ALIGNMENT 32
/* Arrays of arrays are legal GGUF; we accept this many levels (a top-level array is level 1). */
#define GGUF_MAX_ARRAY_DEPTH 4
/* Sanity caps, far above any real model (a 400B model has a few thousand tensors). */
#define GGUF_MAX_KV (1 << 20)
#define GGUF_MAX_TENSORS (1 << 20)

/**
 * The raw serialized bytes of a key's value, as found in the file: for a scalar
 * the value, for a string (u64 len + bytes), for an array (u32 elem type, u64 n,
 * elements). The bytes are self-contained, so a writer can copy them verbatim.
 */
typedef struct gguf__raw {
    gguf_vtype type;
    const uint8_t *bytes;
    size_t len;
} gguf__raw;

gguf__raw gguf__kv_raw(const gguf_file *f, int64_t idx);

/** Size in bytes of a scalar value type, 0 for STRING/ARRAY/unknown. */
size_t gguf__scalar_size(uint32_t type);

/** True for a tensor type GGUF files may carry and we can compute with. */
bool gguf__tensor_type_ok(uint32_t type);

/** GGML's name for a tensor type number ("q4_K"), or "?" for one we do not know. */
const char *gguf__ggml_type_name(uint32_t type);

#endif
