/* attnlab's C kernels as PyTorch operators (libtorch's stable ABI), for attnlab.kernels.cpu.ops.
 *
 * A compiled decode step (attnlab.generate) calls an operator written in Python through the interpreter on every
 * call: about 6 us more than an operator written here, which inductor's C++ wrapper calls directly, and a decode
 * step of SmolLM2-135M with the GGUF's own weights makes about 210 weight matmuls. These operators run the same C
 * functions with the same arguments as the Python ones, so they give the same bits:
 *
 *   attnlab_cpp::qlinear(Tensor x, Tensor blocks, Tensor? bias, str fmt) -> Tensor
 *       x (..., k) float32 times W^T (+ bias), W the rows `blocks` (n, row bytes) uint8 in fmt (fp16, q4_0, q4_1,
 *       q8_0: ggml's layouts), through attnlab_qmatmul (qmatmul.c); fmt "q4_1:q8" quantizes x to 8 bits first
 *       (attnlab_qmatmul_q8), "q4_1:q8p" does so over rows packed by attnlab_pack_q8 (attnlab_qmatmul_q8p). For the
 *       few rows of x of decoding: many rows (prefill) go to torch's GEMM from Python (attnlab.kernels.cpu.qmatmul).
 *
 * Built with qmatmul.c and qattn.c by attnlab.kernels.cpu.ops.build with the system C and C++ compilers against
 * this torch's headers (no Python headers: the stable ABI), loaded by torch.ops.load_library.
 */
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cmath>
#include <cstring>
#include <mutex>
#include <unordered_map>

extern "C" {
int attnlab_qmatmul(int fmt, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y,
                    const float *bias);
int attnlab_qmatmul_q8(int fmt, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y,
                       const float *bias);
int attnlab_qmatmul_q8p(int fmt, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y,
                        const float *bias);
int attnlab_quantize(int fmt, const float *x, int64_t batch, int64_t n, int64_t width, int64_t x_bstride,
                     int64_t x_rstride, uint8_t *quants, int64_t q_bstride, int64_t q_rstride, uint8_t *scales,
                     int64_t s_bstride, int64_t s_rstride, const uint8_t *nf4_below, const float *nf4_inside);
int attnlab_attend(const int64_t *segments, int64_t n_keys, int64_t n_values, int64_t batch, int64_t kv_heads,
                   int64_t group, const float *q, int64_t q_bstride, int64_t q_hstride, float scale, float *s,
                   int64_t n_columns, float *o, int64_t o_bstride, int64_t o_hstride);
}
#include "fp16.h"

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

