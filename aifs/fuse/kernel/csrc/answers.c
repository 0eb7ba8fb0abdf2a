/* The C read loop's answers, its read loop, and the helper thread that reads
 * while Python applies what was journaled (see _native.c). */
#include "front.h"

/* The answer decided under the lock, written after it is released (the
 * helper holds the lock for less, so Python's calls wait less; what was
 * journaled is in the journal before the answer is written either way). One
 * per thread: the loop's, and the helper's. */
static __thread struct {
    size_t len;
    char buf[sizeof(struct out_header) + 256];
} reply;

_Static_assert(sizeof(struct entry_out) + sizeof(struct open_out) <= 256,
               "the largest answer (CREATE's) fits the reply buffer");

static void answer(Front *f, uint64_t unique, int error, const void *body, size_t size) {
    (void)f;
    size = error ? 0 : size;
    struct out_header out = {(uint32_t)(sizeof out + size), -error, unique};
    memcpy(reply.buf, &out, sizeof out);
    if (size)
        memcpy(reply.buf + sizeof out, body, size);
    reply.len = sizeof out + size;
}

static void send_reply(Front *f) {
    while (write(f->devfd, reply.buf, reply.len) < 0 && errno == EINTR) {
    }
    reply.len = 0;
}

static int journal(Front *f, const void *record, size_t size, const char *name, size_t len) {
    static const char zeros[8];
    if (f->broken)
        return -1;
    struct iovec iov[3] = {{(void *)record, size}, {(void *)name, len}, {(void *)zeros, 0}};
    size_t total = size + len;
    iov[2].iov_len = (8 - total % 8) % 8;
    total += iov[2].iov_len;
    ssize_t n;
    while ((n = writev(f->journal_fd, iov, 3)) < 0 && errno == EINTR) {
    }
    if (n != (ssize_t)total) {
        /* A full disk: what was written of it goes (the next record must follow
         * the last whole one), the loop creates no more, and Python answers
         * the request (and says why). */
        if (n > 0 && ftruncate(f->journal_fd, (off_t)f->journaled) < 0)
            f->broken = 1; /* (Python finds a record cut short, and stops the loop) */
        f->creates = 0;
        return -1;
    }
    f->journaled += total;
    return 0;
}

void dir_times(Dir *d, int64_t now) {
    /* as Python will store them: mtime from the nanoseconds, ctime from their
     * float seconds (aifs.posix.inodes: int(ctime * 1e9)); atime follows mtime
     * (a directory made here has none of its own) */
    int64_t ctime_ns = (int64_t)(((double)now / 1e9) * 1e9);
    d->attr.atime = d->attr.mtime = (uint64_t)(now / 1000000000);
    d->attr.atimensec = d->attr.mtimensec = now % 1000000000;
    d->attr.ctime = (uint64_t)(ctime_ns / 1000000000), d->attr.ctimensec = ctime_ns % 1000000000;
}

/* Register fd as a backing file (passthrough); its id, or -1. A refusal
 * stops the loop's creates and opens for good: Python answers them. */
static int backing_open(Front *f, int fd) {
    struct {
        int32_t fd;
        uint32_t flags;
        uint64_t padding;
    } map = {fd, 0, 0};
    int backing = ioctl(f->devfd, BACKING_OPEN, &map);
    if (backing < 0)
        f->no_backing = 1;
    return backing;
}

/* Whether a handle is left to give (the pool, and room in the table). */
static int handle_left(Front *f) {
    return f->next_fh < f->end_fh && f->fhs_count * 2 + 2 <= f->fhs_cap;
}

