// What one MUL_MAT of a decode tick costs at 1..16 rows, for a model's weight shapes, on the CPU backend of the
// llama.cpp build it is linked against; with the weight in the plain CPU buffer and in the CPU_REPACK one.
// Also checks, per shape, that each row's result does not depend on how many rows came with it (bitwise) and
// that the repacked result agrees with the plain one (normalized mean squared error, as test-backend-ops).
//
// rowcost TYPE THREADS ROUNDS K,M [K,M ...]    e.g. rowcost q8_0 2 200 576,576 576,1536 1536,576 576,49152
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

static const int ROWS[] = {1, 2, 3, 4, 5, 8, 16};

struct Result {
    std::vector<float> out;  // n x m
    double ms;               // median per call
};

static Result run(ggml_backend_t be, ggml_backend_buffer_type_t wbuft, ggml_type type, int k, int m, int n,
                  const std::vector<float> & w, const std::vector<float> & x, int rounds) {
    ggml_init_params ip = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, true};
    ggml_context * cw = ggml_init(ip);
    ggml_context * cx = ggml_init(ip);
    ggml_tensor * tw = ggml_new_tensor_2d(cw, type, k, m);
    ggml_tensor * tx = ggml_new_tensor_2d(cx, GGML_TYPE_F32, k, n);
    ggml_tensor * ty = ggml_mul_mat(cx, tw, tx);
    ggml_backend_buffer_t bw = ggml_backend_alloc_ctx_tensors_from_buft(cw, wbuft);
    ggml_backend_buffer_set_usage(bw, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    if (strcmp(ggml_backend_buft_name(wbuft), "CPU_REPACK") == 0 && tw->extra == nullptr) {  // no layout for it here
        ggml_backend_buffer_free(bw);
        ggml_free(cw);
        ggml_free(cx);
        return Result{{}, -1.0};
    }
    ggml_backend_buffer_t bx = ggml_backend_alloc_ctx_tensors(cx, be);
    std::vector<uint8_t> q(ggml_row_size(type, k) * m);
    ggml_quantize_chunk(type, w.data(), q.data(), 0, m, k, nullptr);
    ggml_backend_tensor_set(tw, q.data(), 0, q.size());
    ggml_backend_tensor_set(tx, x.data(), 0, sizeof(float) * k * n);
    ggml_cgraph * gf = ggml_new_graph(cx);
    ggml_build_forward_expand(gf, ty);
    std::vector<double> t;
    for (int r = 0; r < rounds + 3; r++) {
        auto t0 = std::chrono::steady_clock::now();
        ggml_backend_graph_compute(be, gf);
        auto t1 = std::chrono::steady_clock::now();
        if (r >= 3) t.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
    std::sort(t.begin(), t.end());
    Result res{std::vector<float>((size_t) m * n), t[t.size() / 2]};
    ggml_backend_tensor_get(ty, res.out.data(), 0, sizeof(float) * m * n);
    ggml_backend_buffer_free(bw);
    ggml_backend_buffer_free(bx);
    ggml_free(cw);
    ggml_free(cx);
    return res;
}

static double nmse(const std::vector<float> & a, const std::vector<float> & b) {
    double e = 0, s = 0;
    for (size_t i = 0; i < a.size(); i++) { e += (a[i] - b[i]) * (a[i] - b[i]); s += b[i] * b[i]; }
    return e / s;
}

int main(int argc, char ** argv) {
    if (argc < 5) { fprintf(stderr, "usage: rowcost TYPE THREADS ROUNDS K,M [K,M ...]\n"); return 2; }
    ggml_type type = GGML_TYPE_COUNT;
    for (int t = 0; t < GGML_TYPE_COUNT; t++) {
        const char * nm = ggml_type_name((ggml_type) t);
        if (nm && strcmp(nm, argv[1]) == 0) type = (ggml_type) t;
    }
    if (type == GGML_TYPE_COUNT) { fprintf(stderr, "unknown type %s\n", argv[1]); return 2; }
    const int threads = atoi(argv[2]), rounds = atoi(argv[3]);
    ggml_backend_load_all();
    ggml_backend_t be = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
    ggml_backend_cpu_set_n_threads(be, threads);
    ggml_backend_dev_t dev = ggml_backend_get_device(be);
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    auto get_extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    ggml_backend_buffer_type_t repack = nullptr;
    for (ggml_backend_buffer_type_t * b = get_extra ? get_extra(dev) : nullptr; b && *b; b++) {
        if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) repack = *b;
    }
    printf("system_info: %s\n", ggml_backend_dev_description(dev));
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    int bad = 0;
    for (int a = 4; a < argc; a++) {
        int k = 0, m = 0;
        sscanf(argv[a], "%d,%d", &k, &m);
        std::vector<float> w((size_t) k * m), x((size_t) k * 16);
        for (auto & v : w) v = nd(rng) * 0.05f;
        for (auto & v : x) v = nd(rng);
        printf("%s K=%d M=%d (%.2f MB)", argv[1], k, m, ggml_row_size(type, k) * m / 1e6);
        for (int side = 0; side < (repack ? 2 : 1); side++) {
            ggml_backend_buffer_type_t buft = side ? repack : ggml_backend_get_default_buffer_type(be);
            printf("\n  %-10s", side ? "CPU_REPACK" : "CPU");
            std::vector<float> lone;
            double ms1 = 0;
            for (int n : ROWS) {
                Result r = run(be, buft, type, k, m, n, w, x, rounds);
                if (r.ms < 0) { printf(" not repacked by this build"); break; }
                if (n == 1) { lone = r.out; ms1 = r.ms; }
                bool inv = true;  // row 0 of an n-row call, bitwise the lone row's
                for (int i = 0; i < m; i++) inv &= memcmp(&r.out[i], &lone[i], sizeof(float)) == 0;
                printf(" n=%d %.3f ms (%.2fx)%s", n, r.ms, r.ms / ms1, inv ? "" : " [row 0 differs]");
                if (side == 1) {
                    Result ref = run(be, ggml_backend_get_default_buffer_type(be), type, k, m, n, w, x, 1);
                    double e = nmse(r.out, ref.out);
                    if (e > 5e-4) { printf(" [NMSE %.2e vs CPU]", e); bad++; }
                }
            }
        }
        printf("\n");
    }
    ggml_backend_free(be);
    return bad ? 1 : 0;
}
