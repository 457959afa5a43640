"""The allocation journal's common entries, replayed, and a new Allocate's entry packed
(compiled; twin: _entries_py.py).

Owns: `record` and `replay`, the same functions as the twin with the same answers: the frame
headers read from the buffer in C, the type checks of every record field as pointer compares,
records built as tuples of the handed-in record types. A "put" entry in the encoding the agent
writes (agent.state.frames: str map keys, float64 times, GPU indexes as unsigned ints) is read
straight from the frame's bytes into the record (`_Put`), with no msgpack map or list in
between, and the resource, boot, devices, GPUs and response that records repeat are made once
per replay and shared; any other entry, or a put in another encoding, goes through
msgpack.unpackb and `record` as in the twin. The checksum is the call the twin makes
(zlib.crc32). `new_put_frame` writes every Allocate's entry in C into one buffer; its checksum
is zlib's CRC-32 of the bytes it adds (the ID and time) joined with those its `Piece`s computed
once (zlib's crc32_combine): the twin's bytes, without reading the pieces again. Must not
import anything of `agent`, touch files, or say why it stopped (agent.state.frames.scan
replays that frame with its checks).
"""

import zlib

import msgpack

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.unicode cimport (
    PyUnicode_AsUTF8AndSize,
    PyUnicode_DecodeASCII,
    PyUnicode_DecodeUTF8,
)
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, strlen

__all__ = ["Ids", "Piece", "new_put_frame", "record", "replay"]

cdef enum:
    HEAD_SIZE = 8  # <u32 length> <u32 CRC-32>, as agent.state.frames writes them
    MAX_FRAME = 16 << 20

cdef object _unpackb = msgpack.unpackb
cdef object _crc32 = zlib.crc32
cdef object _tuple_new = tuple.__new__


cdef inline bint _is_number(object v):
    return type(v) is float or type(v) is int


cdef tuple _strs(object value):
    cdef object v
    if type(value) is not list:
        return None
    for v in <list>value:
        if type(v) is not str:
            return None
    return tuple(<list>value)


cdef bint _str_map(object value):
    cdef object k, v
    if type(value) is not dict:
        return False
    for k, v in (<dict>value).items():
        if type(k) is not str or type(v) is not str:
            return False
    return True


cdef object _pod(object value, object kind):
    """The pod of a record or claim: None for none, False when it is not [ns, name, container]."""
    cdef tuple parts
    if value is None:
        return None
    parts = _strs(value)
    if parts is None or len(parts) != 3:
        return False
    return _tuple_new(kind, parts)


cdef object _response(object resp, tuple kinds):
    cdef dict d
    cdef object m, s, envs, mounts, specs, annotations, cdi
    cdef tuple cdi_t
    if type(resp) is not dict or len(<dict>resp) != 5:
        return None
    d = <dict>resp
    envs, mounts, specs = d.get("envs"), d.get("mounts"), d.get("devices")
    annotations, cdi = d.get("annotations"), d.get("cdiDevices")
    if type(mounts) is not list or type(specs) is not list:
        return None
    for m in <list>mounts:
        if type(m) is not list or len(<list>m) != 3 or type((<list>m)[0]) is not str or \
                type((<list>m)[1]) is not str or type((<list>m)[2]) is not bool:
            return None
    for s in <list>specs:
        if type(s) is not list or len(<list>s) != 3 or type((<list>s)[0]) is not str or \
                type((<list>s)[1]) is not str or type((<list>s)[2]) is not str:
            return None
    if not _str_map(envs) or not _str_map(annotations):
        return None
    cdi_t = _strs(cdi)
    if cdi_t is None:
        return None
    mount, spec = kinds[4], kinds[5]
    return _tuple_new(kinds[3], (
        envs,
        tuple([_tuple_new(mount, tuple(<list>m)) for m in <list>mounts]),
        tuple([_tuple_new(spec, tuple(<list>s)) for s in <list>specs]),
        annotations, cdi_t))