namespace {

int weight_format(const std::string &fmt) {  // ggml's type ids, as qmatmul.c numbers them
    if (fmt == "fp16") return 1;
    if (fmt == "q4_0") return 2;
    if (fmt == "q4_1") return 3;
    if (fmt == "q8_0") return 8;
    STD_TORCH_CHECK(false, "attnlab_cpp::qlinear: unknown weight format '", fmt, "' (fp16, q4_0, q4_1, q8_0)");
    return 0;
}

int64_t row_bytes(int code, int64_t k) {
    switch (code) {
    case 1: return 2 * k;
    case 2: return k / 32 * 18;
    case 3: return k / 32 * 20;
    default: return k / 32 * 34;
    }
}

Tensor qlinear(Tensor x, Tensor blocks, std::optional<Tensor> bias, std::string fmt) {
    // x quantized to 8 bits first (attnlab.model.qlinear's Q8), the rows as they are or packed (Q8P: qmatmul.c's
    // attnlab_pack_q8 layout, the same bytes in another order)
    const auto ends_with = [&fmt](const std::string &suffix) {
        return fmt.size() > suffix.size() && fmt.compare(fmt.size() - suffix.size(), suffix.size(), suffix) == 0;
    };
    const bool packed = ends_with(":q8p"), q8 = packed || ends_with(":q8");
    if (q8) fmt = fmt.substr(0, fmt.size() - (packed ? 4 : 3));
    const int code = weight_format(fmt);
    STD_TORCH_CHECK(x.scalar_type() == ScalarType::Float && x.is_cpu(), "attnlab_cpp::qlinear: x must be float32 on the CPU");
    const int64_t k = x.size(-1), n = blocks.size(0);
    STD_TORCH_CHECK(k % 32 == 0, "attnlab_cpp::qlinear: in_features ", k, " is not a multiple of 32");
    STD_TORCH_CHECK(blocks.scalar_type() == ScalarType::Byte && blocks.dim() == 2 && blocks.is_contiguous() &&
                        blocks.size(1) == row_bytes(code, k),
                    "attnlab_cpp::qlinear: blocks must be contiguous uint8 (n, ", row_bytes(code, k), ") for ", fmt,
                    " rows of ", k, " weights");
    std::optional<Tensor> bias32;  // as the Python operator: the bias as float32
    if (bias.has_value()) {
        STD_TORCH_CHECK(bias->numel() == n, "attnlab_cpp::qlinear: bias must have ", n, " values");
        bias32 = torch::stable::contiguous(torch::stable::to(*bias, ScalarType::Float));
    }
    const float *bias_pointer = bias32 ? static_cast<const float *>(bias32->data_ptr()) : nullptr;
    Tensor rows = torch::stable::contiguous(x);
    std::vector<int64_t> shape(rows.sizes().begin(), rows.sizes().end());
    shape.back() = n;
    Tensor out = torch::stable::new_empty(rows, shape);
    const int64_t m = k ? rows.numel() / k : 0;
    const auto kernel = packed ? attnlab_qmatmul_q8p : q8 && code != 1 ? attnlab_qmatmul_q8 : attnlab_qmatmul;
    const int status = kernel(code, static_cast<const uint8_t *>(blocks.data_ptr()), n, k,
                              static_cast<const float *>(rows.data_ptr()), m,
                              static_cast<float *>(out.mutable_data_ptr()), bias_pointer);
    STD_TORCH_CHECK(status == 0, "attnlab_cpp::qlinear: qmatmul.c refused format ", fmt, " with k=", k);
    return out;
}

// ---- quantized_attend -------------------------------------------------------------------------------------------

enum { FP32 = 0, FP16 = 1, BF16 = 2 };  // qattn.c's format codes: then q8_0 3, q4_0 4, nf4 5

int kv_format(const std::string &fmt) {
    static const char *names[] = {"fp32", "fp16", "bf16", "q8_0", "q4_0", "nf4"};
    for (int i = 0; i < 6; i++)
        if (fmt == names[i]) return i;
    STD_TORCH_CHECK(false, "attnlab_cpp::quantized_attend: format '", fmt, "' has no C kernel");
    return 0;
}

struct Part {  // attnlab.cache.quantized_kernel.PlanPart
    std::string name, buffer;
    int64_t lo, hi;
    int code;
    int64_t width;
    bool is_key;
    int64_t n_arrays;
};

struct Plan {  // attnlab.cache.quantized_kernel.KernelPlan
    std::vector<Part> parts;
    int64_t ring_slots, resid, flush, kv_heads;
    std::string keys, values;
    int64_t value_width, group;
};

std::vector<std::string> split(const std::string &text, char sep) {
    std::vector<std::string> out;
    size_t start = 0;
    for (size_t i = 0; i <= text.size(); i++)
        if (i == text.size() || text[i] == sep) {
            out.push_back(text.substr(start, i - start));
            start = i + 1;
        }
    return out;
}

Plan parse_spec(const std::string &spec) {  // KernelPlan.to_spec's text: parts;...|scalars
    const auto halves = split(spec, '|');
    STD_TORCH_CHECK(halves.size() == 2, "attnlab_cpp::quantized_attend: bad plan spec '", spec, "'");
    Plan plan;
    for (const auto &text : split(halves[0], ';')) {
        const auto f = split(text, ':');
        STD_TORCH_CHECK(f.size() == 8, "attnlab_cpp::quantized_attend: bad part '", text, "'");
        plan.parts.push_back({f[0], f[1], std::stoll(f[2]), std::stoll(f[3]), kv_format(f[4]), std::stoll(f[5]),
                              f[6] == "True", std::stoll(f[7])});
    }
    const auto s = split(halves[1], ':');
    STD_TORCH_CHECK(s.size() == 8, "attnlab_cpp::quantized_attend: bad plan scalars '", halves[1], "'");
    plan.ring_slots = std::stoll(s[0]);
    plan.resid = std::stoll(s[1]);
    plan.flush = std::stoll(s[2]);
    plan.kv_heads = std::stoll(s[3]);
    plan.keys = s[4];
    plan.values = s[5];
    plan.value_width = std::stoll(s[6]);
    plan.group = std::stoll(s[7]);
    return plan;
}

const Plan &plan_of(const std::string &spec) {  // parsed once per spec
    static std::mutex lock;
    static std::unordered_map<std::string, Plan> plans;
    std::lock_guard<std::mutex> guard(lock);
    auto found = plans.find(spec);
    if (found == plans.end()) found = plans.emplace(spec, parse_spec(spec)).first;
    return found->second;
}

struct Piece {
    int64_t position, slot, length;
};

std::vector<Piece> ring_pieces(const Plan &plan, int64_t first, int64_t end) {  // KernelPlan.ring_pieces
    std::vector<Piece> pieces;
    for (int64_t position = first; position < end;) {
        const int64_t slot = position % plan.ring_slots, length = std::min(end - position, plan.ring_slots - slot);
        pieces.push_back({position, slot, length});
        position += length;
    }
    return pieces;
}

char *bytes(const Tensor &t) { return static_cast<char *>(t.data_ptr()); }

// A run of rows [first, first + n) of stored arrays (contiguous (B, slots, ...)) as qattn.c's segment record.
void add_segment(std::vector<int64_t> &records, int code, const Tensor *arrays, int64_t n_arrays, int64_t first,
                 int64_t n, int64_t column, int64_t lo, int64_t d, bool accumulate) {
    const Tensor &quants = arrays[0];
    STD_TORCH_CHECK(first >= 0 && first + n <= quants.size(1) && quants.is_contiguous() &&
                        (n_arrays == 1 || arrays[1].is_contiguous()),
                    "attnlab_cpp::quantized_attend: rows [", first, ", ", first + n, ") must lie in contiguous arrays of ",
                    quants.size(1), " rows");
    const int64_t item = static_cast<int64_t>(quants.element_size());
    const int64_t q = reinterpret_cast<int64_t>(bytes(quants) + first * quants.stride(1) * item);
    int64_t s = 0, s_stride = 0;
    if (n_arrays > 1) {
        s = reinterpret_cast<int64_t>(bytes(arrays[1]) + first * arrays[1].stride(1));
        s_stride = arrays[1].stride(0);
    }
    const int64_t fields[] = {code, q, s, quants.stride(0) * item, s_stride, n, column, lo, d, accumulate};
    records.insert(records.end(), fields, fields + 10);
}

uint16_t float_to_bf16(float f) {  // as torch rounds: to nearest even, NaN -> 0x7fc0
    if (std::isnan(f)) return 0x7fc0;
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    return static_cast<uint16_t>((bits + (((bits >> 16) & 1) + 0x7fffu)) >> 16);
}

// Rows [r0, r0 + n) of x (B, rows, width) float32 (unit last stride) stored into a part's arrays at slot `at`
// (Codec.encode_into).
void encode_into(const Part &part, const Tensor &x, int64_t r0, int64_t n, const Tensor *arrays, int64_t at,
                 const Tensor &nf4_below, const Tensor &nf4_inside) {
    const int64_t batch = x.size(0), width = part.width;
    const float *source = static_cast<const float *>(x.data_ptr()) + r0 * x.stride(1);
    if (part.code > BF16) {
        const Tensor &quants = arrays[0], &scales = arrays[1];
        const int status = attnlab_quantize(
            part.code, source, batch, n, width, x.stride(0), x.stride(1),
            reinterpret_cast<uint8_t *>(bytes(quants) + at * quants.stride(1)), quants.stride(0), quants.stride(1),
            reinterpret_cast<uint8_t *>(bytes(scales) + at * scales.stride(1)), scales.stride(0), scales.stride(1),
            static_cast<const uint8_t *>(nf4_below.data_ptr()), static_cast<const float *>(nf4_inside.data_ptr()));
        STD_TORCH_CHECK(status == 0, "KV cache part ", part.name, ": a value that is not finite, or too large for ",
                        "the fp16 scale of its blocks, cannot be stored (the model produced it: check its inputs)");
        return;
    }
    const Tensor &rows = arrays[0];  // (B, slots, width * bytes per value) uint8
    bool overflow = false;  // fp16: a finite value that became inf (beyond 65504)
    for (int64_t b = 0; b < batch; b++)
        for (int64_t t = 0; t < n; t++) {
            const float *from = source + b * x.stride(0) + t * x.stride(1);
            char *to = bytes(rows) + b * rows.stride(0) + (at + t) * rows.stride(1);
            if (part.code == FP32) {
                std::memcpy(to, from, width * sizeof(float));
            } else {
                uint16_t *half = reinterpret_cast<uint16_t *>(to);
                for (int64_t j = 0; j < width; j++) {
                    half[j] = part.code == FP16 ? float_to_half(from[j]) : float_to_bf16(from[j]);
                    overflow |= part.code == FP16 && (half[j] & 0x7fff) == 0x7c00 && std::isfinite(from[j]);
                }
            }
        }
    STD_TORCH_CHECK(!overflow, "KV cache part ", part.name, ": a value that is not finite in fp16 (|x| > 65504) ",
                    "cannot be stored (the model produced it: check its inputs)");
}

void check_rows(const Tensor &t, const char *what) {
    STD_TORCH_CHECK(t.scalar_type() == ScalarType::Float && t.is_cpu() && t.stride(-1) == 1,
                    "attnlab_cpp::quantized_attend: ", what, " must be float32 on the CPU with unit last stride");
}

Tensor quantized_attend(Tensor q, std::vector<Tensor> rows, std::vector<Tensor> store, std::vector<Tensor> recent,
                        Tensor counters, std::string spec, double scale, Tensor nf4_below, Tensor nf4_inside) {
    const Plan &plan = plan_of(spec);
    const size_t n_parts = plan.parts.size();
    STD_TORCH_CHECK(rows.size() == n_parts && recent.size() == n_parts,
                    "attnlab_cpp::quantized_attend: one row and one ring per part of the plan");
    std::vector<size_t> first_array;  // store is every part's arrays in order, flattened
    size_t n_arrays = 0;
    for (const Part &p : plan.parts) {
        first_array.push_back(n_arrays);
        n_arrays += p.n_arrays;
    }
    STD_TORCH_CHECK(store.size() == n_arrays, "attnlab_cpp::quantized_attend: ", n_arrays, " stored arrays expected");
    STD_TORCH_CHECK(counters.scalar_type() == ScalarType::Long && counters.numel() >= 3 && counters.is_contiguous(),
                    "attnlab_cpp::quantized_attend: counters must be int64 [seen, stored, max_len]");
    check_rows(q, "q");
    for (size_t i = 0; i < n_parts; i++) {
        check_rows(rows[i], "rows");
        check_rows(recent[i], "the ring");
    }
    int64_t *count = static_cast<int64_t *>(counters.mutable_data_ptr());
    const int64_t seen = count[0], stored = count[1], max_len = count[2];
    STD_TORCH_CHECK(seen + 1 <= max_len, "KV cache is full: ", seen + 1, " tokens exceed its max_len=", max_len,
                    " (make a larger cache)");
    const int64_t batch = q.size(0), heads = q.size(1);

    // Attend: K and V as runs of rows (KernelPlan.attend).
    const auto window = ring_pieces(plan, stored, seen);
    std::vector<int64_t> records;
    int64_t n_keys = 0, n_values = 0;
    for (int pass = 0; pass < 2; pass++)
        for (size_t i = 0; i < n_parts; i++) {
            const Part &p = plan.parts[i];
            if (pass == 0 ? p.buffer != plan.keys : (p.buffer != plan.values || p.hi > plan.value_width)) continue;
            const int64_t d = p.hi - p.lo, before = records.size();
            const bool accumulate = pass == 0 && p.lo > 0;  // a later part of the key rows
            add_segment(records, p.code, &store[first_array[i]], p.n_arrays, 0, stored, 0, p.lo, d, accumulate);
            for (const Piece &w : window)
                add_segment(records, FP32, &recent[i], 1, w.slot, w.length, w.position, p.lo, d, accumulate);
            add_segment(records, FP32, &rows[i], 1, 0, 1, seen, p.lo, d, accumulate);
            (pass == 0 ? n_keys : n_values) += (records.size() - before) / 10;
        }
    Tensor out = torch::stable::new_zeros(q, {batch, heads, 1, plan.value_width});
    Tensor workspace = torch::stable::new_empty(q, {batch, heads, seen + 1});
    const int status = attnlab_attend(records.data(), n_keys, n_values, batch, plan.kv_heads, heads / plan.kv_heads,
                                      static_cast<const float *>(q.data_ptr()), q.stride(0), q.stride(1),
                                      static_cast<float>(scale), static_cast<float *>(workspace.mutable_data_ptr()),
                                      seen + 1, static_cast<float *>(out.mutable_data_ptr()), out.stride(0),
                                      out.stride(1));
    STD_TORCH_CHECK(status == 0, "the CPU attention kernel could not allocate its row buffers");

    // Write the token (KernelPlan.write): tokens leaving the residual window are quantized, the rest is kept.
    const int64_t start = seen, end = seen + 1;
    const int64_t leave = stored + std::max<int64_t>(0, (end - plan.resid - stored) / plan.flush) * plan.flush;
    if (leave > stored)
        for (size_t i = 0; i < n_parts; i++) {
            const Part &p = plan.parts[i];
            for (const Piece &w : ring_pieces(plan, stored, std::min(start, leave)))
                encode_into(p, recent[i], w.slot, w.length, &store[first_array[i]], w.position, nf4_below,
                            nf4_inside);
            if (leave > start) {
                const int64_t first = std::max(start, stored);
                encode_into(p, rows[i], first - start, leave - first, &store[first_array[i]], first, nf4_below,
                            nf4_inside);
            }
        }
    for (const Piece &w : ring_pieces(plan, std::max(start, leave), end))  // the rest stays at full precision
        for (size_t i = 0; i < n_parts; i++) {
            const Tensor &ring = recent[i], &row = rows[i];
            for (int64_t b = 0; b < batch; b++)
                for (int64_t t = 0; t < w.length; t++)
                    std::memcpy(static_cast<float *>(ring.data_ptr()) + b * ring.stride(0) + (w.slot + t) * ring.stride(1),
                                static_cast<const float *>(row.data_ptr()) + b * row.stride(0) +
                                    (w.position - start + t) * row.stride(1),
                                plan.parts[i].width * sizeof(float));
        }
    count[1] = leave;
    count[0] = seen + 1;
    return out;
}

}  // namespace

// The schemas are defined in Python, next to each operator's fake (shape) function: attnlab.model.qlinear and
// attnlab.cache.quantized_kernel.
STABLE_TORCH_LIBRARY_IMPL(attnlab_cpp, CPU, m) {
    m.impl("qlinear", TORCH_BOX(&qlinear));
    m.impl("quantized_attend", TORCH_BOX(&quantized_attend));
}
