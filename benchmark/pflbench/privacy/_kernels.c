/* Two one-pass CPU kernels for the per-user privacy path, each giving exactly the numbers of the
 * torch code it stands in for (privacy/aggregate.py, privacy/clipping.py). Built by setup.py where
 * a C compiler is found; without it pflbench runs that torch code. The passes are bound by memory,
 * so they run on one thread.
 *
 * add_quantized: ExactSum's partial[i] += q((x[i]·factor)·scale), for an fp32 term rounded half to
 * even or an fp64 term rounded toward zero: the integers of torch's passes (multiply by clipping's
 * factor in the term's dtype, widen, scale, round, add), in one read of the term and one read and
 * write of the fp64 partial sum. An fp32 term's factor is rounded to fp32 first, as torch rounds
 * an fp32 factor tensor; times 1 the term is as it is. Two terms can share the pass: the partial
 * sum is read and written once for both, 40% less memory traffic per term. Rounding uses no libm call
 * (nearbyint and trunc are calls on baseline x86-64, ~5x the pass): for |y| <= 2^51,
 * (y + 1.5·2^52) - 1.5·2^52 is y rounded to an integer half to even, since the sum lies in
 * [2^52, 2^53), whose doubles are exactly the integers, IEEE addition rounds half to even (the
 * default mode, which nothing in the process changes) and 1.5·2^52 is even. The caller guarantees
 * the bound (ExactSum's integers are at most 2^42 at its default max_terms). A zero comes out +0
 * where torch's rounding gives -0: the partial sum, which starts at +0, is the same either way.
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

/* The integers of x (and of y, where y is not NULL: two terms in one pass over the partial sum,
 * their integers' sum exact in fp64) added to partial. */
static void add_fp32(const float *x, float fx, const float *y, float fy, double *partial,
                     Py_ssize_t n, double scale) {
    if (y == NULL)
        for (Py_ssize_t i = 0; i < n; i++) partial[i] += fp32_integer(x[i], fx, scale);
    else
        for (Py_ssize_t i = 0; i < n; i++)
            partial[i] += fp32_integer(x[i], fx, scale) + fp32_integer(y[i], fy, scale);
}

static void add_fp64(const double *x, double fx, const double *y, double fy, double *partial,
                     Py_ssize_t n, double scale) {
    if (y == NULL)
        for (Py_ssize_t i = 0; i < n; i++) partial[i] += fp64_integer(x[i], fx, scale);
    else
        for (Py_ssize_t i = 0; i < n; i++)
            partial[i] += fp64_integer(x[i], fx, scale) + fp64_integer(y[i], fy, scale);
}

static double norm_in_fp64(const float *x, Py_ssize_t n) {
    if (n == 1) return fabs((double)x[0]); /* ATen's |x| of one element: a NaN's sign cleared */
    double lane[4] = {0.0, 0.0, 0.0, 0.0};
    Py_ssize_t i = 0, body = n - n % 4;
    for (; i < body; i += 4)
        for (int j = 0; j < 4; j++) lane[j] += (double)x[i + j] * (double)x[i + j];
    double total = ((lane[0] + lane[1]) + lane[2]) + lane[3];
    for (; i < n; i++) total += (double)x[i] * (double)x[i];
    return sqrt(total);
}

/* add_quantized(term_address, kind, partial_address, n, scale, factor[, second_address,
 * second_factor]): kind 'f' (fp32) or 'd' (fp64); the addresses are of n contiguous elements
 * (torch's data_ptr); a second term of the same kind is added in the same pass. */
static PyObject *add_quantized(PyObject *self, PyObject *args) {
    unsigned long long term, partial, second = 0;
    int kind;
    Py_ssize_t n;
    double scale, factor, second_factor = 1.0;
    if (!PyArg_ParseTuple(args, "KCKndd|Kd", &term, &kind, &partial, &n, &scale, &factor, &second,
                          &second_factor))
        return NULL;
    if (n < 0 || (kind != 'f' && kind != 'd')) {
        PyErr_SetString(PyExc_ValueError, "need n >= 0 and kind 'f' (fp32) or 'd' (fp64)");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (kind == 'f')
        add_fp32((const float *)(uintptr_t)term, (float)factor, (const float *)(uintptr_t)second,
                 (float)second_factor, (double *)(uintptr_t)partial, n, scale);
    else
        add_fp64((const double *)(uintptr_t)term, factor, (const double *)(uintptr_t)second,
                 second_factor, (double *)(uintptr_t)partial, n, scale);
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
    if (tensors == NULL || numels == NULL) {
        PyMem_Free(tensors);
        PyMem_Free(numels);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < count && !PyErr_Occurred(); i++) {
        PyObject *address = PySequence_GetItem(addresses, i), *size = PySequence_GetItem(sizes, i);
        if (address != NULL && size != NULL) {
            tensors[i] = (const float *)(uintptr_t)PyLong_AsUnsignedLongLong(address);
            numels[i] = PyLong_AsSsize_t(size);
            if (!PyErr_Occurred() && numels[i] < 0)
                PyErr_SetString(PyExc_ValueError, "need sizes >= 0");
        }
        Py_XDECREF(address);
        Py_XDECREF(size);
    }
    if (!PyErr_Occurred()) {
        double *norms = (double *)(uintptr_t)out;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < count; i++) norms[i] = norm_in_fp64(tensors[i], numels[i]);
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(tensors);
    PyMem_Free(numels);
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
