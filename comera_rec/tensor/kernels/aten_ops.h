// The ATen headers the CPU kernel sources use: tensors, dtype dispatch, parallel loops and
// the few operators the kernels call. Not <torch/extension.h>, which brings the whole C++
// frontend, pybind11 and Python along: parsing it took 44 s per source file on a 2-core
// host, these headers 8-10 s. A source that binds a Python module adds python_module.h.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addcmul.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
