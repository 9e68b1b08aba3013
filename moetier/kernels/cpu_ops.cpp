// The CPU kernels of the torch ops moetier::qlinear / moe_tokens / attn_block / moe_block / embed_rows (schemas in
// cpu.py) in C++:
// the AOT-compiled decode step calls them through the dispatcher without Python (~6 us a call less
// than the Python kernels, 13 calls a token on the default model). The C functions of
// cpu_kernels.c are bound at load (moetier_ops_bind) from the library cpu.py already opened.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>
#include <optional>

extern "C" {
typedef int (*matvec_fn)(int, const uint8_t *, int64_t, int64_t, int64_t, const float *, float *, int);
typedef int64_t (*row_bytes_fn)(int, int64_t);
typedef int (*moe_fn)(int, int, const uint8_t *, const uint8_t *, int64_t, int64_t, const uint8_t *, int64_t, int64_t,
                      int64_t, int64_t, int64_t, int64_t, int64_t, const int64_t *, const float *, const float *,
                      float *, int, int);
typedef int (*attn_block_fn)(const float *, const float *, float, int, int, const uint8_t *, int64_t, int64_t, int,
                              const uint8_t *, int64_t, int64_t, int, const uint8_t *, int64_t, int64_t, int,
                              const uint8_t *, int64_t, int, const float *, const float *, float, const float *,
                              const float *, int, int64_t, float *, float *, int, int, int, float, float *, int);
typedef int (*moe_block_fn)(const float *, const float *, const float *, float, int, const float *, int, int, int, int,
                            int, const uint8_t *, const uint8_t *, int64_t, int64_t, const uint8_t *, int64_t, int64_t,
                            int64_t, int, float *, int);
static matvec_fn g_matvec, g_matvec_q8;
static moe_fn g_moe;
static row_bytes_fn g_row_bytes;
typedef int (*embed_rows_fn)(int, const uint8_t *, int64_t, int64_t, int64_t, const int64_t *, int64_t, float *, int);
static attn_block_fn g_attn_block;
static moe_block_fn g_moe_block;
static embed_rows_fn g_embed_rows;
void moetier_ops_bind(void *matvec, void *matvec_q8, void *moe, void *row_bytes, void *attn_block, void *moe_block,
                      void *embed_rows) {
    g_matvec = (matvec_fn)matvec;
    g_matvec_q8 = (matvec_fn)matvec_q8;
    g_moe = (moe_fn)moe;
    g_row_bytes = (row_bytes_fn)row_bytes;
    g_attn_block = (attn_block_fn)attn_block;
    g_moe_block = (moe_block_fn)moe_block;
    g_embed_rows = (embed_rows_fn)embed_rows;
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

static const float *opt_f32(const std::optional<at::Tensor> &t) {
    return t.has_value() ? t->data_ptr<float>() : nullptr;
}

// a decode block's attention half for one float32 token (cpu_small.c moetier_attn_block; the k / v row written)
static at::Tensor attn_block(const at::Tensor &h, const at::Tensor &norm_w, double eps, const at::Tensor &w0, int64_t t0,
                             const std::optional<at::Tensor> &w1, int64_t t1, const std::optional<at::Tensor> &w2,
                             int64_t t2, const at::Tensor &wo, int64_t ot, bool q8, const std::optional<at::Tensor> &qw,
                             const std::optional<at::Tensor> &kw, double qk_eps, const at::Tensor &cos,
                             const at::Tensor &sin, const at::Tensor &pos, at::Tensor &k_cache, at::Tensor &v_cache,
                             int64_t nh, int64_t hkv, double scale) {
    check_f32(h, "h");
    check_f32(k_cache, "k_cache");
    check_f32(v_cache, "v_cache");
    TORCH_CHECK(g_attn_block, "moetier::attn_block: the C kernel is not bound");
    const at::Tensor c = cos.contiguous(), s = sin.contiguous();
    at::Tensor out = at::empty(h.sizes(), h.options());
    auto part = [](const std::optional<at::Tensor> &w) { return w.has_value() ? w->data_ptr<uint8_t>() : nullptr; };
    int rc = g_attn_block(h.data_ptr<float>(), norm_w.data_ptr<float>(), (float)eps, (int)h.size(-1), (int)t0,
                          w0.data_ptr<uint8_t>(), w0.stride(0), w0.size(0), (int)t1, part(w1),
                          w1.has_value() ? w1->stride(0) : 0, w1.has_value() ? w1->size(0) : 0, (int)t2, part(w2),
                          w2.has_value() ? w2->stride(0) : 0, w2.has_value() ? w2->size(0) : 0, (int)ot,
                          wo.data_ptr<uint8_t>(), wo.stride(0), q8, opt_f32(qw), opt_f32(kw), (float)qk_eps,
                          c.data_ptr<float>(), s.data_ptr<float>(), (int)c.size(-1), pos.item<int64_t>(),
                          k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), (int)nh, (int)hkv,
                          (int)k_cache.size(-1), (float)scale, out.data_ptr<float>(), at::get_num_threads());
    TORCH_CHECK(rc == 0, "moetier::attn_block: the C call failed (", rc, ")");
    return out;
}

// a decode block's MoE half for one float32 token (cpu_small.c moetier_moe_block); NaN logits give NaN out
static at::Tensor moe_block(const at::Tensor &h, const at::Tensor &a, const at::Tensor &norm_w, double eps,
                            const at::Tensor &router_w, int64_t k, bool normalize, const at::Tensor &gate,
                            const at::Tensor &up, const at::Tensor &down, int64_t gate_type, int64_t down_type,
                            bool q8) {
    check_f32(h, "h");
    check_f32(a, "a");
    TORCH_CHECK(g_moe_block, "moetier::moe_block: the C kernel is not bound");
    at::Tensor out = at::empty(h.sizes(), h.options());
    int rc = g_moe_block(h.data_ptr<float>(), a.data_ptr<float>(), norm_w.data_ptr<float>(), (float)eps,
                         (int)h.size(-1), router_w.data_ptr<float>(), (int)router_w.size(0), (int)k, normalize,
                         (int)gate_type, (int)down_type, gate.data_ptr<uint8_t>(), up.data_ptr<uint8_t>(),
                         gate.stride(0), gate.stride(1), down.data_ptr<uint8_t>(), down.stride(0), down.stride(1),
                         gate.size(1), q8, out.data_ptr<float>(), at::get_num_threads());
    if (rc == -2)
        out.fill_(std::numeric_limits<float>::quiet_NaN());
    else
        TORCH_CHECK(rc == 0, "moetier::moe_block: the C call failed (", rc, ")");
    return out;
}

// tokens [T] int64 -> [T, K] float32: rows of a GGML table uint8 [V, row_bytes(K)] (cpu_kernels.c moetier_embed_rows)
static at::Tensor embed_rows(const at::Tensor &tokens, const at::Tensor &w, int64_t qtype, int64_t k) {
    TORCH_CHECK(g_embed_rows, "moetier::embed_rows: the C kernel is not bound");
    TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong && tokens.is_contiguous() && w.dim() == 2
                && w.scalar_type() == at::kByte && w.stride(1) == 1,
                "moetier::embed_rows needs int64 tokens [T] and uint8 blocks [V, row_bytes] with contiguous rows");
    at::Tensor out = at::empty({tokens.size(0), k}, tokens.options().dtype(at::kFloat));
    int rc = g_embed_rows((int)qtype, w.data_ptr<uint8_t>(), w.stride(0), w.size(0), k, tokens.data_ptr<int64_t>(),
                          tokens.size(0), out.data_ptr<float>(), at::get_num_threads());
    TORCH_CHECK(rc != -3, "moetier::embed_rows: a token id is outside the vocabulary [0, ", w.size(0), ")");
    TORCH_CHECK(rc == 0, "moetier::embed_rows: GGML type ", qtype, " rows do not hold ", k, " values");
    return out;
}

TORCH_LIBRARY_IMPL(moetier, CPU, m) {
    m.impl("embed_rows", embed_rows);
    m.impl("qlinear", qlinear);
    m.impl("moe_tokens", moe_tokens);
    m.impl("attn_block", attn_block);
    m.impl("moe_block", moe_block);
}
