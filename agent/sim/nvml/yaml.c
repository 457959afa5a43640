/*
 * yaml.c: the small YAML subset the simulator's profiles are written in.
 *
 * Owns: turning a profile file into a tree of maps, sequences and typed scalars. Must not
 * know the profile schema (profile.c does) and must not accept anything PyYAML would read
 * differently: a construct outside the subset is an error naming the file and line.
 *
 * The subset (documented in docs/simulator.md):
 *   - block mappings `key: value` and block sequences `- item`, nested by indentation
 *     (spaces only; a sequence may sit at its parent key's indentation, as PyYAML writes);
 *     `- key: value` starts a mapping inside a sequence item;
 *   - flow sequences on one line: `[a, "b", [c, d]]`;
 *   - scalars: plain, "double quoted" (YAML's escapes: \" \\ \/ \0 \a \b \t \n \v \f \r
 *     \e \N \_ \L \P \xNN \uNNNN \UNNNNNNNN, but no escaped line breaks), and
 *     'single quoted' ('' for a quote);
 *   - comments: `#` at the start of a line or after whitespace, outside quotes;
 *   - an optional leading `---`.
 * Not supported (rejected): flow mappings `{}`, block scalars `|` `>`, anchors, aliases,
 * tags, multi-line plain scalars, multiple documents.
 *
 * Plain scalars are typed the way PyYAML's SafeLoader (YAML 1.1) types them: null, bool,
 * int (decimal, 0x, 0b, leading-0 octal, sexagesimal, with `_`), float and timestamp; every
 * other plain scalar and every quoted one is a string. Bool, float and timestamp scalars
 * are Y_OTHER here: the schema has no such fields, so they are always an error there.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim.h"

typedef struct {
    int indent;
    int lineno;
    char *text; /* content after the indentation, comment and trailing blanks removed */
} yline;

typedef struct {
    const char *path;
    yline *lines;
    int n;
    int i;
    char *err;
    size_t errlen;
    int failed;
} yparser;

void sim_vfail(char *err, size_t errlen, int *failed, const char *fmt, va_list ap,
               const char *where_fmt, ...)
{
    if (*failed)
        return;
    *failed = 1;
    if (errlen == 0)
        return;
    va_list where;
    va_start(where, where_fmt);
    vsnprintf(err, errlen, where_fmt, where);
    va_end(where);
    size_t n = strlen(err);
    snprintf(err + n, errlen - n, ": ");
    n = strlen(err);
    vsnprintf(err + n, errlen - n, fmt, ap);
}

static void yfail(yparser *p, int line, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    sim_vfail(p->err, p->errlen, &p->failed, fmt, ap, "%s:%d", p->path, line);
    va_end(ap);
}

static ynode *ynew(ytype t, int line)
{
    ynode *n = calloc(1, sizeof *n);
    if (n) {
        n->type = t;
        n->line = line;
    }
    return n;
}

void yaml_free(ynode *n)
{
    if (!n)
        return;
    for (int i = 0; i < n->n; i++) {
        if (n->keys)
            free(n->keys[i]);
        if (n->items)
            yaml_free(n->items[i]);
    }
    free(n->keys);
    free(n->key_lines);
    free(n->items);
    free(n->str);
    free(n);
}

const char *yaml_type_name(ytype t)
{
    switch (t) {
    case Y_NULL: return "null";
    case Y_STR: return "a string";
    case Y_INT: return "an integer";
    case Y_OTHER: return "a boolean, float or date";
    case Y_MAP: return "a mapping";
    case Y_SEQ: return "a sequence";
    }
    return "?";
}

ynode *yaml_get(const ynode *map, const char *key)
{
    if (!map || map->type != Y_MAP)
        return NULL;
    for (int i = 0; i < map->n; i++)
        if (strcmp(map->keys[i], key) == 0)
            return map->items[i];
    return NULL;
}

