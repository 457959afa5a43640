"""The allocation journal's common entries, replayed (compiled; twin: _replay_py.py).

Owns: `record` and `replay`, the same functions as the twin with the same answers: the frame
headers read from the buffer in C, the type checks of every record field as pointer compares,
records built as tuples of the handed-in record types. The checksum and msgpack decoding are
the same calls the twin makes (zlib.crc32, msgpack.unpackb). Must not import anything of
`agent`, touch files, or say why it stopped (agent.state.frames.scan replays that frame with
its checks).
"""

import zlib

import msgpack

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
    cdef object payload, items
    while n - pos >= HEAD_SIZE:
        length = _u32(buf, pos)
        crc = _u32(buf, pos + 4)
        end = pos + HEAD_SIZE + length
        if length == 0 or length > MAX_FRAME or end > n:
            break
        payload = view[pos + HEAD_SIZE:end]
        if _crc32(payload) != crc:
            break
        try:
            items = _unpackb(payload, raw=False, strict_map_key=False)
        except (ValueError, TypeError, UnicodeDecodeError):
            break  # the checked replay says what is wrong with it
        if type(items) is not list or not _apply(records, <list>items, kinds):
            break
        entries += 1
        pos = end
    return pos, entries
