/* The prefetch distance a kernel's x86 paths read ahead in W's stream, in bytes: a multiple of
 * 64 up to MAX_PREFETCH_BYTES, passed with each call. The Python side times a few distances when
 * an engine is built (the best one depends on the machine's memory and prefetchers) and keeps
 * its answer in that engine's KernelPlan. Define KERNEL_NAME, the module's name for error
 * messages, before including this; it adds check_prefetch(bytes). */
#ifndef ASTRAI_PREFETCH_H
#define ASTRAI_PREFETCH_H

#include <Python.h>

#define MAX_PREFETCH_BYTES 16384

/* Whether bytes is a distance the kernels take; sets a ValueError if not. */
static int check_prefetch(int bytes) {
    if (bytes >= 0 && bytes <= MAX_PREFETCH_BYTES && bytes % 64 == 0) return 1;
    PyErr_Format(PyExc_ValueError,
                 KERNEL_NAME ": prefetch distance %d is not a multiple of 64 bytes in 0..%d", bytes,
                 MAX_PREFETCH_BYTES);
    return 0;
}

#endif
