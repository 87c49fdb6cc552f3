/* Two one-pass CPU kernels for the per-user privacy path, each giving exactly the numbers of the
 * torch code it stands in for (privacy/aggregate.py, privacy/clipping.py). Built by setup.py where
 * a C compiler is found; without it pflbench runs that torch code. Each runs on one thread: one
 * term's pass is bound by memory, where a second thread gained nothing.
 *
 * add_quantized: ExactSum's partial[i] += q((x[i]·factor)·scale), for an fp32 term rounded half to
 * even or an fp64 term rounded toward zero: the integers of torch's passes (multiply by clipping's
 * factor in the term's dtype, widen, scale, round, add), in one read of the term and one read and
 * write of the fp64 partial sum. An fp32 term's factor is rounded to fp32 first, as torch rounds
 * an fp32 factor tensor; times 1 the term is as it is. Up to four terms can share the pass: the
 * partial sum is read and written once for all, 60% less memory traffic per term for four.
 * Rounding uses no libm call (nearbyint and trunc are calls on baseline x86-64, ~5x the pass): for
 * |y| <= 2^51, (y + 1.5·2^52) - 1.5·2^52 is y rounded to an integer half to even, since the sum
 * lies in [2^52, 2^53), whose doubles are exactly the integers, IEEE addition rounds half to even
 * (the default mode, which nothing in the process changes) and 1.5·2^52 is even. The caller
 * guarantees the bound (ExactSum's integers are at most 2^42 at its default max_terms). A zero
 * comes out +0 where torch's rounding gives -0: the partial sum, which starts at +0, is the same
 * either way.
 *
 * layer_norms: the fp64 L2 norm of each fp32 tensor, summed in the order of ATen's CPU two-norm of
 * the tensor widened to fp64 (what clipping.layer_norms computes with torch): in 4 lanes, lane j
 * summing the squares of elements j, j+4, ... up to the last multiple of 4 in turn, then the lanes
 * in order, then the remaining elements one by one, then the square root. It reads the fp32
 * tensor once; torch first writes the fp64 copy. An fp32 element's square is exact in fp64, so
 * the order is the only thing that decides the bits; clipping.py uses the kernel only where it
 * gives torch's norms on probes that tell orders apart. (ATen's fp32 norms, summed in fp32, have
 * no such single order: their tails of 4 to 7 elements are summed otherwise, with fused
 * multiply-adds where the CPU has them, so the kernel does not stand in for them.)
 *
 * Both need double arithmetic evaluated in double precision (not x87's extended one) and IEEE
 * semantics: setup.py compiles with -ffp-contract=off (no fused multiply-add where the C has two
 * roundings) and -fno-fast-math, and a build with fast math anyway (CFLAGS=-Ofast) fails, so the
 * optional build falls back to torch (fast math would fold the rounding away, and link a startup
 * file that flushes subnormals to zero in the whole process). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>

#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD != 0
#error "the kernels need double arithmetic evaluated in double precision"
#endif
#if defined(__FAST_MATH__) || defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__
#error "the kernels need IEEE arithmetic: no fast math"
#endif

static const double MAGIC = 6755399441055744.0; /* 1.5·2^52 */

static inline double fp32_integer(float x, float factor, double scale) {
    return ((double)(x * factor) * scale + MAGIC) - MAGIC;
}

static inline double fp64_integer(double x, double factor, double scale) {
    double y = (x * factor) * scale;
    double r = (y + MAGIC) - MAGIC;
    return fabs(r) > fabs(y) ? r - copysign(1.0, y) : r; /* toward zero */
}

/* Up to MAX_TERMS terms of one kind in one pass: partial[i] += the sum of their integers at i,
 * exact in fp64 (ExactSum keeps every partial sum within 2^53). */
#define MAX_TERMS 4
#define F32(t) fp32_integer(x[t][i], f32[t], scale)
#define F64(t) fp64_integer(y[t][i], f64[t], scale)
#define PASS(Q)                                                                                   \
    switch (k) {                                                                                  \
    case 1: for (Py_ssize_t i = 0; i < n; i++) partial[i] += Q(0); break;                        \
    case 2: for (Py_ssize_t i = 0; i < n; i++) partial[i] += Q(0) + Q(1); break;                 \
    case 3: for (Py_ssize_t i = 0; i < n; i++) partial[i] += (Q(0) + Q(1)) + Q(2); break;        \
    default:                                                                                      \
        for (Py_ssize_t i = 0; i < n; i++) partial[i] += ((Q(0) + Q(1)) + Q(2)) + Q(3);          \
    }

