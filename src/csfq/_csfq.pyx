# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Start-time Fair Queueing: the compiled core of sfq.

Derivation (Goyal, Vin and Cheng, "Start-time Fair Queueing", 1996; docs/design.md). Every
flow i carries a meter S_i, the start tag of its next request: the service it has been
charged, aligned to a common baseline. The virtual time v is the start tag of the most
recent dispatch. Dispatch takes the competing flow with the smallest S (ties: the flow whose
head request was enqueued first, i.e. the smaller ticket), sets v = S, and charges
S += cost / weight. A flow that (re)joins gets S = max(S, v): no credit is banked while idle,
no charge escaped by leaving. (A flow whose work the caller reports still in flight, with
work_started(flow), has not left the system: it keeps its meter when it rejoins, so v becomes
max(v, S) at dispatch. Meters charged only at dispatch never fall below v, and there v = S.) When no flow competes and the caller reports no work in flight,
v = max(v, largest finish tag): the next busy period starts level. Hence every competing
meter lies in [v, v + c_max], and two backlogged flows never differ in charged cost by more
than 2 c_max over any interval. adjust() is the one other writer of meters: the caller's
correction from measured usage (the delivered-service modes of the dispatcher).

Fixed point. Meters, v and finish tags are int64 counts of sub-units; SCALE = 2**20
sub-units make one cost unit; a charge is ceil(cost * SCALE / weight) computed in IEEE
double (as the Python twin does), so integer costs with power-of-two weights are exact and
every charge is >= 1 sub-unit. Costs are at most 2**30 and weights at least 2**-10, so a
charge is at most MAX_CHARGE = 2**60; adjust() keeps every meter within MAX_LEAD = 2**61 of v.

Renormalisation. Decisions compare meters of competing flows with each other and with v
(max(S, v), S <= v): subtracting one amount from every meter, from v and from the largest
finish tag changes none of them. When v reaches RENORM_AT = 2**61 we subtract v (meters of
flows that are not competing and lie below v are first raised to v, which is what rejoining
would do), so every value stays below v + MAX_LEAD + MAX_CHARGE < 2**63. The amounts
subtracted add up in a Python int, _base, so the meters and times this class reports never jump.

Memory. An idle flow with the default weight and S <= v would rejoin at v: it carries no
information, and its slot is recycled. Idle flows wait in a second heap keyed on S until v
passes them, so a stream of distinct one-request flows uses bounded memory.

Layout. Competing flows sit in a 4-ary min-heap of (S, head ticket, slot) entries over a C
array (sfq_heap.h), with a per-slot position index so that the dispatched flow is re-keyed
by one in-place sift. Each flow's requests are a ring buffer of (ticket, cost, item); a
cancelled request becomes a tombstone until it reaches the head. An open-addressing table
maps the ticket of every waiting request to its flow's slot, for cancel(). Flow ids are found
through a second open-addressing table of (hash, slot) pairs: each flow id is hashed once per
call, and forgetting a flow removes it by its stored hash, running no Python code. All C
memory is PyMem_* so that tracemalloc accounts for it.

Safety. Python code can run inside a method: a flow id's __hash__/__eq__, a cost's __float__,
a payload's __del__, a garbage collection. One method runs at a time: _owner holds the thread
running one, and any other call (re-entrant, or from another thread) raises SchedulerBusy
before touching anything. Every check and allocation that can fail comes before the first
change, so an exception leaves the scheduler as it was. References the scheduler lets go of
(cancelled payloads, forgotten flow ids) are released after the method's work is done and the
guard is down, so a __del__ that calls back in sees a consistent scheduler. The held payloads
and flow ids are visited by the cycle collector (tp_traverse/tp_clear below).