/* Add `child` (NULL: parsing it failed or ran out of memory) to `parent` under `key` (NULL in
 * a sequence). On failure both are freed and the parse has failed. */
static int append(yparser *p, ynode *parent, char *key, int key_line, ynode *child)
{
    if (!child)
        goto oom;
    int n = parent->n + 1;
    ynode **items = realloc(parent->items, n * sizeof *items);
    if (!items)
        goto oom;
    parent->items = items;
    if (parent->type == Y_MAP) {
        char **keys = realloc(parent->keys, n * sizeof *keys);
        if (!keys)
            goto oom;
        parent->keys = keys;
        int *kl = realloc(parent->key_lines, n * sizeof *kl);
        if (!kl)
            goto oom;
        parent->key_lines = kl;
        keys[n - 1] = key;
        kl[n - 1] = key_line;
    }
    items[n - 1] = child;
    parent->n = n;
    return 0;
oom:
    yfail(p, key_line, "out of memory");
    free(key);
    yaml_free(child);
    return -1;
}

/* ---- plain scalar typing (PyYAML's YAML 1.1 implicit resolvers) ---- */

static int all_in(const char *s, const char *set)
{
    if (!*s)
        return 0;
    for (; *s; s++)
        if (!strchr(set, *s))
            return 0;
    return 1;
}

static int is_digit(char c) { return c >= '0' && c <= '9'; }

/* Matches (:[0-5]?[0-9])+ at s up to its end, or up to a '.' if stop_at_dot. */
static const char *sexagesimal_tail(const char *s)
{
    int groups = 0;
    while (*s == ':') {
        s++;
        if (is_digit(s[0]) && is_digit(s[1])) {
            if (s[0] > '5')
                return NULL;
            s += 2;
        } else if (is_digit(s[0])) {
            s += 1;
        } else {
            return NULL;
        }
        groups++;
    }
    return groups ? s : NULL;
}

static int plain_is_int(const char *s)
{
    if (*s == '-' || *s == '+')
        s++;
    if (s[0] == '0' && s[1] == 'b')
        return all_in(s + 2, "01_");
    if (s[0] == '0' && s[1] == 'x')
        return all_in(s + 2, "0123456789abcdefABCDEF_");
    if (s[0] == '0')
        return s[1] == '\0' || all_in(s + 1, "01234567_");
    if (s[0] >= '1' && s[0] <= '9') {
        s++;
        while (is_digit(*s) || *s == '_')
            s++;
        if (*s == '\0')
            return 1;
        const char *t = sexagesimal_tail(s);
        return t && *t == '\0';
    }
    return 0;
}

static int exponent_ok(const char *s)
{
    /* optional ([eE][-+][0-9]+) then end */
    if (*s == '\0')
        return 1;
    if ((*s == 'e' || *s == 'E') && (s[1] == '-' || s[1] == '+') && is_digit(s[2])) {
        s += 3;
        while (is_digit(*s))
            s++;
        return *s == '\0';
    }
    return 0;
}

static int plain_is_float(const char *s)
{
    const char *t = s;
    if (strcmp(s, ".nan") == 0 || strcmp(s, ".NaN") == 0 || strcmp(s, ".NAN") == 0)
        return 1;
    if (*t == '-' || *t == '+')
        t++;
    if (strcmp(t, ".inf") == 0 || strcmp(t, ".Inf") == 0 || strcmp(t, ".INF") == 0)
        return 1;
    if (s[0] == '.') { /* \.[0-9][0-9_]*exp? */
        t = s + 1;
        if (!is_digit(*t))
            return 0;
        while (is_digit(*t) || *t == '_')
            t++;
        return exponent_ok(t);
    }
    if (!is_digit(*t))
        return 0;
    t++;
    while (is_digit(*t) || *t == '_')
        t++;
    if (*t == '.') { /* [0-9][0-9_]*\.[0-9_]*exp? */
        t++;
        while (is_digit(*t) || *t == '_')
            t++;
        return exponent_ok(t);
    }
    if (*t == ':') { /* sexagesimal float */
        t = sexagesimal_tail(t);
        if (!t || *t != '.')
            return 0;
        t++;
        while (is_digit(*t) || *t == '_')
            t++;
        return *t == '\0';
    }
    return 0;
}

