/*
 * Native fast path of the FPM ingest (stepscale_operator.fpm_native wraps it).
 *
 * Two jobs, both per batch so Python pays its call overhead once per batch,
 * not once per message or per frame:
 *
 *  drain(socket, max_messages, max_bytes, max_payload)  receives whole multipart
 *      messages from a pyzmq socket (its `underlying` address) with ZMQ_DONTWAIT,
 *      checks every frame boundary (exactly three frames, an 8-byte sequence
 *      frame) and packs the sequences and payloads into two byte strings. A
 *      payload over max_payload is rejected before it is copied (only its size
 *      is kept), and a drain stops once it holds max_bytes of payloads, so one
 *      call's memory is bounded whatever the peers send. The GIL is released
 *      while receiving.
 *
 *  decode_columns(payloads, ends, out, schema)  reads msgpack FPM payloads
 *      straight into a float64 row per message, plus the stream key
 *      (worker_id, dp_rank). It understands only the plain form of the wire
 *      format (a map of known keys with values of the declared msgpack types,
 *      unknown keys skipped); anything else marks the row "doubtful" and the
 *      Python caller sends it through the wire module, which decides. So this
 *      code can only make ingest faster, never accept what the wire module
 *      would reject: it produces the same numbers msgspec would, and the
 *      caller's vectorised value checks are the ones the Python path uses.
 *
 * libzmq is not linked: bind_libzmq(path) takes the path of pyzmq's own
 * compiled backend module, which is loaded already (RTLD_NOLOAD), and looks the
 * zmq_msg_* functions up through it (dlsym on a handle searches the object and
 * its dependencies): the same libzmq that made the socket, however many others
 * the process holds, and no build-time dependency on its headers. The few
 * declarations below are from zmq.h (ABI stable since libzmq 3.2).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------------ libzmq */

typedef struct {
    unsigned char _[64] __attribute__((aligned(sizeof(void *))));
} zmq_msg_t;

#define STEPSCALE_ZMQ_DONTWAIT 1

static int (*p_msg_init)(zmq_msg_t *);
static int (*p_msg_recv)(zmq_msg_t *, void *, int);
static void *(*p_msg_data)(zmq_msg_t *);
static size_t (*p_msg_size)(const zmq_msg_t *);
static int (*p_msg_more)(const zmq_msg_t *);
static int (*p_msg_close)(zmq_msg_t *);
static int (*p_errno)(void);

static PyObject *bind_libzmq(PyObject *self, PyObject *arg) {
    (void)self;
    const char *path = PyUnicode_AsUTF8(arg);
    if (path == NULL) return NULL;
    /* RTLD_NOLOAD: only what pyzmq already loaded, never a second copy. */
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL) {
        PyErr_Format(PyExc_OSError, "pyzmq's backend is not loaded from %s: %s", path, dlerror());
        return NULL;
    }
    p_msg_init = (int (*)(zmq_msg_t *))dlsym(lib, "zmq_msg_init");
    p_msg_recv = (int (*)(zmq_msg_t *, void *, int))dlsym(lib, "zmq_msg_recv");
    p_msg_data = (void *(*)(zmq_msg_t *))dlsym(lib, "zmq_msg_data");
    p_msg_size = (size_t (*)(const zmq_msg_t *))dlsym(lib, "zmq_msg_size");
    p_msg_more = (int (*)(const zmq_msg_t *))dlsym(lib, "zmq_msg_more");
    p_msg_close = (int (*)(zmq_msg_t *))dlsym(lib, "zmq_msg_close");
    p_errno = (int (*)(void))dlsym(lib, "zmq_errno");
    if (!p_msg_init || !p_msg_recv || !p_msg_data || !p_msg_size || !p_msg_more ||
        !p_msg_close || !p_errno) {
        p_msg_recv = NULL;
        PyErr_Format(PyExc_OSError, "no zmq_msg_* functions found through %s", path);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ drain */

typedef struct {
    char *data;
    size_t len, cap;
} buffer_t;

static int buf_put(buffer_t *b, const void *src, size_t n) {
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n) cap *= 2;
        char *grown = PyMem_RawRealloc(b->data, cap);
        if (grown == NULL) return -1;
        b->data = grown;
        b->cap = cap;
    }
    memcpy(b->data + b->len, src, n);
    b->len += n;
    return 0;
}

