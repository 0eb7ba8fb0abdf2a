/* The kernel session's read loop in C: requests the daemon answers the same
 * way whatever they name, answered without Python.
 *
 * Why: on this kind of machine a request that reaches the Python loop costs
 * the daemon 20-60 us before any handler runs (docs/kernel-binding.md, "A
 * read loop in C"); some requests the kernel sends on every create or open
 * have one fixed answer:
 *
 *   IOCTL     ENOTTY  (isatty() of every Python open(); no terminal here)
 *   GETXATTR  ENODATA for a name outside "user." (security.capability,
 *             asked before the first write of each new inode; aifs keeps
 *             user.* attributes only: aifs.posix.control.getxattr)
 *
 * serve() reads requests from /dev/fuse (non-blocking) into the caller's
 * buffer, with the GIL released, answers those, and returns the first one
 * Python must answer. While requests keep coming it polls for the next one
 * for up to spin_ns after each, as the Python loop did (a woken idle CPU
 * costs more than the poll). The answers are the Python handlers' own:
 * tests/test_fuse_native.py checks each against the Python session.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define OP_GETXATTR 22
#define OP_IOCTL 39
#define OPCODES 64
#define TURNS 64 /* answered in a row before Python gets a turn (trio's other tasks) */

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

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* An error answer. ENOENT: the request was interrupted; ENODEV: unmounted. */
static void answer_error(int fd, uint64_t unique, int error) {
    struct out_header out = {sizeof out, -error, unique};
    while (write(fd, &out, sizeof out) < 0 && errno == EINTR) {
    }
}

/* Answer the request in buf (n bytes) if its answer is fixed (counted in
 * answered[opcode]); 1 if answered. */
static int answer(int fd, const char *buf, ssize_t n, uint64_t *answered) {
    const struct in_header *in = (const void *)buf;
    if ((size_t)n < sizeof *in || in->len != (uint32_t)n || in->opcode >= OPCODES)
        return 0;
    const char *body = buf + sizeof *in;
    size_t body_len = in->len - sizeof *in - (size_t)in->extlen * 8;
    if ((size_t)in->extlen * 8 > in->len - sizeof *in)
        return 0;
    switch (in->opcode) {
    case OP_IOCTL:
        answer_error(fd, in->unique, ENOTTY);
        break;
    case OP_GETXATTR: { /* fuse_getxattr_in (size, padding), then the name */
        if (body_len <= 8 || !memchr(body + 8, 0, body_len - 8))
            return 0;
        if (!strncmp(body + 8, "user.", 5))
            return 0;
        answer_error(fd, in->unique, ENODATA);
        break;
    }
    default:
        return 0;
    }
    answered[in->opcode]++;
    return 1;
}

static PyObject *serve(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer buf, tally;
    long long spin_ns;
    if (!PyArg_ParseTuple(args, "iw*Lw*", &fd, &buf, &spin_ns, &tally))
        return NULL;
    if (tally.len < (Py_ssize_t)(OPCODES * sizeof(uint64_t))) {
        PyBuffer_Release(&buf);
        PyBuffer_Release(&tally);
        PyErr_SetString(PyExc_ValueError, "counts: 64 unsigned 64-bit integers");
        return NULL;
    }
    uint64_t *answered = tally.buf;
    ssize_t result;
    int turns = 0;
    Py_BEGIN_ALLOW_THREADS
    int64_t deadline = now_ns() + spin_ns;
    for (;;) {
        ssize_t n = read(fd, buf.buf, (size_t)buf.len);
        if (n > 0) {
            if (!answer(fd, buf.buf, n, answered)) {
                result = n;
                break;
            }
            if (++turns >= TURNS) {
                result = 0;
                break;
            }
            deadline = now_ns() + spin_ns;
            continue;
        }
        if (n < 0 && errno == EAGAIN) {
            if (spin_ns > 0 && now_ns() < deadline)
                continue;
            result = 0;
            break;
        }
        if (n < 0 && (errno == EINTR || errno == ENOENT))
            continue; /* ENOENT: the request was interrupted before it was read */
        result = n < 0 ? -errno : -EIO;
        break;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    PyBuffer_Release(&tally);
    return PyLong_FromSsize_t(result);
}

static PyMethodDef methods[] = {
    {"serve", serve, METH_VARARGS,
     "serve(fd, buffer, spin_ns, counts) -> n: answer the requests whose answer is "
     "fixed (counted by opcode in counts, 64 native uint64); return the length of "
     "the first request left in buffer for Python, 0 if none came within spin_ns "
     "(or Python's turn came), or -errno."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