cpdef object record(object d, tuple kinds):
    """The record in map `d` (the nine keys of agent.state.checkpoint.record_data), or None."""
    cdef dict m
    cdef object rid, resource, devices, gpus, t, boot, confirmed, resp, pod, g
    cdef tuple devices_t
    cdef list refs
    if type(d) is not dict or len(<dict>d) != 9:
        return None
    m = <dict>d
    rid, resource, devices, gpus = m.get("id"), m.get("resource"), m.get("devices"), m.get("gpus")
    t, boot, confirmed = m.get("time"), m.get("boot"), m.get("confirmed")
    if "response" not in m or "pod" not in m or "confirmed" not in m:
        return None
    resp, pod = m["response"], _pod(m["pod"], kinds[2])
    if pod is False:
        return None
    if type(rid) is not str or type(resource) is not str or type(boot) is not str or \
            not _is_number(t) or (confirmed is not None and not _is_number(confirmed)):
        return None
    if type(gpus) is not list:
        return None
    gpu = kinds[1]
    refs = []
    for g in <list>gpus:
        if type(g) is not list or len(<list>g) != 2 or type((<list>g)[0]) is not str or \
                type((<list>g)[1]) is not int:
            return None
        refs.append(_tuple_new(gpu, tuple(<list>g)))
    devices_t = _strs(devices)
    if devices_t is None:
        return None
    if resp is not None:
        resp = _response(resp, kinds)
        if resp is None:
            return None
    return _tuple_new(kinds[0], (rid, resource, devices_t, tuple(refs), resp, float(t), boot,
                                 pod, None if confirmed is None else float(confirmed)))


# -- a put entry read from its bytes ------------------------------------------------------------
# The keys of a record map, in the order of the record's fields, and of a response map, in the
# order of the response's (agent.state.checkpoint: record_data, Record, Response).
_RECORD_KEYS = (b"id", b"resource", b"devices", b"gpus", b"response", b"time", b"boot", b"pod",
                b"confirmed")
_RESPONSE_KEYS = (b"envs", b"mounts", b"devices", b"annotations", b"cdiDevices")
cdef enum:  # their places
    F_ID, F_RESOURCE, F_DEVICES, F_GPUS, F_RESPONSE, F_TIME, F_BOOT, F_POD, F_CONFIRMED
    F_ENVS = 0, F_MOUNTS, F_SPECS, F_ANNOTATIONS, F_CDI


cdef Py_ssize_t _place(tuple keys, Py_ssize_t first, const char* k, Py_ssize_t length):
    """Where key `k` is in `keys` (looked for at `first`, then from the start), or -1."""
    cdef Py_ssize_t place
    cdef bytes name = <bytes>keys[first]
    if len(name) == length and memcmp(k, <const char*>name, length) == 0:
        return first
    for place in range(len(keys)):
        name = <bytes>keys[place]
        if len(name) == length and memcmp(k, <const char*>name, length) == 0:
            return place
    return -1