/* Reject codes, mirrored in fpm_native.py. */
enum { REJECT_FRAME_COUNT = 1, REJECT_SEQUENCE_LENGTH = 2, REJECT_PAYLOAD_TOO_LARGE = 3 };

typedef struct {
    int code;
    uint32_t sequence_length; /* REJECT_PAYLOAD_TOO_LARGE: the payload size (saturated) */
    size_t offset, length; /* the payload, in the rejects buffer */
} reject_t;

/* Receive one frame; 1 = got it, 0 = would block or interrupted, -1 = other error. */
static int recv_frame(void *socket, zmq_msg_t *msg, int *error) {
    if (p_msg_recv(msg, socket, STEPSCALE_ZMQ_DONTWAIT) >= 0) return 1;
    *error = p_errno();
    return (*error == EAGAIN || *error == EINTR) ? 0 : -1;
}

static PyObject *drain(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *address;
    Py_ssize_t max_messages, max_bytes, max_payload;
    if (!PyArg_ParseTuple(args, "Onnn", &address, &max_messages, &max_bytes, &max_payload))
        return NULL;
    if (max_bytes < 1 || max_payload < 0) {
        PyErr_SetString(PyExc_ValueError, "max_bytes must be >= 1 and max_payload >= 0");
        return NULL;
    }
    if (p_msg_recv == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "bind_libzmq was not called");
        return NULL;
    }
    void *socket = PyLong_AsVoidPtr(address);
    if (socket == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "null socket");
        return NULL;
    }
    buffer_t seqs = {0}, payloads = {0}, ends = {0}, rejected = {0}, reject_list = {0};
    Py_ssize_t received = 0, accepted = 0;
    int error = 0, failed = 0, oom = 0;
    zmq_msg_t frames[3];

    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < 3; i++) p_msg_init(&frames[i]);
    while (received < max_messages) {
        int got = recv_frame(socket, &frames[0], &error);
        if (got <= 0) {
            failed = got < 0;
            break;
        }
        received++;
        reject_t rej = {0, 0, 0, 0};
        int n = 1;
        /* Zero-copy messages carry their own "more" flag: every boundary is checked. */
        while (n < 3 && p_msg_more(&frames[n - 1])) {
            got = recv_frame(socket, &frames[n], &error);
            if (got <= 0) break; /* cannot happen: ZMQ delivers messages whole */
            n++;
        }
        if (n < 3) {
            rej.code = REJECT_FRAME_COUNT;
        } else if (p_msg_more(&frames[2])) {
            zmq_msg_t rest;
            p_msg_init(&rest);
            int more = 1;
            while (more && recv_frame(socket, &rest, &error) > 0) more = p_msg_more(&rest);
            p_msg_close(&rest);
            rej.code = REJECT_FRAME_COUNT;
        } else if (p_msg_size(&frames[2]) > (size_t)max_payload) {
            /* Never copied: only its size is reported. */
            size_t size = p_msg_size(&frames[2]);
            rej.code = REJECT_PAYLOAD_TOO_LARGE;
            rej.sequence_length = size > 0xffffffffu ? 0xffffffffu : (uint32_t)size;
        } else if (p_msg_size(&frames[1]) != 8) {
            rej.code = REJECT_SEQUENCE_LENGTH;
            rej.sequence_length = (uint32_t)p_msg_size(&frames[1]);
            rej.offset = rejected.len;
            rej.length = p_msg_size(&frames[2]);
            oom |= buf_put(&rejected, p_msg_data(&frames[2]), rej.length);
        } else {
            uint32_t end;
            size_t size = p_msg_size(&frames[2]);
            oom |= buf_put(&seqs, p_msg_data(&frames[1]), 8);
            oom |= buf_put(&payloads, p_msg_data(&frames[2]), size);
            end = (uint32_t)payloads.len;
            oom |= buf_put(&ends, &end, sizeof end);
            accepted++;
        }
        if (rej.code) oom |= buf_put(&reject_list, &rej, sizeof rej);
        if (oom || payloads.len >= (size_t)max_bytes || payloads.len > 0x7fffffffu) break;
    }
    for (int i = 0; i < 3; i++) p_msg_close(&frames[i]);
    Py_END_ALLOW_THREADS

    PyObject *result = NULL;
    if (oom) {
        PyErr_NoMemory();
    } else if (failed && received == 0) {
        PyErr_Format(PyExc_OSError, "zmq_msg_recv failed: errno %d", error);
    } else {
        PyObject *rejects = PyList_New(0);
        size_t n_rej = reject_list.len / sizeof(reject_t);
        for (size_t i = 0; rejects != NULL && i < n_rej; i++) {
            reject_t *r = (reject_t *)reject_list.data + i;
            PyObject *item = Py_BuildValue(
                "(iIy#)", r->code, r->sequence_length,
                r->code == REJECT_SEQUENCE_LENGTH ? rejected.data + r->offset : "",
                (Py_ssize_t)(r->code == REJECT_SEQUENCE_LENGTH ? r->length : 0));
            if (item == NULL || PyList_Append(rejects, item) < 0) Py_CLEAR(rejects);
            Py_XDECREF(item);
        }
        if (rejects != NULL) {
            result = Py_BuildValue("(ny#y#y#N)", received, seqs.data ? seqs.data : "",
                                   (Py_ssize_t)seqs.len, payloads.data ? payloads.data : "",
                                   (Py_ssize_t)payloads.len, ends.data ? ends.data : "",
                                   (Py_ssize_t)ends.len, rejects);
        }
    }
    PyMem_RawFree(seqs.data);
    PyMem_RawFree(payloads.data);
    PyMem_RawFree(ends.data);
    PyMem_RawFree(rejected.data);
    PyMem_RawFree(reject_list.data);
    (void)accepted;
    return result;
}

