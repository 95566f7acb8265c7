// attention/tile_gemm: the kernels' row-major GEMM on raw pointers, both paths (the process's
// BLAS called directly, ATen's addmm), against a naive triple loop; every transposition,
// leading dims wider than the rows, beta = 0 over NaN, beta = 1 accumulating.
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "tile_gemm.h"

namespace {

using hp::attention::detail::gemm;
using hp::attention::detail::gemm_via_aten;

// C = alpha op(A) op(B) + beta C, by the definition (beta = 0 ignores C).
void naive(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha,
           const std::vector<double>& a, int64_t lda, const std::vector<double>& b, int64_t ldb,
           double beta, std::vector<double>& c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double x = ta ? a[p * lda + i] : a[i * lda + p];
        const double y = tb ? b[j * ldb + p] : b[p * ldb + j];
        acc += x * y;
      }
      c[i * ldc + j] = alpha * acc + (beta == 0 ? 0 : beta * c[i * ldc + j]);
    }
  }
}

TEST(TileGemm, BothPathsMatchTheDefinition) {
  std::mt19937 gen(7);
  std::normal_distribution<double> dist;
  const int64_t m = 5, n = 7, k = 3;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (double beta : {0.0, 1.0}) {
        // Stored shapes with leading dims 2 wider than a row.
        const int64_t lda = (ta ? m : k) + 2, ldb = (tb ? k : n) + 2, ldc = n + 2;
        std::vector<double> a((ta ? k : m) * lda), b((tb ? n : k) * ldb), c0(m * ldc);
        for (auto* v : {&a, &b, &c0})
          for (auto& x : *v)
            x = dist(gen);
        if (beta == 0) c0.assign(c0.size(), std::numeric_limits<double>::quiet_NaN());
        auto want = c0, direct = c0, via_aten = c0;
        naive(ta, tb, m, n, k, 0.5, a, lda, b, ldb, beta, want, ldc);
        gemm(ta, tb, m, n, k, 0.5, a.data(), lda, b.data(), ldb, beta, direct.data(), ldc);
        gemm_via_aten(ta, tb, m, n, k, 0.5, a.data(), lda, b.data(), ldb, beta, via_aten.data(),
                      ldc);
        std::vector<float> af(a.begin(), a.end()), bf(b.begin(), b.end()), cf(c0.begin(), c0.end());
        gemm(ta, tb, m, n, k, 0.5f, af.data(), lda, bf.data(), ldb, static_cast<float>(beta),
             cf.data(), ldc);
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            const int64_t at = i * ldc + j;
            EXPECT_NEAR(direct[at], want[at], 1e-12) << ta << tb << beta << " " << i << "," << j;
            EXPECT_NEAR(via_aten[at], want[at], 1e-12) << ta << tb << beta;
            EXPECT_NEAR(cf[at], want[at], 1e-5) << ta << tb << beta;
          }
          for (int64_t j = n; j < ldc; ++j) {  // the padding past each row is never written
            const int64_t at = i * ldc + j;
            EXPECT_TRUE(std::isnan(c0[at]) ? std::isnan(direct[at]) && std::isnan(via_aten[at])
                                           : direct[at] == c0[at] && via_aten[at] == c0[at]);
          }
        }
      }
    }
  }
}

}  // namespace
