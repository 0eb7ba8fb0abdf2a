/* The C read loop's shared declarations: the wire structs it reads and
 * writes, its tables, and the functions the module's parts share (see
 * _native.c for what the loop is and why). */
#ifndef AIFS_NATIVE_FRONT_H
#define AIFS_NATIVE_FRONT_H
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
#define OP_OPEN 14
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
#define J_OPEN 4
#define FOPEN_NOFLUSH (1u << 5)

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
struct open_in {
    uint32_t flags, open_flags;
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
struct j_open { /* J_OPEN: a read-only open of a file handed over */
    uint32_t len, kind;
    uint64_t ino, fh;
    uint32_t pid, flags;
    int32_t backing;
    uint32_t padding;
};

typedef struct { /* a file handed over: closed, its bytes all in its local copy */
    struct attr attr;
    int64_t until_ns; /* CLOCK_MONOTONIC: handed back by then (its directory's TTL) */
    int32_t backing;  /* the backing id of the loop's opens of it, -1 if none open */
    uint32_t count;   /* the loop's opens of it not yet released */
} FileEntry;

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
    int no_backing;     /* the kernel refused a backing file: no creates here again */
    int broken;         /* a record cut short stays in the journal: Python stops it all */
    Dir **dirs;         /* open-addressed by ino; NULL: empty, TOMB: removed */
    size_t dirs_cap, dirs_count;
    uint64_t *inos;     /* inode numbers to give, from Python's pool */
    size_t inos_len, inos_cap;
    uint64_t next_fh, end_fh; /* handles to give: [next_fh, end_fh) */
    uint64_t *fhs, *fh_inos;  /* handles opened here -> their inode (open-addressed) */
    size_t fhs_cap, fhs_count;
    uint64_t *file_inos;      /* files handed over (open-addressed, 0: empty) ... */
    FileEntry *file_vals;     /* ... and what the loop knows of each */
    size_t files_cap, files_count;
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


extern Dir native_tomb; /* a removed slot of the directory table */
#define TOMB (&native_tomb)

static inline int64_t clock_ns(clockid_t which) {
    struct timespec t;
    clock_gettime(which, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* tables.c */
Dir **dir_slot(Front *f, uint64_t ino, int for_insert);
Dir *dir_get(Front *f, uint64_t ino);
void dir_free(Dir *d);
int name_add(Dir *d, const char *name, size_t len);
int name_has(Dir *d, const char *name, size_t len);
uint64_t *fh_slot(Front *f, uint64_t fh);
void fh_remove(Front *f, uint64_t *slot);
FileEntry *file_get(Front *f, uint64_t ino);
FileEntry *file_add(Front *f, uint64_t ino);
int file_remove(Front *f, uint64_t ino);

/* answers.c */
void dir_times(Dir *d, int64_t now);
ssize_t read_loop(Front *f, char *buf, size_t len, int64_t spin_ns, int turns, int *answered,
                  int helper);
int hand_to_helper(Front *f);
void helper_stop(Front *f);

#endif