static int digits(const char **s, int min, int max)
{
    int n = 0;
    while (n < max && is_digit(**s)) {
        (*s)++;
        n++;
    }
    return n >= min;
}

static int plain_is_timestamp(const char *s)
{
    const char *t = s;
    if (!digits(&t, 4, 4) || *t++ != '-')
        return 0;
    if (strlen(s) == 10 && is_digit(s[5]) && is_digit(s[6]) && s[7] == '-' && is_digit(s[8])
        && is_digit(s[9]))
        return 1;
    if (!digits(&t, 1, 2) || *t++ != '-' || !digits(&t, 1, 2))
        return 0;
    if (*t == 'T' || *t == 't') {
        t++;
    } else if (*t == ' ' || *t == '\t') {
        while (*t == ' ' || *t == '\t')
            t++;
    } else {
        return 0;
    }
    if (!digits(&t, 1, 2) || *t++ != ':' || !digits(&t, 2, 2) || *t++ != ':'
        || !digits(&t, 2, 2))
        return 0;
    if (*t == '.') {
        t++;
        while (is_digit(*t))
            t++;
    }
    while (*t == ' ' || *t == '\t')
        t++;
    if (*t == 'Z')
        t++;
    else if (*t == '-' || *t == '+') {
        t++;
        if (!digits(&t, 1, 2))
            return 0;
        if (*t == ':') {
            t++;
            if (!digits(&t, 2, 2))
                return 0;
        }
    }
    return *t == '\0';
}

static ytype classify_plain(const char *s)
{
    static const char *const nulls[] = {"", "~", "null", "Null", "NULL"};
    static const char *const bools[] = {"yes", "Yes", "YES", "no", "No", "NO", "true", "True",
                                        "TRUE", "false", "False", "FALSE", "on", "On", "ON",
                                        "off", "Off", "OFF"};
    for (size_t i = 0; i < sizeof nulls / sizeof *nulls; i++)
        if (strcmp(s, nulls[i]) == 0)
            return Y_NULL;
    for (size_t i = 0; i < sizeof bools / sizeof *bools; i++)
        if (strcmp(s, bools[i]) == 0)
            return Y_OTHER;
    if (plain_is_float(s))
        return Y_OTHER;
    if (plain_is_int(s))
        return Y_INT;
    if (plain_is_timestamp(s) || strcmp(s, "=") == 0 || strcmp(s, "<<") == 0)
        return Y_OTHER;
    return Y_STR;
}

int yaml_int(const ynode *n, long long *out)
{
    if (!n || n->type != Y_INT)
        return -1;
    char buf[128];
    size_t k = 0;
    for (const char *s = n->str; *s && k + 1 < sizeof buf; s++)
        if (*s != '_')
            buf[k++] = *s;
    buf[k] = '\0';
    const char *s = buf;
    int neg = 0;
    if (*s == '-' || *s == '+')
        neg = (*s++ == '-');
    unsigned long long v = 0;
    char *end = NULL;
    errno = 0;
    if (strchr(s, ':')) { /* sexagesimal: a:b:c = (a*60 + b)*60 + c */
        const char *t = s;
        while (*t) {
            unsigned long long part = strtoull(t, &end, 10);
            if (errno || end == t)
                return -1;
            v = v * 60 + part;
            t = (*end == ':') ? end + 1 : end;
            if (!*end)
                break;
        }
    } else if (s[0] == '0' && s[1] == 'x') {
        v = strtoull(s + 2, &end, 16);
    } else if (s[0] == '0' && s[1] == 'b') {
        v = strtoull(s + 2, &end, 2);
    } else if (s[0] == '0' && s[1]) {
        v = strtoull(s + 1, &end, 8);
    } else {
        v = strtoull(s, &end, 10);
    }
    if (errno || (end && *end) || v > (unsigned long long)9223372036854775807LL)
        return -1;
    *out = neg ? -(long long)v : (long long)v;
    return 0;
}

