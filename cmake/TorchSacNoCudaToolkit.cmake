# Lets find_package(Torch) succeed on a CUDA build of torch (PyPI's torch for
# Linux is one) where no CUDA toolkit is installed.
#
# Caffe2Config.cmake of a CUDA build includes public/cuda.cmake, which looks
# for nvcc, cudart and nvrtc and stops configuring when they are missing
# ("Your installed Caffe2 version uses CUDA but I cannot find the CUDA
# libraries"). torch_sac compiles no CUDA source: it reaches CUDA only through
# ATen/c10 interfaces (generators, streams, the caching allocator) that
# libtorch_cuda provides at run time. cuda.cmake returns at once when the
# target torch::cudart exists (its include guard, torch 2.11 to 2.15), and
# torch::cudart is the only one of its targets torch's exported targets name.
# So an empty torch::cudart is defined first, with or without a toolkit: the
# build is the same everywhere and never depends on which toolkit is found.
if(NOT TARGET torch::cudart)
  add_library(torch::cudart INTERFACE IMPORTED)
endif()