/* ------------------------------------------------------------------ msgpack */

typedef struct {
    const uint8_t *p, *end;
} reader_t;

static inline int take(reader_t *r, size_t n, const uint8_t **out) {
    if ((size_t)(r->end - r->p) < n) return -1;
    *out = r->p;
    r->p += n;
    return 0;
}

static inline uint64_t be(const uint8_t *s, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | s[i];
    return v;
}

/* A map header; -1 if the next value is not a map. */
static int64_t read_map(reader_t *r) {
    const uint8_t *s;
    if (take(r, 1, &s)) return -1;
    uint8_t t = s[0];
    if ((t & 0xf0) == 0x80) return t & 0x0f;
    if (t == 0xde && !take(r, 2, &s)) return (int64_t)be(s, 2);
    if (t == 0xdf && !take(r, 4, &s)) return (int64_t)be(s, 4);
    return -1;
}

/* A str; returns 0 and sets the bytes and length, or -1. */
static int read_str(reader_t *r, const uint8_t **s, size_t *n) {
    const uint8_t *h;
    if (take(r, 1, &h)) return -1;
    uint8_t t = h[0];
    if ((t & 0xe0) == 0xa0) {
        *n = t & 0x1f;
    } else if (t == 0xd9 && !take(r, 1, &h)) {
        *n = h[0];
    } else if (t == 0xda && !take(r, 2, &h)) {
        *n = (size_t)be(h, 2);
    } else if (t == 0xdb && !take(r, 4, &h)) {
        *n = (size_t)be(h, 4);
    } else {
        return -1;
    }
    return take(r, *n, s);
}

enum { NUM_INT = 1, NUM_FLOAT = 2 };

/* An int or float as a double; returns NUM_INT/NUM_FLOAT, or -1. Ints also in *iv
 * (uint64 beyond int64 is reported as a float-only value: no int field takes it). */
