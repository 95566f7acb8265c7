// attention/tile_gemm: the kernels' row-major GEMM on raw pointers, every path (the process's
// BLAS called directly, ATen's addmm, our AVX-512 kernel where the CPU has it), against a naive
// triple loop; every transposition, leading dims wider than the rows, beta = 0 over NaN, beta = 1
// accumulating, and for the AVX-512 kernel every remainder of its 6 x 64 register tiles and of
// its 16 x 16 transposes.
#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "hp/attention/attention.h"
#include "tile_gemm.h"
#include "tile_gemm_avx512.h"

namespace {

using hp::attention::detail::gemm;
using hp::attention::detail::gemm_avx512;
using hp::attention::detail::gemm_via_aten;
using hp::attention::detail::gemm_via_blas;

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

// Every shape class of the AVX-512 kernel: rows 1..13 (6-row tiles and each remainder), columns
// across the 16-lane and 64-column edges, k across the 16 x 16 transposes (k = 0 included), in
// both orientations of both operands, against the definition in double; the C padding past n
// is never touched, and beta = 0 ignores a NaN C. The BLAS path of the same float call agrees.
TEST(TileGemm, Avx512KernelMatchesTheDefinitionOnEveryEdge) {
  if (!hp::attention::detail::avx512_gemm_supported()) {
    GTEST_SKIP() << "this CPU has no AVX-512F: the kernel is never used here";
  }
  std::mt19937 gen(11);
  std::normal_distribution<double> dist;
  int64_t cases = 0;
  for (int64_t m : {1, 5, 6, 7, 13}) {
    for (int64_t n : {1, 15, 16, 17, 63, 64, 65, 130}) {
      for (int64_t k : {0, 1, 16, 17, 64, 100}) {
        for (bool ta : {false, true}) {
          for (bool tb : {false, true}) {
            for (double beta : {0.0, 1.0}) {
              const int64_t lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 2, ldc = n + 5;
              std::vector<double> a((ta ? k : m) * lda + 1), b((tb ? n : k) * ldb + 1),
                  c0(m * ldc);
              for (auto* v : {&a, &b, &c0})
                for (auto& x : *v)
                  x = static_cast<float>(dist(gen));  // exactly representable in float
              if (beta == 0) c0.assign(c0.size(), std::numeric_limits<double>::quiet_NaN());
              auto want = c0;
              naive(ta, tb, m, n, k, 0.5, a, lda, b, ldb, beta, want, ldc);
              std::vector<float> af(a.begin(), a.end()), bf(b.begin(), b.end()),
                  cf(c0.begin(), c0.end()), cb(c0.begin(), c0.end());
              gemm_avx512(ta, tb, m, n, k, 0.5f, af.data(), lda, bf.data(), ldb,
                          static_cast<float>(beta), cf.data(), ldc);
              gemm_via_blas(ta, tb, m, n, k, 0.5f, af.data(), lda, bf.data(), ldb,
                            static_cast<float>(beta), cb.data(), ldc);
              const double tol = 2e-6 * (4.0 + static_cast<double>(k));
              for (int64_t i = 0; i < m; ++i) {
                for (int64_t j = 0; j < n; ++j) {
                  const int64_t at = i * ldc + j;
                  ASSERT_NEAR(cf[at], want[at], tol)
                      << "m=" << m << " n=" << n << " k=" << k << " ta=" << ta << " tb=" << tb
                      << " beta=" << beta << " at (" << i << ", " << j << ")";
                  ASSERT_NEAR(cb[at], want[at], tol);
                }
                for (int64_t j = n; j < ldc; ++j) {
                  const int64_t at = i * ldc + j;
                  ASSERT_TRUE(std::isnan(c0[at]) ? std::isnan(cf[at]) : cf[at] == c0[at])
                      << "padding written at (" << i << ", " << j << ")";
                }
              }
              ++cases;
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 5 * 8 * 6 * 8);
}

// SharedBt: one B stored [n x k], multiplied by several A on their leading n' <= n columns, in
// both float (the AVX-512 panels where the CPU has them) and double (BLAS), with beta 0 over
// NaN and beta 1, against the definition; the same object reset to another B forgets the first.
TEST(TileGemm, SharedBtMatchesTheDefinitionForEveryLeadingWidth) {
  std::mt19937 gen(5);
  std::normal_distribution<double> dist;
  for (int64_t n : {1, 17, 64, 100, 256}) {
    for (int64_t k : {1, 16, 64, 70}) {
      const int64_t ldb = k + 1;
      hp::attention::detail::SharedBt<float> shared_f;
      hp::attention::detail::SharedBt<double> shared_d;
      std::vector<double> b0(n * ldb);
      for (auto& x : b0)
        x = dist(gen);
      const std::vector<float> first(300 * 300, 1.0f);  // a larger B, replaced just below
      shared_f.reset(first.data(), 300, 300, 300);
      std::vector<float> b0f(b0.begin(), b0.end());
      shared_f.reset(b0f.data(), ldb, n, k);
      shared_d.reset(b0.data(), ldb, n, k);
      for (int64_t n_used : {int64_t{1}, n / 2 + 1, n}) {
        for (double beta : {0.0, 1.0}) {
          const int64_t m = 7, lda = k + 2, ldc = n + 3;
          std::vector<double> a(m * lda), c0(m * ldc);
          for (auto* v : {&a, &c0})
            for (auto& x : *v)
              x = static_cast<float>(dist(gen));
          if (beta == 0) c0.assign(c0.size(), std::numeric_limits<double>::quiet_NaN());
          auto want = c0, cd = c0;
          naive(false, true, m, n_used, k, 0.5, a, lda, b0, ldb, beta, want, ldc);
          std::vector<float> af(a.begin(), a.end()), cf(c0.begin(), c0.end());
          shared_f.gemm(m, n_used, 0.5f, af.data(), lda, static_cast<float>(beta), cf.data(), ldc);
          shared_d.gemm(m, n_used, 0.5, a.data(), lda, beta, cd.data(), ldc);
          for (int64_t i = 0; i < m; ++i) {
            for (int64_t j = 0; j < ldc; ++j) {
              const int64_t at = i * ldc + j;
              if (j < n_used) {
                ASSERT_NEAR(cf[at], want[at], 2e-6 * (4.0 + k)) << "n=" << n << " k=" << k;
                ASSERT_NEAR(cd[at], want[at], 1e-12);
              } else {
                ASSERT_TRUE(std::isnan(c0[at]) ? std::isnan(cf[at]) : cf[at] == c0[at]);
              }
            }
          }
        }
      }
    }
  }
}

// The path the kernels take is the one the CPU allows (HP_TILE_GEMM is unset under ctest), and
// the rate the benchmarks print beside it is measured through that path.
TEST(TileGemm, ReportsThePathItTakesAndItsRate) {
  if (std::getenv("HP_TILE_GEMM") != nullptr) GTEST_SKIP() << "HP_TILE_GEMM is set";
  EXPECT_EQ(hp::attention::blockwise_tile_gemm_path(),
            hp::attention::detail::avx512_gemm_supported() ? "avx512" : "blas");
  EXPECT_GT(hp::attention::blockwise_tile_gemm_gflops(5), 0.0);
  EXPECT_THROW(hp::attention::blockwise_tile_gemm_gflops(0), std::exception);
}

}  // namespace
