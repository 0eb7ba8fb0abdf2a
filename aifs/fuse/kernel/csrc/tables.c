/* The C read loop's tables: directories handed over (by inode number), the
 * names in each (an open-addressed set), the files handed over, and the
 * handles the loop opened. */
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

/* Open-addressed tables of u64 keys (0: empty) with a parallel array of
 * values (size bytes each): the handles opened here (-> their inode) and the
 * files handed over (-> FileEntry). */
static size_t key_find(const uint64_t *keys, size_t cap, uint64_t key) {
    size_t mask = cap - 1, i = mix(key) & mask;
    while (keys[i] && keys[i] != key)
        i = (i + 1) & mask;
    return i;
}

static void key_remove(uint64_t *keys, void *vals, size_t size, size_t cap, size_t i) {
    size_t mask = cap - 1, j = i; /* backward-shift deletion */
    char *v = vals;
    keys[i] = 0;
    for (;;) {
        j = (j + 1) & mask;
        if (!keys[j])
            return;
        size_t home = mix(keys[j]) & mask;
        if ((j > i && (home <= i || home > j)) || (j < i && home <= i && home > j)) {
            keys[i] = keys[j];
            memcpy(v + i * size, v + j * size, size);
            keys[j] = 0;
            i = j;
        }
    }
}

uint64_t *fh_slot(Front *f, uint64_t fh) { return &f->fhs[key_find(f->fhs, f->fhs_cap, fh)]; }

void fh_remove(Front *f, uint64_t *slot) {
    key_remove(f->fhs, f->fh_inos, sizeof *f->fh_inos, f->fhs_cap, (size_t)(slot - f->fhs));
    f->fhs_count--;
}

FileEntry *file_get(Front *f, uint64_t ino) {
    if (!f->files_count)
        return NULL;
    size_t i = key_find(f->file_inos, f->files_cap, ino);
    return f->file_inos[i] ? &f->file_vals[i] : NULL;
}

FileEntry *file_add(Front *f, uint64_t ino) {
    if ((f->files_count + 1) * 2 > f->files_cap) { /* grow: keep it at most half full */
        size_t cap = f->files_cap ? f->files_cap * 2 : 1024, old_cap = f->files_cap;
        uint64_t *keys = calloc(cap, sizeof *keys), *old_keys = f->file_inos;
        FileEntry *vals = calloc(cap, sizeof *vals), *old_vals = f->file_vals;
        if (!keys || !vals) {
            free(keys);
            free(vals);
            return NULL;
        }
        for (size_t i = 0; i < old_cap; i++)
            if (old_keys[i]) {
                size_t j = key_find(keys, cap, old_keys[i]);
                keys[j] = old_keys[i], vals[j] = old_vals[i];
            }
        free(old_keys);
        free(old_vals);
        f->file_inos = keys, f->file_vals = vals, f->files_cap = cap;
    }
    size_t i = key_find(f->file_inos, f->files_cap, ino);
    if (!f->file_inos[i])
        f->files_count++;
    f->file_inos[i] = ino;
    memset(&f->file_vals[i], 0, sizeof f->file_vals[i]);
    f->file_vals[i].backing = -1;
    return &f->file_vals[i];
}

int file_remove(Front *f, uint64_t ino) {
    if (!f->files_count)
        return 0;
    size_t i = key_find(f->file_inos, f->files_cap, ino);
    if (!f->file_inos[i])
        return 0;
    key_remove(f->file_inos, f->file_vals, sizeof *f->file_vals, f->files_cap, i);
    f->files_count--;
    return 1;
}