static int read_number(reader_t *r, double *v, int64_t *iv, int *int_exact) {
    const uint8_t *s;
    if (take(r, 1, &s)) return -1;
    uint8_t t = s[0];
    *int_exact = 1;
    if (t <= 0x7f) {
        *iv = t;
    } else if (t >= 0xe0) {
        *iv = (int8_t)t;
    } else {
        switch (t) {
        case 0xcc: if (take(r, 1, &s)) return -1; *iv = (int64_t)be(s, 1); break;
        case 0xcd: if (take(r, 2, &s)) return -1; *iv = (int64_t)be(s, 2); break;
        case 0xce: if (take(r, 4, &s)) return -1; *iv = (int64_t)be(s, 4); break;
        case 0xcf: {
            if (take(r, 8, &s)) return -1;
            uint64_t u = be(s, 8);
            *v = (double)u;
            *iv = 0;
            *int_exact = u <= (uint64_t)INT64_MAX;
            if (*int_exact) *iv = (int64_t)u;
            return NUM_INT;
        }
        case 0xd0: if (take(r, 1, &s)) return -1; *iv = (int8_t)be(s, 1); break;
        case 0xd1: if (take(r, 2, &s)) return -1; *iv = (int16_t)be(s, 2); break;
        case 0xd2: if (take(r, 4, &s)) return -1; *iv = (int32_t)be(s, 4); break;
        case 0xd3: if (take(r, 8, &s)) return -1; *iv = (int64_t)be(s, 8); break;
        case 0xca: {
            if (take(r, 4, &s)) return -1;
            uint32_t bits = (uint32_t)be(s, 4);
            float f;
            memcpy(&f, &bits, 4);
            *v = f;
            return NUM_FLOAT;
        }
        case 0xcb: {
            if (take(r, 8, &s)) return -1;
            uint64_t bits = be(s, 8);
            memcpy(v, &bits, 8);
            return NUM_FLOAT;
        }
        default: return -1;
        }
    }
    *v = (double)*iv;
    return NUM_INT;
}

/* Skip any plain msgpack value (what msgspec ignores under an unknown key). Ext
 * types and deep nesting are left to the wire module (-1). */
static int skip_value(reader_t *r, int depth) {
    const uint8_t *s;
    if (depth > 32 || take(r, 1, &s)) return -1;
    uint8_t t = s[0];
    size_t n;
    if (t <= 0x7f || t >= 0xe0 || t == 0xc0 || t == 0xc2 || t == 0xc3) return 0;
    if ((t & 0xe0) == 0xa0) return take(r, t & 0x1f, &s);
    if ((t & 0xf0) == 0x90 || (t & 0xf0) == 0x80) {
        n = (size_t)(t & 0x0f) * ((t & 0xf0) == 0x80 ? 2 : 1);
        for (size_t i = 0; i < n; i++)
            if (skip_value(r, depth + 1)) return -1;
        return 0;
    }
    switch (t) {
    case 0xcc: case 0xd0: return take(r, 1, &s);
    case 0xcd: case 0xd1: return take(r, 2, &s);
    case 0xce: case 0xd2: case 0xca: return take(r, 4, &s);
    case 0xcf: case 0xd3: case 0xcb: return take(r, 8, &s);
    case 0xd9: case 0xc4: if (take(r, 1, &s)) return -1; return take(r, (size_t)be(s, 1), &s);
    case 0xda: case 0xc5: if (take(r, 2, &s)) return -1; return take(r, (size_t)be(s, 2), &s);
    case 0xdb: case 0xc6: if (take(r, 4, &s)) return -1; return take(r, (size_t)be(s, 4), &s);
    case 0xdc: case 0xdd: case 0xde: case 0xdf: {
        int w = (t == 0xdc || t == 0xde) ? 2 : 4;
        if (take(r, (size_t)w, &s)) return -1;
        n = (size_t)be(s, w) * ((t == 0xde || t == 0xdf) ? 2 : 1);
        if (n > (size_t)(r->end - r->p)) return -1; /* each value takes a byte at least */
        for (size_t i = 0; i < n; i++)
            if (skip_value(r, depth + 1)) return -1;
        return 0;
    }
    default: return -1;
    }
}

/* ------------------------------------------------------------------ schema */

/* Field kinds, mirrored in fpm_native.py. */
enum { KIND_INT = 1, KIND_FLOAT = 2, KIND_KEY_STR = 3, KIND_OPT_STR = 4, KIND_MAP = 5 };

#define MAX_FIELDS 16
#define MAX_MAPS 4

typedef struct {
    char name[32];
    size_t name_len;
    int kind;
    int column; /* KIND_INT/FLOAT: output column; KIND_MAP: the nested map's index */
    int key_int; /* 1 for the int that is the second part of the stream key */
} field_t;

