"""The allocation journal's common entries, replayed (compiled; twin: _replay_py.py).

Owns: `record` and `replay`, the same functions as the twin with the same answers: the frame
headers read from the buffer in C, the type checks of every record field as pointer compares,
records built as tuples of the handed-in record types. A "put" entry in the encoding the agent
writes (agent.state.frames: fixed-length headers, str map keys, float64 times) is read straight
from the frame's bytes into the record (`_Put`), with no msgpack map or list in between, and
the devices, GPUs and response that records repeat are made once per replay and shared; any
other entry, or a put in another encoding, goes through msgpack.unpackb and `record` as in the
twin. The checksum is the call the twin makes (zlib.crc32). Must not import anything of
`agent`, touch files, or say why it stopped (agent.state.frames.scan replays that frame with
its checks).
"""

import zlib

import msgpack

from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.string cimport memcmp, memcpy

__all__ = ["record", "replay"]

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
# The record map's and the response map's keys, by the bit each sets in `_Put.seen`.
cdef enum:
    K_ID = 1, K_RESOURCE = 2, K_DEVICES = 4, K_GPUS = 8, K_RESPONSE = 16, K_TIME = 32,
    K_BOOT = 64, K_POD = 128, K_CONFIRMED = 256, K_ALL = 511
    R_ENVS = 1, R_MOUNTS = 2, R_DEVICES = 4, R_ANNOTATIONS = 8, R_CDI = 16, R_ALL = 31