cdef class _Put:
    """Reads one frame's payload as ["put", {record map}] in the agent's own encoding. Every
    method returns its value, or sets `bad` (the frame then goes through msgpack and `record`:
    anything this reader does not take, the twin's path decides). `shared_*` keep, per field,
    the value made for each distinct run of bytes: records repeat their devices, GPUs and
    response, and get the same (immutable) objects."""

    cdef const unsigned char* p
    cdef Py_ssize_t n, pos
    cdef bint bad
    cdef tuple kinds
    cdef dict shared_devices, shared_gpus, shared_response, shared_str

    def __cinit__(self, tuple kinds):
        self.kinds = kinds
        self.shared_devices, self.shared_gpus, self.shared_response = {}, {}, {}
        self.shared_str = {}

    cdef inline int _byte(self) noexcept:
        if self.pos >= self.n:
            self.bad = True
            return -1
        self.pos += 1
        return self.p[self.pos - 1]

    cdef inline Py_ssize_t _be(self, int size) noexcept:
        """An unsigned big-endian number of `size` (1, 2 or 4) bytes."""
        cdef Py_ssize_t v = 0
        cdef int i
        if self.n - self.pos < size:
            self.bad = True
            return 0
        for i in range(size):
            v = (v << 8) | self.p[self.pos + i]
        self.pos += size
        return v

    cdef Py_ssize_t _str_len(self) noexcept:
        """The length of the str whose header is next (its bytes follow), or -1."""
        cdef int b = self._byte()
        cdef Py_ssize_t length
        if 0xa0 <= b <= 0xbf:
            length = b & 0x1f
        elif b == 0xd9:
            length = self._be(1)
        elif b == 0xda:
            length = self._be(2)
        elif b == 0xdb:
            length = self._be(4)
        else:
            self.bad = True
            return -1
        if self.bad or self.n - self.pos < length:
            self.bad = True
            return -1
        return length

    cdef Py_ssize_t _count(self, int fix, int b16, int b32) noexcept:
        """The item count of the array (fix 0x90) or map (fix 0x80) whose header is next."""
        cdef int b = self._byte()
        if fix <= b <= fix + 0x0f:
            return b & 0x0f
        if b == b16:
            return self._be(2)
        if b == b32:
            return self._be(4)
        self.bad = True
        return -1

    cdef inline Py_ssize_t _array(self) noexcept:
        return self._count(0x90, 0xdc, 0xdd)

    cdef inline Py_ssize_t _map(self) noexcept:
        return self._count(0x80, 0xde, 0xdf)

    cdef inline bint _nil(self) noexcept:
        """Whether a nil is next (consumed if so)."""
        if self.pos < self.n and self.p[self.pos] == 0xc0:
            self.pos += 1
            return True
        return False

    cdef object _str(self):
        cdef Py_ssize_t length = self._str_len()
        cdef object s
        if length < 0:
            return None
        try:
            s = PyUnicode_DecodeUTF8(<const char*>self.p + self.pos, length, NULL)
        except UnicodeDecodeError:
            self.bad = True
            return None
        self.pos += length
        return s

    cdef object _float(self):
        """A float64 (how the agent writes times); anything else is left to msgpack."""
        cdef unsigned long long bits = 0
        cdef double value
        cdef int i
        if self._byte() != 0xcb or self.n - self.pos < 8:
            self.bad = True
            return None
        for i in range(8):
            bits = (bits << 8) | self.p[self.pos + i]
        self.pos += 8
        memcpy(&value, &bits, 8)
        return value

    cdef object _uint(self):
        """A non-negative int below 2**32 (a GPU index); anything else is left to msgpack."""
        cdef int b = self._byte()
        if 0 <= b <= 0x7f:
            return b
        if b == 0xcc:
            return self._be(1)
        if b == 0xcd:
            return self._be(2)
        if b == 0xce:
            return self._be(4)
        self.bad = True
        return None

    cdef object _strs(self):
        """An array of str as a tuple."""
        cdef Py_ssize_t count = self._array(), i
        cdef list out
        if count < 0:
            return None
        out = []
        for i in range(count):
            out.append(self._str())
            if self.bad:
                return None
        return tuple(out)

    cdef object _str_map(self):
        cdef Py_ssize_t count = self._map(), i
        cdef dict out = {}
        cdef object k
        if count < 0:
            return None
        for i in range(count):
            k = self._str()
            if self.bad:
                return None
            out[k] = self._str()  # a repeated key: the last value, where the first was
            if self.bad:
                return None
        return out

    cdef object _rows(self, object kind, const char* types):
        """An array of arrays of len(types) items each (s: str, u: a GPU index, b: bool), as a
        tuple of `kind` tuples: GPUs, mounts, device specs."""
        cdef Py_ssize_t count = self._array(), i, j, width = strlen(types)
        cdef list out, fields
        cdef int f
        if count < 0:
            return None
        out = []
        for i in range(count):
            if self._array() != width:
                self.bad = True
                return None
            fields = []
            for j in range(width):
                if types[j] == b"s":
                    fields.append(self._str())
                elif types[j] == b"u":
                    fields.append(self._uint())
                else:
                    f = self._byte()
                    if f != 0xc2 and f != 0xc3:
                        self.bad = True
                    fields.append(f == 0xc3)
                if self.bad:
                    return None
            out.append(_tuple_new(kind, tuple(fields)))
        return tuple(out)

    cdef object _shared(self, dict shared, Py_ssize_t start, object value):
        """`value`, or the equal one made earlier from the same bytes (from `start` to here)."""
        if self.bad:
            return None
        return shared.setdefault(self.p[start:self.pos], value)

    cdef list _fields(self, tuple keys):
        """The values of a map with exactly `keys` (in any order, each once), in the order
        of `keys`; None (`bad`) for any other map."""
        cdef Py_ssize_t n = len(keys), i, length, place
        cdef list values = [None] * n
        cdef unsigned int seen = 0
        cdef const char* k
        if self._map() != n:
            self.bad = True
            return None
        for i in range(n):
            length = self._str_len()
            if length < 0:
                return None
            k = <const char*>self.p + self.pos
            self.pos += length
            place = _place(keys, i, k, length)  # the agent writes them in order: try i first
            if place < 0:
                self.bad = True
                return None
            if seen & (1u << place):
                self.bad = True
                return None
            seen |= 1u << place
            values[place] = self._value(keys is _RECORD_KEYS, place)
            if self.bad:
                return None
        return values

    cdef object _value(self, bint of_record, Py_ssize_t place):
        """The value of the key at `place` of the record map (of_record) or the response's."""
        cdef Py_ssize_t start = self.pos
        cdef object parts
        if not of_record:
            if place == F_ENVS or place == F_ANNOTATIONS:
                return self._str_map()
            if place == F_MOUNTS:
                return self._rows(self.kinds[4], b"ssb")
            if place == F_SPECS:
                return self._rows(self.kinds[5], b"sss")
            return self._strs()
        if place == F_ID:
            return self._str()
        if place == F_RESOURCE or place == F_BOOT:  # a str records repeat: one object
            parts = self._str()
            return None if self.bad else self.shared_str.setdefault(parts, parts)
        if place == F_DEVICES:
            return self._shared(self.shared_devices, start, self._strs())
        if place == F_GPUS:
            return self._shared(self.shared_gpus, start, self._rows(self.kinds[1], b"su"))
        if place == F_TIME:
            return self._float()
        if self._nil():  # response, pod and confirmed may be nil
            return None
        if place == F_RESPONSE:
            parts = self._fields(_RESPONSE_KEYS)
            return None if self.bad else self._shared(
                self.shared_response, start, _tuple_new(self.kinds[3], tuple(parts)))
        if place == F_POD:
            parts = self._strs()
            if self.bad or len(<tuple>parts) != 3:
                self.bad = True
                return None
            return _tuple_new(self.kinds[2], parts)
        return self._float()  # confirmed

    cdef object read(self, const unsigned char* payload, Py_ssize_t length):
        """The record of a put entry in `payload`, or None (`bad`: not one this reads)."""
        cdef list values
        self.p, self.n, self.pos, self.bad = payload, length, 0, False
        # 0x92 0xa3 "put": an array of two whose first item is the str "put"
        if length < 5 or memcmp(payload, b"\x92\xa3put", 5) != 0:
            self.bad = True
            return None
        self.pos = 5
        values = self._fields(_RECORD_KEYS)
        if self.bad or self.pos != self.n:  # msgpack would call more bytes extra data
            self.bad = True
            return None
        return _tuple_new(self.kinds[0], tuple(values))


