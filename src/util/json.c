/*
 * util/json.c - strict JSON parsing on top of cJSON (see json.h).
 */
#include "util/json.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_name(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

const char *td_json_duplicate_key(const cJSON *v)
{
    int n = 0;
    for (const cJSON *c = v->child; c; c = c->next) {
        n++;
        if (cJSON_IsObject(c) || cJSON_IsArray(c)) {
            const char *d = td_json_duplicate_key(c);
            if (d) return d;
        }
    }
    if (!cJSON_IsObject(v) || n < 2) return NULL;
    const char *small[16];
    const char **names = n <= 16 ? small : malloc((size_t)n * sizeof(*names));
    if (!names) return NULL; /* out of memory: the fields are checked as they are */
    int k = 0;
    for (const cJSON *c = v->child; c; c = c->next)
        names[k++] = c->string ? c->string : "";
    qsort(names, (size_t)n, sizeof(*names), cmp_name);
    const char *dup = NULL;
    for (int i = 1; i < n && !dup; i++)
        if (!strcmp(names[i - 1], names[i])) dup = names[i];
    if (names != small) free(names);
    return dup;
}

cJSON *td_json_parse_strict(const char *s, size_t len, char *why, size_t cap)
{
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(s, len, &end, false);
    if (!root) {
        snprintf(why, cap, "malformed JSON near byte %zu",
                 end && end >= s ? (size_t)(end - s) : (size_t)0);
        return NULL;
    }
    for (const char *p = end; p && p < s + len; p++)
        if (*p != ' ' && *p != '\n' && *p != '\r' && *p != '\t') {
            snprintf(why, cap, "trailing data after the value at byte %zu", (size_t)(p - s));
            cJSON_Delete(root);
            return NULL;
        }
    const char *dup = td_json_duplicate_key(root);
    if (dup) {
        snprintf(why, cap, "the key '%.64s' appears twice in one object", dup);
        cJSON_Delete(root);
        return NULL;
    }
    return root;
}
