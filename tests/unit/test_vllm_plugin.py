"""pdctl's vLLM general plugin: inert unless PDCTL_QUEUE_SPIN_S is set; then SpinCondition.wait is replaced at
class level, readers wait in bounded polls, writers keep vLLM's wait."""

import subprocess
import sys
import time
import tomllib

import pytest

from pdctl import vllm_plugin
from pdctl.connector import seam
from tests.conftest import REPO


@pytest.fixture
def spin_class():
    """vLLM's SpinCondition, restored after the test whatever the plugin did."""
    cls = seam.spin_condition_class()
    original = cls.wait
    seam.unpatch_spin_wait()
    assert cls.wait is original
    yield cls
    seam.unpatch_spin_wait()
    cls.wait = original


def _spin_pair(tmp_path):
    import zmq

    cls = seam.spin_condition_class()
    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/n"
    writer = cls(is_reader=False, context=ctx, notify_address=addr)
    reader = cls(is_reader=True, context=ctx, notify_address=addr)
    return ctx, writer, reader


def _joined(writer, reader) -> None:
    """Return once the reader's zmq SUB hears the writer (one that has not joined yet hears nothing), with no
    notify left for it and the writer free to send the next: notifies, as vLLM's notify sends them, until one
    arrives."""
    import zmq

    deadline = time.monotonic() + 10
    while not reader.local_notify_socket.poll(10):
        assert time.monotonic() < deadline, "the reader's SUB never joined the writer's PUB"
        writer.local_notify_socket.send(b"\x00")
    while reader.local_notify_socket.poll(0):
        reader.local_notify_socket.recv()
    # The PUB (high-water mark 1) drops a send until it has processed its I/O thread's word that the last one
    # left, which a send within ~1 ms of the previous one does not do; reading its events does.
    writer.local_notify_socket.getsockopt(zmq.EVENTS)


def _close(ctx, *conds):
    for c in conds:
        for sock in (c.local_notify_socket, c.read_cancel_socket, c.write_cancel_socket):
            if sock is not None:
                sock.close(0)
        wake = getattr(c, seam.WAKE_ATTR, None)
        if wake is not None:
            wake.close()
    ctx.term()


def _waited(reader, timeout_ms: int) -> float:
    reader.last_read = time.monotonic() - 100  # idle: the poll runs to the timeout unless something wakes it
    t0 = time.monotonic()
    reader.wait(timeout_ms=timeout_ms)
    return time.monotonic() - t0


@pytest.mark.parametrize("value", [None, "", "  ", "fast", "-1", "nan", "inf"])
def test_inert_unless_the_variable_holds_seconds(monkeypatch, spin_class, value):
    original = spin_class.wait
    if value is None:
        monkeypatch.delenv(vllm_plugin.ENV, raising=False)
    else:
        monkeypatch.setenv(vllm_plugin.ENV, value)
    vllm_plugin.register()
    assert spin_class.wait is original


def test_set_patches_the_class_readers_bound_writers_keep_vllms(monkeypatch, spin_class, tmp_path):
    original = spin_class.wait
    ctx, writer, reader = _spin_pair(tmp_path)  # built before the plugin loads, as vLLM's may be
    try:
        monkeypatch.setenv(vllm_plugin.ENV, "0")
        vllm_plugin.register()
        patched = spin_class.wait
        assert patched is not original and "wait" not in vars(reader)  # class level: no per-object patch
        vllm_plugin.register()  # vLLM may load plugins more than once: one patch
        assert spin_class.wait is patched
        _joined(writer, reader)
        # A lost notify: the reader is back within ~1/8 of its idle time, where vLLM's wait sleeps the timeout.
        reader.last_read = time.monotonic() - 0.010
        t0 = time.monotonic()
        reader.wait(timeout_ms=300)
        bounded = time.monotonic() - t0
        reader.last_read, reader.busy_loop_s = time.monotonic() - 0.010, 0  # vLLM's wait, its spin over
        t0 = time.monotonic()
        original(reader, timeout_ms=300)
        stock = time.monotonic() - t0
        assert bounded < 0.05 and stock >= 0.29, (bounded, stock)
        with pytest.raises(AssertionError, match="Only readers can wait"):  # vLLM's own wait, unchanged
            writer.wait(timeout_ms=10)
        assert seam.unpatch_spin_wait() and spin_class.wait is original
    finally:
        _close(ctx, writer, reader)


