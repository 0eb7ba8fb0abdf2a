/* The kernel session's read loop in C: requests answered without Python.
 *
 * Why: on this kind of machine a request that reaches the Python loop costs
 * the daemon 20-60 us before its handler runs, and a create brings seven
 * (docs/kernel-binding.md, "A read loop in C"). Front.serve() reads
 * requests from /dev/fuse (non-blocking) into the caller's buffer with the
 * GIL released, answers what it can, and returns the first request Python
 * must answer. While requests keep coming it polls for the next one for up
 * to spin_ns after each, as the Python loop did.
 *
 * Answered whatever they name (the Python handlers' fixed answers):
 *   IOCTL     ENOTTY  (isatty() of every Python open(); no terminal here)
 *   GETXATTR  ENODATA for a name outside "user." (aifs keeps user.* only)
 *
 * Answered in a directory Python handed over (delegate(): a directory this
 * node made, whose every name is known; see aifs/fuse/kernel/native.py for
 * when Python hands one over and takes it back):
 *   LOOKUP    of a name it does not hold: absent (cached for the TTL)
 *   GETATTR   of the directory: its attributes, times moved by the creates
 *   CREATE    of a new name by root for writing: the local copy is made
 *             (files/<ino>, inode numbers and handles from pools Python
 *             fills), registered as the open's backing file (passthrough)
 *   FLUSH, RELEASE of the handles such creates opened
 * Each CREATE, FLUSH and RELEASE answered here is first appended to the
 * journal file (a killed daemon loses none: the next mount applies what is
 * left); Python applies the journal to its own state before it answers any
 * other request or runs anything else (journaled() tells it how far).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define OP_LOOKUP 1
#define OP_GETATTR 3
#define OP_RELEASE 18
#define OP_GETXATTR 22
#define OP_FLUSH 25
#define OP_CREATE 35
#define OP_IOCTL 39
#define OPCODES 64
#define TURNS 64 /* answered in a row before Python gets a turn (trio's other tasks) */
#define BACKING_OPEN 0x4010E501
#define BACKING_CLOSE 0x4004E502
#define FOPEN_PASSTHROUGH (1u << 7)
#define NAME_MAX_BYTES 255
/* journal records (little endian): u32 length, u32 kind, then the kind's fields */
#define J_CREATE 1
#define J_FLUSH 2
#define J_RELEASE 3

struct in_header {
    uint32_t len, opcode;
    uint64_t unique, nodeid;
    uint32_t uid, gid, pid;
    uint16_t extlen, padding;
};
struct out_header {
    uint32_t len;
    int32_t error;
    uint64_t unique;
};
struct attr { /* fuse_attr */
    uint64_t ino, size, blocks, atime, mtime, ctime;
    uint32_t atimensec, mtimensec, ctimensec, mode, nlink, uid, gid, rdev, blksize, flags;
};
struct entry_out {
    uint64_t nodeid, generation, entry_valid, attr_valid;
    uint32_t entry_valid_nsec, attr_valid_nsec;
    struct attr attr;
};
struct attr_out {
    uint64_t attr_valid;
    uint32_t attr_valid_nsec, dummy;
    struct attr attr;
};
struct open_out {
    uint64_t fh;
    uint32_t open_flags;
    int32_t backing_id;
};
struct create_in {
    uint32_t flags, mode, umask, open_flags;
};
struct j_create { /* J_CREATE, then the name (namelen bytes, padded to 8) */
    uint32_t len, kind;
    uint64_t parent, ino, fh, time_ns;
    uint32_t mode, uid, gid, pid, flags, namelen;
    int32_t backing, fd;
};
struct j_handle { /* J_FLUSH, J_RELEASE */
    uint32_t len, kind;
    uint64_t ino, fh;
    uint32_t pid, flags;
};

typedef struct { /* a directory handed over: its names, in an open-addressed set */
    uint64_t ino;
    struct attr attr;
    uint32_t key_room; /* bytes a name may take in its lake key */
    int64_t until_ns;  /* CLOCK_MONOTONIC: handed back by then (the listing TTL) */
    uint64_t *hashes;  /* 0: empty slot */
    char **names;
    size_t cap, count;
} Dir;