cdef bint _apply(dict records, list items, tuple kinds) except -1:
    cdef Py_ssize_t n = len(items)
    cdef object op, r, rid, pod, confirmed
    if n == 0:
        return False
    op = items[0]
    if n == 2 and op == "put":
        r = record(items[1], kinds)
        if r is None:
            return False
        records[(<tuple>r)[0]] = r
        return True
    if n == 4 and op == "claim":
        rid, pod, confirmed = items[1], _pod(items[2], kinds[2]), items[3]
        if type(rid) is not str or pod is False:
            return False
        r = records.get(rid)
        if r is None:
            return False
        if confirmed is not None:
            if not _is_number(confirmed):
                return False
            confirmed = float(confirmed)
        records[rid] = r.with_pod(pod, confirmed)
        return True
    if n == 2 and op == "drop":
        rid = items[1]
        return type(rid) is str and records.pop(rid, None) is not None
    return False


cdef inline unsigned int _u32(const unsigned char[::1] buf, Py_ssize_t at) noexcept:
    return (<unsigned int>buf[at] | (<unsigned int>buf[at + 1] << 8) |
            (<unsigned int>buf[at + 2] << 16) | (<unsigned int>buf[at + 3] << 24))


def replay(object view, Py_ssize_t pos, dict records, tuple kinds):
    """Apply the frames of `view` from byte `pos` to `records` while each is a common entry:
    (where the first frame not applied starts, how many were applied)."""
    cdef const unsigned char[::1] buf = view
    cdef Py_ssize_t n = buf.shape[0]
    cdef Py_ssize_t entries = 0, end
    cdef unsigned int length, crc
    cdef object payload, items, r
    cdef _Put put = _Put(kinds)
    while n - pos >= HEAD_SIZE:
        length = _u32(buf, pos)
        crc = _u32(buf, pos + 4)
        end = pos + HEAD_SIZE + length
        if length == 0 or length > MAX_FRAME or end > n:
            break
        payload = view[pos + HEAD_SIZE:end]
        if _crc32(payload) != crc:
            break
        r = put.read(&buf[pos + HEAD_SIZE], length)
        if not put.bad:
            records[(<tuple>r)[0]] = r
            entries += 1
            pos = end
            continue
        try:
            items = _unpackb(payload, raw=False, strict_map_key=False)
        except (ValueError, TypeError, UnicodeDecodeError):
            break  # the checked replay says what is wrong with it
        if type(items) is not list or not _apply(records, <list>items, kinds):
            break
        entries += 1
        pos = end
    return pos, entries


