// Dequantize-and-multiply for every GGUF layout of execute/quant.py: Y[t][r] = sum_c W[r][c] * X[t][c].
//
// W: rows of raw GGUF blocks (rb bytes per row, any alignment: 32-bit words are read at the aligned
// address below and funnel-shifted, f16 and scale fields by bytes); X: float32 (n, cols).
//
// Quantized types. A lane decodes 32 consecutive weights of a row at a time (dec32: one "chunk",
// the 32 weights of an activation block) into 8 words of 4 int8 values q and, per 16 weights, a
// scale a and an offset b: w = a q + b. Every layout fits: K- and legacy types give their
// quants (unsigned, the offset -8 d / -16 d / -32 a / -4 a / -dmin m through b), the i-quants their
// signed grid bytes (IQ2/IQ3: grid byte with its sign; IQ1: 8 g +- 1 from two 8x tables, a = dl / 8),
// IQ4_NL / IQ4_XS / MXFP4 their levels through a 16-entry byte table (__byte_perm).
// Inputs are staged per thread block in shared memory as two int8 levels per 32 values (as the CPU
// pool): d = max|x| / 127, q1 = round(x / d), q2 = round((x - d q1) 256 / d), so x = d / 256 (256 q1
// + q2) within d / 512; the float sum of the staged values per 16 serves the offsets. A chunk's dot
// is then 4 x 2 dp4a per level and token, exact in int32, scaled once per 16 weights (pass). Up to 8 tokens
// share each decoded chunk; a warp decodes up to 4 rows (2 rows of gate and up) per chunk, issuing
// their loads together.
// The one-token down projection (qmoe1_down_combine: each warp its own input row) multiplies the
// decoded quants with float32 inputs instead (dot_f), as exact as float32 allows.
// Float types (F32, F16, BF16) keep the weight-by-weight path (qw, qmatmul_f).
// Tables of the i-quants come from execute/iq_grids.py, uploaded once by execute/gpu_quant.py into
// global memory (read through the L1 cache: lanes index them at different rows).
// The source lies in five parts, included here in this order (execute.gpu_quant.source() inlines
// them for NVRTC).
#include "gpu_quant_decode.cu"
#ifndef MOELAB_HOST_CHECK  // the kernels (the host check builds the decoders alone)
#include "gpu_quant_gemv.cu"
#include "gpu_quant_mma.cu"
#include "gpu_quant_one.cu"
#include "gpu_quant_mmq.cu"
#endif
