// jsonq: a small JSON query tool for the end-to-end tests, so they need nothing outside the
// build. `jsonq FILE PATH` prints the value at PATH, a dot-separated list of object keys and
// array indices ("modules.0.scale"); a final "#" prints an array's or object's length.
// Numbers print as %.17g, strings raw, booleans and null as in JSON, containers as compact
// JSON. The file is read with llmerge's own reader (json.h), so what llmerge writes is held to
// what it asks of what it reads. Exit status: 0 found, 1 no such path, 2 the file is not JSON.
#include <cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"
#include "util.h"

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: jsonq FILE|- PATH\n");
        return 2;
    }
    // llmerge's reader, as strict with what llmerge writes as with what it reads
    cJSON *root = NULL;
    lm_err err = {0};
    lm_status s;
    if (strcmp(argv[1], "-") == 0) {
        size_t cap = 1 << 16, len = 0;
        char *text = malloc(cap);
        size_t r;
        while (text && (r = fread(text + len, 1, cap - len - 1, stdin)) > 0) {
            len += r;
            if (len + 1 == cap) {
                cap *= 2;
                text = realloc(text, cap);
            }
        }
        s = text ? lm_json_parse(&root, text, len, "stdin", &err) : lm_err_set(&err, LM_ERR_NOMEM, "out of memory");
        free(text);
    } else {
        s = lm_json_load(&root, argv[1], 1u << 30, &err);
    }
    if (s != LM_OK) {
        fprintf(stderr, "jsonq: %s\n", err.msg);
        return 2;
    }
    cJSON *node = root;
    char *path = lm_strdup(argv[2]);
    int rc = 0;
    for (char *tok = strtok(path, "."); tok && node; tok = strtok(NULL, ".")) {
        if (strcmp(tok, "#") == 0) {
            printf("%d\n", cJSON_GetArraySize(node));
            goto done;
        }
        if (cJSON_IsArray(node)) {
            char *end;
            long i = strtol(tok, &end, 10);
            node = *end ? NULL : cJSON_GetArrayItem(node, (int)i);
        } else {
            node = cJSON_GetObjectItemCaseSensitive(node, tok);
        }
    }
    if (!node) {
        fprintf(stderr, "jsonq: no %s in %s\n", argv[2], argv[1]);
        rc = 1;
    } else if (cJSON_IsString(node)) {
        printf("%s\n", node->valuestring);
    } else if (cJSON_IsNumber(node)) {
        printf("%.17g\n", node->valuedouble);
    } else {
        char *s = cJSON_PrintUnformatted(node);
        printf("%s\n", s ? s : "");
        free(s);
    }
done:
    free(path);
    cJSON_Delete(root);
    return rc;
}
