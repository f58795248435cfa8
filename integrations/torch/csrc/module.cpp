// lce_torch._C: an empty Python module; importing it loads this library, whose
// static initialisers register the lce:: operators (register.cpp).
#include <Python.h>

static struct PyModuleDef lce_torch_module = {PyModuleDef_HEAD_INIT, "_C", "lce's torch operators (torch.ops.lce)",
                                              -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&lce_torch_module); }