def test_spin_after_a_message_then_a_notify_wakes_the_reader(monkeypatch, spin_class, tmp_path):
    ctx, writer, reader = _spin_pair(tmp_path)
    try:
        monkeypatch.setenv(vllm_plugin.ENV, "0.25")
        vllm_plugin.register()
        _joined(writer, reader)
        reader.record_read()
        t0 = time.monotonic()
        reader.wait(timeout_ms=2000)  # within the spin: a yield, no poll
        assert time.monotonic() - t0 < 0.05
        # Idle for long: the poll grows up to the caller's timeout, and a notify cuts it short.
        reader.last_read = time.monotonic() - 100
        writer.notify()
        t0 = time.monotonic()
        reader.wait(timeout_ms=2000)
        assert time.monotonic() - t0 < 0.5
        t0 = time.monotonic()
        reader.wait(timeout_ms=200)  # the notify was consumed: nothing left to wake it
        assert time.monotonic() - t0 >= 0.19
    finally:
        _close(ctx, writer, reader)


def test_importing_the_plugin_is_light():
    """vLLM imports every general plugin in every process of every server: nothing heavy at import."""
    heavy = ("vllm", "torch", "zmq", "pydantic", "pdctl.connector.nixl")
    code = f"import sys, pdctl.vllm_plugin; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"


def test_registered_as_a_vllm_general_plugin():
    with open(REPO / "pyproject.toml", "rb") as f:
        eps = tomllib.load(f)["project"]["entry-points"]["vllm.general_plugins"]
    assert eps == {"pdctl_calm_queues": "pdctl.vllm_plugin:register"}


def _skip_unless_installed():
    from importlib.metadata import entry_points

    if "pdctl_calm_queues" not in {e.name for e in entry_points(group="vllm.general_plugins")}:
        pytest.skip("pdctl's entry points are not installed here: run `pip install -e . --no-deps`")


