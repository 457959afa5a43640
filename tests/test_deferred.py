"""agent/deferred.py: asyncio, grpc.aio, protobuf's python_message, typing_extensions and
inspect stay unloaded while the agent does not use them, and turn into exactly the real modules
when something does.

Each case runs in a fresh interpreter (the test process has long imported asyncio), and the
agent case checks the running `gpu-agent run` from outside, through /proc/PID/maps, as an
operator would: no ssl, no _asyncio extension and no OpenSSL (hashlib: only a schema-1
checkpoint or an adoption from podresources needs it, agent/state/checkpoint.py) mapped after
registration and Allocates.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.daemon_harness import Node

_PRELUDE = """
import json, sys
from agent.deferred import defer_unused_modules, is_loaded
defer_unused_modules()
"""


def _python(code: str, defer: bool = True) -> dict:
    """Run `code` after the prelude (with or without the deferral) in a fresh interpreter;
    the JSON it prints last."""
    prelude = _PRELUDE if defer else _PRELUDE.replace("defer_unused_modules()", "")
    out = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_grpc_imports_without_loading_asyncio_ssl_or_grpc_aio():
    got = _python("""
        import grpc
        server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(1))
        server.add_insecure_port("127.0.0.1:0")
        server.start(); server.stop(None)
        print(json.dumps({"asyncio": is_loaded("asyncio"), "grpc.aio": is_loaded("grpc.aio"),
                          "ssl": "ssl" in sys.modules,
                          "base_events": "asyncio.base_events" in sys.modules}))
    """)
    assert got == {"asyncio": False, "grpc.aio": False, "ssl": False, "base_events": False}


def test_a_grpc_server_serves_without_loading_typing_extensions_or_inspect():
    # grpc._server applies typing_extensions.override while its classes are made: the
    # stand-in answers it with a function that marks methods as the real one does (PEP 698)
    real = _python("""
        import grpc._server as s
        print(json.dumps({"marked": sorted(
            n for n, v in vars(s).items() if isinstance(v, type)
            and any(getattr(f, "__override__", False) for f in vars(v).values()))}))
    """, defer=False)
    got = _python("""
        import grpc
        from concurrent import futures
        echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
        handler = grpc.method_handlers_generic_handler("t.T", {"Echo": echo})
        server = grpc.server(futures.ThreadPoolExecutor(1), handlers=[handler])
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            echoed = channel.unary_unary("/t.T/Echo")(b"ping", timeout=10)
        server.stop(None)
        import grpc._server as s
        marked = sorted(n for n, v in vars(s).items() if isinstance(v, type)
                        and any(getattr(f, "__override__", False) for f in vars(v).values()))
        print(json.dumps({"echoed": echoed.decode(), "marked": marked,
                          "typing_extensions": is_loaded("typing_extensions"),
                          "inspect": is_loaded("inspect")}))
    """)
    assert got == {"echoed": "ping", "marked": real["marked"], "typing_extensions": False,
                   "inspect": False}
    assert real["marked"]  # grpc still marks some methods: the stand-in is exercised


def test_first_use_of_typing_extensions_loads_it_whole():
    real = _python("""
        import typing_extensions
        print(json.dumps(sorted(n for n in dir(typing_extensions) if not n.startswith("__"))))
    """, defer=False)
    got = _python("""
        import grpc._server
        import typing_extensions
        before = is_loaded("typing_extensions")
        literal = typing_extensions.Literal["a"]
        print(json.dumps({"before": before, "loaded": is_loaded("typing_extensions"),
                          "inspect": is_loaded("inspect"), "literal": str(literal),
                          "names": sorted(n for n in dir(typing_extensions)
                                          if not n.startswith("__"))}))
    """)
    assert got["before"] is False and got["loaded"] and got["inspect"]
    assert got["literal"].endswith("Literal['a']")
    assert got["names"] == real


def test_first_use_loads_the_real_asyncio_with_every_name_it_has():
    real = _python("""
        import asyncio
        print(json.dumps(sorted(n for n in dir(asyncio) if not n.startswith("__"))))
    """, defer=False)
    got = _python("""
        import grpc, asyncio
        assert not is_loaded("asyncio")
        loop_class = asyncio.AbstractEventLoop  # the one name answered without the load
        assert not is_loaded("asyncio")

        async def three():
            await asyncio.sleep(0)
            return 3

        result = asyncio.run(three())
        from asyncio import Queue, events
        print(json.dumps({"loaded": is_loaded("asyncio"), "result": result,
                          "same_loop_class": loop_class is events.AbstractEventLoop,
                          "queue": Queue.__module__,
                          "names": sorted(n for n in dir(asyncio) if not n.startswith("__"))}))
    """)
    assert got["loaded"] and got["result"] == 3 and got["same_loop_class"]
    assert got["queue"] == "asyncio.queues"
    assert got["names"] == real


def test_grpc_aio_works_when_first_used():
    got = _python("""
        import grpc

        async def call():
            from grpc import aio
            async with aio.insecure_channel("unix:/nonexistent/sock") as channel:
                try:
                    await channel.unary_unary("/x/y")(b"", timeout=0.5)
                except aio.AioRpcError as exc:
                    return exc.code().name

        import asyncio
        print(json.dumps({"code": asyncio.run(call()), "aio": is_loaded("grpc.aio")}))
    """)
    assert got == {"code": "UNAVAILABLE", "aio": True}


def test_protobuf_messages_work_without_python_message_and_its_first_use_loads_it():
    got = _python("""
        from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
        request = dp.AllocateRequest(container_requests=[
            dp.ContainerAllocateRequest(devices_ids=["GPU-a", "GPU-b"])])
        again = dp.AllocateRequest.FromString(request.SerializeToString())
        before = is_loaded("google.protobuf.internal.python_message")
        from google.protobuf import text_format
        text = text_format.MessageToString(again, as_one_line=True)
        from google.protobuf.internal import python_message
        helper = python_message._AttachFieldHelpers.__name__
        print(json.dumps({"before": before, "ids": list(again.container_requests[0].devices_ids),
                          "text": text, "helper": helper,
                          "after": is_loaded("google.protobuf.internal.python_message")}))
    """)
    assert got == {"before": False, "ids": ["GPU-a", "GPU-b"], "after": True,
                   "helper": "_AttachFieldHelpers",
                   "text": 'container_requests { devices_ids: "GPU-a" devices_ids: "GPU-b" }'}


def test_pynvml_imports_without_ctypes_util_and_its_find_library_still_works():
    real = _python("""
        import ctypes.util
        print(json.dumps({"libc": ctypes.util.find_library("c")}))
    """, defer=False)
    got = _python("""
        import pynvml
        before = is_loaded("ctypes.util")
        libc = pynvml.find_library("c")  # the forwarder pynvml imported: loads, then calls
        import ctypes.util
        print(json.dumps({"before": before, "libc": libc, "after": is_loaded("ctypes.util"),
                          "same": ctypes.util.find_library("c") == libc,
                          "real": ctypes.util.find_library.__module__}))
    """)
    assert got == {"before": False, "libc": real["libc"], "after": True, "same": True,
                   "real": "ctypes.util"}


def test_threads_that_race_to_first_use_get_the_same_module_contents():
    got = _python("""
        import threading, asyncio
        seen, start = [], threading.Barrier(8)

        def use():
            start.wait()
            seen.append(id(asyncio.Future) ^ id(asyncio.get_event_loop_policy))

        threads = [threading.Thread(target=use) for _ in range(8)]
        [t.start() for t in threads]; [t.join() for t in threads]
        print(json.dumps({"distinct": len(set(seen)), "calls": len(seen)}))
    """)
    assert got == {"distinct": 1, "calls": 8}


def test_a_lookup_that_missed_just_before_another_threads_load_ended_gets_the_name():
    """A thread's lookup of `ctypes.util.find_library` can miss the module's dict while
    another thread runs the module's code, and reach the stand-in's __getattr__ just after
    that load has ended. It got AttributeError: CI saw the agent's registrar thread die so
    (pyinotify calls ctypes.util.find_library, and the isolation watch's pyinotify had
    started the load), and the agent never registered again after kubelet restarted. That
    interleaving, made here in one thread: the load ends, then __getattr__ runs."""
    got = _python("""
        import ctypes.util
        ctypes.util.find_library("c")  # loads it
        late = type(ctypes.util).__getattr__(ctypes.util, "find_library")
        try:
            type(ctypes.util).__getattr__(ctypes.util, "no_such_name")
            missing = "found"
        except AttributeError as exc:
            missing = str(exc)
        print(json.dumps({"loaded": is_loaded("ctypes.util"),
                          "same": late is ctypes.util.find_library, "missing": missing}))
    """)
    assert got == {"loaded": True, "same": True,
                   "missing": "module 'ctypes.util' has no attribute 'no_such_name'"}


def test_nothing_is_deferred_once_imported():
    got = _python("""
        import asyncio as before
        defer_unused_modules()
        import asyncio
        print(json.dumps({"same": asyncio is before, "loaded": is_loaded("asyncio")}))
    """, defer=False)
    assert got == {"same": True, "loaded": True}


def test_the_running_agent_never_maps_ssl_openssl_or_the_asyncio_extension():
    with Node() as node:
        agent = node.agent()
        devices = agent.wait_registered().devices
        for device in devices[:5]:
            assert agent.allocate([device.id]).container_responses
        with open(f"/proc/{agent.pid}/maps") as f:
            mapped = {line.split()[-1].rsplit("/", 1)[-1] for line in f if "/" in line}
        assert not [m for m in mapped if m.startswith(("_ssl", "libssl", "_asyncio", "_hashlib",
                                                       "libcrypto"))], mapped
        assert agent.stop() == 0
