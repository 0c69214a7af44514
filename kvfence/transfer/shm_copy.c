/* The shm data plane's write in one call: check every segment, copy them, then ask whether the target still
 * holds its lock (see shm.py). A CPython extension rather than ctypes: a 64 KiB copy takes ~1.5 us, and the
 * Python around ctypes calls, segment checks and fcntl cost as much again.
 *
 *   copy(dst_base, src_base, segments, src_size, dst_size, lock_fd) -> 1 | 0 | -1
 *
 * segments: a list or tuple of (src, dst, nbytes) integer triples, offsets into the two regions. Returns -1 (and
 * copies nothing) if any triple is malformed, negative or outside [0, src_size) / [0, dst_size); else copies them
 * in order and returns 1 if some other open file description still holds a lock on lock_fd's file (the target
 * lives), 0 if none does. Copies of 256 KiB or more run without the GIL.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>

#define ON_STACK 32
#define GIL_FREE_BYTES (256 * 1024)

typedef struct { long long src, dst, n; } segment;

static int read_triple(PyObject *item, segment *s) {
    PyObject *fast = PySequence_Fast(item, "");
    if (fast == NULL) { PyErr_Clear(); return -1; }
    int ok = PySequence_Fast_GET_SIZE(fast) == 3;
    long long v[3];
    for (int k = 0; ok && k < 3; k++) {
        PyObject *index = PyNumber_Index(PySequence_Fast_GET_ITEM(fast, k));
        if (index == NULL) { PyErr_Clear(); ok = 0; break; }
        int overflow = 0;
        v[k] = PyLong_AsLongLongAndOverflow(index, &overflow);
        Py_DECREF(index);
        ok = !overflow && !(v[k] == -1 && PyErr_Occurred());
        PyErr_Clear();
    }
    Py_DECREF(fast);
    if (!ok) return -1;
    s->src = v[0]; s->dst = v[1]; s->n = v[2];
    return 0;
}

/* The copies in order, then the lock query: 1 alive, 0 not, -1 fcntl failed (errno set). */
static int copy_all(char *dst, const char *src, const segment *segs, Py_ssize_t count, int fd) {
    for (Py_ssize_t i = 0; i < count; i++) memcpy(dst + segs[i].dst, src + segs[i].src, (size_t)segs[i].n);
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET};
    if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return -1;
    return fl.l_type != F_UNLCK;
}

static PyObject *shm_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) { PyErr_SetString(PyExc_TypeError, "copy() takes 6 arguments"); return NULL; }
    char *dst = (char *)PyLong_AsVoidPtr(args[0]);
    const char *src = (const char *)PyLong_AsVoidPtr(args[1]);
    long long src_size = PyLong_AsLongLong(args[3]), dst_size = PyLong_AsLongLong(args[4]);
    int fd = (int)PyLong_AsLong(args[5]);
    if (PyErr_Occurred()) return NULL;
    PyObject *fast = PySequence_Fast(args[2], "segments must be a list or tuple");
    if (fast == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    segment stack[ON_STACK], *segs = count <= ON_STACK ? stack : PyMem_Malloc(sizeof(segment) * count);
    if (segs == NULL) { Py_DECREF(fast); return PyErr_NoMemory(); }
    long long total = 0;
    int valid = 1;
    for (Py_ssize_t i = 0; valid && i < count; i++) {
        segment *s = &segs[i];
        valid = read_triple(PySequence_Fast_GET_ITEM(fast, i), s) == 0 && s->n >= 0 && s->src >= 0 && s->dst >= 0
                && s->src <= src_size && s->dst <= dst_size && s->n <= src_size - s->src && s->n <= dst_size - s->dst;
        total += valid ? s->n : 0;
    }
    Py_DECREF(fast);
    int alive = -2;
    if (valid && total >= GIL_FREE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        alive = copy_all(dst, src, segs, count, fd);
        Py_END_ALLOW_THREADS
    } else if (valid) {
        alive = copy_all(dst, src, segs, count, fd);
    }
    if (segs != stack) PyMem_Free(segs);
    if (alive == -1) return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(alive == -2 ? -1 : alive);
}

static PyMethodDef methods[] = {
    {"copy", (PyCFunction)(void (*)(void))shm_copy, METH_FASTCALL, "Check, copy, then report the target's lock."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvf_shm_copy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kvf_shm_copy(void) { return PyModule_Create(&module); }
