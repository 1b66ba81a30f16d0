# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Start-time Fair Queueing: the compiled core of sfq.

Derivation (seed 000 §2). Every flow i carries a meter S_i, the start tag of its next
request: the service it has been charged, aligned to a common baseline. The virtual time v
is the start tag of the most recent dispatch. Dispatch takes the waiting flow with the
smallest S (ties: the flow whose head request was enqueued first, i.e. the smaller ticket),
sets v = S, and charges S += cost / weight once, never corrected. A flow that (re)joins
gets S = max(S, v): no credit is banked while idle, no charge escaped by leaving. When no
flow waits, v = max(v, largest finish tag): the next busy period starts level. Hence every
waiting meter lies in [v, v + c_max] (§3.1), and two backlogged flows never differ in
charged cost by more than 2 c_max over any interval (§3.2).

Fixed point. Meters, v and finish tags are int64 counts of sub-units; SCALE = 2**20
sub-units make one cost unit; a charge is ceil(cost * SCALE / weight) computed in IEEE
double (as the Python twin does), so integer costs with power-of-two weights are exact and
every charge is >= 1 sub-unit. Costs are at most 2**30 and weights at least 2**-10, so a
charge is at most MAX_CHARGE = 2**60.

Renormalisation. Decisions compare meters of waiting flows with each other and with v
(max(S, v), S <= v): subtracting one amount from every meter, from v and from the largest
finish tag changes none of them. When v reaches RENORM_AT = 2**61 we subtract v (idle
meters below v are first raised to v, which is what rejoining would do), so every value
stays below v + MAX_CHARGE < 2**62 < 2**63. The amounts subtracted add up in a Python int,
_base, so the meters and times this class reports never jump.

Memory. An idle flow with the default weight and S <= v would rejoin at v: it carries no
information, and its slot is recycled. Idle flows wait in a second heap keyed on S until v
passes them, so a stream of distinct one-request flows uses bounded memory (as long as v
moves: fresh flows arriving exactly at the dispatch rate all start at v, are served first
and each still owes its charge, which is information).

Layout. Waiting flows sit in a 4-ary min-heap of (S, head ticket, slot) entries over a C
array (sfq_heap.h), with a per-slot position index so that the dispatched flow is re-keyed
by one in-place sift. Each flow's requests are a ring buffer of (ticket, cost, item); a
cancelled request becomes a tombstone until it reaches the head. An open-addressing table
maps the ticket of every waiting request to its flow's slot, for cancel(). All C memory is
PyMem_* so that tracemalloc accounts for it.