def test_a_fresh_process_finds_the_entry_point_vllm_loads():
    """What vLLM's loader asks for, asked in a new interpreter in the repository (`pip install -e .` registers it;
    a stale pdctl.egg-info in the working directory would hide it). Without vLLM: the entry point alone."""
    _skip_unless_installed()
    code = ("from importlib.metadata import entry_points; "
            "eps = {e.name: e for e in entry_points(group='vllm.general_plugins')}; "
            "import pdctl.vllm_plugin as m; print(eps['pdctl_calm_queues'].load() is m.register)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.stdout.strip().splitlines()[-1:] == ["True"], out.stderr[-2000:]


def test_vllms_own_loader_patches_the_class_only_when_set(monkeypatch, spin_class):
    """vLLM's load_general_plugins (run once per process, so its once-flag is reset for each call) loads the
    installed entry point: the class is patched with the variable set, untouched without it."""
    import vllm.plugins

    _skip_unless_installed()
    original = spin_class.wait
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv(vllm_plugin.ENV, raising=False)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    assert spin_class.wait is original and not hasattr(spin_class.wait, seam.PATCH_MARK)
    monkeypatch.setenv(vllm_plugin.ENV, "0")
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    assert hasattr(spin_class.wait, seam.PATCH_MARK)


def test_the_spin_setting_reaches_a_server_only_from_its_plan(monkeypatch):
    """One exported in pdctl's own shell must not calm a server the plan leaves plain (a benchmark's plain
    reference); the plan's own value is what the server gets."""
    from pdctl.launch.local import _inherited

    monkeypatch.setenv("PDCTL_QUEUE_SPIN_S", "0")
    monkeypatch.setenv("SOMETHING_ELSE", "1")
    env = _inherited()
    assert "PDCTL_QUEUE_SPIN_S" not in env and env["SOMETHING_ELSE"] == "1"


def test_direct_wake_reaches_every_reader_without_zmq(monkeypatch, spin_class, tmp_path):
    """Queues built after the plugin: each reader has its own datagram socket, the writer's notify wakes all of
    them and sends nothing through zmq (whose I/O thread shares the pinned worker's core)."""
    import zmq

    monkeypatch.setenv(vllm_plugin.ENV, "0")
    vllm_plugin.register()
    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/n"
    writer = spin_class(is_reader=False, context=ctx, notify_address=addr)
    readers = [spin_class(is_reader=True, context=ctx, notify_address=addr) for _ in range(2)]
    try:
        names = [getattr(r, seam.WAKE_ATTR).getsockname() for r in readers]
        assert names == [seam.wake_name(addr, 0), seam.wake_name(addr, 1)]
        zmq_sent = []
        assert seam.direct_notify(writer, zmq_sent.append) == 2 and zmq_sent == []
        assert all(_waited(r, 2000) < 0.05 for r in readers)
        # Negative control: the wake was consumed, nothing else wakes them before the timeout.
        assert all(_waited(r, 200) >= 0.19 for r in readers)
        writer.notify()  # the patched class method takes the same path
        assert _waited(readers[1], 2000) < 0.05
    finally:
        _close(ctx, writer, *readers)


def test_direct_wake_falls_back_to_zmq_for_readers_built_before_the_plugin(monkeypatch, spin_class, tmp_path):
    ctx, writer_old, reader_old = _spin_pair(tmp_path)  # vLLM's: no datagram socket on either side
    monkeypatch.setenv(vllm_plugin.ENV, "0")
    vllm_plugin.register()
    writer = spin_class(is_reader=False, context=ctx, notify_address=f"ipc://{tmp_path}/m")
    try:
        _joined(writer_old, reader_old)
        zmq_sent = []
        assert seam.direct_notify(writer, zmq_sent.append) == 0 and zmq_sent == [writer]  # no reader socket
        writer_old.notify()  # built before the plugin: vLLM's notify, heard by the old reader's bounded wait
        assert _waited(reader_old, 2000) < 0.5
    finally:
        _close(ctx, writer_old, reader_old, writer)


def test_unpatch_restores_vllms_queue_methods(monkeypatch, spin_class):
    before = (spin_class.__init__, spin_class.notify, spin_class.wait)
    monkeypatch.setenv(vllm_plugin.ENV, "0")
    vllm_plugin.register()
    assert spin_class.notify is not before[1] and spin_class.__init__ is not before[0]
    assert seam.unpatch_spin_wait()
    assert (spin_class.__init__, spin_class.notify, spin_class.wait) == before


def test_wake_names_are_abstract_and_distinct():
    a = seam.wake_name("ipc:///tmp/" + "x" * 200, 0)
    assert a.startswith(b"\0") and len(a) < 108  # Linux's sun_path; abstract: nothing on disk
    assert len({a, seam.wake_name("ipc:///tmp/" + "x" * 200, 1), seam.wake_name("ipc:///tmp/y", 0)}) == 3


@pytest.mark.parametrize("cpuinfo, has", [
    ("processor : 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n", True),
    ("processor : 0\nflags\t\t: fpu avx512f avx512_bf16\n", False),  # AVX-512 with bf16, no AMX
    ("flags : amx_tile_x\n", False),  # a flag is a whole word
    ("processor : 0\n", False),
])
def test_amx_tiles_are_read_from_the_cpus_flags(cpuinfo, has):
    assert vllm_plugin.has_amx_tiles(cpuinfo) is has


def test_a_process_may_use_amx_tiles_once_the_plugin_asked():
    """In a fresh interpreter (nothing has asked yet): without the request no permission, with it the permission
    (where the CPU has tiles: vLLM's AMX attention dies of SIGILL without it beside NIXL); elsewhere the request
    says there is nothing to ask for."""
    code = ("from pdctl import vllm_plugin as m; before = m.has_amx_tiles() and m.amx_tiles_permitted(); "
            "print(m.has_amx_tiles(), before, m.request_amx_tiles(), m.has_amx_tiles() and m.amx_tiles_permitted())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    has, before, asked, after = out.stdout.split()
    if has == "True":
        assert (before, asked, after) == ("False", "True", "True"), out.stdout
    else:
        assert (before, asked, after) == ("False", "None", "False"), out.stdout