cdef class _Put:
    """Reads one frame's payload as ["put", {record map}] in the agent's own encoding. Every
    method returns its value, or sets `bad` (the frame then goes through msgpack and `record`:
    anything this reader does not take, the twin's path decides). `shared` keeps, per field,
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

    cdef Py_ssize_t _count(self, int fix, int fix_max, int b16, int b32) noexcept:
        """The item count of the array (or map) whose header is next, or -1."""
        cdef int b = self._byte()
        if fix <= b <= fix_max:
            return b & 0x0f
        if b == b16:
            return self._be(2)
        if b == b32:
            return self._be(4)
        self.bad = True
        return -1

    cdef inline Py_ssize_t _array(self) noexcept:
        return self._count(0x90, 0x9f, 0xdc, 0xdd)

    cdef inline Py_ssize_t _map(self) noexcept:
        return self._count(0x80, 0x8f, 0xde, 0xdf)

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

    cdef object _common_str(self):
        """A str that many records repeat (resource, boot): the same object for each."""
        cdef object s = self._str()
        if self.bad:
            return None
        return self.shared_str.setdefault(s, s)

    cdef int _key(self, int table) noexcept:
        """The bit of the map key next (table 0: the record's keys, 1: the response's), or 0."""
        cdef Py_ssize_t length = self._str_len()
        cdef const char* k
        if length < 0:
            return 0
        k = <const char*>self.p + self.pos
        self.pos += length
        if table == 0:
            if length == 2 and memcmp(k, b"id", 2) == 0:
                return K_ID
            if length == 8 and memcmp(k, b"resource", 8) == 0:
                return K_RESOURCE
            if length == 7 and memcmp(k, b"devices", 7) == 0:
                return K_DEVICES
            if length == 4 and memcmp(k, b"gpus", 4) == 0:
                return K_GPUS
            if length == 8 and memcmp(k, b"response", 8) == 0:
                return K_RESPONSE
            if length == 4 and memcmp(k, b"time", 4) == 0:
                return K_TIME
            if length == 4 and memcmp(k, b"boot", 4) == 0:
                return K_BOOT
            if length == 3 and memcmp(k, b"pod", 3) == 0:
                return K_POD
            if length == 9 and memcmp(k, b"confirmed", 9) == 0:
                return K_CONFIRMED
        else:
            if length == 4 and memcmp(k, b"envs", 4) == 0:
                return R_ENVS
            if length == 6 and memcmp(k, b"mounts", 6) == 0:
                return R_MOUNTS
            if length == 7 and memcmp(k, b"devices", 7) == 0:
                return R_DEVICES
            if length == 11 and memcmp(k, b"annotations", 11) == 0:
                return R_ANNOTATIONS
            if length == 10 and memcmp(k, b"cdiDevices", 10) == 0:
                return R_CDI
        self.bad = True
        return 0

    cdef double _float(self) noexcept:
        """A float64 (how the agent writes times); anything else is left to msgpack."""
        cdef int b = self._byte()
        cdef unsigned long long bits = 0
        cdef int i
        if b != 0xcb or self.n - self.pos < 8:
            self.bad = True
            return 0.0
        cdef double value
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

    cdef object _devices(self):
        cdef Py_ssize_t start = self.pos
        cdef object value = self._strs()
        if self.bad:
            return None
        return self.shared_devices.setdefault(self.p[start:self.pos], value)

    cdef object _gpus(self):
        cdef Py_ssize_t start = self.pos
        cdef Py_ssize_t count = self._array(), i
        cdef list refs
        cdef object uuid, index
        cdef object gpu = self.kinds[1]
        if count < 0:
            return None
        refs = []
        for i in range(count):
            if self._array() != 2:
                self.bad = True
                return None
            uuid = self._str()
            index = self._uint()
            if self.bad:
                return None
            refs.append(_tuple_new(gpu, (uuid, index)))
        return self.shared_gpus.setdefault(self.p[start:self.pos], tuple(refs))

    cdef object _triples(self, object kind, bint flag):
        """[str, str, bool] (flag) or [str, str, str] items as `kind` tuples."""
        cdef Py_ssize_t count = self._array(), i
        cdef list out
        cdef object a, b, c
        cdef int f
        if count < 0:
            return None
        out = []
        for i in range(count):
            if self._array() != 3:
                self.bad = True
                return None
            a = self._str()
            b = self._str()
            if flag:
                f = self._byte()
                if f != 0xc2 and f != 0xc3:
                    self.bad = True
                c = f == 0xc3
            else:
                c = self._str()
            if self.bad:
                return None
            out.append(_tuple_new(kind, (a, b, c)))
        return tuple(out)

    cdef object _response(self):
        cdef Py_ssize_t start = self.pos
        cdef int seen = 0, key
        cdef Py_ssize_t i
        cdef object envs = None, mounts = None, specs = None, annotations = None, cdi = None
        if self._map() != 5:
            self.bad = True
            return None
        for i in range(5):
            key = self._key(1)
            if self.bad or seen & key:
                self.bad = True
                return None
            seen |= key
            if key == R_ENVS:
                envs = self._str_map()
            elif key == R_MOUNTS:
                mounts = self._triples(self.kinds[4], True)
            elif key == R_DEVICES:
                specs = self._triples(self.kinds[5], False)
            elif key == R_ANNOTATIONS:
                annotations = self._str_map()
            else:
                cdi = self._strs()
            if self.bad:
                return None
        return self.shared_response.setdefault(
            self.p[start:self.pos],
            _tuple_new(self.kinds[3], (envs, mounts, specs, annotations, cdi)))

    cdef object read(self, const unsigned char* payload, Py_ssize_t length):
        """The record of a put entry in `payload`, or None (`bad`: not one this reads)."""
        cdef int seen = 0, key
        cdef Py_ssize_t i
        cdef object rid = None, resource = None, devices = None, gpus = None, resp = None
        cdef object boot = None, pod = None, confirmed = None, parts
        cdef double t = 0.0
        self.p, self.n, self.pos, self.bad = payload, length, 0, False
        # 0x92 0xa3 "put": an array of two whose first item is the str "put"
        if length < 5 or memcmp(payload, b"\x92\xa3put", 5) != 0:
            self.bad = True
            return None
        self.pos = 5
        if self._map() != 9:
            self.bad = True
            return None
        for i in range(9):
            key = self._key(0)
            if self.bad or seen & key:
                self.bad = True
                return None
            seen |= key
            if key == K_ID:
                rid = self._str()
            elif key == K_RESOURCE:
                resource = self._common_str()
            elif key == K_DEVICES:
                devices = self._devices()
            elif key == K_GPUS:
                gpus = self._gpus()
            elif key == K_RESPONSE:
                if not self._nil():
                    resp = self._response()
            elif key == K_TIME:
                t = self._float()
            elif key == K_BOOT:
                boot = self._common_str()
            elif key == K_POD:
                if not self._nil():
                    parts = self._strs()
                    if not self.bad:
                        if len(<tuple>parts) != 3:
                            self.bad = True
                        else:
                            pod = _tuple_new(self.kinds[2], parts)
            elif not self._nil():
                confirmed = self._float()
            if self.bad:
                return None
        if self.pos != self.n:  # msgpack would call the rest extra data
            self.bad = True
            return None
        return _tuple_new(self.kinds[0], (rid, resource, devices, gpus, resp, t, boot, pod,
                                          confirmed))


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