/* Several terms per pass make the pass bound by arithmetic, not memory: where the compiler and
 * loader can (x86-64 Linux), the CPU's widest vectors are chosen at load time (4 terms on the AMD
 * EPYC: ~25% faster with AVX-512 than with baseline SSE2). Each element's operations are the
 * same IEEE ones at any width, and -ffp-contract=off keeps fused multiply-adds out of them. */
#if defined(__x86_64__) && defined(__linux__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define WIDEST_VECTORS __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef WIDEST_VECTORS
#define WIDEST_VECTORS
#endif

WIDEST_VECTORS
static void add_fp32(const float *const x[], const float f32[], int k, double *partial,
                     Py_ssize_t n, double scale) {
    PASS(F32)
}

WIDEST_VECTORS
static void add_fp64(const double *const y[], const double f64[], int k, double *partial,
                     Py_ssize_t n, double scale) {
    PASS(F64)
}

/* Lane j of a tensor's norm sums the squares of its elements j, j+4, ... in turn: one chain of
 * dependent additions per lane, so one tensor's pass waits on the adder's latency. Two tensors'
 * chains in one loop keep it busy (a 4.89M-element update: ~35% faster); each lane still adds
 * its own squares in its own order. */
static void add_squares(const float *x, Py_ssize_t from, Py_ssize_t to, double lane[4]) {
    for (Py_ssize_t i = from; i < to; i += 4)
        for (int j = 0; j < 4; j++) lane[j] += (double)x[i + j] * (double)x[i + j];
}

static void add_squares_of_two(const float *x, const float *y, Py_ssize_t to, double lx[4],
                               double ly[4]) {
    double x0 = 0.0, x1 = 0.0, x2 = 0.0, x3 = 0.0, y0 = 0.0, y1 = 0.0, y2 = 0.0, y3 = 0.0;
    for (Py_ssize_t i = 0; i < to; i += 4) {
        x0 += (double)x[i] * (double)x[i];
        x1 += (double)x[i + 1] * (double)x[i + 1];
        x2 += (double)x[i + 2] * (double)x[i + 2];
        x3 += (double)x[i + 3] * (double)x[i + 3];
        y0 += (double)y[i] * (double)y[i];
        y1 += (double)y[i + 1] * (double)y[i + 1];
        y2 += (double)y[i + 2] * (double)y[i + 2];
        y3 += (double)y[i + 3] * (double)y[i + 3];
    }
    lx[0] = x0, lx[1] = x1, lx[2] = x2, lx[3] = x3;
    ly[0] = y0, ly[1] = y1, ly[2] = y2, ly[3] = y3;
}

/* The norm of x's n elements, its lanes summed up to element `from` already. */
static double finish_norm(const float *x, Py_ssize_t n, Py_ssize_t from, double lane[4]) {
    if (n == 1) return fabs((double)x[0]); /* ATen's |x| of one element: a NaN's sign cleared */
    Py_ssize_t i = n - n % 4;
    add_squares(x, from, i, lane);
    double total = ((lane[0] + lane[1]) + lane[2]) + lane[3];
    for (; i < n; i++) total += (double)x[i] * (double)x[i];
    return sqrt(total);
}

/* norms[i] = the norm of tensors[i], two tensors of similar sizes at a time. */
static void norms_in_pairs(const float **tensors, Py_ssize_t *numels, Py_ssize_t *order,
                           Py_ssize_t count, double *norms) {
    for (Py_ssize_t k = 1; k < count; k++) /* larger first (insertion: a model's few tensors) */
        for (Py_ssize_t m = k; m > 0 && numels[order[m]] > numels[order[m - 1]]; m--) {
            Py_ssize_t swap = order[m];
            order[m] = order[m - 1], order[m - 1] = swap;
        }
    for (Py_ssize_t k = 0; k < count; k += 2) {
        Py_ssize_t a = order[k];
        double la[4] = {0.0, 0.0, 0.0, 0.0}, lb[4] = {0.0, 0.0, 0.0, 0.0};
        if (k + 1 == count) {
            norms[a] = finish_norm(tensors[a], numels[a], 0, la);
            continue;
        }
        Py_ssize_t b = order[k + 1], shared = numels[b] - numels[b] % 4; /* numels[b] <= [a] */
        add_squares_of_two(tensors[a], tensors[b], shared, la, lb);
        norms[a] = finish_norm(tensors[a], numels[a], shared, la);
        norms[b] = finish_norm(tensors[b], numels[b], shared, lb);
    }
}

