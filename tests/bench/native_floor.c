/* The floor of a FUSE daemon written in C on this machine: a single-threaded
 * loopback over a local directory that speaks the protocol on /dev/fuse with
 * aifs's INIT flags and mount options (default_permissions, passthrough,
 * HANDLE_KILLPRIV_V2), and does no more per request than a system call or
 * two. `native_floor.py` builds it, mounts it and runs aifs bench's small-file
 * loops on it; see that file. Root only (mount(2), passthrough).
 *
 *   native_floor [--noflush] MOUNTPOINT BACKING_DIR
 *
 * With `--noflush` a writable open is answered FOPEN_NOFLUSH too (a close then
 * sends no FLUSH: 6 requests per create instead of 7). Serves until unmounted.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#define TTL 3600
#define SLOTS (1u << 20)
#define BUFSIZE (1u << 20) + 4096
#define BACKING_OPEN 0x4010E501
#define BACKING_CLOSE 0x4004E502

struct in_header { uint32_t len, opcode; uint64_t unique, nodeid; uint32_t uid, gid, pid;
                   uint16_t extlen, pad; };
struct out_header { uint32_t len; int32_t error; uint64_t unique; };
struct attr { uint64_t ino, size, blocks, atime, mtime, ctime;
              uint32_t atimensec, mtimensec, ctimensec, mode, nlink, uid, gid, rdev,
                       blksize, flags; };
struct entry_out { uint64_t nodeid, generation, entry_valid, attr_valid;
                   uint32_t entry_valid_nsec, attr_valid_nsec; struct attr attr; };
struct attr_out { uint64_t attr_valid; uint32_t attr_valid_nsec, dummy; struct attr attr; };
struct open_out { uint64_t fh; uint32_t open_flags; int32_t backing_id; };
struct init_out { uint32_t major, minor, max_readahead, flags; uint16_t max_background,
                  congestion_threshold; uint32_t max_write, time_gran; uint16_t max_pages,
                  map_alignment; uint32_t flags2, max_stack_depth; uint32_t unused[6]; };
struct backing_map { int32_t fd; uint32_t flags; uint64_t padding; };

static char *paths[SLOTS];  /* nodeid (the backing inode number) -> path */
static uint64_t keys[SLOTS];
static int devfd, noflush;

static char **slot(uint64_t ino) {
    uint32_t i = (uint32_t)(ino * 0x9E3779B97F4A7C15ull >> 44) & (SLOTS - 1);
    while (keys[i] && keys[i] != ino) i = (i + 1) & (SLOTS - 1);
    keys[i] = ino;
    return &paths[i];
}

static void reply(uint64_t unique, int error, const void *body, size_t size) {
    struct out_header out = { sizeof out + (error ? 0 : size), -error, unique };
    struct iovec iov[2] = { { &out, sizeof out }, { (void *)body, error ? 0 : size } };
    if (writev(devfd, iov, 2) < 0 && errno != ENOENT) perror("writev");
}

static void fill(struct attr *a, const struct stat *st, uint64_t ino) {
    memset(a, 0, sizeof *a);
    a->ino = ino; a->size = st->st_size; a->blocks = st->st_blocks;
    a->atime = st->st_atim.tv_sec; a->atimensec = st->st_atim.tv_nsec;
    a->mtime = st->st_mtim.tv_sec; a->mtimensec = st->st_mtim.tv_nsec;
    a->ctime = st->st_ctim.tv_sec; a->ctimensec = st->st_ctim.tv_nsec;
    a->mode = st->st_mode; a->nlink = st->st_nlink; a->uid = st->st_uid; a->gid = st->st_gid;
    a->blksize = 4096;
}

/* the entry of PATH (stat taken), remembered under its inode number */
static int entry(const char *path, struct entry_out *e) {
    struct stat st;
    if (lstat(path, &st) < 0) return errno;
    char **p = slot(st.st_ino);
    if (!*p) *p = strdup(path);
    memset(e, 0, sizeof *e);
    e->nodeid = st.st_ino; e->entry_valid = e->attr_valid = TTL;
    fill(&e->attr, &st, st.st_ino);
    return 0;
}

static const char *path_of(uint64_t nodeid) { return *slot(nodeid == 1 ? 1 : nodeid); }

static int child(uint64_t parent, const char *name, char *out) {
    return snprintf(out, 4096, "%s/%s", path_of(parent), name) >= 4096 ? ENAMETOOLONG : 0;
}

/* open PATH, register it as a backing file; the kernel keeps its own reference */
static int passthrough(const char *path, int flags, int mode, struct open_out *o) {
    int fd = open(path, flags & ~O_NOCTTY, mode);
    if (fd < 0) return errno;
    struct backing_map map = { fd, 0, 0 };
    int id = ioctl(devfd, BACKING_OPEN, &map);
    int err = id < 0 ? errno : 0;
    close(fd);
    if (err) return err;
    o->fh = id; o->backing_id = id;
    o->open_flags = 1 << 7 /* PASSTHROUGH */;
    if (noflush || (flags & O_ACCMODE) == O_RDONLY) o->open_flags |= 1 << 5; /* NOFLUSH */
    return 0;
}