typedef struct {
    PyObject_HEAD
    int devfd, journal_fd, files_fd;
    uint64_t ttl_s;
    uint32_t ttl_ns, blksize;
    int creates;        /* CREATE may be answered here (passthrough, room on disk) */
    Dir **dirs;         /* open-addressed by ino; NULL: empty, TOMB: removed */
    size_t dirs_cap, dirs_count;
    uint64_t *inos;     /* inode numbers to give, from Python's pool */
    size_t inos_len, inos_cap;
    uint64_t next_fh, end_fh; /* handles to give: [next_fh, end_fh) */
    uint64_t *fhs, *fh_inos;  /* handles opened here -> their inode (open-addressed) */
    size_t fhs_cap, fhs_count;
    uint64_t journaled; /* bytes appended to the journal */
    uint64_t told;      /* ... when Python was last told (the event fd) */
    uint64_t counts[OPCODES];
    /* The helper: a thread that holds the reader's role while creates come, so
     * Python applies them meanwhile (on another CPU) instead of in between. */
    pthread_mutex_t lock; /* the tables, pools and journal */
    pthread_mutex_t role_lock;
    pthread_cond_t role;
    pthread_t helper;
    int helper_started, helper_reads, stopping;
    int efd;            /* Python's: the helper handed a request over, or journaled */
    char *hbuf;         /* the helper's request buffer */
    size_t hbuf_len;
    ssize_t handed;     /* the request the helper left in hbuf (length), or -errno */
    int64_t helper_spin_ns; /* the helper polls this long after each request */
} Front;

#define TELL_EVERY 2048 /* journal bytes the helper appends before it tells Python */

static Dir TOMB_DIR;
#define TOMB (&TOMB_DIR)