# -- packing: a new Allocate's "put" entry -------------------------------------------------------

# ["put", {9 keys}] with the "id" key (agent.state.frames' record map), and the "time" key: the
# bytes the twin's _PUT_HEAD and _K_TIME hold
cdef bytes _PUT_HEAD = b"\x92\xa3put\x89\xa2id"
cdef bytes _K_TIME = b"\xa4time"
cdef inline unsigned char* _le32(unsigned char* q, uint32_t v) noexcept:
    q[0] = v & 0xFF
    q[1] = (v >> 8) & 0xFF
    q[2] = (v >> 16) & 0xFF
    q[3] = v >> 24
    return q + 4


# CRC-32 as zlib computes it (reflected, polynomial 0xEDB88320), over the few bytes an Allocate's
# entry adds, and zlib's crc32_combine (multmodp, x2nmodp) to join the checksums of the pieces
# computed once: the pieces' bytes are not read again per Allocate (they are its cold cache
# misses: the handler runs after the client and kubelet had the CPU).
cdef uint32_t _POLY = 0xEDB88320
cdef uint32_t _CRC_TABLE[256]
cdef uint32_t _X2N[32]  # x^(2^k) modulo the polynomial


cdef uint32_t _multmodp(uint32_t a, uint32_t b) noexcept nogil:
    """a times b modulo the polynomial (a is never 0: no power of x is)."""
    cdef uint32_t m = (<uint32_t>1) << 31, p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


cdef uint32_t _x2nmodp(Py_ssize_t n, unsigned int k) noexcept nogil:
    """x^(n * 2^k) modulo the polynomial."""
    cdef uint32_t p = (<uint32_t>1) << 31  # x^0
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


cdef inline uint32_t _crc_more(uint32_t crc, const unsigned char* p, Py_ssize_t n) noexcept nogil:
    """zlib.crc32(bytes, crc): the checksum of what `crc` is the checksum of, then the n bytes."""
    cdef uint32_t c = ~crc  # zlib's conditioning: the register starts and ends inverted
    cdef Py_ssize_t i
    for i in range(n):
        c = _CRC_TABLE[(c ^ p[i]) & 0xFF] ^ (c >> 8)
    return ~c


cdef void _crc_tables() noexcept:
    cdef uint32_t c, p
    cdef int i, k
    for i in range(256):
        c = i
        for k in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        _CRC_TABLE[i] = c
    p = (<uint32_t>1) << 30  # x^1
    _X2N[0] = p
    for k in range(1, 32):
        p = _multmodp(p, p)
        _X2N[k] = p


_crc_tables()


cdef class Piece:
    """Packed bytes that go whole into new entries (an answer: agent.state.frames.answer_piece;
    the tail: frames.tail_piece), with their checksum and the shift of a checksum over their
    length prepared, so that `new_put_frame` reads only the bytes it adds."""

    cdef readonly bytes data
    cdef uint32_t crc, shift

    def __cinit__(self, bytes data not None):
        self.data = data
        self.crc = _crc32(data)
        self.shift = _x2nmodp(PyBytes_GET_SIZE(data), 3)  # 8 bits a byte: x^(8n)


