# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The C-loop floor of the benchmarks: SFQ's steady-state pair entirely in C.

The same dispatch / enqueue-back sequence as ``bench_core.py``'s steady group, on the same
data, with no Python object touched per pair: one Python call runs a whole array of pairs. It
is the hardware floor that the compiled core (which pays for Python calls, payload references,
result objects, tickets for cancel and input checks) is measured against.

Same decisions as ``sfq.Scheduler``: meters are int64 sub-units (2**20 per cost unit), a
charge is ceil(cost * 2**20 / weight) (computed as cost * (2**20 / weight), equal for the
power-of-two weights of the benchmark), ties between equal meters go to the flow whose head
request was enqueued first, a flow that joins starts at max(S, v), and v moves to the largest
finish tag when no flow waits. ``bench_core.py`` checks the dispatched flows and start tags
against the core, event for event.

Layout (what a C programmer would do for this workload):

* a packed 4-ary min-heap of 16-byte entries (meter, 32-bit head ticket, slot), laid out so
  that every family of four children fills one 64-byte cache line;
* one 64-byte record per flow holding its meter, its charge multiplier and an inline ring of
  up to ``CAP = 4`` waiting requests (32-bit ticket, float cost): a dispatch touches the heap
  and one flow line, and the enqueue back hits the same line.

