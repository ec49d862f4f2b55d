"""C kernels of a linear over a frozen weight stored as NF4 codes (``formats.nf4_linear``): the
products read the codes, never a decoded weight.

``W`` (d_out, d_in) is ``codebook.encode_leaf``'s bytes: its fp32 absmax scales (one a block of 64
along a row), then its codes, two a byte, high nibble first. ``forward`` is ``y = x @ W^T`` and
``grad_input`` is ``dx = g @ W`` for few rows of ``x`` / ``g`` (fp32). Per block of 64 the kernels
make its 16 possible weights once (``code[k] * absmax``, rounded to bfloat16 as torch's cast rounds
where the parameters are bf16: the weights are bitwise ``codebook.decode_leaf``'s), expand the codes
into them and fuse the products, so the weight is read once at 0.56 bytes an element.

The order of the sums is fixed, the same in the AVX-512, AVX2 and scalar paths (so each is bitwise
the others): ``forward`` accumulates each output in 16 lanes, lane l taking the terms j = l mod 16
in increasing j, one fused multiply-add each, then adds the lanes pairwise (l + 8, then + 4, + 2,
+ 1); ``grad_input`` accumulates each dx[n, j] over the output rows o in increasing o, one fused
multiply-add each. Threads split the outputs (rows of W forward, blocks of 64 columns backward),
so the thread count never changes a bit; a range of those outputs alone is the same bits
(``nf4_linear.run``'s ``part``: ``nf4_forward`` over W's rows from the range's, and
``nf4_grad_input_part`` over a range of blocks, on one thread). Both read W once, asking the cache
for the codes of the rows ``AHEAD`` before their use: a fetched expert's codes come from DRAM, and
arrive while the rows before them compute (cold, 256 distinct experts, one thread: about 1.3x the
in-cache time, against 2.6x without). A block whose absmax is not finite makes the kernels report
it (the caller then runs the torch twin).

Each block is decoded once a product. Up to ``GROUP`` (4) rows of ``x`` / ``g`` a block's weights
stay in registers between its decode and its multiply-adds (``grad_input`` reads W in its stored
order, dx's rows accumulators in memory, a few KB); more rows share one decode: ``forward`` decodes
``FWD_W`` rows of W into a thread's buffer that all its rows then read (``fwd_rows_decoded``), and
``grad_input`` (from ``BWD_SHARED`` rows) decodes each block once for all its rows, W's blocks taken
in chunks of columns whose rows of dx stay in L1 (``KEEP_DX``), the rows of W in runs of ``BWD_O``
whose blocks at a column are decoded together (``bwd_decoded_run``). Decoding a block per group of
4 rows made a product's time a step function of ceil(rows / 4); on AVX2, whose expand is the
costly part, an expert at 32 rows took ~8x its time at 1 row (~5x with the tiles below), and the
same decodes and multiply-adds in the same order give the same bits.

Where the rows share a decode, the AVX2 and AVX-512 builds block their multiply-adds so that each
load serves several (``nf4_blocks``, the tiles in registers of 8 lanes on both): forward, 3 decoded
rows of W against 2 rows of x at a time, their 6 outputs' 12 accumulators in registers, the columns
in chunks of 1024 whose 3 rows of W stay in L1; backward, from 4 rows, 32 rows of W at a time, each
pair of rows of dx held in registers (half a block at a time) while their 32 blocks add in. One row
of x against one row of W took a load an FMA, and a row of dx a load and a store an FMA: at 32 rows
an expert's products ran at a third (forward) and a sixth (backward) of a Zen 3 core's FMA rate, now
at over half and about two thirds; on Zen 5 the AVX-512 build's one row of W at a time in 16-lane
registers took 2.3-2.8x the tiles' time at 32-64 rows. Each output's sum keeps its order: a tile
only changes which outputs advance together.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .. import native
from . import nf4_blocks

SOURCE = r"""
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define BLK 64
#define GROUP 4   /* rows of x (g) whose sums share one decode of a block */
#define AHEAD 4   /* rows of W a thread asks the cache for before it reads them */

