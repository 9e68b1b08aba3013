// The CPU kernels of the torch ops moetier::qlinear / moetier::moe_tokens (schemas in cpu.py) in C++:
// the AOT-compiled decode step calls them through the dispatcher without Python (~6 us a call less
// than the Python kernels, 13 calls a token on the default model). The C functions of
// cpu_kernels.c are bound at load (moetier_ops_bind) from the library cpu.py already opened.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

extern "C" {
typedef int (*matvec_fn)(int, const uint8_t *, int64_t, int64_t, int64_t, const float *, float *, int);
typedef int64_t (*row_bytes_fn)(int, int64_t);
typedef int (*moe_fn)(int, int, const uint8_t *, const uint8_t *, int64_t, int64_t, const uint8_t *, int64_t, int64_t,
                      int64_t, int64_t, int64_t, int64_t, int64_t, const int64_t *, const float *, const float *,
                      float *, int, int);
static matvec_fn g_matvec, g_matvec_q8;
static moe_fn g_moe;
static row_bytes_fn g_row_bytes;
void moetier_ops_bind(void *matvec, void *matvec_q8, void *moe, void *row_bytes) {
    g_matvec = (matvec_fn)matvec;
    g_matvec_q8 = (matvec_fn)matvec_q8;
    g_moe = (moe_fn)moe;
    g_row_bytes = (row_bytes_fn)row_bytes;
}
}

static void check_f32(const at::Tensor &t, const char *what) {
    TORCH_CHECK(g_matvec && g_matvec_q8 && g_moe && g_row_bytes,
                "moetier CPU ops: the C kernels are not bound (moetier_ops_bind)");
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(), "moetier CPU op: ", what,
                " must be a contiguous float32 CPU tensor");
}

// x [T, K] float32, w uint8 [N, row_bytes(K)] -> [T, N]
static at::Tensor qlinear(const at::Tensor &x, const at::Tensor &w, int64_t qtype, bool q8) {
    check_f32(x, "x");
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.scalar_type() == at::kByte && w.stride(1) == 1,
                "moetier::qlinear needs x [T, K] and uint8 blocks [N, row_bytes] with contiguous rows");
    const int64_t t = x.size(0), n = w.size(0), k = x.size(1);
    const int64_t bytes = g_row_bytes((int)qtype, k);        // the C kernels' own block table (x8 ids included)
    TORCH_CHECK(bytes > 0 && w.size(1) == bytes, "moetier::qlinear: GGML type ", qtype, " rows of ", w.size(1),
                " bytes do not hold K=", k, " values");
    at::Tensor y = at::empty({t, n}, x.options());
    const int threads = at::get_num_threads();
    for (int64_t i = 0; i < t; i++) {
        int rc = (q8 ? g_matvec_q8 : g_matvec)((int)qtype, w.data_ptr<uint8_t>(), w.stride(0), n, k,
                                               x.data_ptr<float>() + i * k, y.data_ptr<float>() + i * n, threads);
        TORCH_CHECK(rc == 0, "moetier::qlinear: the C kernel failed (", rc, "): GGML type ", qtype, ", K=", k);
    }
    return y;
}

static at::Tensor moe_tokens(const at::Tensor &x, const at::Tensor &ids, const at::Tensor &w, const at::Tensor &gate,
                             const at::Tensor &up, const at::Tensor &down, int64_t gate_type, int64_t down_type,
                             bool q8) {
    check_f32(x, "x");
    check_f32(w, "w");
    TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && gate.strides() == up.strides() &&
                gate.stride(2) == 1 && down.stride(2) == 1, "moetier::moe_tokens: bad ids or expert blocks");
    at::Tensor y = at::empty({x.size(0), down.size(1)}, x.options());
    int rc = g_moe((int)gate_type, (int)down_type, gate.data_ptr<uint8_t>(), up.data_ptr<uint8_t>(), gate.stride(0),
                   gate.stride(1), down.data_ptr<uint8_t>(), down.stride(0), down.stride(1), gate.size(0),
                   down.size(1), gate.size(1), x.size(0), ids.size(1), ids.data_ptr<int64_t>(), w.data_ptr<float>(),
                   x.data_ptr<float>(), y.data_ptr<float>(), q8, at::get_num_threads());
    TORCH_CHECK(rc == 0, "moetier::moe_tokens: the C kernel failed (", rc, "): expert ids outside [0, ",
                gate.size(0), ") or shapes not multiples of the block size");
    return y;
}

TORCH_LIBRARY_IMPL(moetier, CPU, m) {
    m.impl("qlinear", qlinear);
    m.impl("moe_tokens", moe_tokens);
}