cdef class Ids:
    """New record IDs, one per call: `prefix` (ASCII, up to 64 characters), then a count from
    1 in lowercase hex. A call is atomic (it never lets the GIL go)."""

    cdef bytes prefix
    cdef unsigned long long count

    def __cinit__(self, str prefix not None):
        self.prefix = prefix.encode("ascii")
        if len(self.prefix) > 64:
            raise ValueError(f"an ID prefix of at most 64 characters, not {len(self.prefix)}")
        self.count = 0

    def __call__(self):
        cdef char buf[80]
        cdef Py_ssize_t n = PyBytes_GET_SIZE(self.prefix), digits = 0, i
        cdef unsigned long long v
        self.count += 1
        v = self.count
        while True:  # how many hex digits
            digits += 1
            v >>= 4
            if not v:
                break
        memcpy(buf, PyBytes_AS_STRING(self.prefix), n)
        v = self.count
        for i in range(n + digits - 1, n - 1, -1):
            buf[i] = b"0123456789abcdef"[v & 15]
            v >>= 4
        return PyUnicode_DecodeASCII(buf, n + digits, NULL)


def new_put_frame(str record_id, double time, Piece answer, Piece tail):
    """The frame of a "put" entry of a new record: its ID, then `answer` (the packed resource,
    devices, GPUs and response), its time, then `tail` (the packed boot, pod and confirmed);
    the twin's bytes, in one buffer, the checksum joined from the pieces' (zlib's
    crc32_combine)."""
    cdef Py_ssize_t nrid
    cdef const char* rid = PyUnicode_AsUTF8AndSize(record_id, &nrid)
    # msgpack's str head: fixstr, str 8, str 16 or str 32 by the UTF-8 length
    cdef Py_ssize_t nhead = 1 if nrid < 32 else 2 if nrid < 0x100 else 3 if nrid < 0x10000 else 5
    cdef Py_ssize_t nanswer = PyBytes_GET_SIZE(answer.data), ntail = PyBytes_GET_SIZE(tail.data)
    cdef Py_ssize_t nid = 9 + nhead + nrid  # the entry's head, up to the ID's end
    cdef Py_ssize_t n = nid + nanswer + 5 + 9 + ntail
    cdef bytes out = PyBytes_FromStringAndSize(NULL, HEAD_SIZE + n)
    cdef unsigned char* start = <unsigned char*>PyBytes_AS_STRING(out) + HEAD_SIZE
    cdef unsigned char* q = start
    cdef unsigned char* at_time
    cdef uint64_t bits
    cdef uint32_t crc
    cdef int i
    memcpy(q, PyBytes_AS_STRING(_PUT_HEAD), 9)
    q += 9
    if nhead == 1:
        q[0] = 0xA0 | nrid
    elif nhead == 2:
        q[0], q[1] = 0xD9, nrid
    elif nhead == 3:
        q[0], q[1], q[2] = 0xDA, nrid >> 8, nrid & 0xFF
    else:
        q[0], q[1], q[2], q[3], q[4] = (0xDB, nrid >> 24, (nrid >> 16) & 0xFF,
                                        (nrid >> 8) & 0xFF, nrid & 0xFF)
    q += nhead
    memcpy(q, rid, nrid)
    q += nrid
    memcpy(q, PyBytes_AS_STRING(answer.data), nanswer)
    q += nanswer
    at_time = q
    memcpy(q, PyBytes_AS_STRING(_K_TIME), 5)
    q += 5
    q[0] = 0xCB  # float 64, big-endian
    memcpy(&bits, &time, 8)
    for i in range(8):
        q[1 + i] = (bits >> (56 - 8 * i)) & 0xFF
    q += 9
    memcpy(q, PyBytes_AS_STRING(tail.data), ntail)
    crc = _crc_more(0, start, nid)
    crc = _multmodp(answer.shift, crc) ^ answer.crc
    crc = _crc_more(crc, at_time, 14)
    crc = _multmodp(tail.shift, crc) ^ tail.crc
    q = _le32(<unsigned char*>PyBytes_AS_STRING(out), <uint32_t>n)
    _le32(q, crc)
    return out