/* rows R <= GROUP with R a constant where inlined: each case its own specialised loop */
#define BY_ROWS(call) switch (R) { case 1: call(1); break; case 2: call(2); break; \
                                   case 3: call(3); break; default: call(4); }

""" + native.BITS + nf4_blocks.BLOCKS + r"""
/* ask the cache for [p, p + bytes) ahead of its use: codes read from DRAM (a fetched expert's,
   not yet in any cache) then arrive while the rows before them compute */
static inline void ahead(const void* p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char*)p + i, 0, 3);
}

/* y (n <= GROUP rows, ldy d_out) = x @ W^T: each row of W decoded in registers as it is used */
static void fwd_in_registers(int64_t n, int64_t d_out, int64_t nb, const float* x,
                             const uint8_t* q, const float* s, const float* code, int rb,
                             float* y, int threads) {
    const int64_t d_in = nb * BLK;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < d_out; o++) {
        if (o + AHEAD < d_out) {
            ahead(q + (o + AHEAD) * nb * 32, nb * 32);
            ahead(s + (o + AHEAD) * nb, nb * 4);
        }
        const int R = (int)n;
        #define FWD(k) fwd_row(k, x, d_in, q + o * nb * 32, s + o * nb, nb, code, rb, y + o, d_out)
        BY_ROWS(FWD)
        #undef FWD
    }
}

/* y (n > GROUP rows, ldy d_out) = x @ W^T: FWD_W rows of W at a time decoded into a thread's
   buffer (wrows, FWD_W * d_in floats in bufs), which all the rows of x then read
   (fwd_rows_decoded): a row's cost is one decode and its rows' multiply-adds, not a decode per
   GROUP rows */
static void fwd_shared_decode(int64_t n, int64_t d_out, int64_t nb, const float* x,
                              const uint8_t* q, const float* s, const float* code, int rb,
                              float* y, float* bufs, int threads) {
    const int64_t d_in = nb * BLK, tiles = (d_out + FWD_W - 1) / FWD_W;
    #pragma omp parallel num_threads(threads)
    {
        float* wrows = bufs + (int64_t)omp_get_thread_num() * FWD_W * d_in;
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t o = t * FWD_W;
            const int M = (int)(d_out - o < FWD_W ? d_out - o : FWD_W);
            if (o + M + AHEAD <= d_out) {   /* the rows of W in place AHEAD rows on */
                ahead(q + (o + AHEAD) * nb * 32, M * nb * 32);
                ahead(s + (o + AHEAD) * nb, M * nb * 4);
            }
            for (int64_t k = 0; k < M * nb; k++)   /* rows o .. o+M of W: contiguous blocks */
                decode_block(q + (o * nb + k) * 32, s[o * nb + k], code, rb, wrows + k * BLK);
            fwd_rows_decoded(n, M, x, d_in, wrows, d_in, nb, y + o, d_out);
        }
    }
}

/* y (n, d_out) = x (n, d_in) @ W^T, W (d_out, d_in) the codes q and scales s; 1 where a scale
   is not finite (y unwritten). Up to GROUP rows (or without the memory of the decoded rows'
   buffers) W is decoded in registers per GROUP rows, more share one decode */
int nf4_forward(int64_t n, int64_t d_out, int64_t d_in, const float* restrict x,
                const uint8_t* restrict q, const float* restrict s, const float* restrict code,
                int rb, float* restrict y, int threads) {
    const int64_t nb = d_in / BLK;
    if (bad_scales(d_out * nb, s)) return 1;
    /* 64-byte aligned (d_in a multiple of 64 floats): no vector load of a row crosses a line */
    float* bufs = n > GROUP ? aligned_alloc(64, (size_t)threads * FWD_W * (size_t)d_in * 4)
                            : NULL;
    if (bufs) {
        fwd_shared_decode(n, d_out, nb, x, q, s, code, rb, y, bufs, threads);
        free(bufs);
        return 0;
    }
    for (int64_t r0 = 0; r0 < n; r0 += GROUP)
        fwd_in_registers(n - r0 < GROUP ? n - r0 : GROUP, d_out, nb, x + r0 * d_in, q, s, code,
                         rb, y + r0 * d_out, threads);
    return 0;
}