typedef struct {
    int n;
    field_t fields[MAX_FIELDS];
} map_schema_t;

#define MAX_COLUMNS 64

typedef struct {
    int n_maps, n_columns;
    double defaults[MAX_COLUMNS]; /* a missing key reads as its default, as in msgspec */
    map_schema_t maps[MAX_MAPS];  /* 0 is the top level */
} schema_t;

static int parse_schema(PyObject *obj, schema_t *schema) {
    /* obj: (defaults, [[(name, kind, column, key_int), ...] per map]); map 0 is the top */
    PyObject *defaults, *maps;
    memset(schema, 0, sizeof *schema);
    if (!PyArg_ParseTuple(obj, "O!O!", &PyTuple_Type, &defaults, &PyList_Type, &maps)) return -1;
    Py_ssize_t n_columns = PyTuple_GET_SIZE(defaults);
    if (n_columns < 1 || n_columns > MAX_COLUMNS) goto bad;
    schema->n_columns = (int)n_columns;
    for (Py_ssize_t c = 0; c < n_columns; c++) {
        schema->defaults[c] = PyFloat_AsDouble(PyTuple_GET_ITEM(defaults, c));
        if (PyErr_Occurred()) return -1;
    }
    Py_ssize_t n_maps = PyList_GET_SIZE(maps);
    if (n_maps < 1 || n_maps > MAX_MAPS) goto bad;
    schema->n_maps = (int)n_maps;
    for (Py_ssize_t m = 0; m < n_maps; m++) {
        PyObject *fields = PyList_GET_ITEM(maps, m);
        if (!PyList_Check(fields) || PyList_GET_SIZE(fields) > MAX_FIELDS) goto bad;
        map_schema_t *ms = &schema->maps[m];
        ms->n = (int)PyList_GET_SIZE(fields);
        for (int i = 0; i < ms->n; i++) {
            field_t *f = &ms->fields[i];
            const char *name;
            Py_ssize_t len;
            if (!PyArg_ParseTuple(PyList_GET_ITEM(fields, i), "s#iii", &name, &len, &f->kind,
                                  &f->column, &f->key_int))
                return -1;
            if (len >= (Py_ssize_t)sizeof f->name) goto bad;
            memcpy(f->name, name, (size_t)len);
            f->name_len = (size_t)len;
            if ((f->kind == KIND_INT || f->kind == KIND_FLOAT) &&
                (f->column < 0 || f->column >= schema->n_columns))
                goto bad;
            if (f->kind == KIND_MAP && (f->column <= 0 || f->column >= n_maps)) goto bad;
        }
    }
    return 0;
bad:
    PyErr_SetString(PyExc_ValueError, "bad FPM column schema");
    return -1;
}

typedef struct {
    const uint8_t *worker;
    size_t worker_len;
    int64_t rank;
} key_parts_t;

/* Parse one map of the schema into row; 0 = plain and understood, -1 = doubtful. */
static int parse_map(reader_t *r, const schema_t *schema, int m, double *row, key_parts_t *key,
                     int depth) {
    const map_schema_t *ms = &schema->maps[m];
    int64_t n = read_map(r);
    if (n < 0) return -1;
    uint32_t seen = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *name;
        size_t name_len;
        if (read_str(r, &name, &name_len)) return -1;
        int j = 0;
        while (j < ms->n && !(ms->fields[j].name_len == name_len &&
                              memcmp(ms->fields[j].name, name, name_len) == 0))
            j++;
        if (j == ms->n) {
            if (skip_value(r, depth + 1)) return -1;
            continue;
        }
        if (seen & (1u << j)) return -1; /* a repeated key: let msgspec decide */
        seen |= 1u << j;
        const field_t *f = &ms->fields[j];
        double v;
        int64_t iv;
        int exact;
        int kind;
        switch (f->kind) {
        case KIND_INT:
            if (read_number(r, &v, &iv, &exact) != NUM_INT) return -1;
            row[f->column] = v;
            if (f->key_int) {
                if (!exact) return -1;
                key->rank = iv;
            }
            break;
        case KIND_FLOAT:
            kind = read_number(r, &v, &iv, &exact);
            if (kind < 0) return -1;
            row[f->column] = v;
            break;
        case KIND_KEY_STR:
            if (read_str(r, &key->worker, &key->worker_len)) return -1;
            break;
        case KIND_OPT_STR: {
            const uint8_t *s;
            size_t len;
            if (r->p < r->end && *r->p == 0xc0) {
                r->p++; /* nil: read as unset, as the wire module does */
            } else if (read_str(r, &s, &len)) {
                return -1;
            } else {
                /* Only validated (msgspec would reject bad UTF-8); the scope is no column. */
                PyObject *scope = PyUnicode_DecodeUTF8((const char *)s, (Py_ssize_t)len, NULL);
                if (scope == NULL) {
                    PyErr_Clear();
                    return -1;
                }
                Py_DECREF(scope);
            }
            break;
        }
        case KIND_MAP:
            if (parse_map(r, schema, f->column, row, key, depth + 1)) return -1;
            break;
        default:
            return -1;
        }
    }
    return 0;
}

