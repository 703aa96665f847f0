// What a kernel source needs to bind its functions as a Python module (PYBIND11_MODULE):
// pybind11 with ATen tensors and standard containers as arguments and results. 14 s to
// parse on a 2-core host, against 44 s for <torch/extension.h>, which includes it.
#pragma once

#include <torch/csrc/utils/pybind.h>