int main(int argc, char **argv) {
    noflush = argc > 1 && !strcmp(argv[1], "--noflush");
    argv += noflush; argc -= noflush;
    if (argc != 3) { fprintf(stderr, "usage: native_floor [--noflush] MOUNTPOINT BACKING_DIR\n"); return 2; }
    *slot(1) = argv[2];
    devfd = open("/dev/fuse", O_RDWR | O_CLOEXEC);
    if (devfd < 0) { perror("/dev/fuse"); return 1; }
    char opts[256];
    snprintf(opts, sizeof opts, "fd=%d,rootmode=40000,user_id=0,group_id=0,"
             "default_permissions,allow_other", devfd);
    if (mount("native_floor", argv[1], "fuse.native_floor", MS_NOSUID | MS_NODEV, opts) < 0) {
        perror("mount"); return 1;
    }
    char *buf = malloc(BUFSIZE), path[4096];
    for (;;) {
        ssize_t n = read(devfd, buf, BUFSIZE);
        if (n < 0) {
            if (errno == EINTR || errno == ENOENT || errno == EAGAIN) continue;
            if (errno == ENODEV) return 0;  /* unmounted */
            perror("read /dev/fuse"); return 1;
        }
        struct in_header *in = (void *)buf;
        char *body = buf + sizeof *in;
        struct entry_out e;
        int err;
        switch (in->opcode) {
        case 26: { /* INIT */
            uint32_t *i = (void *)body;
            uint64_t offered = i[3] | ((i[3] & (1u << 30)) ? (uint64_t)i[4] << 32 : 0);
            uint64_t want = 1 | 1 << 3 | 1 << 5 | 1 << 12 | 1 << 13 | 1 << 14 | 1 << 15
                | 1 << 18 | 1 << 22 | 1 << 23 | 1 << 28 | 1 << 30 | 1ull << 37;
            uint64_t chosen = offered & want;
            struct init_out o = { 7, i[1] < 45 ? i[1] : 45, 1 << 20, (uint32_t)chosen, 64, 48,
                                  1 << 20, 1, 256, 0, (uint32_t)(chosen >> 32), 1, {0} };
            reply(in->unique, 0, &o, sizeof o);
            break;
        }
        case 1: /* LOOKUP */
            err = child(in->nodeid, body, path);
            if (!err) err = entry(path, &e);
            if (err == ENOENT) {  /* negative entry, cached as aifs's are */
                memset(&e, 0, sizeof e); e.entry_valid = TTL; err = 0;
            }
            reply(in->unique, err, &e, sizeof e);
            break;
        case 3: { /* GETATTR */
            struct stat st;
            struct attr_out o = { TTL, 0, 0, {0} };
            err = lstat(path_of(in->nodeid), &st) < 0 ? errno : 0;
            if (!err) fill(&o.attr, &st, in->nodeid);
            reply(in->unique, err, &o, sizeof o);
            break;
        }
        case 9: { /* MKDIR */
            uint32_t *m = (void *)body;
            err = child(in->nodeid, body + 8, path);
            if (!err && mkdir(path, m[0] & ~m[1]) < 0) err = errno;
            if (!err) err = entry(path, &e);
            reply(in->unique, err, &e, sizeof e);
            break;
        }
        case 35: { /* CREATE */
            uint32_t *c = (void *)body;
            struct { struct entry_out e; struct open_out o; } r;
            err = child(in->nodeid, body + 16, path);
            if (!err) err = passthrough(path, c[0] | O_CREAT, c[1] & ~c[2], &r.o);
            if (!err) err = entry(path, &r.e);
            reply(in->unique, err, &r, sizeof r);
            break;
        }
        case 14: { /* OPEN */
            struct open_out o;
            err = passthrough(path_of(in->nodeid), *(uint32_t *)body, 0, &o);
            reply(in->unique, err, &o, sizeof o);
            break;
        }
        case 18: /* RELEASE */
            err = ioctl(devfd, BACKING_CLOSE, (uint32_t *)body) < 0 ? errno : 0;
            reply(in->unique, err, NULL, 0);
            break;
        case 25: /* FLUSH */
            reply(in->unique, 0, NULL, 0);
            break;
        case 22: /* GETXATTR */
            reply(in->unique, ENODATA, NULL, 0);
            break;
        case 39: /* IOCTL */
            reply(in->unique, ENOTTY, NULL, 0);
            break;
        case 17: { /* STATFS */
            struct { uint64_t blocks, bfree, bavail, files, ffree;
                     uint32_t bsize, namelen, frsize, padding, spare[6]; } s =
                { 1 << 20, 1 << 20, 1 << 20, 1 << 20, 1 << 20, 4096, 255, 4096, 0, {0} };
            reply(in->unique, 0, &s, sizeof s);
            break;
        }
        case 2: case 42: case 36: /* FORGET, BATCH_FORGET, INTERRUPT: no answer */
            break;
        case 38: /* DESTROY */
            reply(in->unique, 0, NULL, 0);
            return 0;
        default:
            reply(in->unique, ENOSYS, NULL, 0);
        }
    }
}