Limits, checked: at most 4 waiting requests per flow, costs in [1, 2**24] (stored as float32:
exact for the benchmark's integer costs), fewer than 2**32 tickets and meters below 2**62 (no renormalisation). No payloads,
no cancel, no flow ids other than 0..T-1: this is a floor, not a scheduler.
"""

from libc.stdint cimport int32_t, int64_t, uint32_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset

DEF CAP = 4                    # inline ring entries per flow
cdef double SCALE = 1048576.0  # sub-units per cost unit, as the core
cdef int64_t S_LIMIT = (<int64_t>1) << 62


ctypedef struct Entry:         # 16 bytes: four children to a cache line
    int64_t S                  # the flow's meter, sub-units
    uint32_t ticket            # ticket of the flow's head request
    int32_t slot               # the flow


ctypedef struct Req:           # 8 bytes
    uint32_t ticket
    float cost


ctypedef struct Flow:          # 64 bytes: one cache line
    int64_t S                  # meter, sub-units
    double mul                 # 2**20 / weight
    uint32_t head              # ring index of the oldest request
    uint32_t count             # waiting requests
    int64_t _pad               # (the heap needs no position index: only the root moves)
    Req ring[CAP]


cdef inline bint less(const Entry* x, const Entry* y) noexcept nogil:
    return (x.S < y.S) | ((x.S == y.S) & (x.ticket < y.ticket))


cdef inline void sift_up(Entry* a, Py_ssize_t i, Entry e) noexcept nogil:
    cdef Py_ssize_t p
    while i > 0:
        p = (i - 1) >> 2
        if not less(&e, &a[p]):
            break
        a[i] = a[p]
        i = p
    a[i] = e


cdef inline void sift_down(Entry* a, Py_ssize_t n, Py_ssize_t i, Entry e) noexcept nogil:
    cdef Py_ssize_t c, m, m1, m2, k
    while True:
        c = 4 * i + 1
        if c >= n:
            break
        if c + 3 < n:  # a full family: a two-round tournament, branch-free
            m1 = c + 1 if less(&a[c + 1], &a[c]) else c
            m2 = c + 3 if less(&a[c + 3], &a[c + 2]) else c + 2
            m = m2 if less(&a[m2], &a[m1]) else m1
        else:
            m = c
            for k in range(c + 1, n):
                if less(&a[k], &a[m]):
                    m = k
        if not less(&a[m], &e):
            break
        a[i] = a[m]
        i = m
    a[i] = e


cdef inline void sift_root(Entry* a, Py_ssize_t n, Entry e) noexcept nogil:
    """Place e at the root hole when it likely belongs near the leaves (the flow just charged):
    walk the hole down the smallest children to a leaf, then sift e up (Floyd's bottom-up
    variant, as the compiled core does: one comparison per level fewer)."""
    cdef Py_ssize_t i = 0, c, m, m1, m2, k
    while True:
        c = 4 * i + 1
        if c >= n:
            break
        if c + 3 < n:
            m1 = c + 1 if less(&a[c + 1], &a[c]) else c
            m2 = c + 3 if less(&a[c + 3], &a[c + 2]) else c + 2
            m = m2 if less(&a[m2], &a[m1]) else m1
        else:
            m = c
            for k in range(c + 1, n):
                if less(&a[k], &a[m]):
                    m = k
        a[i] = a[m]
        i = m
    sift_up(a, i, e)


cdef inline int64_t charge(float cost, double mul) noexcept nogil:
    """ceil(cost * mul) for positive values, without a call to libm's ceil"""
    cdef double x = <double>cost * mul
    cdef int64_t k = <int64_t>x
    return k + (<double>k < x)


cdef inline bint bad_cost(double c) noexcept nogil:
    return not (c >= 1.0 and c <= 16777216.0)


cdef class Floor:
    """T flows (slots 0..T-1) with ``weights[f]``; ``costs`` (length a multiple of T, at most
    4T) are enqueued round-robin, flow 0 to T-1 then again, as ``bench_core.build_backlogged``
    does. ``steady(costs)`` then runs ``len(costs)`` pairs: dispatch, and enqueue the next
    cost back on the dispatched flow."""

    cdef void* _heap_mem
    cdef void* _flow_mem
    cdef Entry* _a
    cdef Flow* _f
    cdef Py_ssize_t _n          # flows in the heap
    cdef Py_ssize_t _T
    cdef int64_t _v
    cdef int64_t _max_finish
    cdef uint32_t _next_ticket
    cdef readonly long long pairs  # pairs run so far

    def __cinit__(self, weights, const double[::1] costs):
        cdef Py_ssize_t T = len(weights), i, f
        cdef double w
        if T <= 0 or T > 2 ** 30:
            raise ValueError(f"need 1 <= T <= 2**30 flows, got {T}")
        if costs.shape[0] % T or costs.shape[0] > CAP * T:
            raise ValueError(f"need a multiple of T = {T} costs, at most {CAP * T}; got {costs.shape[0]}")
        # heap: 64-byte aligned, shifted by 3 entries so that a[4i+1 .. 4i+4] share a line
        self._heap_mem = malloc((T + 4) * sizeof(Entry) + 64)
        self._flow_mem = malloc(T * sizeof(Flow) + 64)
        if self._heap_mem == NULL or self._flow_mem == NULL:
            raise MemoryError()
        self._a = <Entry*>((<uintptr_t>self._heap_mem + 63) & ~(<uintptr_t>63)) + 3
        self._f = <Flow*>((<uintptr_t>self._flow_mem + 63) & ~(<uintptr_t>63))
        memset(self._f, 0, T * sizeof(Flow))
        self._T = T
        self._next_ticket = 1
        for f in range(T):
            w = float(weights[f])
            if not w > 0:
                raise ValueError(f"weight of flow {f} must be > 0, got {weights[f]!r}")
            self._f[f].mul = SCALE / w
        for i in range(costs.shape[0]):
            if bad_cost(costs[i]):
                raise ValueError(f"costs must lie in [1, 2**24], got {costs[i]!r}")
            self._enqueue(<int32_t>(i % T), <float>costs[i])

    def __dealloc__(self):
        free(self._heap_mem)
        free(self._flow_mem)

    def __len__(self):
        cdef Py_ssize_t f, n = 0
        for f in range(self._T):
            n += self._f[f].count
        return n

    @property
    def waiting_flows(self):
        return self._n

    @property
    def virtual_time(self):
        return <double>self._v / SCALE


    cdef inline void _enqueue(self, int32_t slot, float cost) noexcept nogil:
        cdef Flow* f = &self._f[slot]
        cdef Req* r = &f.ring[(f.head + f.count) & (CAP - 1)]
        cdef Entry e
        r.ticket = self._next_ticket
        r.cost = cost
        self._next_ticket += 1
        f.count += 1
        if f.count == 1:  # join: S = max(S, v)
            if f.S < self._v:
                f.S = self._v
            e.S = f.S
            e.ticket = r.ticket
            e.slot = slot
            self._n += 1
            sift_up(self._a, self._n - 1, e)

    cdef inline int32_t _dispatch(self, int64_t* start) noexcept nogil:
        cdef Entry* a = self._a
        cdef int32_t slot = a[0].slot
        cdef Flow* f = &self._f[slot]
        cdef Req* r = &f.ring[f.head]
        cdef Entry e
        start[0] = a[0].S
        self._v = a[0].S
        f.S = a[0].S + charge(r.cost, f.mul)
        if f.S > self._max_finish:
            self._max_finish = f.S
        f.head = (f.head + 1) & (CAP - 1)
        f.count -= 1
        if f.count:
            e.S = f.S
            e.ticket = f.ring[f.head].ticket
            e.slot = slot
            sift_root(a, self._n, e)
        else:
            self._n -= 1
            if self._n:
                sift_down(a, self._n, 0, a[self._n])
            elif self._max_finish > self._v:  # busy period over
                self._v = self._max_finish
        return slot

    def steady(self, const double[::1] costs, int32_t[::1] flows_out=None, int64_t[::1] starts_out=None):
        """Run ``len(costs)`` pairs: dispatch, then enqueue ``costs[i]`` back on the flow.
        With ``flows_out`` / ``starts_out`` (same length), record each dispatched flow and
        its start tag in sub-units (for the decision check; the timed runs pass neither)."""
        cdef Py_ssize_t n = costs.shape[0], i
        cdef int32_t slot
        cdef int64_t start
        cdef bint record = flows_out is not None or starts_out is not None
        if flows_out is not None and flows_out.shape[0] != n:
            raise ValueError(f"flows_out has {flows_out.shape[0]} entries, costs {n}")
        if starts_out is not None and starts_out.shape[0] != n:
            raise ValueError(f"starts_out has {starts_out.shape[0]} entries, costs {n}")
        for i in range(n):
            if bad_cost(costs[i]):
                raise ValueError(f"costs must lie in [1, 2**24], got {costs[i]!r}")
        if self._n == 0 and n:
            raise ValueError("no flow is waiting")
        if <long long>self._next_ticket + n >= 2 ** 32:
            raise OverflowError("the floor's 32-bit tickets would wrap")
        with nogil:
            if record:
                for i in range(n):
                    slot = self._dispatch(&start)
                    if flows_out is not None:
                        flows_out[i] = slot
                    if starts_out is not None:
                        starts_out[i] = start
                    self._enqueue(slot, <float>costs[i])
            else:
                for i in range(n):
                    slot = self._dispatch(&start)
                    self._enqueue(slot, <float>costs[i])
        self.pairs += n
        if self._v >= S_LIMIT:
            raise OverflowError("meters grew past 2**62 (the floor does not renormalise)")
