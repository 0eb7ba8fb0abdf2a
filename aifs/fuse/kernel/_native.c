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
 *
 * Answered for a file Python handed over (delegate_files(): closed, its bytes
 * all in its local copy, until its directory's TTL ends):
 *   GETATTR   its attributes
 *   OPEN      for reading: passthrough to its local copy
 *   RELEASE   of the handles such opens opened
 * Each CREATE, OPEN, FLUSH and RELEASE answered here is first appended to the
 * journal file (a killed daemon loses none: the next mount applies what is
 * left); Python applies the journal to its own state before it answers any
 * other request or runs anything else (journaled() tells it how far).
 */
#include "csrc/front.h"

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

static PyObject *front_stop(Front *f, PyObject *unused) {
    Py_BEGIN_ALLOW_THREADS
    helper_stop(f);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
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

static PyObject *front_delegate_files_locked(Front *f, PyObject *args) {
    /* records of u64 ino, i64 until (CLOCK_MONOTONIC ns), fuse_attr (88 bytes) */
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "y*", &buf))
        return NULL;
    const size_t size = 16 + sizeof(struct attr);
    PyObject *result = Py_None;
    if (buf.len % size) {
        PyErr_SetString(PyExc_ValueError, "records of 104 bytes");
        result = NULL;
    }
    for (size_t at = 0; result && at < (size_t)buf.len; at += size) {
        const char *r = (const char *)buf.buf + at;
        uint64_t ino;
        int64_t until_ns;
        memcpy(&ino, r, 8);
        memcpy(&until_ns, r + 8, 8);
        FileEntry *e = file_get(f, ino);
        if (e && e->count) { /* (opened here, its backing id in use: it stays as it is) */
            continue;
        } else if (!e && !(e = file_add(f, ino))) {
            result = PyErr_NoMemory();
        } else {
            memcpy(&e->attr, r + 16, sizeof e->attr);
            e->until_ns = until_ns;
        }
    }
    PyBuffer_Release(&buf);
    Py_XINCREF(result);
    return result;
}

static PyObject *front_recall_file_locked(Front *f, PyObject *args) {
    unsigned long long ino;
    if (!PyArg_ParseTuple(args, "K", &ino))
        return NULL;
    return PyBool_FromLong(file_remove(f, ino));
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
            uint64_t *fhs = calloc(4096, sizeof *fhs), *inos_of = calloc(4096, sizeof *inos_of);
            if (!fhs || !inos_of) {
                free(fhs);
                free(inos_of);
                f->end_fh = f->next_fh; /* (none to give: no creates answered here) */
                return PyErr_NoMemory();
            }
            f->fhs = fhs, f->fh_inos = inos_of, f->fhs_cap = 4096;
        }
    }
    return Py_BuildValue("nK", (Py_ssize_t)f->inos_len, (unsigned long long)(f->end_fh - f->next_fh));
}

static PyObject *front_add_name_locked(Front *f, PyObject *args) {
    /* Python made a name in directory ino, whose times moved: the loop knows them now */
    unsigned long long ino;
    Py_buffer name;
    long long mtime_ns, ctime_ns;
    if (!PyArg_ParseTuple(args, "Ky*LL", &ino, &name, &mtime_ns, &ctime_ns))
        return NULL;
    Dir *d = dir_get(f, ino);
    int failed = d && name_add(d, name.buf, (size_t)name.len) < 0;
    PyBuffer_Release(&name);
    if (failed) { /* (out of memory: Python takes the directory back) */
        PyErr_NoMemory();
        return NULL;
    }
    if (d) {
        dir_times(d, mtime_ns);
        d->attr.ctime = (uint64_t)(ctime_ns / 1000000000);
        d->attr.ctimensec = (uint32_t)(ctime_ns % 1000000000);
    }
    return PyBool_FromLong(d != NULL);
}

static PyObject *front_set_creates_locked(Front *f, PyObject *args) {
    int on;
    if (!PyArg_ParseTuple(args, "p", &on))
        return NULL;
    f->creates = on;
    Py_RETURN_NONE;
}

static PyObject *front_state_locked(Front *f, PyObject *unused) {
    return Py_BuildValue("{s:n,s:n,s:n,s:K,s:n,s:i,s:i}", "dirs", (Py_ssize_t)f->dirs_count,
                         "files", (Py_ssize_t)f->files_count,
                         "inos", (Py_ssize_t)f->inos_len, "fhs",
                         (unsigned long long)(f->end_fh - f->next_fh), "open",
                         (Py_ssize_t)f->fhs_count, "creates", f->creates && !f->no_backing,
                         "broken", f->broken);
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
LOCKED(front_delegate_files)
LOCKED(front_recall_file)
LOCKED(front_give)
LOCKED(front_set_creates)
LOCKED(front_add_name)
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
    free(f->file_inos);
    free(f->file_vals);
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
    {"eventfd", (PyCFunction)front_eventfd, METH_NOARGS,
     "eventfd() -> the fd that becomes readable when the helper journaled or handed over"},
    {"stop", (PyCFunction)front_stop, METH_NOARGS, "stop(): end the helper thread"},
    {"delegate", (PyCFunction)front_delegate, METH_VARARGS,
     "delegate(ino, attr, key_room, ttl_left_ns, names): hand over directory ino "
     "(attr: its fuse_attr; names: every name in it)"},
    {"recall", (PyCFunction)front_recall, METH_VARARGS,
     "recall(ino) -> whether directory ino was handed over (it is not now)"},
    {"delegate_files", (PyCFunction)front_delegate_files, METH_VARARGS,
     "delegate_files(records): hand over files, closed and wholly in their local "
     "copies; each record: u64 ino, i64 CLOCK_MONOTONIC ns when it is handed back, its "
     "fuse_attr (one the loop holds open stays as it is)"},
    {"recall_file", (PyCFunction)front_recall_file, METH_VARARGS,
     "recall_file(ino) -> whether file ino was handed over (it is not now; the loop's "
     "handles of it stay the loop's)"},
    {"give", (PyCFunction)front_give, METH_VARARGS,
     "give(inos, first_fh, end_fh) -> (inode numbers, handles) left to give: add inode "
     "numbers; handles from first_fh up to end_fh (replacing what is left, if any)"},
    {"add_name", (PyCFunction)front_add_name, METH_VARARGS,
     "add_name(ino, name, mtime_ns, ctime_ns) -> whether directory ino is handed over: "
     "Python made name in it, and its times moved there"},
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
    if (PyModule_AddIntConstant(m, "TURNS", TURNS) < 0 ||
        PyModule_AddObject(m, "Front", (PyObject *)&FrontType) < 0) {
        Py_DECREF(&FrontType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
