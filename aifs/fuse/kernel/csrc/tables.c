/* The C read loop's tables: directories handed over (by inode number), the
 * names in each (an open-addressed set), and the handles its creates opened. */
#include "front.h"

Dir native_tomb;

static uint64_t mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return x | 1; /* never 0 (empty) */
}

static uint64_t name_hash(const char *name, size_t len) {
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < len; i++)
        h = (h ^ (unsigned char)name[i]) * 1099511628211ULL;
    return mix(h);
}

Dir **dir_slot(Front *f, uint64_t ino, int for_insert) {
    if (!f->dirs_cap)
        return NULL;
    size_t mask = f->dirs_cap - 1, i = mix(ino) & mask;
    Dir **free_slot = NULL;
    for (size_t n = 0; n < f->dirs_cap; n++, i = (i + 1) & mask) {
        Dir *d = f->dirs[i];
        if (!d)
            return for_insert && free_slot ? free_slot : &f->dirs[i];
        if (d == TOMB) {
            if (!free_slot)
                free_slot = &f->dirs[i];
        } else if (d->ino == ino) {
            return &f->dirs[i];
        }
    }
    return free_slot;
}

Dir *dir_get(Front *f, uint64_t ino) {
    Dir **slot = dir_slot(f, ino, 0);
    return slot && *slot && *slot != TOMB ? *slot : NULL;
}

void dir_free(Dir *d) {
    for (size_t i = 0; i < d->cap; i++)
        free(d->names[i]);
    free(d->hashes);
    free(d->names);
    free(d);
}

static size_t name_find(Dir *d, const char *name, size_t len, uint64_t h) {
    size_t mask = d->cap - 1, i = h & mask;
    while (d->hashes[i]) {
        if (d->hashes[i] == h && !strncmp(d->names[i], name, len) && !d->names[i][len])
            return i;
        i = (i + 1) & mask;
    }
    return i; /* the empty slot where it would go */
}

int name_add(Dir *d, const char *name, size_t len) {
    if ((d->count + 1) * 2 > d->cap) { /* grow: keep it at most half full */
        size_t cap = d->cap * 2, old_cap = d->cap;
        uint64_t *hashes = calloc(cap, sizeof *hashes), *old_h = d->hashes;
        char **names = calloc(cap, sizeof *names), **old_n = d->names;
        if (!hashes || !names) {
            free(hashes);
            free(names);
            return -1;
        }
        d->hashes = hashes, d->names = names, d->cap = cap;
        for (size_t i = 0; i < old_cap; i++)
            if (old_h[i]) {
                size_t j = name_find(d, old_n[i], strlen(old_n[i]), old_h[i]);
                d->hashes[j] = old_h[i], d->names[j] = old_n[i];
            }
        free(old_h);
        free(old_n);
    }
    uint64_t h = name_hash(name, len);
    size_t i = name_find(d, name, len, h);
    if (d->hashes[i])
        return 0;
    if (!(d->names[i] = strndup(name, len)))
        return -1;
    d->hashes[i] = h;
    d->count++;
    return 0;
}

int name_has(Dir *d, const char *name, size_t len) {
    return d->hashes[name_find(d, name, len, name_hash(name, len))] != 0;
}

uint64_t *fh_slot(Front *f, uint64_t fh) {
    size_t mask = f->fhs_cap - 1, i = mix(fh) & mask;
    while (f->fhs[i] && f->fhs[i] != fh)
        i = (i + 1) & mask;
    return &f->fhs[i];
}

void fh_remove(Front *f, uint64_t *slot) { /* backward-shift deletion */
    size_t mask = f->fhs_cap - 1, i = (size_t)(slot - f->fhs), j = i;
    f->fhs[i] = 0;
    f->fhs_count--;
    for (;;) {
        j = (j + 1) & mask;
        if (!f->fhs[j])
            return;
        size_t home = mix(f->fhs[j]) & mask;
        if ((j > i && (home <= i || home > j)) || (j < i && home <= i && home > j)) {
            f->fhs[i] = f->fhs[j], f->fh_inos[i] = f->fh_inos[j];
            f->fhs[j] = 0;
            i = j;
        }
    }
}
