/* The Python module that a kernel source defines: its name and its table of methods. */
#ifndef ASTRAI_MODULE_H
#define ASTRAI_MODULE_H

#include <Python.h>

#define ASTRAI_MODULE(name, methods)                                                           \
    static struct PyModuleDef name##_definition = {                                            \
        PyModuleDef_HEAD_INIT, .m_name = #name, .m_size = -1, .m_methods = methods};           \
    PyMODINIT_FUNC PyInit_##name(void) { return PyModule_Create(&name##_definition); }

#endif