The pure-Python twin, sfq/_scheduler_py.py, is the readable specification; the tests run
both and compare them event by event.
"""

cimport cython
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.ref cimport PyObject, Py_DECREF, Py_INCREF, Py_XDECREF
from libc.math cimport ceil
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.string cimport memcpy

import operator

import numpy as np

from sfq import _common

cdef extern from "Python.h":
    double PyFloat_AS_DOUBLE(object)
    long long PyLong_AsLongLongAndOverflow(object, int*) except? -1
    Py_ssize_t PyLong_AsSsize_t(object) except? -1
    Py_ssize_t PyList_GET_SIZE(object)
    PyObject* PyList_GET_ITEM(object, Py_ssize_t)
    object PyList_New(Py_ssize_t)
    void PyList_SET_ITEM(object, Py_ssize_t, PyObject*)

# --------------------------------------------------------------------------- limits
# One place per fact: the values come from sfq._common, which the twin uses too.
cdef double SCALE_D = float(_common.SCALE)          # sub-units per cost unit (2**20)
cdef double INV_SCALE = 1.0 / SCALE_D               # exact: SCALE is a power of two
cdef double MAX_COST_D = _common.MAX_COST           # largest cost, cost units
cdef double MIN_WEIGHT_D = _common.MIN_WEIGHT       # smallest weight
cdef double MAX_WEIGHT_D = _common.MAX_WEIGHT       # largest weight
cdef int64_t RENORM_AT = _common.RENORM_AT          # renormalise once v reaches this, sub-units
cdef object _check_cost = _common.check_cost
cdef object _check_weight = _common.check_weight
cdef object _check_batch = _common.check_batch
cdef object _unhashable = _common.unhashable_flow
cdef object _DispatchBatch = _common.DispatchBatch
assert _common.MAX_COST * _common.SCALE / _common.MIN_WEIGHT == _common.MAX_CHARGE
assert _common.MAX_CHARGE * 2 <= RENORM_AT and RENORM_AT * 2 <= 2 ** 62

# flow states
cdef enum:
    FREE = 0       # slot unused, on the free stack
    WAITING = 1    # has waiting requests; in the wait heap
    IDLE = 2       # no waiting request, S > v; in the idle heap until v passes S
    DORMANT = 3    # no waiting request, S <= v, kept only for its non-default weight

ctypedef struct Req:
    int64_t ticket      # enqueue ticket; negated once cancelled (a tombstone until it reaches the head)
    double cost         # cost units, as enqueued (validated)
    PyObject* item      # owned reference to the caller's payload; NULL in a tombstone

ctypedef struct Flow:
    int64_t S           # meter: start tag of the next request, sub-units (relative to _base)
    double weight       # charges are divided by it; 1.0 by default
    Req* ring           # FIFO of waiting requests, a ring buffer of `cap` entries (power of two)
    uint32_t cap        # ring capacity, entries
    uint32_t head       # ring index of the oldest entry
    uint32_t count      # entries in the ring, tombstones included
    uint32_t live       # waiting requests, tombstones excluded
    int32_t state       # FREE / WAITING / IDLE / DORMANT
    PyObject* key       # owned reference to the flow id; NULL when FREE

cdef extern from "sfq_heap.h":
    # (S, ticket, slot): S the flow's meter in sub-units, ticket its head request's ticket
    ctypedef struct sfq_entry:
        int64_t S
        int64_t ticket
        int32_t slot
    bint sfq_less(const sfq_entry* x, const sfq_entry* y) noexcept nogil
    void sfq_sift_up(sfq_entry* a, int32_t* pos, Py_ssize_t i, sfq_entry e) noexcept nogil
    void sfq_sift_down(sfq_entry* a, int32_t* pos, Py_ssize_t n, Py_ssize_t i, sfq_entry e) noexcept nogil
    void sfq_sift_root(sfq_entry* a, int32_t* pos, Py_ssize_t n, sfq_entry e) noexcept nogil
    void sfq_prefetch(const void* p) noexcept nogil

ctypedef sfq_entry Entry

ctypedef struct Popped:
    PyObject* key       # new reference to the dispatched flow's id
    PyObject* item      # new reference to the request's payload
    double cost         # cost units, as enqueued
    int64_t ticket      # the request's ticket
    int64_t start       # start tag (= v), sub-units relative to _base
    int64_t finish      # finish tag, sub-units relative to _base

ctypedef struct Heap:
    Entry* a            # 4-ary min-heap on (S, ticket)
    Py_ssize_t n        # entries in use
    Py_ssize_t cap      # entries allocated


cdef inline double _units0(int64_t sub) noexcept nogil:
    # sub-units to cost units when _base == 0: (double)sub rounds like Python's int/int, and
    # scaling by 2**-20 is exact, so this equals the twin's `sub / SCALE`
    return <double>sub * INV_SCALE


cdef inline object _units(object base, int64_t sub):
    if not base:
        return _units0(sub)
    return (base + sub) / _common.SCALE


@cython.final
@cython.freelist(64)
cdef class Dispatch:
    """One dispatched request: ``flow``, ``item``, ``cost`` (as enqueued), ``ticket``,
    ``start`` (the meter before charging, = v) and ``finish`` (after), in cost units."""

    cdef readonly object flow
    cdef readonly object item
    cdef readonly double cost
    cdef readonly int64_t ticket
    cdef int64_t _start         # sub-units relative to _base
    cdef int64_t _finish        # sub-units relative to _base
    cdef object _base           # the scheduler's _base when dispatched (a Python int)

    @property
    def start(self):
        return _units(self._base, self._start)

    @property
    def finish(self):
        return _units(self._base, self._finish)

    def __repr__(self):
        return (
            f"Dispatch(flow={self.flow!r}, ticket={self.ticket}, cost={self.cost!r}, "
            f"start={self.start!r}, finish={self.finish!r}, item={self.item!r})"
        )


@cython.final
cdef class Scheduler:
    """Start-time Fair Queueing over flows of waiting requests (compiled core)."""

    cdef Flow* _flows           # flow records, indexed by slot
    cdef int32_t* _pos          # per slot: index in the wait or idle heap, -1 if in neither
    cdef int32_t* _free         # stack of free slots
    cdef int32_t _nfree         # slots on the free stack
    cdef int32_t _nslots        # slots handed out so far (high-water mark)
    cdef int32_t _slotcap       # slots allocated
    cdef Heap _wait             # waiting flows, keyed (S, head ticket)
    cdef Heap _idle             # idle flows, keyed (S, 0)
    cdef int64_t* _tkey         # open-addressing table: ticket of a waiting request (0 = empty)
    cdef int32_t* _tval         # ... and its flow's slot
    cdef uint64_t _tmask        # table size - 1 (size a power of two)
    cdef Py_ssize_t _tcount     # tickets in the table = waiting requests
    cdef int64_t _v             # virtual time, sub-units relative to _base
    cdef int64_t _max_finish    # largest finish tag so far, sub-units relative to _base
    cdef int64_t _next_ticket   # the next enqueue's ticket
    cdef dict _index            # flow id -> slot (int)
    cdef object _base           # Python int: sub-units subtracted by renormalisation so far
    cdef int64_t _last_shift    # sub-units the latest renormalisation subtracted
    cdef readonly Py_ssize_t renormalisations  # how many times meters were renormalised
    cdef PyObject* _ckey        # one-entry lookup cache: a live slot's own key object (borrowed from it)...
    cdef int32_t _cslot         # ... and that slot; `enqueue(d.flow, ...)` after a dispatch skips the dict

    def __cinit__(self):
        self._index = {}
        self._base = 0
        self._next_ticket = 1
        self._slotcap = 16
        self._flows = <Flow*>PyMem_Malloc(16 * sizeof(Flow))
        self._pos = <int32_t*>PyMem_Malloc(16 * sizeof(int32_t))
        self._free = <int32_t*>PyMem_Malloc(16 * sizeof(int32_t))
        self._wait.a = <Entry*>PyMem_Malloc(16 * sizeof(Entry))
        self._wait.cap = 16
        self._idle.a = <Entry*>PyMem_Malloc(16 * sizeof(Entry))
        self._idle.cap = 16
        self._tkey = <int64_t*>PyMem_Malloc(32 * sizeof(int64_t))
        self._tval = <int32_t*>PyMem_Malloc(32 * sizeof(int32_t))
        self._tmask = 31
        if (self._flows == NULL or self._pos == NULL or self._free == NULL or self._wait.a == NULL
                or self._idle.a == NULL or self._tkey == NULL or self._tval == NULL):
            raise MemoryError()
        cdef Py_ssize_t i
        for i in range(32):
            self._tkey[i] = 0

    def __init__(self):
        pass

    def __dealloc__(self):
        cdef int32_t s
        cdef uint32_t k
        cdef Flow* f
        if self._flows != NULL:
            for s in range(self._nslots):
                f = &self._flows[s]
                for k in range(f.count):
                    Py_XDECREF(f.ring[(f.head + k) & (f.cap - 1)].item)
                PyMem_Free(f.ring)
                Py_XDECREF(f.key)
        PyMem_Free(self._flows)
        PyMem_Free(self._pos)
        PyMem_Free(self._free)
        PyMem_Free(self._wait.a)
        PyMem_Free(self._idle.a)
        PyMem_Free(self._tkey)
        PyMem_Free(self._tval)

    # =================================================================== heaps
    cdef inline int _heap_reserve(self, Heap* h) except -1:
        if h.n < h.cap:
            return 0
        return self._heap_grow(h)

    cdef int _heap_grow(self, Heap* h) except -1:
        cdef Entry* a
        a = <Entry*>PyMem_Realloc(h.a, 2 * h.cap * sizeof(Entry))
        if a == NULL:
            raise MemoryError()
        h.a = a
        h.cap *= 2
        return 0

    cdef inline void _heap_push(self, Heap* h, int64_t S, int64_t ticket, int32_t slot) noexcept nogil:
        # room reserved by the caller
        cdef Entry e
        e.S = S
        e.ticket = ticket
        e.slot = slot
        h.n += 1
        sfq_sift_up(h.a, self._pos, h.n - 1, e)

    cdef inline void _heap_remove(self, Heap* h, Py_ssize_t i) noexcept nogil:
        cdef Entry last
        h.n -= 1
        self._pos[h.a[i].slot] = -1
        if i == h.n:
            return
        last = h.a[h.n]
        if i == 0:
            sfq_sift_root(h.a, self._pos, h.n, last)
        elif sfq_less(&last, &h.a[i]):
            sfq_sift_up(h.a, self._pos, i, last)
        else:
            sfq_sift_down(h.a, self._pos, h.n, i, last)

    # =================================================================== ticket table
    cdef inline uint64_t _thash(self, int64_t t) noexcept nogil:
        cdef uint64_t h = <uint64_t>t * <uint64_t>0x9E3779B97F4A7C15ULL  # Fibonacci hashing
        return h ^ (h >> 31)

    cdef inline int _treserve(self) except -1:
        # keep the load factor <= 1/2
        if <uint64_t>(self._tcount + 1) * 2 <= self._tmask + 1:
            return 0
        return self._tgrow()

    cdef int _tgrow(self) except -1:
        cdef uint64_t oldsize = self._tmask + 1, newsize, i, j, mask
        cdef int64_t* ok = self._tkey
        cdef int32_t* ov = self._tval
        cdef int64_t* nk
        cdef int32_t* nv
        if <uint64_t>(self._tcount + 1) * 2 <= oldsize:
            return 0
        newsize = oldsize * 2
        nk = <int64_t*>PyMem_Malloc(newsize * sizeof(int64_t))
        nv = <int32_t*>PyMem_Malloc(newsize * sizeof(int32_t))
        if nk == NULL or nv == NULL:
            PyMem_Free(nk)
            PyMem_Free(nv)
            raise MemoryError()
        mask = newsize - 1
        for i in range(newsize):
            nk[i] = 0
        for i in range(oldsize):
            if ok[i] != 0:
                j = self._thash(ok[i]) & mask
                while nk[j] != 0:
                    j = (j + 1) & mask
                nk[j] = ok[i]
                nv[j] = ov[i]
        self._tkey = nk
        self._tval = nv
        self._tmask = mask
        PyMem_Free(ok)
        PyMem_Free(ov)
        return 0

    cdef inline void _tput(self, int64_t t, int32_t slot) noexcept nogil:
        # room reserved by the caller
        cdef uint64_t mask = self._tmask
        cdef uint64_t j = self._thash(t) & mask
        while self._tkey[j] != 0:
            j = (j + 1) & mask
        self._tkey[j] = t
        self._tval[j] = slot
        self._tcount += 1

    cdef inline int64_t _tfind(self, int64_t t) noexcept nogil:
        cdef uint64_t mask = self._tmask
        cdef uint64_t j = self._thash(t) & mask
        while self._tkey[j] != 0:
            if self._tkey[j] == t:
                return <int64_t>j
            j = (j + 1) & mask
        return -1

    cdef inline void _tdel_at(self, uint64_t j) noexcept nogil:
        # linear probing, backward-shift deletion (no tombstones in the table)
        cdef uint64_t mask = self._tmask
        cdef uint64_t k = j, home
        while True:
            k = (k + 1) & mask
            if self._tkey[k] == 0:
                break
            home = self._thash(self._tkey[k]) & mask
            # move entry k back to j if its home does not lie cyclically in (j, k]
            if (j <= k and (home <= j or home > k)) or (j > k and (home <= j and home > k)):
                self._tkey[j] = self._tkey[k]
                self._tval[j] = self._tval[k]
                j = k
        self._tkey[j] = 0
        self._tcount -= 1

    cdef inline void _tdel(self, int64_t t) noexcept nogil:
        cdef int64_t j = self._tfind(t)
        if j >= 0:
            self._tdel_at(<uint64_t>j)

    # =================================================================== flows
    cdef inline int _ring_reserve(self, Flow* f) except -1:
        if f.count < f.cap:
            return 0
        return self._ring_grow(f)

    cdef int _ring_grow(self, Flow* f) except -1:
        cdef uint32_t newcap, k
        cdef Req* r
        newcap = f.cap * 2 if f.cap else 4
        r = <Req*>PyMem_Malloc(newcap * sizeof(Req))
        if r == NULL:
            raise MemoryError()
        for k in range(f.count):
            r[k] = f.ring[(f.head + k) & (f.cap - 1)]
        PyMem_Free(f.ring)
        f.ring = r
        f.cap = newcap
        f.head = 0
        return 0

    cdef int32_t _new_slot(self, object key) except -1:
        cdef int32_t slot, newcap
        cdef void* p
        cdef Flow* f
        if self._nfree > 0:
            self._nfree -= 1
            slot = self._free[self._nfree]
        else:
            if self._nslots == self._slotcap:
                newcap = self._slotcap * 2
                p = PyMem_Realloc(self._flows, newcap * sizeof(Flow))
                if p == NULL:
                    raise MemoryError()
                self._flows = <Flow*>p
                p = PyMem_Realloc(self._pos, newcap * sizeof(int32_t))
                if p == NULL:
                    raise MemoryError()
                self._pos = <int32_t*>p
                p = PyMem_Realloc(self._free, newcap * sizeof(int32_t))
                if p == NULL:
                    raise MemoryError()
                self._free = <int32_t*>p
                self._slotcap = newcap
            slot = self._nslots
            self._nslots += 1
            f = &self._flows[slot]
            f.ring = NULL
            f.cap = 0
        self._index[key] = slot
        f = &self._flows[slot]
        f.S = self._v
        f.weight = 1.0
        f.head = 0
        f.count = 0
        f.live = 0
        f.state = DORMANT
        Py_INCREF(key)
        f.key = <PyObject*>key
        self._pos[slot] = -1
        return slot

    cdef void _forget(self, int32_t slot):
        cdef Flow* f = &self._flows[slot]
        cdef object key = <object>f.key
        if self._ckey == f.key:
            self._ckey = NULL
        del self._index[key]
        Py_DECREF(key)
        f.key = NULL
        f.state = FREE
        self._free[self._nfree] = slot
        self._nfree += 1

    cdef inline void _drop_tombstones(self, Flow* f) noexcept nogil:
        cdef uint32_t mask = f.cap - 1
        while f.count and f.ring[f.head].ticket < 0:
            f.head = (f.head + 1) & mask
            f.count -= 1

    cdef int _leave(self, int32_t slot) except -1:
        """The flow has no waiting request left: out of the competition, meter kept."""
        cdef Flow* f = &self._flows[slot]
        self._heap_reserve(&self._idle)
        f.state = IDLE
        PyMem_Free(f.ring)  # an idle flow keeps no buffer (memory per idle flow stays small)
        f.ring = NULL
        f.cap = 0
        f.head = 0
        self._heap_push(&self._idle, f.S, 0, slot)
        if self._wait.n == 0 and self._max_finish > self._v:  # global idle: close the busy period
            self._v = self._max_finish
        return 0

    cdef inline int _after_v_moved(self) except -1:
        """Forget idle flows that v has reached; renormalise if v grew large."""
        if (self._idle.n and self._idle.a[0].S <= self._v) or self._v >= RENORM_AT:
            return self._after_v_moved_slow()
        return 0

    cdef int _after_v_moved_slow(self) except -1:
        cdef int32_t slot
        cdef Heap* h = &self._idle
        while h.n and h.a[0].S <= self._v:
            slot = h.a[0].slot
            self._heap_remove(h, 0)
            if self._flows[slot].weight == 1.0:
                self._forget(slot)
            else:
                self._flows[slot].state = DORMANT
        if self._v >= RENORM_AT:
            self._renormalise()
        return 0

    cdef void _renormalise(self):
        cdef int64_t d = self._v
        cdef int32_t s
        cdef Py_ssize_t i
        cdef Flow* f
        for s in range(self._nslots):
            f = &self._flows[s]
            if f.state != FREE:
                if f.S < d:
                    f.S = d  # only DORMANT flows are below v; rejoining would raise them to v
                f.S -= d
        for i in range(self._wait.n):
            self._wait.a[i].S -= d
        for i in range(self._idle.n):
            self._idle.a[i].S -= d
        self._max_finish -= d
        self._v = 0
        self._last_shift = d
        self._base = self._base + d
        self.renormalisations += 1

    cdef inline int32_t _lookup(self, object flow) except -2:
        """The flow's slot, -1 if unknown; TypeError naming an unhashable flow id."""
        cdef object o
        cdef int32_t slot
        if <PyObject*>flow == self._ckey:
            return self._cslot
        try:
            o = self._index.get(flow)
        except TypeError:
            raise _unhashable(flow) from None
        if o is None:
            return -1
        slot = <int32_t>PyLong_AsSsize_t(o)
        self._ckey = self._flows[slot].key
        self._cslot = slot
        return slot

    # =================================================================== queries
    def __len__(self):
        return self._tcount

    @property
    def waiting_flows(self):
        """Flows with at least one waiting request."""
        return self._wait.n

    @property
    def known_flows(self):
        """Flows the scheduler holds state for (waiting, or idle with information)."""
        return len(self._index)

    @property
    def virtual_time(self):
        """v, in cost units."""
        return _units(self._base, self._v)

    def meter(self, flow):
        """The flow's meter S in cost units (v for a flow with no state, or idle below v)."""
        cdef int32_t slot = self._lookup(flow)
        if slot < 0:
            return _units(self._base, self._v)
        return _units(self._base, max(self._flows[slot].S, self._v))

    def pending(self, flow):
        """Waiting requests of ``flow``."""
        cdef int32_t slot = self._lookup(flow)
        return 0 if slot < 0 else self._flows[slot].live

    def weight(self, flow):
        """The flow's weight (1.0 unless set)."""
        cdef int32_t slot = self._lookup(flow)
        return 1.0 if slot < 0 else self._flows[slot].weight

    def __repr__(self):
        return (f"<sfq.Scheduler compiled: {self._tcount} waiting in {self._wait.n} flows, "
                f"{len(self._index)} known, v={self.virtual_time!r}>")

    # =================================================================== events
    cdef inline double _cost(self, object cost) except -1.0:
        cdef double c
        cdef int overflow = 0
        cdef long long lv
        if type(cost) is float:
            c = PyFloat_AS_DOUBLE(cost)
        elif type(cost) is int:
            lv = PyLong_AsLongLongAndOverflow(cost, &overflow)
            if overflow:
                return _check_cost(cost)  # raises
            c = <double>lv
        else:
            return _check_cost(cost)
        if not (c > 0.0 and c <= MAX_COST_D):
            return _check_cost(cost)  # raises, naming the value
        return c

    cdef int64_t _enqueue(self, object flow, double c, object item, int32_t slot) except -1:
        cdef Flow* f
        cdef int64_t ticket
        cdef Req* r
        if slot < 0:
            self._heap_reserve(&self._wait)
            self._treserve()
            slot = self._new_slot(flow)
            f = &self._flows[slot]
        else:
            f = &self._flows[slot]
            if f.state != WAITING:
                self._heap_reserve(&self._wait)
            self._treserve()
        self._ring_reserve(f)  # everything that can fail has now been done
        ticket = self._next_ticket
        self._next_ticket += 1
        r = &f.ring[(f.head + f.count) & (f.cap - 1)]
        r.ticket = ticket
        r.cost = c
        Py_INCREF(item)
        r.item = <PyObject*>item
        f.count += 1
        f.live += 1
        self._tput(ticket, slot)
        if f.state != WAITING:  # (re)join: S = max(S, v)
            if f.state == IDLE:
                self._heap_remove(&self._idle, self._pos[slot])
            if f.S < self._v:
                f.S = self._v
            f.state = WAITING
            self._heap_push(&self._wait, f.S, ticket, slot)
        return ticket

    def enqueue(self, flow, cost, item=None):
        """Append a request to ``flow``'s FIFO; returns its ticket."""
        cdef int32_t slot = self._lookup(flow)
        cdef double c = self._cost(cost)
        return self._enqueue(flow, c, item, slot)

    cdef int _pop(self, Popped* out) except -1:
        """Dispatch the head of the flow with the smallest (S, head ticket); wait heap non-empty."""
        cdef Entry* top = &self._wait.a[0]
        cdef int32_t slot = top.slot
        cdef Flow* f = &self._flows[slot]
        cdef Req r = f.ring[f.head]
        cdef Entry e
        cdef int64_t start = top.S
        cdef Py_ssize_t renorms = self.renormalisations
        self._heap_reserve(&self._idle)  # the one allocation a pop may need, before any change
        f.head = (f.head + 1) & (f.cap - 1)
        f.count -= 1
        f.live -= 1
        self._tdel(r.ticket)
        self._v = start
        f.S = start + <int64_t>ceil(r.cost * SCALE_D / f.weight)
        if f.S > self._max_finish:
            self._max_finish = f.S
        Py_INCREF(<object>f.key)
        out.key = f.key
        out.item = r.item  # the ring's reference moves to the caller
        out.cost = r.cost
        out.ticket = r.ticket
        out.start = start
        out.finish = f.S
        self._ckey = f.key
        self._cslot = slot
        self._drop_tombstones(f)
        if f.count:
            e.S = f.S
            e.ticket = f.ring[f.head].ticket
            e.slot = slot
            sfq_sift_root(self._wait.a, self._pos, self._wait.n, e)
        else:
            self._heap_remove(&self._wait, 0)
            self._leave(slot)
        self._after_v_moved()
        self._prefetch_next()
        if self.renormalisations != renorms:  # keep start/finish relative to the new _base
            out.start -= self._last_shift
            out.finish -= self._last_shift
        return 0

    cdef inline void _prefetch_next(self) noexcept nogil:
        """Start loading what the next dispatch and enqueue will touch (the new root's flow
        record and its ticket's table cell, the next ticket's cell) while the caller's
        Python runs in between: on a large scheduler these are cache misses otherwise."""
        cdef Entry* top
        sfq_prefetch(&self._tkey[self._thash(self._next_ticket) & self._tmask])
        if self._wait.n:
            top = &self._wait.a[0]
            sfq_prefetch(&self._flows[top.slot])
            sfq_prefetch(&self._tkey[self._thash(top.ticket) & self._tmask])

    cdef Dispatch _dispatch(self):
        cdef Popped p
        cdef Dispatch d = Dispatch.__new__(Dispatch)
        self._pop(&p)
        d.flow = <object>p.key
        Py_DECREF(<object>p.key)
        d.item = <object>p.item
        Py_DECREF(<object>p.item)
        d.cost = p.cost
        d.ticket = p.ticket
        d._start = p.start
        d._finish = p.finish
        d._base = self._base
        return d

    def dispatch(self):
        """Dispatch the head request of the waiting flow with the smallest meter, or None."""
        if self._wait.n == 0:
            return None
        return self._dispatch()

    def cancel(self, ticket):
        """Remove a still-waiting request, uncharged. False if unknown or already dispatched."""
        cdef int64_t t, j
        cdef int32_t slot
        cdef Flow* f
        cdef uint32_t lo, hi, mid, mask, idx
        cdef Req* r
        try:
            t = operator.index(ticket)
        except (TypeError, OverflowError):
            return False
        if t <= 0:
            return False
        j = self._tfind(t)
        if j < 0:
            return False
        slot = self._tval[j]
        self._tdel_at(<uint64_t>j)
        f = &self._flows[slot]
        mask = f.cap - 1
        lo = 0
        hi = f.count
        while lo < hi:  # tickets increase along the ring; tombstones keep |ticket|
            mid = (lo + hi) >> 1
            r = &f.ring[(f.head + mid) & mask]
            if (r.ticket if r.ticket > 0 else -r.ticket) < t:
                lo = mid + 1
            else:
                hi = mid
        idx = (f.head + lo) & mask
        r = &f.ring[idx]
        r.ticket = -t
        Py_XDECREF(r.item)
        r.item = NULL
        f.live -= 1
        if lo == 0:  # the head changed: re-key, or leave
            self._drop_tombstones(f)
            if f.count:
                self._wait.a[self._pos[slot]].ticket = f.ring[f.head].ticket
                sfq_sift_down(self._wait.a, self._pos, self._wait.n, self._pos[slot], self._wait.a[self._pos[slot]])
            else:
                self._heap_remove(&self._wait, self._pos[slot])
                self._leave(slot)
                self._after_v_moved()
        return True

    def set_weight(self, flow, weight):
        """Weight (> 0) for this flow's future charges: a charge is cost / weight."""
        cdef int32_t slot = self._lookup(flow)
        cdef double w
        if type(weight) is float and MIN_WEIGHT_D <= PyFloat_AS_DOUBLE(weight) <= MAX_WEIGHT_D:
            w = PyFloat_AS_DOUBLE(weight)
        else:
            w = _check_weight(weight)
        if slot < 0:
            if w == 1.0:
                return
            slot = self._new_slot(flow)
        self._flows[slot].weight = w
        if w == 1.0 and self._flows[slot].state == DORMANT:
            self._forget(slot)

    # =================================================================== batches
    def enqueue_many(self, flows, costs, items=None):
        """Enqueue ``flows[i]`` with ``costs[i]`` (and ``items[i]``) in order, as many
        ``enqueue`` calls would; all arguments are checked first, so a bad one enqueues
        nothing. Returns the tickets as an int64 numpy array."""
        cdef list fl
        cdef double[::1] cv
        cdef Py_ssize_t i, n
        cdef int32_t slot
        cdef int32_t* slots
        cdef object flow, item = None
        cdef int64_t first = self._next_ticket
        fl, arr, its = _check_batch(flows, costs, items, False)
        n = len(fl)
        cv = arr
        slots = <int32_t*>PyMem_Malloc(max(n, 1) * sizeof(int32_t))
        if slots == NULL:
            raise MemoryError()
        try:
            # pass 1: look every flow up (a TypeError for an unhashable id, before any change)
            for i in range(n):
                slots[i] = self._lookup(<object>PyList_GET_ITEM(fl, i))
            # pass 2: enqueue; a flow unknown in pass 1 may have been created by an earlier entry
            for i in range(n):
                flow = <object>PyList_GET_ITEM(fl, i)
                if its is not None:
                    item = <object>PyList_GET_ITEM(its, i)
                slot = slots[i]
                if slot < 0:
                    slot = self._lookup(flow)
                self._enqueue(flow, cv[i], item, slot)
        finally:
            PyMem_Free(slots)
        return np.arange(first, first + n, dtype=np.int64)

    def dispatch_many(self, Py_ssize_t n):
        """Dispatch up to ``n`` requests, exactly as ``n`` calls of ``dispatch``; returns a
        ``DispatchBatch`` of parallel arrays (fewer than ``n`` entries if the queue ran dry)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        cdef Py_ssize_t m = min(n, self._tcount), i
        cdef object flows = PyList_New(m), items = PyList_New(m)
        tickets = np.empty(m, dtype=np.int64)
        costs = np.empty(m, dtype=np.float64)
        starts = np.empty(m, dtype=np.float64)
        finishes = np.empty(m, dtype=np.float64)
        cdef int64_t[::1] tv = tickets
        cdef double[::1] cv = costs, sv = starts, fv = finishes
        cdef Popped p
        for i in range(m):
            self._pop(&p)
            PyList_SET_ITEM(flows, i, p.key)  # steals the references
            PyList_SET_ITEM(items, i, p.item)
            tv[i] = p.ticket
            cv[i] = p.cost
            if not self._base:
                sv[i] = _units0(p.start)
                fv[i] = _units0(p.finish)
            else:
                sv[i] = _units(self._base, p.start)
                fv[i] = _units(self._base, p.finish)
        return _DispatchBatch(flows, items, tickets, costs, starts, finishes)