The pure-Python twin, sfq/_scheduler_py.py, is the readable specification; the tests run
both and compare them event by event.
"""

cimport cython
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.ref cimport PyObject, Py_DECREF, Py_INCREF, Py_XDECREF
from libc.math cimport ceil
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t

import operator
from types import GenericAlias

from sfq import _common
from sfq.errors import SchedulerBusy

cdef extern from "Python.h":
    double PyFloat_AS_DOUBLE(object)
    long long PyLong_AsLongLongAndOverflow(object, int*) except? -1
    Py_ssize_t PyList_GET_SIZE(object)
    PyObject* PyList_GET_ITEM(object, Py_ssize_t)
    object PyList_New(Py_ssize_t)
    void PyList_SET_ITEM(object, Py_ssize_t, PyObject*)
    ctypedef Py_ssize_t Py_hash_t
    Py_hash_t PyObject_Hash(object) except? -1
    int PyObject_RichCompareBool(PyObject*, PyObject*, int) except -1
    int Py_EQ
    unsigned long PyThread_get_thread_ident() nogil
    # the cycle collector's hooks, declared here without Cython's exception specs
    ctypedef int (*sfq_visitproc "visitproc")(PyObject*, void*) noexcept
    ctypedef int (*sfq_traverseproc "traverseproc")(PyObject*, sfq_visitproc, void*) noexcept
    ctypedef int (*sfq_inquiry "inquiry")(PyObject*) noexcept
    ctypedef struct sfq_typeobject "PyTypeObject":
        sfq_traverseproc tp_traverse
        sfq_inquiry tp_clear
        unsigned long tp_flags
    unsigned long Py_TPFLAGS_HAVE_GC

# --------------------------------------------------------------------------- limits
# One place per fact: the values come from sfq._common, which the twin uses too.
cdef double SCALE_D = float(_common.SCALE)          # sub-units per cost unit (2**20)
cdef double INV_SCALE = 1.0 / SCALE_D               # exact: SCALE is a power of two
cdef double MAX_COST_D = _common.MAX_COST           # largest cost, cost units
cdef double MIN_WEIGHT_D = _common.MIN_WEIGHT       # smallest weight
cdef double MAX_WEIGHT_D = _common.MAX_WEIGHT       # largest weight
cdef int64_t RENORM_AT = _common.RENORM_AT          # renormalise once v reaches this, sub-units
cdef int64_t MAX_LEAD = _common.MAX_LEAD            # adjust() keeps S - v at most this, sub-units
cdef object _check_cost = _common.check_cost
cdef object _check_weight = _common.check_weight
cdef object _check_delta = _common.check_delta
cdef object _check_count = _common.check_count
cdef object _check_batch = _common.check_batch
cdef object _lead_overflow = _common.lead_overflow
cdef object _unhashable = _common.unhashable_flow
cdef object _DispatchBatch = _common.DispatchBatch
cdef object _REENTRANT = _common.REENTRANT
cdef object _CONCURRENT = _common.CONCURRENT
assert _common.MAX_COST * _common.SCALE / _common.MIN_WEIGHT == _common.MAX_CHARGE
assert _common.MAX_CHARGE * 2 <= RENORM_AT and RENORM_AT * 2 <= 2 ** 62
assert RENORM_AT + MAX_LEAD + 2 * _common.MAX_CHARGE < 2 ** 63

cdef object _np = None


cdef object _numpy():
    # numpy is needed only by the batch API: `import sfq` does not load it
    global _np
    if _np is None:
        import numpy
        _np = numpy
    return _np


# flow states
cdef enum:
    FREE = 0       # slot unused, on the free stack
    WAITING = 1    # has waiting requests and competes; in the wait heap
    IDLE = 2       # no waiting request, S > v; in the idle heap until v passes S
    DORMANT = 3    # no waiting request, S <= v, kept only for its non-default weight
    SUSPENDED = 4  # taken out of the competition by the caller; its requests (if any) keep waiting
    RUNNING = 5    # no waiting request, but work in flight (work_started(flow)): kept, in no heap

ctypedef struct Req:
    int64_t ticket      # enqueue ticket; negated once cancelled (a tombstone until it reaches the head)
    double cost         # cost units, as enqueued (validated)
    PyObject* item      # owned reference to the caller's payload; NULL in a tombstone

ctypedef struct Flow:
    int64_t S           # meter: start tag of the next request, sub-units (relative to _base)
    double weight       # charges are divided by it; 1.0 by default
    Req* ring           # FIFO of waiting requests, a ring buffer of `cap` entries (power of two)
    PyObject* key       # owned reference to the flow id; NULL when FREE
    Py_hash_t hash      # hash(key), computed once when the flow was created
    uint32_t cap        # ring capacity, entries
    uint32_t head       # ring index of the oldest entry
    uint32_t count      # entries in the ring, tombstones included
    uint32_t live       # waiting requests, tombstones excluded
    int32_t state       # FREE / WAITING / IDLE / DORMANT / SUSPENDED
    uint32_t batch      # scratch for enqueue_many: requests of this batch not yet reserved; 0 otherwise
    uint32_t running    # the caller's work of this flow in flight (work_started(flow) - work_done(flow))

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


cdef inline uint64_t _mix(uint64_t h) noexcept nogil:
    h = h * <uint64_t>0x9E3779B97F4A7C15ULL  # Fibonacci hashing
    return h ^ (h >> 31)


# An open-addressing table of int64 keys to int32 values (linear probing, load <= 1/2,
# backward-shift deletion, so no tombstones). Two of them: tickets -> slot (a key is unique),
# and flow-id hashes -> slot (equal hashes may repeat; the caller compares the ids).
ctypedef struct Table:
    int64_t* key        # the key of each cell
    int32_t* val        # its value; -1 marks an empty cell
    uint64_t mask       # cells - 1 (cells a power of two)
    Py_ssize_t count    # cells in use


cdef int _tab_init(Table* t, uint64_t size) except -1:
    cdef uint64_t i
    t.key = <int64_t*>PyMem_Malloc(size * sizeof(int64_t))
    t.val = <int32_t*>PyMem_Malloc(size * sizeof(int32_t))
    if t.key == NULL or t.val == NULL:
        raise MemoryError()
    t.mask = size - 1
    t.count = 0
    for i in range(size):
        t.val[i] = -1
    return 0


cdef void _tab_free(Table* t) noexcept:
    PyMem_Free(t.key)
    PyMem_Free(t.val)


cdef void _tab_clear(Table* t) noexcept nogil:
    cdef uint64_t i
    for i in range(t.mask + 1):
        t.val[i] = -1
    t.count = 0


cdef inline int _tab_reserve(Table* t, Py_ssize_t extra) except -1:
    if <uint64_t>(t.count + extra) * 2 <= t.mask + 1:
        return 0
    return _tab_grow(t, extra)


cdef int _tab_grow(Table* t, Py_ssize_t extra) except -1:
    cdef uint64_t oldsize = t.mask + 1, newsize = oldsize, i, j, mask
    cdef int64_t* nk
    cdef int32_t* nv
    while <uint64_t>(t.count + extra) * 2 > newsize:
        newsize *= 2
    nk = <int64_t*>PyMem_Malloc(newsize * sizeof(int64_t))
    nv = <int32_t*>PyMem_Malloc(newsize * sizeof(int32_t))
    if nk == NULL or nv == NULL:
        PyMem_Free(nk)
        PyMem_Free(nv)
        raise MemoryError()
    mask = newsize - 1
    for i in range(newsize):
        nv[i] = -1
    for i in range(oldsize):
        if t.val[i] >= 0:
            j = _mix(<uint64_t>t.key[i]) & mask
            while nv[j] >= 0:
                j = (j + 1) & mask
            nk[j] = t.key[i]
            nv[j] = t.val[i]
    PyMem_Free(t.key)
    PyMem_Free(t.val)
    t.key = nk
    t.val = nv
    t.mask = mask
    return 0


cdef inline void _tab_put(Table* t, int64_t key, int32_t val) noexcept nogil:
    # room reserved by the caller; the key is known to be absent (or allowed to repeat)
    cdef uint64_t j = _mix(<uint64_t>key) & t.mask
    while t.val[j] >= 0:
        j = (j + 1) & t.mask
    t.key[j] = key
    t.val[j] = val
    t.count += 1


cdef inline void _tab_del_at(Table* t, uint64_t j) noexcept nogil:
    cdef uint64_t mask = t.mask
    cdef uint64_t k = j, home
    while True:
        k = (k + 1) & mask
        if t.val[k] < 0:
            break
        home = _mix(<uint64_t>t.key[k]) & mask
        # move cell k back to j if its home does not lie cyclically in (j, k]
        if (j <= k and (home <= j or home > k)) or (j > k and (home <= j and home > k)):
            t.key[j] = t.key[k]
            t.val[j] = t.val[k]
            j = k
    t.val[j] = -1
    t.count -= 1


@cython.final
@cython.freelist(64)
cdef class Dispatch:
    """One request as the scheduler hands it out (``dispatch()``, ``peek()``): ``flow``,
    ``item`` (what was enqueued with it), ``cost`` (as enqueued), ``ticket`` (``enqueue``'s),
    ``start`` (the flow's meter before the charge, = v) and ``finish`` (after), in cost
    units. Read-only."""

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

    @classmethod
    def __class_getitem__(cls, item):
        # Dispatch[Job] in annotations, as the twin (a typing.Generic) allows
        return GenericAlias(cls, item)


@cython.final
cdef class Scheduler:
    """Decides whose request goes next when flows share a resource: Start-time Fair Queueing
    (Goyal, Vin and Cheng, 1996), compiled.

    A flow is whoever owns a share (any hashable id: ``"team-a"``, ``("acme", "batch")``); a
    backlogged flow is served in proportion to its weight, whatever the number or the size of
    its requests, and a flow that was idle rejoins level, with no credit banked. The scheduler
    only orders: it does no I/O and keeps no clock. Costs are in any unit (tokens, seconds).

    * ``enqueue(flow, cost, item)`` queues a request and returns its ticket;
    * ``dispatch()`` takes the next one, as a :class:`Dispatch` (``None`` when nothing waits);
      ``peek()`` says which it would be, changing nothing;
    * ``cancel(ticket)`` withdraws a waiting request, uncharged;
    * ``work_started(flow)`` / ``work_done(flow)`` bracket the work you run, so a flow whose
      request is still running keeps its place; ``adjust(flow, delta)`` corrects a charge once
      the real cost is known; ``suspend``/``resume`` hold a flow back without banking credit.

    Example::

        s = sfq.Scheduler()
        s.set_weight("chat", 3)                     # three times the share of "batch"
        for i in range(4):
            s.enqueue("batch", 100, f"batch-{i}")
            s.enqueue("chat", 100, f"chat-{i}")
        [s.dispatch().item for _ in range(8)]
        # ['batch-0', 'chat-0', 'chat-1', 'chat-2', 'batch-1', 'chat-3', 'batch-2', 'batch-3']

    Annotate the items you enqueue as ``sfq.Scheduler[Job]`` and ``Dispatch.item`` is a
    ``Job`` to a type checker. One method runs at a time: a call from another thread while a
    method runs, or from inside one (a flow id's ``__hash__``, a payload's ``__del__``),
    raises :class:`sfq.errors.SchedulerBusy` and changes nothing; share a scheduler between
    threads behind your own lock. Bad input (a cost or weight that is not a finite number
    > 0, an unhashable flow) raises ``ValueError``/``TypeError`` naming the value, with the
    scheduler unchanged. :class:`sfq.ReferenceScheduler` is the pure-Python twin: the same
    decisions, call for call.
    """

    cdef Flow* _flows           # flow records, indexed by slot
    cdef int32_t* _pos          # per slot: index in the wait or idle heap, -1 if in neither
    cdef int32_t* _free         # stack of free slots
    cdef int32_t _nfree         # slots on the free stack
    cdef int32_t _nslots        # slots handed out so far (high-water mark)
    cdef int32_t _slotcap       # slots allocated
    cdef Heap _wait             # competing flows, keyed (S, head ticket)
    cdef Heap _idle             # idle flows, keyed (S, 0)
    cdef Table _tick            # ticket of each waiting request -> its flow's slot (count = waiting requests)
    cdef Table _ftab            # hash of each known flow id -> its slot (count = known flows)
    cdef Py_ssize_t _ready      # waiting requests of competing (not suspended) flows
    cdef Py_ssize_t _in_flight  # work the caller reported started and not yet done
    cdef int64_t _v             # virtual time, sub-units relative to _base
    cdef int64_t _max_finish    # largest finish tag so far, sub-units relative to _base
    cdef int64_t _next_ticket   # the next enqueue's ticket
    cdef object _base           # Python int: sub-units subtracted by renormalisation so far
    cdef int64_t _last_shift    # sub-units the latest renormalisation subtracted
    cdef readonly Py_ssize_t renormalisations  # how many times meters were renormalised
    cdef PyObject* _ckey        # one-entry lookup cache: a live slot's own key object (borrowed from it)...
    cdef int32_t _cslot         # ... and that slot; `enqueue(d.flow, ...)` after a dispatch skips hashing
    cdef unsigned long _owner   # thread running a method of this scheduler, 0 when none
    cdef PyObject** _grave      # references to release once the running method is done
    cdef Py_ssize_t _ngrave     # entries in _grave
    cdef Py_ssize_t _gravecap   # entries allocated
    cdef object __weakref__     # schedulers can be weakly referenced, like the twin

    def __cinit__(self):
        cdef Py_ssize_t i
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
        if (self._flows == NULL or self._pos == NULL or self._free == NULL or self._wait.a == NULL
                or self._idle.a == NULL):
            raise MemoryError()
        _tab_init(&self._tick, 32)
        _tab_init(&self._ftab, 32)

    def __init__(self):
        pass

    @classmethod
    def __class_getitem__(cls, item):
        # Scheduler[Job] in annotations, as the twin (a typing.Generic) allows
        return GenericAlias(cls, item)

    def __dealloc__(self):
        self._release_all()
        PyMem_Free(self._flows)
        PyMem_Free(self._pos)
        PyMem_Free(self._free)
        PyMem_Free(self._wait.a)
        PyMem_Free(self._idle.a)
        _tab_free(&self._tick)
        _tab_free(&self._ftab)
        PyMem_Free(self._grave)

    cdef void _release_all(self) noexcept:
        """Empty the scheduler (for the cycle collector and for dealloc): the state is reset
        to that of a new scheduler first, then the payloads and flow ids are released."""
        cdef int32_t s, n = self._nslots
        cdef uint32_t k
        cdef Flow* f
        cdef Py_ssize_t i
        if self._flows == NULL:
            return
        self._owner = <unsigned long>-1  # a __del__ run from here cannot call back in
        for s in range(n):
            f = &self._flows[s]
            if f.state == FREE:
                continue
            for k in range(f.count):
                self._bury(f.ring[(f.head + k) & (f.cap - 1)].item)
            PyMem_Free(f.ring)
            f.ring = NULL
            f.cap = 0
            f.count = 0
            f.live = 0
            self._bury(f.key)
            f.key = NULL
            f.state = FREE
        self._nslots = 0
        self._nfree = 0
        self._wait.n = 0
        self._idle.n = 0
        if self._tick.val != NULL:
            _tab_clear(&self._tick)
        if self._ftab.val != NULL:
            _tab_clear(&self._ftab)
        self._ready = 0
        self._in_flight = 0
        self._ckey = NULL
        self._owner = 0
        self._flush()

    # =================================================================== the one-at-a-time guard
    cdef inline int _enter(self) except -1:
        if self._owner != 0:
            return self._refuse()
        self._owner = PyThread_get_thread_ident()
        return 0

    cdef int _refuse(self) except -1:
        if self._owner == PyThread_get_thread_ident() or self._owner == <unsigned long>-1:
            raise SchedulerBusy(_REENTRANT)
        raise SchedulerBusy(_CONCURRENT)

    cdef inline void _bury(self, PyObject* o) noexcept:
        """Release ``o`` once the running method is done (immediately if no room is left:
        safe, since the guard refuses any call its __del__ makes)."""
        cdef PyObject** g
        cdef Py_ssize_t cap
        if o == NULL:
            return
        if self._ngrave == self._gravecap:
            cap = self._gravecap * 2 if self._gravecap else 16
            g = <PyObject**>PyMem_Realloc(self._grave, cap * sizeof(PyObject*))
            if g == NULL:
                Py_DECREF(<object>o)
                return
            self._grave = g
            self._gravecap = cap
        self._grave[self._ngrave] = o
        self._ngrave += 1

    cdef inline void _leave_method(self) noexcept:
        self._owner = 0
        if self._ngrave:
            self._flush()

    cdef void _flush(self) noexcept:
        # one at a time from the end: a __del__ run here may call back in and bury more
        cdef PyObject* o
        while self._ngrave and self._owner == 0:
            self._ngrave -= 1
            o = self._grave[self._ngrave]
            Py_DECREF(<object>o)

    # =================================================================== heaps
    cdef inline int _heap_reserve(self, Heap* h, Py_ssize_t extra) except -1:
        if h.n + extra <= h.cap:
            return 0
        return self._heap_grow(h, extra)

    cdef int _heap_grow(self, Heap* h, Py_ssize_t extra) except -1:
        cdef Entry* a
        cdef Py_ssize_t cap = h.cap
        while cap < h.n + extra:
            cap *= 2
        a = <Entry*>PyMem_Realloc(h.a, cap * sizeof(Entry))
        if a == NULL:
            raise MemoryError()
        h.a = a
        h.cap = cap
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

    cdef inline void _heap_rekey(self, Heap* h, Py_ssize_t i, int64_t S, int64_t ticket) noexcept nogil:
        cdef Entry e = h.a[i]
        cdef bint up
        e.S = S
        e.ticket = ticket
        up = sfq_less(&e, &h.a[i])
        if up:
            sfq_sift_up(h.a, self._pos, i, e)
        else:
            sfq_sift_down(h.a, self._pos, h.n, i, e)

    # =================================================================== ticket table
    cdef inline int64_t _tfind(self, int64_t t) noexcept nogil:
        cdef Table* tab = &self._tick
        cdef uint64_t j = _mix(<uint64_t>t) & tab.mask
        while tab.val[j] >= 0:
            if tab.key[j] == t:
                return <int64_t>j
            j = (j + 1) & tab.mask
        return -1

    cdef inline void _tdel(self, int64_t t) noexcept nogil:
        cdef int64_t j = self._tfind(t)
        if j >= 0:
            _tab_del_at(&self._tick, <uint64_t>j)

    # =================================================================== flow table
    cdef int32_t _ffind(self, object flow, Py_hash_t h) except -2:
        """The slot of ``flow`` (hash ``h``), -1 if unknown. Runs the ids' __eq__ (the guard
        is up: nothing can change the table meanwhile)."""
        cdef Table* tab = &self._ftab
        cdef uint64_t j = _mix(<uint64_t>h) & tab.mask
        cdef int32_t s
        cdef PyObject* k
        while True:
            s = tab.val[j]
            if s < 0:
                return -1
            if tab.key[j] == h:
                k = self._flows[s].key
                if k == <PyObject*>flow or PyObject_RichCompareBool(k, <PyObject*>flow, Py_EQ):
                    return s
            j = (j + 1) & tab.mask

    cdef void _fdel(self, int32_t slot) noexcept nogil:
        """Remove ``slot``'s id from the table by its stored hash: no Python code runs."""
        cdef Table* tab = &self._ftab
        cdef uint64_t j = _mix(<uint64_t>self._flows[slot].hash) & tab.mask
        while tab.val[j] != slot:
            j = (j + 1) & tab.mask
        _tab_del_at(tab, j)

    cdef inline int32_t _lookup(self, object flow, Py_hash_t* hout) except -2:
        """The flow's slot, -1 if unknown (then ``*hout`` is its hash); TypeError naming an
        unhashable flow id."""
        cdef Py_hash_t h
        cdef int32_t slot
        if <PyObject*>flow == self._ckey:
            return self._cslot
        try:
            h = PyObject_Hash(flow)
        except TypeError:
            raise _unhashable(flow) from None
        hout[0] = h
        slot = self._ffind(flow, h)
        if slot >= 0:
            self._ckey = self._flows[slot].key
            self._cslot = slot
        return slot

    # =================================================================== flows
    cdef inline int _ring_reserve(self, Flow* f, uint32_t extra) except -1:
        if f.count + extra <= f.cap:
            return 0
        return self._ring_grow(f, extra)

    cdef int _ring_grow(self, Flow* f, uint32_t extra) except -1:
        cdef uint32_t newcap = f.cap if f.cap else 4, k
        cdef Req* r
        if <uint64_t>f.count + extra > (<uint64_t>1 << 31):
            raise OverflowError("too many requests waiting in one flow (at most 2**31)")
        while newcap < f.count + extra:
            newcap *= 2
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

    cdef int _slot_reserve(self, Py_ssize_t extra) except -1:
        """Room for ``extra`` new flows: slot arrays and the flow table."""
        cdef int32_t newcap
        cdef void* p
        cdef Py_ssize_t need = <Py_ssize_t>self._nslots + extra - self._nfree
        if need > 0x7FFFFFF0:
            raise OverflowError("too many flows (at most 2**31)")
        if need > self._slotcap:
            newcap = self._slotcap
            while newcap < need:
                newcap *= 2
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
        _tab_reserve(&self._ftab, extra)
        return 0

    cdef int32_t _new_slot(self, object key, Py_hash_t h) noexcept:
        """A DORMANT flow for ``key`` at S = v; room reserved by the caller (_slot_reserve),
        so nothing here fails and no Python code runs."""
        cdef int32_t slot
        cdef Flow* f
        if self._nfree > 0:
            self._nfree -= 1
            slot = self._free[self._nfree]
        else:
            slot = self._nslots
            self._nslots += 1
        f = &self._flows[slot]
        f.S = self._v
        f.weight = 1.0
        f.ring = NULL
        f.cap = 0
        f.head = 0
        f.count = 0
        f.live = 0
        f.batch = 0
        f.running = 0
        f.state = DORMANT
        f.hash = h
        Py_INCREF(key)
        f.key = <PyObject*>key
        self._pos[slot] = -1
        _tab_put(&self._ftab, h, slot)
        return slot

    cdef void _forget(self, int32_t slot) noexcept:
        cdef Flow* f = &self._flows[slot]
        if self._ckey == f.key:
            self._ckey = NULL
        self._fdel(slot)
        self._bury(f.key)
        f.key = NULL
        PyMem_Free(f.ring)
        f.ring = NULL
        f.cap = 0
        f.state = FREE
        self._free[self._nfree] = slot
        self._nfree += 1

    cdef inline void _drop_tombstones(self, Flow* f) noexcept nogil:
        cdef uint32_t mask = f.cap - 1
        while f.count and f.ring[f.head].ticket < 0:
            f.head = (f.head + 1) & mask
            f.count -= 1

    cdef void _park(self, int32_t slot) noexcept:
        """The flow has no waiting request and does not compete: idle until v passes S.
        Room in the idle heap reserved by the caller."""
        cdef Flow* f = &self._flows[slot]
        f.state = IDLE
        PyMem_Free(f.ring)  # an idle flow keeps no buffer (memory per idle flow stays small)
        f.ring = NULL
        f.cap = 0
        f.head = 0
        f.count = 0
        self._heap_push(&self._idle, f.S, 0, slot)

    cdef void _leave(self, int32_t slot) noexcept:
        """The flow has no waiting request left and stops competing: it is parked in the idle
        heap, or kept as RUNNING while its work is in flight (room reserved by the caller)."""
        cdef Flow* f = &self._flows[slot]
        if f.running:
            f.state = RUNNING
            PyMem_Free(f.ring)
            f.ring = NULL
            f.cap = 0
            f.head = 0
            f.count = 0
        else:
            self._park(slot)

    cdef inline void _idle_rule(self) noexcept nogil:
        # the system is idle (nothing competes, no work in flight): close the busy period
        if self._wait.n == 0 and self._in_flight == 0 and self._max_finish > self._v:
            self._v = self._max_finish

    cdef inline void _after_v_moved(self) noexcept:
        """Forget idle flows that v has reached; renormalise if v grew large."""
        if (self._idle.n and self._idle.a[0].S <= self._v) or self._v >= RENORM_AT:
            self._after_v_moved_slow()

    cdef void _after_v_moved_slow(self) noexcept:
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

    cdef void _renormalise(self) noexcept:
        cdef int64_t d = self._v
        cdef int32_t s
        cdef Py_ssize_t i
        cdef Flow* f
        for s in range(self._nslots):
            f = &self._flows[s]
            if f.state != FREE:
                if f.S < d and f.state != WAITING and f.state != RUNNING:
                    f.S = d  # below v and not keeping a lag: rejoining would raise it to v
                f.S -= d
                if f.S < -MAX_LEAD:
                    f.S = -MAX_LEAD  # a lag of more than 2**41 cost units is capped there
        for i in range(self._wait.n):
            self._wait.a[i].S -= d
            if self._wait.a[i].S < -MAX_LEAD:
                self._wait.a[i].S = -MAX_LEAD
        for i in range(self._idle.n):
            self._idle.a[i].S -= d
        self._max_finish -= d
        self._v = 0
        self._last_shift = d
        self._base = self._base + d  # a small int addition: no Python code of the caller's runs
        self.renormalisations += 1

    # =================================================================== queries
    def __len__(self):
        return self._tick.count

    @property
    def waiting_flows(self):
        """Flows with a waiting request that compete for dispatch (suspended ones do not)."""
        return self._wait.n

    @property
    def known_flows(self):
        """Flows the scheduler holds state for (waiting, or idle with information)."""
        return self._ftab.count

    @property
    def in_flight(self):
        """Work reported by ``work_started()`` and not yet by ``work_done()``."""
        return self._in_flight

    @property
    def virtual_time(self):
        """v, in cost units."""
        return _units(self._base, self._v)

    def meter(self, flow):
        """The flow's meter S in cost units (v for a flow with no state, or idle below v; a flow
        with work in flight keeps its own, which may lie below v)."""
        cdef Py_hash_t h
        cdef int32_t slot
        cdef int64_t S
        self._enter()
        try:
            slot = self._lookup(flow, &h)
            if slot < 0:
                S = self._v
            elif self._flows[slot].state == WAITING or self._flows[slot].state == RUNNING:
                S = self._flows[slot].S  # competing, or keeping its lag while its work runs
            else:
                S = max(self._flows[slot].S, self._v)
        finally:
            self._leave_method()
        return _units(self._base, S)

    cdef int32_t _query(self, object flow) except -2:
        """The slot of ``flow`` for a read-only query (-1 if unknown), found under the guard. A
        query buries nothing, so no Python code runs between this and the caller's read."""
        cdef Py_hash_t h
        self._enter()
        try:
            return self._lookup(flow, &h)
        finally:
            self._leave_method()

    def pending(self, flow):
        """Waiting requests of ``flow``."""
        cdef int32_t slot = self._query(flow)
        return 0 if slot < 0 else self._flows[slot].live

    def weight(self, flow):
        """The flow's weight (1.0 unless set)."""
        cdef int32_t slot = self._query(flow)
        return 1.0 if slot < 0 else self._flows[slot].weight

    def running(self, flow):
        """Work of ``flow`` reported by ``work_started(flow)`` and not yet done."""
        cdef int32_t slot = self._query(flow)
        return 0 if slot < 0 else self._flows[slot].running

    def suspended(self, flow):
        """Whether ``flow`` is suspended (out of the competition)."""
        cdef int32_t slot = self._query(flow)
        return slot >= 0 and self._flows[slot].state == SUSPENDED

    def __repr__(self):
        return (f"<sfq.Scheduler compiled: {self._tick.count} waiting in {self._wait.n} competing flows, "
                f"{self._ftab.count} known, v={self.virtual_time!r}>")

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
            return _check_cost(cost)  # runs the cost's own conversion; the guard is up
        if not (c > 0.0 and c <= MAX_COST_D):
            return _check_cost(cost)  # raises, naming the value
        return c

    cdef inline void _append(self, int32_t slot, int64_t ticket, double c, PyObject* item) noexcept:
        """Append a request to the flow (room in its ring, the ticket table and, if it joins,
        the wait heap reserved by the caller): nothing fails, no Python code runs."""
        cdef Flow* f = &self._flows[slot]
        cdef Req* r = &f.ring[(f.head + f.count) & (f.cap - 1)]
        r.ticket = ticket
        r.cost = c
        Py_INCREF(<object>item)
        r.item = item
        f.count += 1
        f.live += 1
        _tab_put(&self._tick, ticket, slot)
        if f.state == WAITING:
            self._ready += 1
        elif f.state != SUSPENDED:  # (re)join: S = max(S, v), unless work of it is in flight
            if f.state == IDLE:
                self._heap_remove(&self._idle, self._pos[slot])
            if f.S < self._v and f.state != RUNNING:
                f.S = self._v
            f.state = WAITING
            self._ready += 1
            self._heap_push(&self._wait, f.S, f.ring[f.head].ticket, slot)

    def enqueue(self, flow, cost, item=None):
        """Append a request to ``flow``'s FIFO; returns its ticket."""
        cdef Py_hash_t h = 0
        cdef int32_t slot
        cdef double c
        cdef int64_t ticket
        cdef Flow* f
        self._enter()
        try:
            slot = self._lookup(flow, &h)
            c = self._cost(cost)
            # every allocation before the first change
            _tab_reserve(&self._tick, 1)
            self._heap_reserve(&self._wait, 1)
            if slot < 0:
                self._slot_reserve(1)
                slot = self._new_slot(flow, h)
                f = &self._flows[slot]
                try:
                    self._ring_reserve(f, 1)
                except BaseException:
                    self._forget(slot)  # undo the new slot: nothing changed
                    raise
            else:
                self._ring_reserve(&self._flows[slot], 1)
            ticket = self._next_ticket
            self._next_ticket += 1
            self._append(slot, ticket, c, <PyObject*>item)
            return ticket
        finally:
            self._leave_method()

    cdef void _pop(self, Popped* out) noexcept:
        """Dispatch the head of the flow with the smallest (S, head ticket). The wait heap is
        non-empty and the idle heap has room for one more entry (reserved by the caller)."""
        cdef Entry* top = &self._wait.a[0]
        cdef int32_t slot = top.slot
        cdef Flow* f = &self._flows[slot]
        cdef Req r = f.ring[f.head]
        cdef Entry e
        cdef int64_t start = top.S
        cdef Py_ssize_t renorms = self.renormalisations
        f.head = (f.head + 1) & (f.cap - 1)
        f.count -= 1
        f.live -= 1
        self._ready -= 1
        self._tdel(r.ticket)
        if start > self._v:
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
            self._idle_rule()
        self._after_v_moved()
        self._prefetch_next()
        if self.renormalisations != renorms:  # keep start/finish relative to the new _base
            out.start -= self._last_shift
            out.finish -= self._last_shift

    cdef inline void _prefetch_next(self) noexcept nogil:
        """Start loading what the next dispatch and enqueue will touch (the new root's flow
        record and its ticket's table cell, the next ticket's cell) while the caller's
        Python runs in between: on a large scheduler these are cache misses otherwise."""
        cdef Entry* top
        sfq_prefetch(&self._tick.key[_mix(<uint64_t>self._next_ticket) & self._tick.mask])
        if self._wait.n:
            top = &self._wait.a[0]
            sfq_prefetch(&self._flows[top.slot])
            sfq_prefetch(&self._tick.key[_mix(<uint64_t>top.ticket) & self._tick.mask])

    def dispatch(self):
        """Dispatch the head request of the competing flow with the smallest meter, or None."""
        cdef Popped p
        cdef Dispatch d
        self._enter()
        try:
            if self._wait.n == 0:
                return None
            d = Dispatch.__new__(Dispatch)  # the allocations that can fail come first
            self._heap_reserve(&self._idle, 1)
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
        finally:
            self._leave_method()

    def peek(self):
        """What ``dispatch()`` would return now, changing nothing; None when nothing competes."""
        cdef Dispatch d
        cdef Entry* top
        cdef Flow* f
        cdef Req* r
        self._enter()
        try:
            if self._wait.n == 0:
                return None
            d = Dispatch.__new__(Dispatch)
            top = &self._wait.a[0]
            f = &self._flows[top.slot]
            r = &f.ring[f.head]
            d.flow = <object>f.key
            d.item = <object>r.item
            d.cost = r.cost
            d.ticket = r.ticket
            d._start = top.S
            d._finish = top.S + <int64_t>ceil(r.cost * SCALE_D / f.weight)
            d._base = self._base
            return d
        finally:
            self._leave_method()

    def cancel(self, ticket):
        """Remove a still-waiting request, uncharged. False if unknown or already dispatched."""
        cdef int64_t t, j
        cdef int32_t slot
        cdef Flow* f
        cdef uint32_t lo, hi, mid, mask
        cdef Req* r
        self._enter()
        try:
            try:
                t = operator.index(ticket)
            except (TypeError, OverflowError):
                return False
            if t <= 0:
                return False
            j = self._tfind(t)
            if j < 0:
                return False
            self._heap_reserve(&self._idle, 1)  # before any change
            slot = self._tick.val[j]
            _tab_del_at(&self._tick, <uint64_t>j)
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
            r = &f.ring[(f.head + lo) & mask]
            r.ticket = -t
            self._bury(r.item)  # the payload is released when this call is done
            r.item = NULL
            f.live -= 1
            if f.state == WAITING:
                self._ready -= 1
            if lo == 0:  # the head changed: re-key, or leave
                self._drop_tombstones(f)
                if f.state == WAITING:
                    if f.count:
                        self._heap_rekey(&self._wait, self._pos[slot], f.S, f.ring[f.head].ticket)
                    else:
                        self._heap_remove(&self._wait, self._pos[slot])
                        self._leave(slot)
                        self._idle_rule()
                        self._after_v_moved()
            return True
        finally:
            self._leave_method()

    def set_weight(self, flow, weight):
        """Weight (> 0) for this flow's future charges: a charge is cost / weight."""
        cdef Py_hash_t h = 0
        cdef int32_t slot
        cdef double w
        self._enter()
        try:
            slot = self._lookup(flow, &h)
            if type(weight) is float and MIN_WEIGHT_D <= PyFloat_AS_DOUBLE(weight) <= MAX_WEIGHT_D:
                w = PyFloat_AS_DOUBLE(weight)
            else:
                w = _check_weight(weight)
            if slot < 0:
                if w == 1.0:
                    return
                self._slot_reserve(1)
                slot = self._new_slot(flow, h)
            self._flows[slot].weight = w
            if w == 1.0 and self._flows[slot].state == DORMANT:
                self._forget(slot)
        finally:
            self._leave_method()

    def suspend(self, flow):
        """Take ``flow`` out of the competition: its requests keep waiting (``pending``,
        ``cancel`` and ``len`` see them) but no dispatch picks it until ``resume``."""
        cdef Py_hash_t h = 0
        cdef int32_t slot
        cdef Flow* f
        self._enter()
        try:
            slot = self._lookup(flow, &h)
            if slot < 0:
                self._slot_reserve(1)
                slot = self._new_slot(flow, h)
            f = &self._flows[slot]
            if f.state == SUSPENDED:
                return
            if f.state == WAITING:
                self._heap_remove(&self._wait, self._pos[slot])
                self._ready -= f.live
                f.state = SUSPENDED
                self._idle_rule()
                self._after_v_moved()
            else:
                if f.state == IDLE:
                    self._heap_remove(&self._idle, self._pos[slot])
                f.state = SUSPENDED
        finally:
            self._leave_method()

    def resume(self, flow):
        """Put a suspended ``flow`` back: with waiting requests it rejoins at ``S = max(S, v)``."""
        cdef Py_hash_t h = 0
        cdef int32_t slot
        cdef Flow* f
        self._enter()
        try:
            slot = self._lookup(flow, &h)
            if slot < 0 or self._flows[slot].state != SUSPENDED:
                return
            f = &self._flows[slot]
            if f.count:
                self._heap_reserve(&self._wait, 1)
                if f.S < self._v:
                    f.S = self._v
                f.state = WAITING
                self._ready += f.live
                self._heap_push(&self._wait, f.S, f.ring[f.head].ticket, slot)
            else:
                self._heap_reserve(&self._idle, 1)
                self._leave(slot)
                self._after_v_moved()
        finally:
            self._leave_method()

    def adjust(self, flow, delta):
        """Correct ``flow``'s meter by ``delta`` cost units (negative: a refund), divided by
        its weight like a charge. A competing flow is re-keyed and never falls below ``v``."""
        cdef Py_hash_t h = 0
        cdef int32_t slot
        cdef double d, w
        cdef int64_t sub, base, new
        cdef Flow* f
        self._enter()
        try:
            slot = self._lookup(flow, &h)
            if type(delta) is float and -MAX_COST_D <= PyFloat_AS_DOUBLE(delta) <= MAX_COST_D:
                d = PyFloat_AS_DOUBLE(delta)  # the common case, checked here (NaN fails the test)
            else:
                d = _check_delta(delta)  # everything else, with the twin's messages
            if d == 0.0:
                return
            w = 1.0 if slot < 0 else self._flows[slot].weight
            # as _common.adjustment(): |delta| / weight rounded up, with delta's sign
            if d > 0.0:
                sub = <int64_t>ceil(d * SCALE_D / w)
            else:
                sub = -<int64_t>ceil(-d * SCALE_D / w)
            if slot >= 0 and self._flows[slot].running:
                # work in flight: the flow never left, its meter (lag included) is its own;
                # a refund may take it below v, never more than MAX_LEAD below
                base = self._flows[slot].S
                if sub > MAX_LEAD - (base - self._v):
                    raise _lead_overflow(flow, delta)
                new = base + sub
                if new < self._v - MAX_LEAD:
                    new = self._v - MAX_LEAD
            else:
                base = self._v if slot < 0 else max(self._flows[slot].S, self._v)
                if sub > MAX_LEAD - (base - self._v):
                    raise _lead_overflow(flow, delta)
                new = base + sub
                if new < self._v:
                    new = self._v
            if slot < 0:
                if new <= self._v:
                    return  # a refund to a flow with no state: it would start at v anyway
                self._slot_reserve(1)
                self._heap_reserve(&self._idle, 1)
                slot = self._new_slot(flow, h)
            else:
                self._heap_reserve(&self._idle, 1)
            f = &self._flows[slot]
            f.S = new
            if new > self._max_finish:
                self._max_finish = new
            if f.state == WAITING:
                self._heap_rekey(&self._wait, self._pos[slot], new, self._wait.a[self._pos[slot]].ticket)
            elif f.state == IDLE:
                self._heap_rekey(&self._idle, self._pos[slot], new, 0)
                self._after_v_moved()
            elif f.state == DORMANT:
                if new > self._v:
                    self._park(slot)
        finally:
            self._leave_method()

    def work_started(self, flow=None):
        """The caller started work (a request went to a server): the busy period stays open
        until the matching ``work_done()``, even when no request waits here. With ``flow``,
        the work is that flow's: until it is done the flow keeps its meter when it rejoins."""
        cdef Py_hash_t h = 0
        cdef int32_t slot
        cdef Flow* f
        self._enter()
        try:
            if flow is not None:
                slot = self._lookup(flow, &h)
                if slot < 0:
                    self._slot_reserve(1)
                    slot = self._new_slot(flow, h)
                f = &self._flows[slot]
                if f.running == 0xFFFFFFFF:
                    raise OverflowError(f"too much work in flight for flow {flow!r} (at most 2**32 - 1)")
                if f.state == IDLE:
                    self._heap_remove(&self._idle, self._pos[slot])
                    f.state = RUNNING
                elif f.state == DORMANT:
                    f.state = RUNNING
                f.running += 1
            self._in_flight += 1
        finally:
            self._leave_method()

    def work_done(self, flow=None):
        """Work reported by ``work_started()`` (with the same ``flow``) ended. When it was the
        last and no flow competes, the idle rule closes the busy period."""
        cdef Py_hash_t h = 0
        cdef int32_t slot
        cdef Flow* f
        self._enter()
        try:
            if flow is not None:
                slot = self._lookup(flow, &h)
                if slot < 0 or self._flows[slot].running == 0:
                    raise ValueError(f"work_done({flow!r}) without a matching work_started({flow!r})")
                self._heap_reserve(&self._idle, 1)  # before any change
                f = &self._flows[slot]
                f.running -= 1
                if f.running == 0 and f.state == RUNNING:
                    self._park(slot)
            elif self._in_flight == 0:
                raise ValueError("work_done() without a matching work_started(): no work is in flight")
            self._in_flight -= 1
            self._idle_rule()
            self._after_v_moved()
        finally:
            self._leave_method()

    # =================================================================== batches
    def enqueue_many(self, flows, costs, items=None):
        """Enqueue ``flows[i]`` with ``costs[i]`` (and ``items[i]``) in order, as many
        ``enqueue`` calls would; all arguments are checked first, so a bad one enqueues
        nothing. Returns the tickets as an int64 numpy array."""
        cdef list fl
        cdef double[::1] cv
        cdef Py_ssize_t i, n, nnew = 0, joins = 0, made = 0
        cdef int32_t slot
        cdef int32_t* slots = NULL
        cdef Py_hash_t* hashes = NULL
        cdef Py_hash_t h = 0
        cdef Flow* f
        cdef object flow
        cdef PyObject* item
        cdef int64_t first
        cdef dict newmap
        np = _numpy()
        self._enter()
        try:
            fl, arr, its = _check_batch(flows, costs, items, False)
            n = len(fl)
            cv = arr
            tickets = np.arange(self._next_ticket, self._next_ticket + n, dtype=np.int64)
            slots = <int32_t*>PyMem_Malloc(max(n, 1) * sizeof(int32_t))
            hashes = <Py_hash_t*>PyMem_Malloc(max(n, 1) * sizeof(Py_hash_t))
            if slots == NULL or hashes == NULL:
                raise MemoryError()
            # pass 1, Python code allowed, no change: look every flow up; flows new to the
            # scheduler get the index of their first entry, encoded as -2 - index
            newmap = {}
            for i in range(n):
                flow = <object>PyList_GET_ITEM(fl, i)
                slot = self._lookup(flow, &h)
                if slot < 0:
                    o = newmap.get(flow)
                    if o is None:
                        newmap[flow] = i
                        hashes[i] = h
                        nnew += 1
                        slot = -2 - i
                    else:
                        slot = -2 - <Py_ssize_t>o
                slots[i] = slot
            # pass 2, no Python code: reserve everything, making the new flows' slots
            _tab_reserve(&self._tick, n)
            self._slot_reserve(nnew)
            for i in range(n):
                if slots[i] == -2 - i:
                    slots[i] = self._new_slot(<object>PyList_GET_ITEM(fl, i), hashes[i])
                    made += 1
                elif slots[i] < -1:
                    slots[i] = slots[-2 - slots[i]]
            try:
                for i in range(n):
                    f = &self._flows[slots[i]]
                    if f.batch == 0 and f.state != WAITING and f.state != SUSPENDED:
                        joins += 1
                    f.batch += 1
                self._heap_reserve(&self._wait, joins)
                for i in range(n):
                    f = &self._flows[slots[i]]
                    if f.batch:
                        self._ring_reserve(f, f.batch)
                        f.batch = 0
            except BaseException:
                for i in range(n):  # undo: the batch enqueues nothing
                    self._flows[slots[i]].batch = 0
                for i in range(n):
                    if self._flows[slots[i]].state == DORMANT and self._flows[slots[i]].count == 0 \
                            and self._flows[slots[i]].weight == 1.0:
                        self._forget(slots[i])  # only the slots this call made are dormant at weight 1
                raise
            # pass 3: append, nothing fails
            first = self._next_ticket
            self._next_ticket += n
            for i in range(n):
                item = <PyObject*>None if its is None else PyList_GET_ITEM(its, i)
                self._append(slots[i], first + i, cv[i], item)
            return tickets
        finally:
            PyMem_Free(slots)
            PyMem_Free(hashes)
            self._leave_method()

    def dispatch_many(self, n):
        """Dispatch up to ``n`` requests, exactly as ``n`` calls of ``dispatch``; returns a
        ``DispatchBatch`` of parallel arrays (fewer than ``n`` entries if the queue ran dry)."""
        cdef Py_ssize_t m, i
        cdef Popped p
        cdef int64_t[::1] tv
        cdef double[::1] cv, sv, fv
        np = _numpy()
        self._enter()
        try:
            k = _check_count(n)
            m = min(k, self._ready)
            flows = PyList_New(m)
            items = PyList_New(m)
            tickets = np.empty(m, dtype=np.int64)
            costs = np.empty(m, dtype=np.float64)
            starts = np.empty(m, dtype=np.float64)
            finishes = np.empty(m, dtype=np.float64)
            tv = tickets
            cv = costs
            sv = starts
            fv = finishes
            self._heap_reserve(&self._idle, min(m, self._wait.n))
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
        finally:
            self._leave_method()


# ------------------------------------------------------------------- the cycle collector
# A scheduler owns references held in C buffers (flow ids, payloads): the collector must see
# them, or a payload that refers back to its scheduler forms a cycle that is never freed.
cdef sfq_traverseproc _cython_traverse = (<sfq_typeobject*>Scheduler).tp_traverse


cdef int _sched_traverse(PyObject* o, sfq_visitproc visit, void* arg) noexcept:
    cdef Scheduler s = <Scheduler>o
    cdef int32_t slot
    cdef uint32_t k
    cdef Flow* f
    cdef Py_ssize_t i
    cdef int r
    if _cython_traverse != NULL:
        r = _cython_traverse(o, visit, arg)
        if r:
            return r
    if s._flows == NULL:
        return 0
    for slot in range(s._nslots):
        f = &s._flows[slot]
        if f.state == FREE:
            continue
        if f.key != NULL:
            r = visit(f.key, arg)
            if r:
                return r
        for k in range(f.count):
            if f.ring[(f.head + k) & (f.cap - 1)].item != NULL:
                r = visit(f.ring[(f.head + k) & (f.cap - 1)].item, arg)
                if r:
                    return r
    for i in range(s._ngrave):
        r = visit(s._grave[i], arg)
        if r:
            return r
    return 0


cdef int _sched_clear(PyObject* o) noexcept:
    cdef Scheduler s = <Scheduler>o
    s._release_all()
    return 0


assert (<sfq_typeobject*>Scheduler).tp_flags & Py_TPFLAGS_HAVE_GC
(<sfq_typeobject*>Scheduler).tp_traverse = _sched_traverse
(<sfq_typeobject*>Scheduler).tp_clear = _sched_clear