/* Give the next handle to ino. */
static uint64_t handle_take(Front *f, uint64_t ino) {
    uint64_t fh = f->next_fh++, *slot = fh_slot(f, fh);
    *slot = fh, f->fh_inos[slot - f->fhs] = ino, f->fhs_count++;
    return fh;
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
    if ((c->flags & O_ACCMODE) == O_RDONLY || in->uid != 0 || !f->creates || f->no_backing ||
        !f->inos_len || !handle_left(f) || name_has(d, name, namelen))
        return 0; /* Python's: a reader, a user whose writes must clear set-ID, no room ... */
    uint64_t ino = f->inos[f->inos_len - 1], fh = f->next_fh;
    char copy[32];
    snprintf(copy, sizeof copy, "%llu", (unsigned long long)ino);
    int fd = openat(f->files_fd, copy, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
        return 0; /* Python tries, and answers the error */
    int backing = backing_open(f, fd);
    int64_t now = clock_ns(CLOCK_REALTIME);
    /* the copy's times are the create's: a copy never written keeps them (as
     * Python's create stores them), one written moves from them */
    struct timespec times[2] = {{now / 1000000000, now % 1000000000},
                                {now / 1000000000, now % 1000000000}};
    futimens(fd, times);
    uint32_t mode = (c->mode & ~c->umask) & 07777;
    struct j_create j = {0, J_CREATE, in->nodeid, ino, fh, (uint64_t)now, mode, in->uid,
                         in->gid, in->pid, c->flags, (uint32_t)namelen, backing, fd};
    j.len = (uint32_t)(sizeof j + namelen + (8 - (sizeof j + namelen) % 8) % 8);
    if (backing < 0) { /* passthrough refused (backing_open): Python answers */
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
    handle_take(f, ino);
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

/* OPEN for reading of a file handed over: passthrough to its local copy, one
 * backing id for all the loop's opens of it at a time (the kernel's rule),
 * registered at the first; Python closes it at the last release it applies. */
static int open_file(Front *f, const struct in_header *in, const char *body, size_t len) {
    FileEntry *e;
    if (len < sizeof(struct open_in) || !f->files_count || !(e = file_get(f, in->nodeid)))
        return 0;
    const struct open_in *o = (const void *)body;
    if ((o->flags & O_ACCMODE) != O_RDONLY || o->flags & O_TRUNC || f->no_backing ||
        !handle_left(f) || clock_ns(CLOCK_MONOTONIC) >= e->until_ns)
        return 0; /* Python's: a writer, no handles left, past the TTL ... */
    int backing = e->backing, registered = 0;
    if (!e->count) {
        char copy[32];
        snprintf(copy, sizeof copy, "%llu", (unsigned long long)in->nodeid);
        /* read-write, as Python's: its writers may share this backing file */
        int fd = openat(f->files_fd, copy, O_RDWR | O_CLOEXEC);
        if (fd < 0)
            return 0; /* evicted: Python reads it from the lake */
        backing = backing_open(f, fd);
        close(fd); /* (the kernel holds the file) */
        if (backing < 0)
            return 0; /* passthrough refused: Python answers */
        registered = 1;
    }
    uint64_t fh = f->next_fh;
    struct j_open j = {sizeof j, J_OPEN, in->nodeid, fh, in->pid, o->flags, backing, 0};
    if (journal(f, &j, sizeof j, NULL, 0) < 0) {
        if (registered)
            ioctl(f->devfd, BACKING_CLOSE, &backing);
        return 0;
    }
    handle_take(f, in->nodeid);
    e->backing = backing, e->count++;
    struct open_out r = {fh, FOPEN_PASSTHROUGH | FOPEN_NOFLUSH, backing};
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
    if (kind == J_RELEASE) { /* (Python's, if it cannot be journaled) */
        FileEntry *e = file_get(f, j.ino);
        if (e && e->count && !--e->count)
            e->backing = -1; /* (Python closes it as it applies this release) */
        fh_remove(f, slot);
    }
    if (journal(f, &j, sizeof j, NULL, 0) < 0)
        return 0;
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
    case OP_OPEN:
        done = open_file(f, in, body, len);
        break;
    default:
        if (in->opcode == OP_GETATTR && f->files_count) {
            FileEntry *e = file_get(f, in->nodeid);
            if (e && clock_ns(CLOCK_MONOTONIC) < e->until_ns) {
                struct attr_out o = {f->ttl_s, f->ttl_ns, 0, e->attr};
                answer(f, in->unique, 0, &o, sizeof o);
                done = 1;
                break;
            }
        }
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

/* answer_locked under the lock; *tell: TELL_EVERY bytes were journaled since
 * Python was last told (and it counts as told now) */
static int answer_here(Front *f, const char *buf, ssize_t n, int *tell) {
    pthread_mutex_lock(&f->lock);
    int done = answer_locked(f, buf, n);
    if ((*tell = done && f->journaled - f->told >= TELL_EVERY))
        f->told = f->journaled;
    pthread_mutex_unlock(&f->lock);
    if (done)
        send_reply(f);
    return done;
}

static void tell_python(Front *f) {
    uint64_t one = 1;
    while (write(f->efd, &one, sizeof one) < 0 && errno == EINTR) {
    }
}

/* Read and answer requests until one is Python's (its length), none came
 * within spin_ns of the last (0), turns ran out (0), or an error (-errno).
 * *answered: how many were answered. The helper tells Python as it journals. */
ssize_t read_loop(Front *f, char *buf, size_t len, int64_t spin_ns, int turns,
                         int *answered, int helper) {
    int64_t deadline = clock_ns(CLOCK_MONOTONIC) + spin_ns;
    for (;;) {
        if (helper && __atomic_load_n(&f->stopping, __ATOMIC_RELAXED))
            return 0;
        ssize_t n = read(f->devfd, buf, len);
        if (n > 0) {
            int tell;
            if (!answer_here(f, buf, n, &tell))
                return n;
            if (helper && tell)
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
            if (n || __atomic_load_n(&f->stopping, __ATOMIC_RELAXED))
                break;
            pthread_mutex_lock(&f->lock); /* idle: Python applies what is left */
            int tell = f->journaled != f->told;
            f->told = f->journaled;
            pthread_mutex_unlock(&f->lock);
            if (tell)
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
int hand_to_helper(Front *f) {
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

void helper_stop(Front *f) {
    if (!f->helper_started)
        return;
    pthread_mutex_lock(&f->role_lock);
    f->stopping = 1;
    pthread_cond_signal(&f->role);
    pthread_mutex_unlock(&f->role_lock);
    pthread_join(f->helper, NULL);
    f->helper_started = 0;
}