/* add_quantized(term_address, kind, partial_address, n, scale, factor[, term_address, factor]...):
 * kind 'f' (fp32) or 'd' (fp64); the addresses are of n contiguous elements (torch's data_ptr);
 * up to MAX_TERMS terms of that kind, each with its factor, are added in the same pass. */
static PyObject *add_quantized(PyObject *self, PyObject *args) {
    unsigned long long terms[MAX_TERMS] = {0}, partial;
    double factors[MAX_TERMS] = {1.0, 1.0, 1.0, 1.0};
    int kind;
    Py_ssize_t n;
    double scale;
    if (!PyArg_ParseTuple(args, "KCKndd|KdKdKd", &terms[0], &kind, &partial, &n, &scale,
                          &factors[0], &terms[1], &factors[1], &terms[2], &factors[2], &terms[3],
                          &factors[3]))
        return NULL;
    if (n < 0 || (kind != 'f' && kind != 'd') || PyTuple_GET_SIZE(args) % 2) {
        PyErr_SetString(PyExc_ValueError,
                        "need n >= 0, kind 'f' (fp32) or 'd' (fp64) and a factor for each term");
        return NULL;
    }
    int k = 1 + (int)(PyTuple_GET_SIZE(args) - 6) / 2;
    const float *x[MAX_TERMS];
    const double *y[MAX_TERMS];
    float f32[MAX_TERMS];
    for (int t = 0; t < k; t++) {
        x[t] = (const float *)(uintptr_t)terms[t];
        y[t] = (const double *)(uintptr_t)terms[t];
        f32[t] = (float)factors[t];
    }
    Py_BEGIN_ALLOW_THREADS
    if (kind == 'f')
        add_fp32(x, f32, k, (double *)(uintptr_t)partial, n, scale);
    else
        add_fp64(y, factors, k, (double *)(uintptr_t)partial, n, scale);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* layer_norms(addresses, sizes, out_address): out[i] = the fp64 norm of the contiguous fp32
 * tensor of sizes[i] elements at addresses[i] (two sequences of ints), into an fp64 array. */
static PyObject *layer_norms(PyObject *self, PyObject *args) {
    PyObject *addresses, *sizes;
    unsigned long long out;
    if (!PyArg_ParseTuple(args, "OOK", &addresses, &sizes, &out)) return NULL;
    Py_ssize_t count = PySequence_Size(addresses);
    if (count < 0) return NULL;
    if (PySequence_Size(sizes) != count) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "need as many sizes as addresses");
        return NULL;
    }
    if (count == 0) Py_RETURN_NONE;
    const float **tensors = PyMem_Malloc(count * sizeof *tensors);
    Py_ssize_t *numels = PyMem_Malloc(count * sizeof *numels);
    Py_ssize_t *order = PyMem_Malloc(count * sizeof *order);
    if (tensors == NULL || numels == NULL || order == NULL) {
        PyMem_Free(tensors);
        PyMem_Free(numels);
        PyMem_Free(order);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < count && !PyErr_Occurred(); i++) {
        PyObject *address = PySequence_GetItem(addresses, i), *size = PySequence_GetItem(sizes, i);
        if (address != NULL && size != NULL) {
            tensors[i] = (const float *)(uintptr_t)PyLong_AsUnsignedLongLong(address);
            numels[i] = PyLong_AsSsize_t(size);
            order[i] = i;
            if (!PyErr_Occurred() && numels[i] < 0)
                PyErr_SetString(PyExc_ValueError, "need sizes >= 0");
        }
        Py_XDECREF(address);
        Py_XDECREF(size);
    }
    if (!PyErr_Occurred()) {
        double *norms = (double *)(uintptr_t)out;
        Py_BEGIN_ALLOW_THREADS
        norms_in_pairs(tensors, numels, order, count, norms);
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(tensors);
    PyMem_Free(numels);
    PyMem_Free(order);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"add_quantized", add_quantized, METH_VARARGS,
     "partial[i] += q(term[i] * factor * scale), in one pass (see the source)"},
    {"layer_norms", layer_norms, METH_VARARGS,
     "fp64 L2 norm of each fp32 tensor, in ATen's order (see the source)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
