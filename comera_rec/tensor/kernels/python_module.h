// What a kernel source needs to bind its functions as a Python module (PYBIND11_MODULE):
// pybind11 with ATen tensors and standard containers as arguments and results. 14 s to
// parse on a 2-core host, against 44 s for <torch/extension.h>, which includes it (and
// stands in where a torch release keeps it elsewhere).
#pragma once

#if __has_include(<torch/csrc/utils/pybind.h>)
#include <torch/csrc/utils/pybind.h>
#else
#include <torch/extension.h>
#endif

// A kernel runs without Python's global lock (it touches no Python object), so other
// Python threads go on meanwhile: a data loader's, or another branch of the same model.
#define COMERA_RELEASE_GIL pybind11::call_guard<pybind11::gil_scoped_release>()