/* ---- lexical helpers ---- */

static char *xstrndup(const char *s, size_t n)
{
    char *d = malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = '\0';
    }
    return d;
}

static void put_utf8(char **o, unsigned long cp)
{
    char *d = *o;
    if (cp < 0x80) {
        *d++ = (char)cp;
    } else if (cp < 0x800) {
        *d++ = (char)(0xC0 | (cp >> 6));
        *d++ = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        *d++ = (char)(0xE0 | (cp >> 12));
        *d++ = (char)(0x80 | ((cp >> 6) & 0x3F));
        *d++ = (char)(0x80 | (cp & 0x3F));
    } else {
        *d++ = (char)(0xF0 | (cp >> 18));
        *d++ = (char)(0x80 | ((cp >> 12) & 0x3F));
        *d++ = (char)(0x80 | ((cp >> 6) & 0x3F));
        *d++ = (char)(0x80 | (cp & 0x3F));
    }
    *o = d;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Parse a quoted scalar starting at *s (on the quote). Returns the unescaped text and moves
 * *s past the closing quote, or NULL on error. */
static char *parse_quoted(yparser *p, int line, const char **s)
{
    const char *q = *s;
    char quote = *q++;
    char *out = malloc(strlen(q) * 4 + 1);
    if (!out) {
        yfail(p, line, "out of memory");
        return NULL;
    }
    char *o = out;
    for (;;) {
        char c = *q;
        if (c == '\0') {
            yfail(p, line, "unterminated %s-quoted string (multi-line strings are not supported)",
                  quote == '"' ? "double" : "single");
            free(out);
            return NULL;
        }
        if (quote == '\'') {
            if (c == '\'') {
                if (q[1] == '\'') {
                    *o++ = '\'';
                    q += 2;
                    continue;
                }
                q++;
                break;
            }
            *o++ = c;
            q++;
            continue;
        }
        if (c == '"') {
            q++;
            break;
        }
        if (c != '\\') {
            *o++ = c;
            q++;
            continue;
        }
        q++;
        c = *q++;
        int width = 0;
        switch (c) {
        case '"': *o++ = '"'; break;
        case '\\': *o++ = '\\'; break;
        case '/': *o++ = '/'; break;
        case 'n': *o++ = '\n'; break;
        case 't': *o++ = '\t'; break;
        case 'r': *o++ = '\r'; break;
        case '0': *o++ = '\0'; break;
        case 'a': *o++ = '\a'; break;
        case 'b': *o++ = '\b'; break;
        case 'v': *o++ = '\v'; break;
        case 'f': *o++ = '\f'; break;
        case 'e': *o++ = '\x1b'; break;
        case ' ': *o++ = ' '; break;
        case '\t': *o++ = '\t'; break;
        case 'N': put_utf8(&o, 0x85); break;
        case '_': put_utf8(&o, 0xA0); break;
        case 'L': put_utf8(&o, 0x2028); break;
        case 'P': put_utf8(&o, 0x2029); break;
        case 'x': width = 2; break;
        case 'u': width = 4; break;
        case 'U': width = 8; break;
        default:
            yfail(p, line, "unsupported escape \\%c in a double-quoted string", c ? c : ' ');
            free(out);
            return NULL;
        }
        if (width) {
            unsigned long cp = 0;
            for (int k = 0; k < width; k++) {
                int h = hexval(q[k]);
                if (h < 0) {
                    yfail(p, line, "bad \\%c escape: expected %d hex digits", c, width);
                    free(out);
                    return NULL;
                }
                cp = cp * 16 + (unsigned long)h;
            }
            q += width;
            if (cp > 0x10FFFF) {
                yfail(p, line, "escape out of the Unicode range");
                free(out);
                return NULL;
            }
            put_utf8(&o, cp);
        }
    }
    *o = '\0';
    if (memchr(out, '\0', (size_t)(o - out))) {
        yfail(p, line, "NUL characters are not supported in strings");
        free(out);
        return NULL;
    }
    *s = q;
    return out;
}

static const char *skip_blanks(const char *s)
{
    while (*s == ' ')
        s++;
    return s;
}

static int is_seq_item(const char *t) { return t[0] == '-' && (t[1] == '\0' || t[1] == ' '); }

/* YAML: a plain scalar cannot start with an indicator, nor with "- ", "? " or ": ". */
static int plain_start_ok(const char *s)
{
    if (*s && strchr(",[]{}#&*!|>'\"%@`", *s))
        return 0;
    if ((*s == '-' || *s == '?' || *s == ':') && (s[1] == '\0' || s[1] == ' '))
        return 0;
    return 1;
}

static ynode *scalar_node(yparser *p, int line, char *text, int quoted)
{
    ynode *n = ynew(quoted ? Y_STR : classify_plain(text), line);
    if (!n) {
        free(text);
        yfail(p, line, "out of memory");
        return NULL;
    }
    n->str = text;
    n->quoted = quoted;
    return n;
}

static ynode *parse_flow_seq(yparser *p, int line, const char **s)
{
    const char *q = *s + 1; /* past '[' */
    ynode *seq = ynew(Y_SEQ, line);
    if (!seq) {
        yfail(p, line, "out of memory");
        return NULL;
    }
    for (;;) {
        q = skip_blanks(q);
        if (*q == ']') {
            q++;
            break;
        }
        ynode *item = NULL;
        if (*q == '[') {
            item = parse_flow_seq(p, line, &q);
        } else if (*q == '"' || *q == '\'') {
            char *t = parse_quoted(p, line, &q);
            item = t ? scalar_node(p, line, t, 1) : NULL;
        } else if (*q == '{') {
            yfail(p, line, "flow mappings {...} are not supported");
        } else if (*q == ',' || *q == '\0') {
            yfail(p, line, *q ? "empty item in a flow sequence" : "unterminated flow sequence");
        } else if (*q == '&' || *q == '*' || *q == '!') {
            yfail(p, line, "anchors, aliases and tags are not supported");
        } else {
            const char *b = q;
            if (!plain_start_ok(q)) {
                yfail(p, line, "'%c' cannot start a plain value (quote it)", *q);
                yaml_free(seq);
                return NULL;
            }
            while (*q && *q != ',' && *q != ']' && *q != '[' && *q != '{' && *q != '}')
                q++;
            const char *e = q;
            while (e > b && e[-1] == ' ')
                e--;
            char *t = xstrndup(b, (size_t)(e - b));
            if (t && (strstr(t, ": ") || (e > b && e[-1] == ':'))) {
                yfail(p, line, "mappings inside flow sequences are not supported");
                free(t);
            } else {
                item = t ? scalar_node(p, line, t, 0) : NULL;
            }
        }
        if (!item) {
            yaml_free(seq);
            return NULL;
        }
        if (append(p, seq, NULL, line, item) < 0) {
            yaml_free(seq);
            return NULL;
        }
        q = skip_blanks(q);
        if (*q == ',') {
            q++;
            continue;
        }
        if (*q == ']') {
            q++;
            break;
        }
        yfail(p, line, *q ? "expected ',' or ']' in a flow sequence" : "unterminated flow sequence");
        yaml_free(seq);
        return NULL;
    }
    *s = q;
    return seq;
}

/* A value written on the same line as its key or dash. */
static ynode *parse_inline(yparser *p, int line, const char *s)
{
    const char *q = s;
    ynode *n = NULL;
    switch (*q) {
    case '[':
        n = parse_flow_seq(p, line, &q);
        break;
    case '"':
    case '\'': {
        char *t = parse_quoted(p, line, &q);
        n = t ? scalar_node(p, line, t, 1) : NULL;
        break;
    }
    case '{':
        yfail(p, line, "flow mappings {...} are not supported");
        return NULL;
    case '|':
    case '>':
        yfail(p, line, "block scalars (| and >) are not supported");
        return NULL;
    case '&':
    case '*':
    case '!':
        yfail(p, line, "anchors, aliases and tags are not supported");
        return NULL;
    default: {
        if (!plain_start_ok(q)) {
            yfail(p, line, is_seq_item(q) ? "a sequence cannot start on the same line as a key"
                                          : "'%c' cannot start a plain value (quote it)", *q);
            return NULL;
        }
        if (strstr(q, ": ") || q[strlen(q) - 1] == ':') {
            yfail(p, line, "a mapping cannot start on the same line as a key");
            return NULL;
        }
        char *t = xstrndup(q, strlen(q));
        return t ? scalar_node(p, line, t, 0) : NULL;
    }
    }
    if (n) {
        q = skip_blanks(q);
        if (*q) {
            yfail(p, line, "unexpected text after a value: '%s'", q);
            yaml_free(n);
            return NULL;
        }
    }
    return n;
}


/* If `t` is `key: value` / `key:`, set *key (allocated) and *value (pointer into t). */
static int split_key(yparser *p, int line, const char *t, char **key, const char **value)
{
    const char *q = t;
    const char *kb, *ke;
    char *quoted_key = NULL;
    if (*q == '"' || *q == '\'') {
        int was_failed = p->failed;
        quoted_key = parse_quoted(p, line, &q);
        if (!quoted_key) {
            if (!was_failed) { /* not a key after all: let the caller report it as a value */
                p->failed = 0;
            }
            return 0;
        }
        q = skip_blanks(q);
        if (*q != ':' || (q[1] != '\0' && q[1] != ' ')) {
            free(quoted_key);
            return 0;
        }
        *key = quoted_key;
        *value = skip_blanks(q + 1);
        return 1;
    }
    kb = q;
    for (; *q; q++) {
        if (*q == ':' && (q[1] == '\0' || q[1] == ' '))
            break;
    }
    if (!*q)
        return 0;
    if (*kb == '[' || *kb == '{' || *kb == '&' || *kb == '*' || *kb == '!' || *kb == '?') {
        yfail(p, line, "complex keys, anchors and tags are not supported");
        return -1;
    }
    ke = q;
    while (ke > kb && ke[-1] == ' ')
        ke--;
    if (ke == kb) {
        yfail(p, line, "empty mapping key");
        return -1;
    }
    *key = xstrndup(kb, (size_t)(ke - kb));
    *value = skip_blanks(q + 1);
    return *key ? 1 : -1;
}

static ynode *parse_node(yparser *p, int indent);

/* A new block collection of type `t` opening at the current line (NULL: out of memory). */
static ynode *block_new(yparser *p, ytype t)
{
    ynode *n = ynew(t, p->lines[p->i].lineno);
    if (!n)
        yfail(p, p->lines[p->i].lineno, "out of memory");
    return n;
}

/* The next line of the block at `indent`; NULL where the block ends (a line indented less, the
 * end of the file) or the parse failed. */
static yline *block_line(yparser *p, int indent)
{
    if (p->failed || p->i >= p->n)
        return NULL;
    yline *l = &p->lines[p->i];
    if (l->indent < indent)
        return NULL;
    if (l->indent > indent) {
        yfail(p, l->lineno, "bad indentation");
        return NULL;
    }
    return l;
}

/* `n`, or NULL (with `n` freed) when the parse has failed. */
static ynode *unless_failed(yparser *p, ynode *n)
{
    if (!p->failed)
        return n;
    yaml_free(n);
    return NULL;
}

static void check_no_deeper(yparser *p, int indent)
{
    if (!p->failed && p->i < p->n && p->lines[p->i].indent > indent)
        yfail(p, p->lines[p->i].lineno,
              "unexpected indentation (multi-line plain values are not supported)");
}

static ynode *parse_seq(yparser *p, int indent)
{
    ynode *seq = block_new(p, Y_SEQ);
    if (!seq)
        return NULL;
    for (yline *l; (l = block_line(p, indent));) {
        if (!is_seq_item(l->text))
            break;
        const char *rest = skip_blanks(l->text + 1);
        ynode *child;
        if (*rest == '\0') {
            p->i++;
            if (p->i < p->n && p->lines[p->i].indent > indent)
                child = parse_node(p, p->lines[p->i].indent);
            else
                child = ynew(Y_NULL, l->lineno);
        } else {
            char *key = NULL;
            const char *value = NULL;
            int k = is_seq_item(rest) ? 1 : split_key(p, l->lineno, rest, &key, &value);
            free(key);
            if (k < 0)
                break;
            if (k > 0) { /* `- key: v` or `- - x`: the item is a block at the column of rest */
                l->indent = indent + (int)(rest - l->text);
                l->text = (char *)rest;
                child = parse_node(p, l->indent);
            } else {
                child = parse_inline(p, l->lineno, rest);
                p->i++;
                check_no_deeper(p, indent);
            }
        }
        if (append(p, seq, NULL, l->lineno, child) < 0)
            break;
    }
    return unless_failed(p, seq);
}

static ynode *parse_map(yparser *p, int indent)
{
    ynode *map = block_new(p, Y_MAP);
    if (!map)
        return NULL;
    for (yline *l; (l = block_line(p, indent));) {
        if (is_seq_item(l->text)) {
            yfail(p, l->lineno, "a sequence item where a mapping key was expected");
            break;
        }
        char *key = NULL;
        const char *value = NULL;
        int k = split_key(p, l->lineno, l->text, &key, &value);
        if (k == 0)
            yfail(p, l->lineno, "expected 'key: value', found '%s'", l->text);
        if (k <= 0)
            break;
        if (yaml_get(map, key)) {
            yfail(p, l->lineno, "duplicate key '%s'", key);
            free(key);
            break;
        }
        int key_line = l->lineno;
        ynode *child;
        p->i++;
        if (*value == '\0') {
            if (p->i < p->n && p->lines[p->i].indent > indent)
                child = parse_node(p, p->lines[p->i].indent);
            else if (p->i < p->n && p->lines[p->i].indent == indent
                     && is_seq_item(p->lines[p->i].text))
                child = parse_seq(p, indent);
            else
                child = ynew(Y_NULL, key_line);
        } else {
            child = parse_inline(p, key_line, value);
            check_no_deeper(p, indent);
        }
        if (append(p, map, key, key_line, child) < 0)
            break;
    }
    return unless_failed(p, map);
}

static ynode *parse_node(yparser *p, int indent)
{
    yline *l = &p->lines[p->i];
    if (is_seq_item(l->text))
        return parse_seq(p, indent);
    char *key = NULL;
    const char *value = NULL;
    int k = split_key(p, l->lineno, l->text, &key, &value);
    free(key);
    if (k < 0)
        return NULL;
    if (k > 0)
        return parse_map(p, indent);
    ynode *n = parse_inline(p, l->lineno, l->text);
    p->i++;
    check_no_deeper(p, indent);
    return unless_failed(p, n);
}

/* Remove a comment: '#' at the start or after a blank, outside quoted scalars. */
static void strip_comment(char *t)
{
    char quote = 0;
    char prev_sig = '\0'; /* last non-blank char outside quotes */
    for (char *q = t; *q; q++) {
        char c = *q;
        if (quote) {
            if (quote == '"' && c == '\\' && q[1]) {
                q++;
            } else if (c == quote) {
                if (quote == '\'' && q[1] == '\'')
                    q++;
                else
                    quote = 0;
            }
            continue;
        }
        int at_token = (q == t) || q[-1] == ' ' || q[-1] == '[' || q[-1] == ',';
        if (c == '#' && (q == t || q[-1] == ' ')) {
            *q = '\0';
            break;
        }
        if ((c == '"' || c == '\'') && at_token
            && (prev_sig == '\0' || prev_sig == ':' || prev_sig == '-' || prev_sig == '['
                || prev_sig == ',')) {
            quote = c;
            continue;
        }
        if (c != ' ')
            prev_sig = c;
    }
}

ynode *yaml_load_file(const char *path, char *err, size_t errlen)
{
    yparser p = {.path = path, .err = err, .errlen = errlen};
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    size_t cap = 65536, len = 0;
    char *buf = malloc(cap + 1);
    while (buf) {
        size_t got = fread(buf + len, 1, cap - len, f);
        len += got;
        if (len < cap)
            break;
        if (cap >= (64u << 20)) {
            snprintf(err, errlen, "%s: file too large", path);
            free(buf);
            fclose(f);
            return NULL;
        }
        cap *= 2;
        char *nb = realloc(buf, cap + 1);
        if (!nb) {
            free(buf);
            buf = NULL;
        }
        buf = nb;
    }
    fclose(f);
    if (!buf) {
        snprintf(err, errlen, "%s: out of memory", path);
        return NULL;
    }
    buf[len] = '\0';
    if (memchr(buf, '\0', len)) {
        snprintf(err, errlen, "%s: not a text file", path);
        free(buf);
        return NULL;
    }

    int nlines = 1;
    for (size_t k = 0; k < len; k++)
        nlines += buf[k] == '\n';
    p.lines = calloc((size_t)nlines, sizeof *p.lines);
    if (!p.lines) {
        snprintf(err, errlen, "%s: out of memory", path);
        free(buf);
        return NULL;
    }
    char *s = buf;
    int lineno = 0, seen_content = 0;
    while (s && !p.failed) {
        char *nl = strchr(s, '\n');
        if (nl)
            *nl = '\0';
        lineno++;
        size_t sl = strlen(s);
        if (sl && s[sl - 1] == '\r')
            s[--sl] = '\0';
        int indent = 0;
        while (s[indent] == ' ')
            indent++;
        char *t = s + indent;
        if (*t == '\t') {
            yfail(&p, lineno, "tab in indentation (use spaces)");
            break;
        }
        strip_comment(t);
        size_t tl = strlen(t);
        while (tl && (t[tl - 1] == ' ' || t[tl - 1] == '\t'))
            t[--tl] = '\0';
        if (tl) {
            if (indent == 0 && strcmp(t, "---") == 0 && !seen_content) {
                /* document start */
            } else if (indent == 0 && (strcmp(t, "...") == 0 || strncmp(t, "---", 3) == 0)) {
                if (strcmp(t, "...") == 0)
                    break;
                yfail(&p, lineno, "multiple documents are not supported");
            } else if (indent == 0 && t[0] == '%') {
                yfail(&p, lineno, "directives are not supported");
            } else {
                seen_content = 1;
                p.lines[p.n].indent = indent;
                p.lines[p.n].lineno = lineno;
                p.lines[p.n].text = t;
                p.n++;
            }
        }
        s = nl ? nl + 1 : NULL;
    }
    ynode *root = NULL;
    if (!p.failed) {
        if (p.n == 0) {
            yfail(&p, 1, "empty file");
        } else {
            root = parse_node(&p, p.lines[0].indent);
            if (root && p.i < p.n) {
                yfail(&p, p.lines[p.i].lineno, "unexpected content after the top-level block");
            }
            if (p.failed) {
                yaml_free(root);
                root = NULL;
            }
        }
    }
    free(p.lines);
    free(buf);
    return root;
}
