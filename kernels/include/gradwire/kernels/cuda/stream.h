// The CUDA stream type without the CUDA headers, so CPU-only code can hold and pass streams. The
// declaration is the runtime's own (driver_types.h), which a later include repeats harmlessly.
#pragma once

typedef struct CUstream_st* cudaStream_t;
