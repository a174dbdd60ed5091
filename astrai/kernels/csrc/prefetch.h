/* The prefetch distance a kernel's x86 paths read ahead in W's stream, in bytes: a multiple of
 * 64 up to MAX_PREFETCH_BYTES, set at start from the distances the Python side times (the best
 * one depends on the machine's memory and prefetchers). Define KERNEL_NAME, the module's name
 * for error messages, before including this; it adds set_prefetch(bytes) and prefetch(). */
#ifndef ASTRAI_PREFETCH_H
#define ASTRAI_PREFETCH_H

#include <Python.h>

#define MAX_PREFETCH_BYTES 16384

static int prefetch_bytes = 2048;

static PyObject *set_prefetch(PyObject *module, PyObject *arg) {
    (void)module;
    const long bytes = PyLong_AsLong(arg);
    if (bytes == -1 && PyErr_Occurred()) return NULL;
    if (bytes < 0 || bytes > MAX_PREFETCH_BYTES || bytes % 64 != 0)
        return PyErr_Format(PyExc_ValueError,
                            KERNEL_NAME ": prefetch distance %ld is not a multiple of 64 bytes in "
                                        "0..%d",
                            bytes, MAX_PREFETCH_BYTES);
    prefetch_bytes = (int)bytes;
    Py_RETURN_NONE;
}

static PyObject *get_prefetch(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    return PyLong_FromLong(prefetch_bytes);
}

#endif
