/*
 * util/json.h - strict JSON documents for inputs whose typos must not pass silently
 * (request bodies, --kv-transfer-config, tandem up's --config).
 *
 * cJSON's own parse accepts bytes after the value and keeps every copy of a key that an
 * object names twice, and readers then disagree on which wins (GetObjectItem takes the
 * first, other parsers the last). td_json_parse_strict refuses both.
 */
#ifndef TD_UTIL_JSON_H
#define TD_UTIL_JSON_H

#include <stdbool.h>
#include <stddef.h>

#include <cjson/cJSON.h>

/** The first key that an object in v (v included) names twice, or NULL. */
const char *td_json_duplicate_key(const cJSON *v);

/**
 * Parse len bytes as one JSON value followed by nothing but whitespace, with no object
 * naming a key twice. NULL on failure, with a one-line reason in why (for example
 * "malformed JSON near byte 12", "trailing data after the value at byte 40", "the key
 * 'kv_role' appears twice in one object").
 */
cJSON *td_json_parse_strict(const char *s, size_t len, char *why, size_t cap);

#endif