/* dx's R rows (ldx; dx at W's column k0 * BLK) += g's rows (ldg d_out) @ W over the blocks
   [k0, k1) of each row of W, the rows of W in increasing order: W streams from memory once, as it
   is stored */
static void bwd_blocks(int R, const float* g, int64_t d_out, int64_t nb, int64_t k0, int64_t k1,
                       const uint8_t* q, const float* s, const float* code, int rb, float* dx,
                       int64_t ldx) {
    for (int64_t o = 0; o < d_out; o++) {
        if (o + AHEAD < d_out) {
            ahead(q + ((o + AHEAD) * nb + k0) * 32, (k1 - k0) * 32);
            ahead(s + (o + AHEAD) * nb + k0, (k1 - k0) * 4);
        }
        for (int64_t k = k0; k < k1; k++) {
            #define BWD(m) bwd_step(m, g + o, d_out, q + (o * nb + k) * 32, s[o * nb + k], code, \
                                    rb, dx + (k - k0) * BLK, ldx)
            BY_ROWS(BWD)
            #undef BWD
        }
    }
}

/* dx[:, k0*BLK .. k1*BLK) (n rows, ldx; dx at column k0 * BLK) += g (n rows, ldg d_out) @ W
   over those blocks of every row of W, each block decoded once for all n rows; the blocks in
   chunks whose n rows of dx stay in L1 (KEEP_DX bytes) while the rows of W pass, in increasing
   order, in runs of BWD_O: a run's blocks at a column decoded into wo, then added to all the rows
   of dx (bwd_decoded_run) */
#define KEEP_DX (32 << 10)
static void bwd_all_rows(int64_t n, const float* g, int64_t d_out, int64_t nb, int64_t k0,
                         int64_t k1, const uint8_t* q, const float* s, const float* code, int rb,
                         float* dx, int64_t ldx) {
    const int64_t chunk = n * BLK * 4 >= KEEP_DX ? 1 : KEEP_DX / (n * BLK * 4);
    float wo[BWD_O * BLK] __attribute__((aligned(64)));
    for (int64_t c0 = k0; c0 < k1; c0 += chunk) {
        const int64_t c1 = c0 + chunk < k1 ? c0 + chunk : k1;
        for (int64_t o0 = 0; o0 < d_out; o0 += BWD_O) {
            const int O = (int)(d_out - o0 < BWD_O ? d_out - o0 : BWD_O);
            for (int64_t o = o0 + AHEAD; o < o0 + O + AHEAD && o < d_out; o++) {
                ahead(q + (o * nb + c0) * 32, (c1 - c0) * 32);
                ahead(s + o * nb + c0, (c1 - c0) * 4);
            }
            for (int64_t k = c0; k < c1; k++) {
                for (int i = 0; i < O; i++)
                    decode_block(q + ((o0 + i) * nb + k) * 32, s[(o0 + i) * nb + k], code, rb,
                                 wo + i * BLK);
                bwd_decoded_run(n, O, g + o0, d_out, wo, dx + (k - k0) * BLK, ldx);
            }
        }
    }
}

/* dx's n rows (ldx; dx at column k0 * BLK) += g (n, d_out) @ W over W's blocks [k0, k1) of each
   row: below BWD_SHARED rows each block of W is decoded in registers per GROUP rows (W streamed
   once, as stored); from it the rows share one decode of each block (bwd_all_rows). Each dx[r, j]
   is its sum over o in increasing order whatever the range: a range's columns are the whole
   product's bits */
static void bwd_range(int64_t n, const float* g, int64_t d_out, int64_t nb, int64_t k0,
                      int64_t k1, const uint8_t* q, const float* s, const float* code, int rb,
                      float* dx, int64_t ldx) {
    if (n >= BWD_SHARED) {
        bwd_all_rows(n, g, d_out, nb, k0, k1, q, s, code, rb, dx, ldx);
        return;
    }
    for (int64_t r0 = 0; r0 < n; r0 += GROUP) {
        const int R = (int)(n - r0 < GROUP ? n - r0 : GROUP);
        bwd_blocks(R, g + r0 * d_out, d_out, nb, k0, k1, q, s, code, rb, dx + r0 * ldx, ldx);
    }
}

