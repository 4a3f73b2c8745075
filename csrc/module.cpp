// The importable module msa._C. It holds no Python functions: importing it loads the shared library,
// whose static initializers register the ops (torch_bindings.cpp, api/*.cpp) in torch.ops.msa.
// Built against the limited API so one binary serves every CPython >= 3.9.
#include <Python.h>

PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "msa compiled ops; use them through torch.ops.msa or the msa package",
      -1, nullptr};
  return PyModule_Create(&module_def);
}
