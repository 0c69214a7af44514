/* L3's fast path in one call: is every page a decode step reads held by the grant it was read under, in the page
 * table and (where the pool has them) in its tag record? A NumPy pass makes ~15 ufunc calls per step; after a
 * forward pass has streamed the weights through the caches, those cost ~50 us at batch 1 (~1% of a step).
 *
 *   all_held(table_hi, table_lo, table_epoch, table_state, held_lo, held_hi, seq_tags, tag_records) -> bool
 *
 * table_*: the page table's C-contiguous columns, one entry per page (uint64, uint64, uint64, uint8).
 * seq_tags: a list or tuple of 4-tuples (pages int64, owner_hi uint64, owner_lo uint64, epochs uint64), one per
 *   sequence, each array C-contiguous and of one length.
 * tag_records: None, or the pool's tag records, 64 bytes per page: owner_hi u64 at 0, owner_lo u64 at 8,
 *   epoch u64 at 16, page u32 at 24 (layout.TAG_DTYPE).
 * True iff every page is in range, its table entry names that owner and epoch with a state in
 * [held_lo, held_hi], and its tag record (if given) names that owner, epoch and page. False says only that some
 * page failed: the caller's NumPy path finds which. Malformed arguments raise TypeError or ValueError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define TAG_BYTES 64

typedef struct {
    Py_buffer view;
    int held;
} buffer;

static int get(PyObject *obj, buffer *b, Py_ssize_t itemsize, Py_ssize_t count, const char *what) {
    if (PyObject_GetBuffer(obj, &b->view, PyBUF_C_CONTIGUOUS) != 0) return -1;
    b->held = 1;
    if (count >= 0 ? b->view.len != itemsize * count : b->view.len % itemsize != 0) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd-byte items%s", what, b->view.len, itemsize,
                     count >= 0 ? " for every page" : "");
        return -1;
    }
    return 0;
}

static void release(buffer *b, int n) {
    for (int i = 0; i < n; i++)
        if (b[i].held) PyBuffer_Release(&b[i].view);
}

/* 1 all held, 0 some page not; -1 with an exception set. */
static int check_seq(PyObject *four, const buffer *table, Py_ssize_t num_pages, long held_lo, long held_hi,
                     const unsigned char *records) {
    if (!PyTuple_Check(four) || PyTuple_GET_SIZE(four) != 4) {
        PyErr_SetString(PyExc_TypeError, "each sequence's tags must be a 4-tuple of arrays");
        return -1;
    }
    buffer seq[4] = {{{0}}};
    int result = -1;
    if (get(PyTuple_GET_ITEM(four, 0), &seq[0], 8, -1, "pages") != 0) goto done;
    Py_ssize_t n = seq[0].view.len / 8;
    for (int k = 1; k < 4; k++)
        if (get(PyTuple_GET_ITEM(four, k), &seq[k], 8, n, "owner/epoch tags") != 0) goto done;
    const int64_t *pages = seq[0].view.buf;
    const uint64_t *hi = seq[1].view.buf, *lo = seq[2].view.buf, *epochs = seq[3].view.buf;
    const uint64_t *t_hi = table[0].view.buf, *t_lo = table[1].view.buf, *t_epoch = table[2].view.buf;
    const uint8_t *t_state = table[3].view.buf;
    result = 1;
    for (Py_ssize_t i = 0; i < n && result; i++) {
        int64_t p = pages[i];
        if (p < 0 || p >= num_pages) { result = 0; break; }
        result = t_hi[p] == hi[i] && t_lo[p] == lo[i] && t_epoch[p] == epochs[i] && t_state[p] >= held_lo
                 && t_state[p] <= held_hi;
        if (result && records != NULL) {
            const unsigned char *r = records + p * TAG_BYTES;
            uint64_t r_hi, r_lo, r_epoch;
            uint32_t r_page;
            memcpy(&r_hi, r, 8);
            memcpy(&r_lo, r + 8, 8);
            memcpy(&r_epoch, r + 16, 8);
            memcpy(&r_page, r + 24, 4);
            result = r_hi == hi[i] && r_lo == lo[i] && r_epoch == epochs[i] && r_page == (uint64_t)p;
        }
    }
done:
    release(seq, 4);
    return result;
}

static PyObject *all_held(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "all_held() takes 8 arguments");
        return NULL;
    }
    long held_lo = PyLong_AsLong(args[4]), held_hi = PyLong_AsLong(args[5]);
    if (PyErr_Occurred()) return NULL;
    buffer table[5] = {{{0}}};
    int result = -1;
    if (get(args[0], &table[0], 8, -1, "table_hi") != 0) goto done;
    Py_ssize_t num_pages = table[0].view.len / 8;
    if (get(args[1], &table[1], 8, num_pages, "table_lo") != 0 || get(args[2], &table[2], 8, num_pages,
        "table_epoch") != 0 || get(args[3], &table[3], 1, num_pages, "table_state") != 0)
        goto done;
    const unsigned char *records = NULL;
    if (args[7] != Py_None) {
        if (get(args[7], &table[4], TAG_BYTES, num_pages, "tag_records") != 0) goto done;
        records = table[4].view.buf;
    }
    PyObject *fast = PySequence_Fast(args[6], "seq_tags must be a list or tuple");
    if (fast == NULL) goto done;
    result = 1;
    for (Py_ssize_t s = 0; s < PySequence_Fast_GET_SIZE(fast) && result == 1; s++)
        result = check_seq(PySequence_Fast_GET_ITEM(fast, s), table, num_pages, held_lo, held_hi, records);
    Py_DECREF(fast);
done:
    release(table, 5);
    if (result < 0) return NULL;
    return PyBool_FromLong(result);
}

static PyMethodDef methods[] = {
    {"all_held", (PyCFunction)(void (*)(void))all_held, METH_FASTCALL, "L3: every page held by its grant?"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvf_tag_check", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kvf_tag_check(void) { return PyModule_Create(&module); }