static int64_t clock_ns(clockid_t which) {
    struct timespec t;
    clock_gettime(which, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

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

/* -- tables -------------------------------------------------------------- */

static Dir **dir_slot(Front *f, uint64_t ino, int for_insert) {
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

static Dir *dir_get(Front *f, uint64_t ino) {
    Dir **slot = dir_slot(f, ino, 0);
    return slot && *slot && *slot != TOMB ? *slot : NULL;
}

static void dir_free(Dir *d) {
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

static int name_add(Dir *d, const char *name, size_t len) {
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

static int name_has(Dir *d, const char *name, size_t len) {
    return d->hashes[name_find(d, name, len, name_hash(name, len))] != 0;
}

static uint64_t *fh_slot(Front *f, uint64_t fh) {
    size_t mask = f->fhs_cap - 1, i = mix(fh) & mask;
    while (f->fhs[i] && f->fhs[i] != fh)
        i = (i + 1) & mask;
    return &f->fhs[i];
}

static void fh_remove(Front *f, uint64_t *slot) { /* backward-shift deletion */
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

/* -- answers ------------------------------------------------------------- */

static void answer(Front *f, uint64_t unique, int error, const void *body, size_t size) {
    struct out_header out = {(uint32_t)(sizeof out + (error ? 0 : size)), -error, unique};
    struct iovec iov[2] = {{&out, sizeof out}, {(void *)body, error ? 0 : size}};
    while (writev(f->devfd, iov, 2) < 0 && errno == EINTR) {
    }
}

static int journal(Front *f, const void *record, size_t size, const char *name, size_t len) {
    static const char zeros[8];
    struct iovec iov[3] = {{(void *)record, size}, {(void *)name, len}, {(void *)zeros, 0}};
    size_t total = size + len;
    iov[2].iov_len = (8 - total % 8) % 8;
    total += iov[2].iov_len;
    ssize_t n;
    while ((n = writev(f->journal_fd, iov, 3)) < 0 && errno == EINTR) {
    }
    if (n != (ssize_t)total) /* a full disk: Python answers it, and knows why */
        return -1;
    f->journaled += total;
    return 0;
}

static void dir_times(Dir *d, int64_t now) {
    /* as Python will store them: mtime from the nanoseconds, ctime from their
     * float seconds (aifs.posix.inodes: int(ctime * 1e9)) */
    int64_t ctime_ns = (int64_t)(((double)now / 1e9) * 1e9);
    d->attr.mtime = (uint64_t)(now / 1000000000), d->attr.mtimensec = now % 1000000000;
    d->attr.ctime = (uint64_t)(ctime_ns / 1000000000), d->attr.ctimensec = ctime_ns % 1000000000;
}

static int create(Front *f, const struct in_header *in, Dir *d, const char *body, size_t len) {
    if (len < sizeof(struct create_in) + 2)
        return 0;
    const struct create_in *c = (const void *)body;
    const char *name = body + sizeof *c;
    size_t namelen = strnlen(name, len - sizeof *c);
    if (namelen == len - sizeof *c || !namelen || namelen > NAME_MAX_BYTES ||
        namelen > d->key_room || (name[0] == '.' && (namelen == 1 || (namelen == 2 && name[1] == '.'))))
        return 0;
    if ((c->flags & O_ACCMODE) == O_RDONLY || in->uid != 0 || !f->creates || !f->inos_len ||
        f->next_fh >= f->end_fh || f->fhs_count * 2 + 2 > f->fhs_cap || name_has(d, name, namelen))
        return 0; /* Python's: a reader, a user whose writes must clear set-ID, no room ... */
    uint64_t ino = f->inos[f->inos_len - 1], fh = f->next_fh;
    char copy[32];
    snprintf(copy, sizeof copy, "%llu", (unsigned long long)ino);
    int fd = openat(f->files_fd, copy, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
        return 0; /* Python tries, and answers the error */
    struct {
        int32_t fd;
        uint32_t flags;
        uint64_t padding;
    } map = {fd, 0, 0};
    int backing = ioctl(f->devfd, BACKING_OPEN, &map);
    int64_t now = clock_ns(CLOCK_REALTIME);
    uint32_t mode = (c->mode & ~c->umask) & 07777;
    struct j_create j = {0, J_CREATE, in->nodeid, ino, fh, (uint64_t)now, mode, in->uid,
                         in->gid, in->pid, c->flags, (uint32_t)namelen, backing, fd};
    j.len = (uint32_t)(sizeof j + namelen + (8 - (sizeof j + namelen) % 8) % 8);
    if (backing < 0) { /* passthrough refused: Python answers every create from now */
        f->creates = 0;
        close(fd);
        unlinkat(f->files_fd, copy, 0);
        return 0;
    }
    if (name_add(d, name, namelen) < 0 || journal(f, &j, sizeof j, name, namelen) < 0) {
        /* out of memory or disk: Python answers (and says which); the name, if
         * it went in, only sends its requests to Python */
        f->creates = 0;
        ioctl(f->devfd, BACKING_CLOSE, &backing);
        close(fd);
        unlinkat(f->files_fd, copy, 0);
        return 0;
    }
    f->inos_len--;
    f->next_fh++;
    uint64_t *slot = fh_slot(f, fh);
    *slot = fh, f->fh_inos[slot - f->fhs] = ino, f->fhs_count++;
    dir_times(d, now);
    int64_t ctime_ns = (int64_t)(((double)now / 1e9) * 1e9);
    struct {
        struct entry_out e;
        struct open_out o;
    } r;
    memset(&r, 0, sizeof r);
    r.e.nodeid = ino;
    r.e.entry_valid = r.e.attr_valid = f->ttl_s;
    r.e.entry_valid_nsec = r.e.attr_valid_nsec = f->ttl_ns;
    struct attr *a = &r.e.attr;
    a->ino = ino;
    a->atime = a->mtime = (uint64_t)(now / 1000000000);
    a->atimensec = a->mtimensec = now % 1000000000;
    a->ctime = (uint64_t)(ctime_ns / 1000000000), a->ctimensec = ctime_ns % 1000000000;
    a->mode = S_IFREG | mode, a->nlink = 1, a->uid = in->uid, a->gid = in->gid;
    a->blksize = f->blksize;
    r.o.fh = fh, r.o.open_flags = FOPEN_PASSTHROUGH, r.o.backing_id = backing;
    answer(f, in->unique, 0, &r, sizeof r);
    return 1;
}

static int handle(Front *f, const struct in_header *in, uint32_t kind, const char *body,
                  size_t len) {
    if (len < 16)
        return 0;
    uint64_t fh;
    memcpy(&fh, body, 8);
    if (!f->fhs_cap)
        return 0;
    uint64_t *slot = fh_slot(f, fh);
    if (!*slot)
        return 0;
    struct j_handle j = {sizeof j, kind, f->fh_inos[slot - f->fhs], fh, in->pid, 0};
    memcpy(&j.flags, body + 8, 4);
    if (journal(f, &j, sizeof j, NULL, 0) < 0)
        return 0;
    if (kind == J_RELEASE)
        fh_remove(f, slot);
    answer(f, in->unique, 0, NULL, 0);
    return 1;
}

/* Answer the request in buf (n bytes) if this loop can; 1 if it did. */
static int answer_locked(Front *f, const char *buf, ssize_t n) {
    const struct in_header *in = (const void *)buf;
    if ((size_t)n < sizeof *in || in->len != (uint32_t)n || in->opcode >= OPCODES ||
        (size_t)in->extlen * 8 > in->len - sizeof *in)
        return 0;
    const char *body = buf + sizeof *in;
    size_t len = in->len - sizeof *in - (size_t)in->extlen * 8;
    int done = 0;
    Dir *d;
    switch (in->opcode) {
    case OP_IOCTL:
        answer(f, in->unique, ENOTTY, NULL, 0);
        done = 1;
        break;
    case OP_GETXATTR: /* fuse_getxattr_in (size, padding), then the name */
        if (len > 8 && memchr(body + 8, 0, len - 8) && strncmp(body + 8, "user.", 5)) {
            answer(f, in->unique, ENODATA, NULL, 0);
            done = 1;
        }
        break;
    case OP_FLUSH:
        done = handle(f, in, J_FLUSH, body, len);
        break;
    case OP_RELEASE:
        done = handle(f, in, J_RELEASE, body, len);
        break;
    default:
        if (!f->dirs_count || !(d = dir_get(f, in->nodeid)))
            break;
        if (clock_ns(CLOCK_MONOTONIC) >= d->until_ns)
            break; /* the listing's TTL is over: Python looks again */
        if (in->opcode == OP_LOOKUP) {
            size_t namelen = strnlen(body, len);
            if (namelen == len || namelen > NAME_MAX_BYTES || name_has(d, body, namelen))
                break;
            struct entry_out e;
            memset(&e, 0, sizeof e);
            e.entry_valid = f->ttl_s, e.entry_valid_nsec = f->ttl_ns;
            answer(f, in->unique, 0, &e, sizeof e);
            done = 1;
        } else if (in->opcode == OP_GETATTR) {
            struct attr_out o = {f->ttl_s, f->ttl_ns, 0, d->attr};
            answer(f, in->unique, 0, &o, sizeof o);
            done = 1;
        } else if (in->opcode == OP_CREATE) {
            done = create(f, in, d, body, len);
        }
    }
    if (done)
        f->counts[in->opcode]++;
    return done;
}

static int answer_here(Front *f, const char *buf, ssize_t n) {
    pthread_mutex_lock(&f->lock);
    int done = answer_locked(f, buf, n);
    pthread_mutex_unlock(&f->lock);
    return done;
}

static void tell_python(Front *f) {
    uint64_t one = 1;
    f->told = f->journaled;
    while (write(f->efd, &one, sizeof one) < 0 && errno == EINTR) {
    }
}

/* Read and answer requests until one is Python's (its length), none came
 * within spin_ns of the last (0), turns ran out (0), or an error (-errno).
 * *answered: how many were answered. The helper tells Python as it journals. */
static ssize_t read_loop(Front *f, char *buf, size_t len, int64_t spin_ns, int turns,
                         int *answered, int helper) {
    int64_t deadline = clock_ns(CLOCK_MONOTONIC) + spin_ns;
    for (;;) {
        ssize_t n = read(f->devfd, buf, len);
        if (n > 0) {
            if (!answer_here(f, buf, n))
                return n;
            if (helper && f->journaled - f->told >= TELL_EVERY)
                tell_python(f);
            if (++*answered >= turns)
                return 0;
            if (!helper && f->journaled) /* creates came: the helper reads from now on */
                return 0;
            deadline = clock_ns(CLOCK_MONOTONIC) + spin_ns;
            continue;
        }
        if (n < 0 && errno == EAGAIN) {
            if (spin_ns > 0 && clock_ns(CLOCK_MONOTONIC) < deadline)
                continue;
            return 0;
        }
        if (n < 0 && (errno == EINTR || errno == ENOENT))
            continue; /* ENOENT: the request was interrupted before it was read */
        return n < 0 ? -errno : -EIO;
    }
}

static void *helper_main(void *arg) {
    Front *f = arg;
    pthread_mutex_lock(&f->role_lock);
    for (;;) {
        while (!f->helper_reads && !f->stopping)
            pthread_cond_wait(&f->role, &f->role_lock);
        if (f->stopping)
            break;
        pthread_mutex_unlock(&f->role_lock);
        ssize_t n;
        for (;;) {
            int answered = 0;
            n = read_loop(f, f->hbuf, f->hbuf_len, f->helper_spin_ns, INT_MAX, &answered, 1);
            if (n || f->stopping)
                break;
            if (f->journaled != f->told)
                tell_python(f);
            struct pollfd p = {f->devfd, POLLIN, 0};
            poll(&p, 1, 100); /* (and looks at stopping now and then) */
        }
        pthread_mutex_lock(&f->role_lock);
        f->handed = n;
        f->helper_reads = 0;
        tell_python(f);
    }
    pthread_mutex_unlock(&f->role_lock);
    return NULL;
}

/* Python's thread leaves the reader's role to the helper (started the first time). */
static int hand_to_helper(Front *f) {
    pthread_mutex_lock(&f->role_lock);
    if (!f->helper_started) {
        if (!f->hbuf && !(f->hbuf = malloc(f->hbuf_len))) {
            pthread_mutex_unlock(&f->role_lock);
            return -1;
        }
        if (pthread_create(&f->helper, NULL, helper_main, f)) {
            pthread_mutex_unlock(&f->role_lock);
            return -1;
        }
        f->helper_started = 1;
    }
    f->helper_reads = 1;
    f->handed = 0;
    pthread_cond_signal(&f->role);
    pthread_mutex_unlock(&f->role_lock);
    return 0;
}

/* -- the Python type ------------------------------------------------------- */

static PyObject *front_serve(Front *f, PyObject *args) {
    Py_buffer buf;
    long long spin_ns;
    if (!PyArg_ParseTuple(args, "w*L", &buf, &spin_ns))
        return NULL;
    ssize_t result;
    int answered = 0, helper = 0;
    Py_BEGIN_ALLOW_THREADS
    result = read_loop(f, buf.buf, (size_t)buf.len, spin_ns, TURNS, &answered, 0);
    f->helper_spin_ns = spin_ns ? spin_ns : f->helper_spin_ns;
    if (!result && f->journaled && f->efd >= 0 && !hand_to_helper(f))
        helper = 1;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    return Py_BuildValue("nii", (Py_ssize_t)result, answered, helper);
}

static PyObject *front_take(Front *f, PyObject *args) {
    /* What the helper left: a request (copied into buffer: its length; the
     * reader's role is Python's again), 0 if it still reads, or -errno. */
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "w*", &buf))
        return NULL;
    uint64_t value;
    while (read(f->efd, &value, sizeof value) < 0 && errno == EINTR) {
    }
    ssize_t result = 0;
    pthread_mutex_lock(&f->role_lock);
    if (!f->helper_reads && f->handed) {
        result = f->handed;
        if (result > 0) {
            if (result > buf.len)
                result = -EIO;
            else
                memcpy(buf.buf, f->hbuf, (size_t)result);
        }
        f->handed = 0;
    }
    pthread_mutex_unlock(&f->role_lock);
    PyBuffer_Release(&buf);
    return PyLong_FromSsize_t(result);
}

static void helper_stop(Front *f) {
    if (!f->helper_started)
        return;
    pthread_mutex_lock(&f->role_lock);
    f->stopping = 1;
    pthread_cond_signal(&f->role);
    pthread_mutex_unlock(&f->role_lock);
    pthread_join(f->helper, NULL);
    f->helper_started = 0;
}

static PyObject *front_stop(Front *f, PyObject *unused) {
    Py_BEGIN_ALLOW_THREADS
    helper_stop(f);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *front_helper_reads(Front *f, PyObject *unused) {
    pthread_mutex_lock(&f->role_lock);
    int reads = f->helper_reads;
    pthread_mutex_unlock(&f->role_lock);
    return PyBool_FromLong(reads);
}

static PyObject *front_eventfd(Front *f, PyObject *unused) { return PyLong_FromLong(f->efd); }

static PyObject *front_counts(Front *f, PyObject *unused) {
    return PyBytes_FromStringAndSize((const char *)f->counts, sizeof f->counts);
}

static PyObject *front_journaled_locked(Front *f, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(f->journaled);
}

static PyObject *front_journal_applied_locked(Front *f, PyObject *args) {
    /* Python applied the records up to upto: if that is all, the journal starts again */
    unsigned long long upto;
    if (!PyArg_ParseTuple(args, "K", &upto))
        return NULL;
    if (f->journaled != upto)
        Py_RETURN_FALSE;
    if (ftruncate(f->journal_fd, 0) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    f->journaled = f->told = 0;
    Py_RETURN_TRUE;
}

static PyObject *front_recall_locked(Front *f, PyObject *args) {
    unsigned long long ino;
    if (!PyArg_ParseTuple(args, "K", &ino))
        return NULL;
    Dir **slot = dir_slot(f, ino, 0);
    if (slot && *slot && *slot != TOMB) {
        dir_free(*slot);
        *slot = TOMB;
        f->dirs_count--;
        Py_RETURN_TRUE;
    }
    Py_RETURN_FALSE;
}

static PyObject *front_delegate_locked(Front *f, PyObject *args) {
    unsigned long long ino;
    Py_buffer attr;
    unsigned int key_room;
    long long ttl_left_ns;
    PyObject *names;
    if (!PyArg_ParseTuple(args, "Ky*ILO!", &ino, &attr, &key_room, &ttl_left_ns,
                          &PyList_Type, &names))
        return NULL;
    if (attr.len != sizeof(struct attr)) {
        PyBuffer_Release(&attr);
        PyErr_SetString(PyExc_ValueError, "attr: a fuse_attr (88 bytes)");
        return NULL;
    }
    if ((f->dirs_count + 1) * 2 > f->dirs_cap) { /* grow (dropping tombs) */
        size_t cap = f->dirs_cap ? f->dirs_cap * 2 : 16, old_cap = f->dirs_cap;
        Dir **old = f->dirs, **dirs = calloc(cap, sizeof *dirs);
        if (!dirs) {
            PyBuffer_Release(&attr);
            return PyErr_NoMemory();
        }
        f->dirs = dirs, f->dirs_cap = cap;
        for (size_t i = 0; i < old_cap; i++)
            if (old[i] && old[i] != TOMB)
                *dir_slot(f, old[i]->ino, 1) = old[i];
        free(old);
    }
    Py_ssize_t count = PyList_GET_SIZE(names);
    Dir *d = calloc(1, sizeof *d);
    size_t cap = 64;
    while (cap < (size_t)count * 2 + 2)
        cap *= 2;
    if (d) {
        d->hashes = calloc(cap, sizeof *d->hashes);
        d->names = calloc(cap, sizeof *d->names);
        d->cap = cap;
    }
    if (!d || !d->hashes || !d->names) {
        if (d)
            dir_free(d);
        PyBuffer_Release(&attr);
        return PyErr_NoMemory();
    }
    memcpy(&d->attr, attr.buf, sizeof d->attr);
    PyBuffer_Release(&attr);
    d->ino = ino, d->key_room = key_room;
    d->until_ns = clock_ns(CLOCK_MONOTONIC) + ttl_left_ns;
    for (Py_ssize_t i = 0; i < count; i++) {
        char *name;
        Py_ssize_t len;
        if (PyBytes_AsStringAndSize(PyList_GET_ITEM(names, i), &name, &len) < 0 ||
            name_add(d, name, (size_t)len) < 0) {
            dir_free(d);
            return PyErr_Occurred() ? NULL : PyErr_NoMemory();
        }
    }
    Dir **slot = dir_slot(f, ino, 1);
    if (*slot && *slot != TOMB)
        dir_free(*slot);
    else
        f->dirs_count++;
    *slot = d;
    Py_RETURN_NONE;
}

static PyObject *front_give_locked(Front *f, PyObject *args) {
    PyObject *inos;
    unsigned long long first_fh, end_fh;
    if (!PyArg_ParseTuple(args, "O!KK", &PyList_Type, &inos, &first_fh, &end_fh))
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(inos);
    if (f->inos_len + (size_t)count > f->inos_cap) {
        size_t cap = f->inos_len + (size_t)count;
        uint64_t *grown = realloc(f->inos, cap * sizeof *grown);
        if (!grown)
            return PyErr_NoMemory();
        f->inos = grown, f->inos_cap = cap;
    }
    for (Py_ssize_t i = count - 1; i >= 0; i--) { /* handed out first to last */
        unsigned long long ino = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(inos, i));
        if (PyErr_Occurred())
            return NULL;
        f->inos[f->inos_len++] = ino;
    }
    if (end_fh > first_fh) {
        f->next_fh = first_fh, f->end_fh = end_fh;
        if (!f->fhs_cap) {
            f->fhs_cap = 4096;
            f->fhs = calloc(f->fhs_cap, sizeof *f->fhs);
            f->fh_inos = calloc(f->fhs_cap, sizeof *f->fh_inos);
            if (!f->fhs || !f->fh_inos)
                return PyErr_NoMemory();
        }
    }
    return Py_BuildValue("nK", (Py_ssize_t)f->inos_len, (unsigned long long)(f->end_fh - f->next_fh));
}

static PyObject *front_set_creates_locked(Front *f, PyObject *args) {
    int on;
    if (!PyArg_ParseTuple(args, "p", &on))
        return NULL;
    f->creates = on;
    Py_RETURN_NONE;
}

static PyObject *front_state_locked(Front *f, PyObject *unused) {
    return Py_BuildValue("{s:n,s:n,s:K,s:n,s:i}", "dirs", (Py_ssize_t)f->dirs_count, "inos",
                         (Py_ssize_t)f->inos_len, "fhs",
                         (unsigned long long)(f->end_fh - f->next_fh), "open",
                         (Py_ssize_t)f->fhs_count, "creates", f->creates);
}

/* Python's calls take the lock the helper answers under. */
#define LOCKED(name)                                                                        \
    static PyObject *name(Front *f, PyObject *args) {                                      \
        pthread_mutex_lock(&f->lock);                                                      \
        PyObject *result = name##_locked(f, args);                                         \
        pthread_mutex_unlock(&f->lock);                                                    \
        return result;                                                                     \
    }
LOCKED(front_journaled)
LOCKED(front_journal_applied)
LOCKED(front_recall)
LOCKED(front_delegate)
LOCKED(front_give)
LOCKED(front_set_creates)
LOCKED(front_state)

static int front_init(Front *f, PyObject *args, PyObject *kw) {
    unsigned long long ttl_s;
    unsigned int ttl_ns, blksize;
    Py_ssize_t buffer;
    f->journal_fd = f->files_fd = f->efd = -1;
    if (!PyArg_ParseTuple(args, "iiiKIIn", &f->devfd, &f->journal_fd, &f->files_fd, &ttl_s,
                          &ttl_ns, &blksize, &buffer))
        return -1;
    f->ttl_s = ttl_s, f->ttl_ns = ttl_ns, f->blksize = blksize, f->hbuf_len = (size_t)buffer;
    pthread_mutex_init(&f->lock, NULL);
    pthread_mutex_init(&f->role_lock, NULL);
    pthread_cond_init(&f->role, NULL);
    if ((f->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

static void front_dealloc(Front *f) {
    helper_stop(f);
    if (f->efd >= 0)
        close(f->efd);
    free(f->hbuf);
    for (size_t i = 0; i < f->dirs_cap; i++)
        if (f->dirs[i] && f->dirs[i] != TOMB)
            dir_free(f->dirs[i]);
    free(f->dirs);
    free(f->inos);
    free(f->fhs);
    free(f->fh_inos);
    Py_TYPE(f)->tp_free((PyObject *)f);
}

static PyMethodDef front_methods[] = {
    {"serve", (PyCFunction)front_serve, METH_VARARGS,
     "serve(buffer, spin_ns) -> (n, answered, helper): answer what can be answered "
     "here, polling for up to spin_ns after each; n: the length of the first request "
     "left in buffer for Python, 0 if none came in time (or Python's turn came), or "
     "-errno; answered: how many this call answered; helper: creates came, and the "
     "helper thread reads from now on (take() says when it hands the role back)."},
    {"counts", (PyCFunction)front_counts, METH_NOARGS,
     "counts() -> 64 native uint64: requests answered here, by opcode"},
    {"journaled", (PyCFunction)front_journaled, METH_NOARGS,
     "journaled() -> bytes appended to the journal since it last started again"},
    {"journal_applied", (PyCFunction)front_journal_applied, METH_VARARGS,
     "journal_applied(upto) -> whether the journal started again: Python applied the "
     "records up to upto, and no more came"},
    {"take", (PyCFunction)front_take, METH_VARARGS,
     "take(buffer) -> n: the request the helper read for Python (copied into buffer; "
     "the reader's role is Python's again), 0 if it still reads, or -errno"},
    {"helper_reads", (PyCFunction)front_helper_reads, METH_NOARGS,
     "helper_reads() -> whether the helper thread holds the reader's role"},
    {"eventfd", (PyCFunction)front_eventfd, METH_NOARGS,
     "eventfd() -> the fd that becomes readable when the helper journaled or handed over"},
    {"stop", (PyCFunction)front_stop, METH_NOARGS, "stop(): end the helper thread"},
    {"delegate", (PyCFunction)front_delegate, METH_VARARGS,
     "delegate(ino, attr, key_room, ttl_left_ns, names): hand over directory ino "
     "(attr: its fuse_attr; names: every name in it)"},
    {"recall", (PyCFunction)front_recall, METH_VARARGS,
     "recall(ino) -> whether directory ino was handed over (it is not now)"},
    {"give", (PyCFunction)front_give, METH_VARARGS,
     "give(inos, first_fh, end_fh) -> (inode numbers, handles) left to give: add inode "
     "numbers; handles from first_fh up to end_fh (replacing what is left, if any)"},
    {"set_creates", (PyCFunction)front_set_creates, METH_VARARGS,
     "set_creates(on): whether CREATE may be answered here"},
    {"state", (PyCFunction)front_state, METH_NOARGS, "state() -> a dict, for tests and logs"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FrontType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "aifs.fuse.kernel._native.Front",
    .tp_basicsize = sizeof(Front),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Front(devfd, journal_fd, files_dirfd, ttl_s, ttl_ns, blksize, buffer): the C "
              "read loop of one session (buffer: the largest request)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)front_init,
    .tp_dealloc = (destructor)front_dealloc,
    .tp_methods = front_methods,
};

static struct PyModuleDef module = {.m_base = PyModuleDef_HEAD_INIT, .m_name = "_native", .m_size = -1};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&FrontType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&FrontType);
    if (PyModule_AddObject(m, "Front", (PyObject *)&FrontType) < 0) {
        Py_DECREF(&FrontType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