/* dx (n, d_in) = g (n, d_out) @ W; 1 where a scale is not finite (dx unwritten). Thread t takes
   the blocks [k0, k1) of every row of W (bwd_range) */
int nf4_grad_input(int64_t n, int64_t d_out, int64_t d_in, const float* restrict g,
                   const uint8_t* restrict q, const float* restrict s, const float* restrict code,
                   int rb, float* restrict dx, int threads) {
    const int64_t nb = d_in / BLK;
    if (bad_scales(d_out * nb, s)) return 1;
    memset(dx, 0, (size_t)(n * d_in) * sizeof(float));
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < threads; t++) {
        const int64_t k0 = nb * t / threads, k1 = nb * (t + 1) / threads;
        bwd_range(n, g, d_out, nb, k0, k1, q, s, code, rb, dx + k0 * BLK, d_in);
    }
    return 0;
}

/* dx (n, (k1 - k0) * BLK) = g (n, d_out) @ W[:, k0*BLK .. k1*BLK), on this thread: the columns of
   nf4_grad_input's dx, bitwise; 1 where a scale is not finite (dx unwritten) */
int nf4_grad_input_part(int64_t n, int64_t d_out, int64_t d_in, const float* restrict g,
                        const uint8_t* restrict q, const float* restrict s,
                        const float* restrict code, int rb, float* restrict dx, int64_t k0,
                        int64_t k1) {
    const int64_t nb = d_in / BLK;
    if (bad_scales(d_out * nb, s)) return 1;
    memset(dx, 0, (size_t)(n * (k1 - k0) * BLK) * sizeof(float));
    bwd_range(n, g, d_out, nb, k0, k1, q, s, code, rb, dx, (k1 - k0) * BLK);
    return 0;
}
"""

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_ARGS = [_I64, _I64, _I64, _P, _P, _P, _P, _I32, _P, _I32]
# multiply-adds a thread takes at least: a small product runs on one (waking another costs more)
WORK_PER_THREAD = 1 << 20
# rows a product runs on one thread up to: the kernels read and decode the codes once, so such a
# product's time is one pass over the codes and its rows' multiply-adds, a few milliseconds for an
# expert; a second thread would halve that on an idle core, but each product is then
# one OpenMP region whose wake-up and end barrier put the compute thread to sleep and back (a
# futex each) while the engine's fetch, issue and I/O threads take the other core: a 30B step at
# 32 tokens routes 1-32 rows to an expert, and on one thread each its step ran 4 % faster with
# ~640 fewer sleeps of the compute thread (examples/train_larger_than_ram.py, 8 layers)
ONE_THREAD_ROWS = 32


def threads(rows: int, work: int) -> int:
    """The threads a product of ``rows`` rows and ``work`` multiply-adds runs on: torch's, fewer
    where it is small, one up to ``ONE_THREAD_ROWS`` rows."""
    if rows <= ONE_THREAD_ROWS:
        return 1
    return max(1, min(torch.get_num_threads(), work // WORK_PER_THREAD))


def _load(lib: ctypes.CDLL | None) -> ctypes.CDLL | None:
    if lib is None:
        return None
    for fn in (lib.nf4_forward, lib.nf4_grad_input):
        fn.argtypes = _ARGS
        fn.restype = _I32
    lib.nf4_grad_input_part.argtypes = [*_ARGS[:-1], _I64, _I64]
    lib.nf4_grad_input_part.restype = _I32
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels, once per process; None where they cannot be built."""
    return _load(native.build("zinf_nf4_linear", SOURCE))


@functools.cache
def variant(isa: tuple[str, ...]) -> ctypes.CDLL | None:
    """The same source built for the instruction sets ``isa`` names instead of this CPU's
    (``()``: baseline x86-64 or any CPU, the scalar path; ``("-mavx2", "-mfma")``: the AVX2 path),
    which a test holds bitwise to the path ``library`` runs."""
    flags = tuple(f for f in native.FLAGS if not f.startswith(("-march", "-mprefer")))
    name = "zinf_nf4_linear_" + ("_".join(f.lstrip("-m") for f in isa) or "portable")
    return _load(native.build(name, SOURCE, (*isa, *flags)))
