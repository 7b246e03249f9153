// Force-included (nvcc -include) ahead of every FlashMLA source the C API library compiles.
//
// FlashMLA's host checks (CHECK_CUDA, FLASH_ASSERT in csrc/utils.h) print and call exit(1): inside a library loaded
// by a Python process that would end the process on a bad launch. Here they throw instead, and the C API
// (flashmla_capi.cu) catches at its boundary and returns the message through flashmla_last_error(). FlashMLA's
// kerutils checks (KU_ASSERT, KU_CUDA_CHECK) already throw a std::exception.
#pragma once

#include <cstdio>
#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>

#include "utils.h"  // FlashMLA's csrc/utils.h (#pragma once): its later includes keep the definitions below

#undef CHECK_CUDA
#define CHECK_CUDA(call)                                                                                  \
    do {                                                                                                  \
        cudaError_t status_ = call;                                                                       \
        if (status_ != cudaSuccess) {                                                                     \
            throw std::runtime_error(std::string("CUDA error (") + __FILE__ + ":" + std::to_string(__LINE__) \
                                     + "): " + cudaGetErrorString(status_));                              \
        }                                                                                                 \
    } while (0)

#undef FLASH_ASSERT
#define FLASH_ASSERT(cond)                                                                                \
    do {                                                                                                  \
        if (not(cond)) {                                                                                  \
            throw std::runtime_error(std::string("assertion failed (") + __FILE__ + ":"                   \
                                     + std::to_string(__LINE__) + "): " #cond);                           \
        }                                                                                                 \
    } while (0)