static PyObject *decode_columns(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer payloads, ends, out;
    PyObject *schema_obj;
    Py_ssize_t max_payload;
    if (!PyArg_ParseTuple(args, "y*y*w*On", &payloads, &ends, &out, &schema_obj, &max_payload))
        return NULL;
    PyObject *keys = NULL, *doubtful = NULL, *result = NULL;
    schema_t schema;
    if (parse_schema(schema_obj, &schema) < 0) goto done;
    Py_ssize_t n = ends.len / (Py_ssize_t)sizeof(uint32_t);
    if (out.len < n * schema.n_columns * (Py_ssize_t)sizeof(double)) {
        PyErr_SetString(PyExc_ValueError, "output buffer too small");
        goto done;
    }
    keys = PyList_New(n);
    doubtful = PyBytes_FromStringAndSize(NULL, n);
    if (keys == NULL || doubtful == NULL) goto done;
    char *flags = PyBytes_AS_STRING(doubtful);
    const uint32_t *end_at = (const uint32_t *)ends.buf;
    const uint8_t *base = (const uint8_t *)payloads.buf;
    double *rows = (double *)out.buf;
    size_t start = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        size_t stop = end_at[i];
        double *row = rows + i * schema.n_columns;
        memcpy(row, schema.defaults, (size_t)schema.n_columns * sizeof(double));
        key_parts_t key = {(const uint8_t *)"", 0, 0};
        int bad = stop < start || stop > (size_t)payloads.len ||
                  (Py_ssize_t)(stop - start) > max_payload;
        if (!bad) {
            reader_t r = {base + start, base + stop};
            bad = parse_map(&r, &schema, 0, row, &key, 0) || r.p != r.end;
        }
        PyObject *item = NULL;
        if (!bad) {
            PyObject *worker =
                PyUnicode_DecodeUTF8((const char *)key.worker, (Py_ssize_t)key.worker_len, NULL);
            if (worker == NULL) {
                PyErr_Clear();
                bad = 1;
            } else {
                PyObject *rank = PyLong_FromLongLong(key.rank);
                item = rank ? PyTuple_Pack(2, worker, rank) : NULL;
                Py_DECREF(worker);
                Py_XDECREF(rank);
                if (item == NULL) goto done;
            }
        }
        flags[i] = (char)bad;
        if (item == NULL) item = Py_NewRef(Py_None);
        PyList_SET_ITEM(keys, i, item);
        start = stop;
    }
    result = PyTuple_Pack(2, keys, doubtful);
done:
    Py_XDECREF(keys);
    Py_XDECREF(doubtful);
    PyBuffer_Release(&payloads);
    PyBuffer_Release(&ends);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"bind_libzmq", bind_libzmq, METH_O, "Resolve zmq_msg_* through pyzmq's backend module."},
    {"drain", drain, METH_VARARGS,
     "drain(socket_address, max_messages, max_bytes, max_payload) -> batch tuple"},
    {"decode_columns", decode_columns, METH_VARARGS,
     "decode_columns(payloads, ends, out, schema, max_payload) -> (keys, doubtful)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fpm_native", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fpm_native(void) { return PyModule_Create(&module); }
